"""How much any draft-length policy could gain over a fixed k for ngram at one row, on this machine: an
offline replay of measured steps, not a test.

Greedy output is the target's whatever k each step drafts (verification is lossless), and ngram's draft
at a position does not depend on k (a shorter draft is the start of a longer one). So for every position
of every greedy output, the draft proposed there and how many of its tokens the target keeps are fixed,
and with the measured seconds of a one-row step by tokens fed, any k policy's steps and time follow:

- ``k=N``: drafting N every step (speedup over plain decoding, as the bench would measure it);
- ``oracle``: the fastest choices knowing each draft's kept length in advance (dynamic programming over
  positions): an upper bound that no policy reaches, as it needs the target's answer before asking;
- ``auto``: specdec's ``num_speculative_tokens="auto"`` policy (:class:`specdec.adaptive.AdaptiveK`)
  replayed on the same steps, fed the table's seconds: its decisions, without its own Python cost;
- ``by outcome (fitted on W)``: a policy that chooses k from the previous step's outcome (first step,
  nothing proposed, every draft kept, none kept, some kept), the k per outcome fitted to workload W by
  coordinate search and scored on every workload: what knowing the state this way could add.

    python scripts/k_policy_bound.py --workloads code spec_bench --max-k 8 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.adaptive import AdaptiveK
from specdec.assets import require_default_pair
from specdec.bench.workloads import PromptBuilder, load_workload
from specdec.drafters.base import SpeculativeConfig
from specdec.drafters.ngram import NgramDrafter
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.step_cost import StepCost
from specdec.verify import common_prefix

OUTCOMES = ("first", "none", "all", "zero", "some")  # the previous step's, for the by-outcome policy


def greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def step_seconds(llms: dict[int, LLM], prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
    """``(plain, cost)``: the median seconds of a plain one-row step (``llms[0]``), and ``cost[f]`` of a
    step feeding ``f`` tokens with ngram (``f = 1``: a step whose lookup proposed nothing), from fixed-k
    runs of every prompt in rotating order (``llms[k]`` drafts ``k``); unmeasured ``f`` interpolated."""
    times: dict[tuple[bool, int], list[float]] = {}
    for llm in llms.values():
        engine, step = llm.engine, llm.engine.step

        def timed(seqs: list[Sequence], prompt_backlog: int = 0, step=step,
                  drafting=engine.drafter is not None) -> list:
            start = time.perf_counter()
            outputs = step(seqs, prompt_backlog)
            fed = 1 + sum(o.num_drafted for o in outputs)
            times.setdefault((drafting, fed), []).append(time.perf_counter() - start)
            return outputs

        engine.step = timed
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ks = sorted(llms)
    for i, prompt in enumerate(prompts):
        for k in ks[i % len(ks):] + ks[: i % len(ks)]:
            llms[k].generate([{"prompt_token_ids": prompt}], params)
    measured = {fed: statistics.median(v) for (drafting, fed), v in times.items() if drafting}
    cost = [0.0]
    for fed in range(1, max(ks) + 2):
        below = max(f for f in measured if f <= fed)
        above = min((f for f in measured if f >= fed), default=below)
        share = (fed - below) / (above - below) if above > below else 0.0
        cost.append(measured[below] + share * (measured[above] - measured[below]))
    return statistics.median(times[(False, 1)]), cost


def draft_outcomes(prompt: list[int], output: list[int], max_draft: int) -> list[tuple[int, int]]:
    """Per position ``t`` of ``output`` after the first (prefill emits ``output[0]``): ``(drafted, kept)``,
    the length of ngram's draft of at most ``max_draft`` tokens there and how many the target keeps."""
    config = SpeculativeConfig(method="ngram")
    drafter = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min, torch.device("cpu"))
    params = SamplingParams(temperature=0, max_tokens=len(output), ignore_eos=True)
    generator = torch.Generator()
    seq = Sequence("replay", prompt, params, generator, len(output), frozenset())
    drafter.add([seq])
    sampling = SamplingBatch([params], [generator], torch.device("cpu"))
    rows = [(0, 0)]
    for t in range(1, len(output)):
        seq.token_ids = prompt + output[:t]
        draft = drafter.propose([seq], [max_draft], sampling)
        tokens = draft.tokens[0, : draft.num_draft[0]].tolist()
        rows.append((len(tokens), common_prefix(tokens, output[t:])))
    return rows


class Replay:
    """Every k policy's seconds over fixed greedy outputs (see the module docstring)."""

    def __init__(self, generations: list[list[tuple[int, int]]], plain: float, cost: list[float]) -> None:
        self.generations, self.plain, self.cost = generations, plain, cost

    def speedup(self, seconds: float) -> float:
        return sum(len(g) - 1 for g in self.generations) * self.plain / seconds

    def step(self, rows: list[tuple[int, int]], t: int, k: int) -> tuple[float, int, int]:
        """``(seconds, drafted, kept)`` of drafting at most ``k`` at position ``t`` (``k <= 0``: plain)."""
        k = min(k, len(rows) - t - 1)
        if k <= 0:
            return self.plain, 0, 0
        drafted = min(rows[t][0], k)
        return self.cost[drafted + 1], drafted, min(rows[t][1], drafted)

    def policy(self, choose) -> float:
        """The speedup of ``choose(rows, t, outcome) -> k`` (outcome: the previous step's, see OUTCOMES)."""
        seconds = 0.0
        for rows in self.generations:
            t, outcome = 1, "first"
            while t < len(rows):
                spent, drafted, kept = self.step(rows, t, choose(rows, t, outcome))
                seconds += spent
                outcome = "none" if not drafted else "all" if kept == drafted else "zero" if not kept else "some"
                t += kept + 1
        return self.speedup(seconds)

    def oracle(self, max_k: int) -> float:
        seconds = 0.0
        for rows in self.generations:
            end = len(rows)
            best = [0.0] * (end + max_k + 2)  # [t]: the least seconds from position t to the end
            for t in range(end - 1, 0, -1):
                best[t] = min(spent + best[t + kept + 1]
                              for spent, _, kept in (self.step(rows, t, k) for k in range(max_k + 1)))
            seconds += best[1]
        return self.speedup(seconds)

    def auto(self, max_k: int) -> float:
        policy, seconds = AdaptiveK(max_k), 0.0
        params = SamplingParams(temperature=0, ignore_eos=True)
        for i, rows in enumerate(self.generations):
            seq, t = Sequence(str(i), [0], params, torch.Generator(), len(rows), frozenset()), 1
            while t < len(rows):
                (k,) = policy.choose([seq], [max(0, min(max_k, len(rows) - t - 1))])
                spent, drafted, kept = self.step(rows, t, k)
                seconds += spent
                policy.observe([seq], [drafted], [kept], StepCost(1 + drafted, drafted, spent, 0.0))
                t += kept + 1
            policy.release(seq)
        return self.speedup(seconds)

    def fit_by_outcome(self, max_k: int) -> dict[str, int]:
        """The k per previous outcome that is fastest here, by two rounds of coordinate search from ``max_k``."""
        table = dict.fromkeys(OUTCOMES, max_k)
        best = self.policy(lambda rows, t, outcome: table[outcome])
        for _ in range(2):
            for outcome in OUTCOMES:
                for k in range(max_k + 1):
                    trial = {**table, outcome: k}
                    score = self.policy(lambda rows, t, o, trial=trial: trial[o])
                    if score > best + 1e-12:
                        best, table = score, trial
        return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["code", "spec_bench"])
    parser.add_argument("--num-prompts", type=int, default=None, help="per workload (all of them by default)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--cost-prompts", type=int, default=8, help="prompts per workload that measure step costs")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, _ = require_default_pair()
    plain = LLM(target, max_num_seqs=1)
    builder = PromptBuilder(plain.tokenizer)
    prompts = {}
    for workload in args.workloads:
        built = (builder.build(q.turns[:1], []) for q in load_workload(workload, num_prompts=args.num_prompts))
        prompts[workload] = [p for p in built if len(p) + args.max_tokens <= plain.target.max_length]
    widest = max(args.max_k)
    llms = {0: plain} | {k: LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": k},
                                max_num_seqs=1) for k in range(1, widest + 1)}
    cost_prompts = [p for w in args.workloads for p in prompts[w][: args.cost_prompts]]
    plain_seconds, cost = step_seconds(llms, cost_prompts, args.max_tokens // 2)
    print(f"one-row step, ms: plain {plain_seconds * 1e3:.2f}; ngram by tokens fed "
          + " ".join(f"{f}:{c * 1e3:.2f}" for f, c in enumerate(cost) if f))
    replays = {w: Replay([draft_outcomes(p, o, widest) for p, o in zip(prompts[w], greedy_outputs(plain, prompts[w],
                                                                                                  args.max_tokens))],
                         plain_seconds, cost) for w in args.workloads}
    for max_k in args.max_k:
        fitted = {w: replays[w].fit_by_outcome(max_k) for w in args.workloads}
        columns = ["best fixed k", "oracle", "auto"] + [f"by outcome (fitted on {w})" for w in args.workloads]
        print(f"\nat most {max_k} tokens: speedup over plain decoding\n\n| workload | {' | '.join(columns)} |\n|"
              + " --- |" * (len(columns) + 1))
        for workload, replay in replays.items():
            fixed = {k: replay.policy(lambda rows, t, outcome, k=k: k) for k in range(1, max_k + 1)}
            k_best = max(fixed, key=fixed.get)
            cells = [f"{fixed[k_best]:.3f} (k={k_best})", f"{replay.oracle(max_k):.3f}", f"{replay.auto(max_k):.3f}"]
            cells += [f"{replay.policy(lambda rows, t, o, table=fitted[w]: table[o]):.3f}" for w in args.workloads]
            print(f"| {workload} ({len(replay.generations)}) | {' | '.join(cells)} |")
        for workload, table in fitted.items():
            print(f"k by previous outcome, fitted on {workload}: {table}")


if __name__ == "__main__":
    main()
