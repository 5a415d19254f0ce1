#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md in one command (needs CUDA), stage by stage:
#
#   scripts/gpu_bench.sh [STAGE ...]        (default: every stage, in this order)
#
#   check   greedy equality in float32, eager against CUDA graphs, every method of scripts/gpu_greedy_check.py
#   costs   forward costs and plain decoding against the bandwidth limit, random 1b and 8b shapes, each forward
#           mode (scripts/gpu_forward_costs.py)
#   spec    the embedded pair inflated to $SHAPE (default 8b; same logits, real cost): every GPU-relevant method at
#           k 2/4/8/auto, batch 1, and eagle's EAGLE-2 tree (SPEC_CONFIG, a --method-config; empty: none)
#   sweep   the inflated pair, batch 1-64 with auto k
#   peers   transformers' generate and assisted generation on the inflated pair
#
# Each stage is bounded by STAGE_TIMEOUT seconds (default 900) so that one stuck stage leaves the others' results.
# Smaller runs: PROMPTS, TOKENS, CHECK_METHODS, COSTS_SHAPES, SPEC_METHODS, SPEC_K, SPEC_CONFIG, SWEEP_BATCHES, SWEEP_PROMPTS
# (see below for the defaults). SPECDEC_SRC: the sources to run (default ./src; another checkout's src for a
# before/after comparison on the same machine).
# Reports go to $OUT (default gpu-results): a log per stage and each bench's bench.md and bench.json. The inflated
# pairs are built once into $SPECDEC_SHAPES_DIR (default /tmp/specdec-shapes).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=${SPECDEC_SRC:-$PWD/src}:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export SPECDEC_SHAPES_DIR=${SPECDEC_SHAPES_DIR:-/tmp/specdec-shapes}
LIMIT=${STAGE_TIMEOUT:-900}
PROMPTS=${PROMPTS:-8}
TOKENS=${TOKENS:-128}
CHECK_METHODS=${CHECK_METHODS:-}  # empty: every method of scripts/gpu_greedy_check.py
COSTS_SHAPES=${COSTS_SHAPES:-1b 8b}
COSTS_MODES=${COSTS_MODES:-eager graphs graphs+fused}
SHAPE=${SHAPE:-8b}
SPEC_METHODS=${SPEC_METHODS:-plain,draft_model,eagle,medusa,ngram,suffix}
SPEC_K=${SPEC_K:-2 4 8 auto}
TREE='eagle_tree={"method": "eagle", "num_candidates": 2}'
SPEC_CONFIG=${SPEC_CONFIG-$TREE}  # one --method-config NAME=JSON; empty: none
SWEEP_BATCHES=${SWEEP_BATCHES:-1 4 16 64}
SWEEP_PROMPTS=${SWEEP_PROMPTS:-64}
S="python3 -m specdec.cli"

bench() {  # bench NAME ARGS...: one specdec bench run, its report kept as $OUT/NAME.md and $OUT/NAME.json
    local name=$1 dir
    shift
    dir=$(mktemp -d)
    timeout "$LIMIT" $S bench --num-prompts "$PROMPTS" --max-tokens "$TOKENS" --out "$dir" "$@" 2>&1 | tee "$OUT/$name.log"
    cp "$dir/bench.md" "$OUT/$name.md" 2>/dev/null
    cp "$dir/bench.json" "$OUT/$name.json" 2>/dev/null
}

stage() {
    echo "=== stage $1: $(date -u +%H:%M:%S)"
    case $1 in
        check) timeout "$LIMIT" python3 scripts/gpu_greedy_check.py --dtypes float32 --max-tokens 64 \
                   ${CHECK_METHODS:+--methods $CHECK_METHODS} 2>&1 | tee "$OUT/check.log" ;;
        costs) timeout "$LIMIT" python3 scripts/gpu_forward_costs.py --shapes $COSTS_SHAPES --modes $COSTS_MODES \
                   --tokens 256 2>&1 \
                   | tee "$OUT/costs.log" ;;
        spec) bench spec --shape $SHAPE --methods "$SPEC_METHODS" --num-speculative-tokens $SPEC_K --batch-size 1 \
                  ${SPEC_CONFIG:+--method-config "$SPEC_CONFIG"} ;;
        sweep) bench sweep --shape $SHAPE --methods plain,draft_model,eagle --num-speculative-tokens auto \
                   --batch-size $SWEEP_BATCHES --num-prompts "$SWEEP_PROMPTS" ;;
        peers) bench peers --shape $SHAPE --methods plain,draft_model,hf,hf_assisted --num-speculative-tokens 4 \
                   --batch-size 1 ;;
        *) echo "unknown stage $1 (check, costs, spec, sweep, peers)" >&2; return 2 ;;
    esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
for name in "${@:-check costs spec sweep peers}"; do
    for one in $name; do stage "$one"; done
done
echo "=== done: $(date -u +%H:%M:%S)"
