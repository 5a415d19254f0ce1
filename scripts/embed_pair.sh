#!/usr/bin/env bash
# Copy a trained target/draft pair into the package as the embedded default pair.
# Usage: scripts/embed_pair.sh TARGET_DIR DRAFT_DIR
set -euo pipefail
target=${1:?target folder}
draft=${2:?draft folder}
dest="$(dirname "$0")/../src/specdec/assets/default_pair"
for role in target draft; do
  src=$([ "$role" = target ] && echo "$target" || echo "$draft")
  rm -rf "${dest:?}/$role"
  mkdir -p "$dest/$role"
  for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json \
           token_counts.safetensors train_summary.json training_log.jsonl; do
    [ -f "$src/$f" ] && cp "$src/$f" "$dest/$role/"
  done
done
du -sh "$dest"
