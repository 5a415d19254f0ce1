"""The deterministic mode's guarantee at scale: requests in random batch compositions give the same
tokens as alone, with every drafting method. A check run by hand (minutes), not a test; the tests
(``tests/test_deterministic.py``) prove the same on a random bfloat16 model in seconds.

For each method, ``--requests`` requests (held-out code prompts, half greedy, half seeded sampling at
T = 0.8 with top-p 0.95; 8 to 40 tokens each, end-of-sequence ignored) are generated

- alone, with plain decoding (the mode's speculation, greedy or sampled with keyed noise, must give
  plain decoding's tokens bit for bit: ``specdec/keyed_noise.py``);
- with the method, shuffled into random batches of 1 to 16 requests, each batch run through a random
  number of slots (2 to 16), so that rows join and leave between steps (continuous batching).

Every request's batched tokens are compared with plain decoding's alone; a difference is printed
with the first position it differs at. ``--no-deterministic`` runs the same in the default mode, to show that
the comparison can fail. Exit status 1 when any request differs.

    PYTHONPATH=src python3 scripts/deterministic_compositions.py                    # every method, 200 requests
    PYTHONPATH=src python3 scripts/deterministic_compositions.py --methods plain eagle --requests 50
"""

from __future__ import annotations

import argparse
import random
import sys
import time

FIXED_K = 4


def method_configs(draft: str) -> dict[str, dict | None]:
    """Every method on the embedded pair (heads found beside its target), by name."""
    small = {"method": "draft_model", "model": draft}
    return {
        "plain": None,
        "draft_model": {**small, "num_speculative_tokens": FIXED_K},
        "eagle": {"method": "eagle", "num_speculative_tokens": FIXED_K},
        "eagle_tree": {"method": "eagle", "num_speculative_tokens": FIXED_K, "num_candidates": 2},
        "medusa": {"method": "medusa", "num_speculative_tokens": FIXED_K},
        "mtp": {"method": "mtp", "num_speculative_tokens": 2},
        "ngram": {"method": "ngram", "num_speculative_tokens": FIXED_K},
        "suffix": {"method": "suffix", "num_speculative_tokens": FIXED_K},
        "lookahead": {"method": "lookahead", "num_speculative_tokens": FIXED_K},
        "layer_skip": {"method": "layer_skip", "num_speculative_tokens": FIXED_K},
        "early_exit": {"method": "layer_skip", "early_exit": True, "num_speculative_tokens": FIXED_K},
        # The embedded pair has one draft: it is both stages here (the machinery, not a useful cascade).
        "cascade": {"method": "cascade", "num_speculative_tokens": FIXED_K, "stages": [
            {**small, "num_speculative_tokens": 2}, small]},
        "auto": {"method": "auto", "num_speculative_tokens": "auto", "candidates": [
            {"method": "ngram"}, {"method": "suffix"}, small, {"method": "eagle"}]},
        "draft_model_auto_k": {**small, "num_speculative_tokens": "auto"},
    }


def requests(count: int, seed: int) -> list[tuple[str, object]]:
    """``(prompt, SamplingParams)`` per request: held-out code prompts, alternately greedy and seeded."""
    from specdec import SamplingParams
    from specdec.bench.workloads import load_code

    rng = random.Random(seed)
    prompts = [q.turns[0] for q in load_code(count, seed=seed)]
    out = []
    for i, prompt in enumerate(prompts):
        tokens = rng.randint(8, 40)
        if i % 2:
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        out.append((prompt, params))
    return out


def generate(llm, batch: list[tuple[str, object]]) -> list[list[int]]:
    outs = llm.generate([p for p, _ in batch], [q for _, q in batch])
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    from specdec import LLM
    from specdec.assets import require_default_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target, draft = (str(p) for p in require_default_pair())
    configs = method_configs(draft)
    parser.add_argument("--methods", nargs="+", default=list(configs), choices=list(configs))
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    options = parser.parse_args()
    work = requests(options.requests, options.seed)
    mode = "deterministic" if options.deterministic else "default"
    print(f"{len(work)} requests ({sum(q.temperature == 0 for _, q in work)} greedy), embedded pair, bfloat16, "
          f"{mode} mode")

    def build(name: str, slots: int):
        return LLM(target, speculative_config=configs[name], dtype="bfloat16", max_num_seqs=slots,
                   deterministic=options.deterministic, enable_prefix_caching=False)

    start = time.perf_counter()
    plain = build("plain", 1)
    alone = [generate(plain, [r])[0] for r in work]
    print(f"plain decoding alone: {time.perf_counter() - start:.0f} s")
    total = 0
    for name in options.methods:
        start = time.perf_counter()
        rng = random.Random(f"{options.seed}-{name}")
        order = list(range(len(work)))
        rng.shuffle(order)
        batched: dict[int, list[int]] = {}
        batches, engines = 0, {}  # one engine per number of slots
        while order:
            size = rng.randint(1, 16)
            chosen, order = order[:size], order[size:]
            slots = rng.randint(2, 16)
            if slots not in engines:
                engines[slots] = build(name, slots)
            for i, tokens in zip(chosen, generate(engines[slots], [work[i] for i in chosen])):
                batched[i] = tokens
            batches += 1
        differ = [i for i in range(len(work)) if batched[i] != alone[i]]
        total += len(differ)
        print(f"{name:20s} {len(differ):3d} of {len(work)} differ ({batches} random batches, "
              f"{time.perf_counter() - start:.0f} s)")
        for i in differ[:5]:
            first = next((j for j, (a, b) in enumerate(zip(batched[i], alone[i])) if a != b), None)
            kind = "greedy" if work[i][1].temperature == 0 else "sampled"
            print(f"    request {i} ({kind}): first difference at token {first}")
    print(f"total: {total} differences")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
