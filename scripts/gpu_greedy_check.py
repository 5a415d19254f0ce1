"""On a GPU: greedy outputs with CUDA graphs equal eager outputs, and speculative equals plain.

A check for the device machine (CI has no GPU): the embedded pair in float32 (and bf16,
where a multi-token forward may round differently from a one-token forward: mismatches
there are reported, not failed), plain / draft_model / ngram, batch 1 and a batch of 8
prompts with ragged lengths. Exits 1 on a float32 mismatch.

    python scripts/gpu_greedy_check.py
"""

from __future__ import annotations

import argparse
import sys

from specdec import LLM, SamplingParams
from specdec.assets import default_pair
from specdec.train.corpus import code_prompts

METHODS = {
    "plain": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    target, draft = default_pair()
    prompts = code_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    failed = False
    for dtype in args.dtypes:
        reference = None
        for method, spec in METHODS.items():
            if spec is not None and spec["method"] == "draft_model":
                spec = {**spec, "model": str(draft)}
            for eager in (True, False):
                llm = LLM(target, speculative_config=spec, dtype=dtype, max_num_seqs=8, enforce_eager=eager)
                outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                single = llm.generate(prompts[0], params)[0].outputs[0].token_ids
                if reference is None:
                    reference = outs
                same = sum(a == b for a, b in zip(outs, reference))
                ok = same == len(prompts) and single == reference[0]
                print(f"{dtype} {method} {'eager' if eager else 'graphs'}: {same}/{len(prompts)} batched equal "
                      f"plain eager, batch-1 equal: {single == reference[0]}")
                failed |= dtype == "float32" and not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
