"""How much of the corpus and of the target's greedy output the N most frequent tokens hold.

    python scripts/draft_vocab_cover.py [NUM_PROMPTS] [MAX_TOKENS]

On the embedded pair: the training split's token counts (what ``specdec train token-counts`` writes)
ranked, then, for each draft vocabulary size, the share of the corpus's tokens and of the target's
greedy continuations of held-out code prompts that fall inside it (docs/lab-notes/2026-11-23.md, the draft
vocabulary section).
"""

from __future__ import annotations

import sys

import numpy as np

from specdec import LLM, SamplingParams
from specdec.assets import default_pair
from specdec.models.loader import load_tokenizer
from specdec.train.corpus import code_prompts, split_files, token_stream

SIZES = (512, 1024, 2048, 3072, 4096)


def main() -> None:
    num_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    target, _ = default_pair()
    stream = token_stream(split_files(None)["train"], load_tokenizer(target, required=True), None)
    counts = np.bincount(stream, minlength=8192)
    order = np.argsort(-counts, kind="stable")
    llm = LLM(target, max_num_seqs=16)
    outputs = llm.generate(code_prompts(num_prompts, None, split="heldout", seed=0),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    generated = np.concatenate([np.asarray(o.outputs[0].token_ids) for o in outputs])
    print(f"{len(stream)} corpus tokens, {len(generated)} greedy tokens ({num_prompts} prompts x {max_tokens})")
    print("| draft vocabulary | corpus tokens inside | greedy output inside |\n| --- | --- | --- |")
    for n in SIZES:
        inside = np.isin(generated, order[:n])
        print(f"| {n} | {counts[order[:n]].sum() / counts.sum():.2%} | {inside.mean():.2%} |")


if __name__ == "__main__":
    main()
