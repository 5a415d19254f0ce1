#!/usr/bin/env bash
# The transformers fallback and the loader against the OLDEST transformers that pyproject allows
# (transformers>=5.0): installs transformers 5.0.0 with the tokenizers and huggingface-hub versions it
# pins into a separate folder (no change to the environment) and runs the backend's tests with it
# first on the path. The newest allowed version is the one `pip install -e .` resolves, which the
# suite itself runs against (.ci/run).
#   scripts/check_transformers_range.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=5.0.0
TARGET=${SPECDEC_OLD_TRANSFORMERS_DIR:-/tmp/specdec-transformers-$OLDEST}
if [ ! -f "$TARGET/.complete" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$TARGET" \
    "transformers==$OLDEST" "tokenizers==0.22.1" "huggingface-hub==1.3.0"
  touch "$TARGET/.complete"
fi
PYTHONPATH="$TARGET:src" python3 - <<'PY'
import transformers
print(f"transformers {transformers.__version__} from {transformers.__file__}")
PY
PYTHONPATH="$TARGET:src" python3 -m pytest -p no:cacheprovider -q \
  tests/test_fallback_archs.py tests/test_forward_contract.py tests/test_cache_rollback.py \
  tests/test_pool_memory.py tests/test_backend_line.py "$@"
