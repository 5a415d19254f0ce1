#!/usr/bin/env bash
# The GPU measurements of docs/lab-notes/2026-11-23.md, in one go (needs CUDA; about 10 minutes on an H100):
# greedy equality eager vs graphed, forward costs and decoding rates of random 1.1B/8B shapes,
# the embedded pair against transformers, a batch sweep, and the 1b shape's roofline and
# draft-equals-target overhead. Reports go to $OUT (default gpu-results).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
S="python3 -m specdec.cli"
python3 scripts/gpu_greedy_check.py 2>&1 | tee "$OUT/greedy_check.log"
python3 scripts/gpu_forward_costs.py --shapes 1b 8b --tokens 256 2>&1 | tee "$OUT/forward_costs.log"
$S bench --methods plain,draft_model,ngram,hf,hf_assisted,hf_prompt_lookup --num-prompts 10 --max-tokens 128 \
    --out "$OUT/pair"
$S bench --methods plain,draft_model,ngram --batch-size 1 4 16 --num-prompts 16 --max-tokens 128 --out "$OUT/pair_batch"
$S bench --synthetic 1b --draft-equals-target --batch-size 1 32 --num-prompts 32 --max-tokens 128 \
    --out "$OUT/synthetic_1b"
