"""What the deterministic mode costs: plain decoding and draft_model speculation, default and
deterministic, side by side in one process (configurations alternate within each repeat), at several
batch sizes. A benchmark, not a test.

    PYTHONPATH=src python3 scripts/deterministic_cost.py                       # the embedded pair
    PYTHONPATH=src python3 scripts/deterministic_cost.py --model T --draft D   # e.g. the inflated 1b pair
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPTS = [
    "def quicksort(arr):\n", "class Stack:\n    def __init__(self):\n", "def read_json(path):\n",
    "import os\n\ndef walk(root):\n", "def fibonacci(n):\n", "class LRUCache:\n", "def parse_args():\n",
    "def merge(a, b):\n",
]


def main() -> None:
    from specdec import LLM, SamplingParams
    from specdec.assets import default_pair

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model"), parser.add_argument("--draft")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    target, draft = (options.model, options.draft) if options.model else default_pair()
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": options.k}
    llms = {(mode, name): LLM(target, speculative_config=config, deterministic=mode == "deterministic",
                              max_num_seqs=max(options.batch), enable_prefix_caching=False)
            for mode in ("default", "deterministic") for name, config in (("plain", None), ("draft_model", spec))}
    params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True)
    for batch in options.batch:
        prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
        for llm in llms.values():  # warm-up
            llm.generate(prompts, params)
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in llms}
        for _ in range(options.repeats):
            for key, llm in llms.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates[key].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        median = {key: statistics.median(values) for key, values in rates.items()}
        for key, values in rates.items():
            raw = [round(v, 1) for v in values]
            print(f"batch {batch:3d} {key[0]:13s} {key[1]:11s} {median[key]:8.1f} tok/s  raw {raw}")
        for mode in ("default", "deterministic"):
            ratio = median[(mode, "draft_model")] / median[(mode, "plain")]
            print(f"batch {batch:3d} {mode:13s} speculation {ratio:.2f}x plain")
        print(f"batch {batch:3d} deterministic plain costs "
              f"{median[('default', 'plain')] / median[('deterministic', 'plain')]:.2f}x default plain's time")


if __name__ == "__main__":
    main()
