"""What auto k decided and what each step cost, step by step: a trace of :class:`specdec.adaptive.AdaptiveK`
for one method on the embedded pair or an inflated shape, greedy, one request at a time. A diagnostic, not a
test. Each decision prints the cost model's plain step and its prediction of a step drafting 1, 2 and 8
positions in plain steps (calibrated where the calibration applies); each step prints its measured target
and drafting seconds. ``docs/lab-notes/2026-11-28-step-bound.md`` read the one-position cost of eagle at
``1b`` from it.

    python scripts/k_policy_trace.py eagle --max-step-time-ratio 1.1 --shape 1b --shape-cache /tmp/inflate_1b
"""

from __future__ import annotations

import argparse

from specdec import LLM, SamplingParams
from specdec.adaptive import AdaptiveK
from specdec.bench.serving import speculative_config
from specdec.train.corpus import code_prompts


def pair(shape: str | None, cache: str | None) -> tuple[str, str]:
    """The target and draft folders: the embedded pair, or the pair inflated to ``shape``."""
    if shape is None:
        from specdec.assets import require_default_pair

        target, draft = require_default_pair()
        return str(target), str(draft)
    from specdec.inflate.pair import cached_pair

    inflated = cached_pair(shape, cache)
    return str(inflated.target), str(inflated.draft)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("draft_model", "eagle", "suffix", "ngram"))
    parser.add_argument("--max-step-time-ratio", type=float, default=None)
    parser.add_argument("--shape", default=None, help="an inflated shape (1b, ...); default the embedded pair")
    parser.add_argument("--shape-cache", default=None)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    target, draft = pair(args.shape, args.shape_cache)
    llm = LLM(target, speculative_config=speculative_config(args.method, "auto", draft, args.max_step_time_ratio),
              max_num_seqs=4)
    choose, observe = AdaptiveK.choose, AdaptiveK.observe

    def traced_choose(policy: AdaptiveK, seqs, limits):
        ks = choose(policy, seqs, limits)
        cost, scale = policy._model(len(seqs)), policy.drafting_scale(len(seqs)) or 1.0
        if cost is None:
            print(f"choose {ks}  (cold start)")
            return ks
        plain = cost.target_seconds(len(seqs))
        ratios = " ".join(f"k{w} {cost.seconds(len(seqs) * (w + 1), w) * scale / plain:.2f}" for w in (1, 2, 8))
        print(f"choose {ks}  plain {plain * 1e3:.0f} ms, predicted in plain steps: {ratios} (scale {scale:.2f})")
        return ks

    def traced_observe(policy: AdaptiveK, seqs, num_drafted, num_accepted, step):
        print(f"  step drafted {num_drafted} kept {num_accepted}: target {step.target_seconds * 1e3:.0f} ms, "
              f"drafting {step.draft_seconds * 1e3:.0f} ms, {step.num_tokens} tokens fed")
        return observe(policy, seqs, num_drafted, num_accepted, step)

    AdaptiveK.choose, AdaptiveK.observe = traced_choose, traced_observe
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for prompt in code_prompts(args.prompts, seed=0):
        llm.generate([prompt[:300]], params)


if __name__ == "__main__":
    main()
