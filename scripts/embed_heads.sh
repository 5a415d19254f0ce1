#!/usr/bin/env bash
# Copy trained heads (from `specdec train medusa|eagle|mtp`) into the package as the embedded
# target's heads. Usage: scripts/embed_heads.sh METHOD HEADS_DIR [METHOD HEADS_DIR ...]
set -euo pipefail
dest="$(dirname "$0")/../src/specdec/assets/default_pair/heads"
while [ $# -gt 0 ]; do
  method=${1:?method}
  src=${2:?heads folder}
  shift 2
  rm -rf "${dest:?}/$method"
  mkdir -p "$dest/$method"
  for f in config.json model.safetensors token_counts.safetensors train_summary.json training_log.jsonl; do
    [ -f "$src/$f" ] && cp "$src/$f" "$dest/$method/"
  done
done
du -sh "$dest"/*
