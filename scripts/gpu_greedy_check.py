"""On a GPU: greedy outputs with CUDA graphs equal eager outputs, and speculative equals plain.

A check for the device machine (CI has no GPU): the embedded pair in float32 (and bf16, where a
multi-token forward may round differently from a one-token forward: mismatches there are reported,
not failed), every method of :data:`METHODS` (plain, a draft model's graphed draft loop, n-grams,
the suffix cache, lookahead, self-speculation and the trained early exit, the hidden-state forwards
of EAGLE, Medusa and MTP, an EAGLE-2 tree, the auto method), eager and with CUDA graphs, batch 1 and
a batch of 8 prompts with ragged lengths. Exits 1 on a float32 mismatch, or when a graphed draft_model or eagle
run replayed no greedy draft chain (its drafting fell back to eager forwards, as it silently did with a draft
vocabulary until 2026-11-28).

    python scripts/gpu_greedy_check.py --dtypes float32 --max-tokens 64
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
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 4},
    "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 4},
    "early_exit": {"method": "layer_skip", "early_exit": True, "num_speculative_tokens": 4},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "num_speculative_tokens": 4},
    "mtp": {"method": "mtp", "num_speculative_tokens": 4},
    "eagle_tree": {"method": "eagle", "num_speculative_tokens": 8, "num_candidates": 2},
    "auto": {"method": "auto", "num_speculative_tokens": "auto", "candidates": [
        {"method": "draft_model"}, {"method": "ngram"}, {"method": "suffix"}]},
}


CAPTURED_DRAFTING = ("draft_model", "eagle")
"""Methods whose greedy draft loop a graphed run must replay as one graph (checked, not only timed)."""


def _drafter_graphs(llm) -> list[str] | None:
    """The kinds of graph the drafter's own pool captured (``forward``, ``greedy_chain``), or None when the
    drafter has no pool of the fast backend."""
    cache = getattr(llm.engine.drafter, "cache", None)
    if not hasattr(cache, "graphs"):
        return None
    return [] if cache.graphs is None else sorted({key[0] for key in cache.graphs.graphs})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    target, draft = default_pair()
    prompts = code_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    failed = False
    for dtype in args.dtypes:
        reference = None
        for method in ["plain", *(m for m in args.methods if m != "plain")]:
            spec = METHODS[method]
            if spec is not None and spec["method"] == "draft_model":
                spec = {**spec, "model": str(draft)}
            if spec is not None and spec["method"] == "auto":
                spec = {**spec, "candidates": [{**c, "model": str(draft)} if c["method"] == "draft_model" else c
                                               for c in spec["candidates"]]}
            for eager in (True, False):
                llm = LLM(target, speculative_config=spec, dtype=dtype, max_num_seqs=8, enforce_eager=eager)
                outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                single = llm.generate(prompts[0], params)[0].outputs[0].token_ids
                if reference is None:
                    reference = outs
                same = sum(a == b for a, b in zip(outs, reference))
                ok = same == len(prompts) and single == reference[0]
                captured = _drafter_graphs(llm)
                print(f"{dtype} {method} {'eager' if eager else 'graphs'}: {same}/{len(prompts)} batched equal "
                      f"plain eager, batch-1 equal: {single == reference[0]}"
                      + (f"; drafter graphs: {', '.join(captured) or 'none'}" if captured is not None else ""),
                      flush=True)
                failed |= dtype == "float32" and not ok
                on_gpu = llm.engine.target.device.type == "cuda"
                if on_gpu and not eager and method in CAPTURED_DRAFTING and "greedy_chain" not in (captured or []):
                    print(f"{method}: the greedy draft loop ran eagerly under CUDA graphs", flush=True)
                    failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
