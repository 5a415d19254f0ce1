"""Where a method's decoding step spends its time: the engine's stage times per step, and the Python
functions the host runs (cProfile), over timed generate calls after warm-up calls.

For the device machine first (a step there is bound by the host's launches and Python when a drafter runs
eagerly), but it runs anywhere. The embedded pair, or with ``--shape`` its inflated pair.

    python scripts/gpu_profile_step.py --method eagle --k 4 --dtype bfloat16 --prompts 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from specdec import LLM, SamplingParams
from specdec.assets import default_pair
from specdec.models import cuda_graphs
from specdec.train.corpus import code_prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="eagle")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--shape", default=None, help="an inflated pair (specdec bench --shape), e.g. 1b or 8b")
    parser.add_argument("--top", type=int, default=35, help="functions listed, by cumulative time")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    if args.shape is None:
        target, draft = default_pair()
    else:
        from specdec.inflate.pair import cached_pair

        pair = cached_pair(args.shape)
        target, draft = pair.target, pair.draft
    spec = None
    if args.method != "plain":
        spec = {"method": args.method, "num_speculative_tokens": args.k}
        if args.method == "draft_model":
            spec["model"] = str(draft)
    llm = LLM(target, speculative_config=spec, dtype=args.dtype, max_num_seqs=1, enforce_eager=args.enforce_eager)
    prompts = code_prompts(2 * args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in prompts[args.prompts:]:  # warm-up: graphs captured, functions compiled
        llm.generate(prompt, params)
    captures = cuda_graphs.one_time_setups()
    profile = cProfile.Profile()
    metrics = []
    profile.enable()
    for prompt in prompts[: args.prompts]:
        metrics.append(llm.generate(prompt, params)[0].metrics)
    profile.disable()
    steps = sum(m.num_steps for m in metrics)
    print(f"{args.method} k={args.k} {args.dtype} {args.shape or 'embedded pair'} on {llm.engine.target.device}: "
          f"{steps} steps, {sum(m.num_generated_tokens for m in metrics)} tokens; one-time set-ups in the timed "
          f"calls: {cuda_graphs.one_time_setups() - captures}")
    for stage in ("drafting", "target", "other", "prefill"):
        total = sum(getattr(m, f"time_{stage}") for m in metrics)
        print(f"  {stage:9s} {1000 * total / steps:7.3f} ms a step")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
