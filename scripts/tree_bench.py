"""Tree drafts against chains on the embedded pair (issue 10): ngram chains and ngram trees of
several candidate continuations, batch 1, greedy, held-out code prompts, alternating methods per
prompt. ``specdec bench`` has no ``num_candidates`` flag yet, hence this script.

    python scripts/tree_bench.py [NUM_PROMPTS] [MAX_TOKENS]
"""

from __future__ import annotations

import sys
import time

from specdec import LLM, SamplingParams
from specdec.assets import default_pair
from specdec.bench.workloads import PromptBuilder, load_workload

CONFIGS = {
    "plain": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
    "ngram tree k=8 c=2": {"method": "ngram", "num_speculative_tokens": 8, "num_candidates": 2},
    "ngram tree k=12 c=3": {"method": "ngram", "num_speculative_tokens": 12, "num_candidates": 3},
}


def main(num_prompts: int = 10, max_tokens: int = 128) -> None:
    target, _ = default_pair()
    llms = {name: LLM(target, speculative_config=spec, max_num_seqs=1) for name, spec in CONFIGS.items()}
    builder = PromptBuilder(llms["plain"].tokenizer)
    prompts = [builder.build(q.turns[:1], []) for q in load_workload("code", num_prompts=num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    totals = {name: [0.0, 0, 0, 0, 0] for name in llms}  # seconds, tokens, steps, drafted nodes, mismatches
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": prompts[0]}], params)  # warm-up
    for prompt in prompts:
        reference = None
        for name, llm in llms.items():
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
            seconds = time.perf_counter() - start
            tokens = out.outputs[0].token_ids
            reference = tokens if reference is None else reference
            row = totals[name]
            for i, value in enumerate((seconds, len(tokens), out.metrics.num_steps, out.metrics.num_draft_tokens,
                                       tokens != reference)):
                row[i] += value
    base = totals["plain"][1] / totals["plain"][0]
    print(f"target dtype {llms['plain'].target.dtype}, {num_prompts} prompts, {max_tokens} tokens")
    print("| method | tok/s | speedup over plain | τ (tokens/step) | drafted nodes/step | outputs ≠ plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (seconds, tokens, steps, drafted, mismatches) in totals.items():
        print(f"| {name} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f}x | {tokens / steps:.2f} | "
              f"{drafted / steps:.2f} | {mismatches}/{num_prompts} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
