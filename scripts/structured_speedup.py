"""Speculation under JSON-schema constraints against speculation without them: a benchmark, not a test.

Four runs of the same prompts, alternating in rotating order: plain and speculative decoding, each without
and with a constraint (each prompt's JSON schema, from a small set of tool-call-like schemas). Reports
tokens/s of each, the speedup of speculation with and without the constraint, the constrained speedup as a
fraction of the unconstrained one, α, and the grammar compilation time.

    python scripts/structured_speedup.py                                   # embedded pair, CPU
    python scripts/structured_speedup.py --model TARGET --draft DRAFT --device cuda --dtype bfloat16 \
        --num-prompts 64 --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import time

from specdec import LLM, SamplingParams, StructuredOutputsParams
from specdec.assets import require_default_pair

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "email": {"type": "string", "maxLength": 40}},
     "required": ["name", "age", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"enum": ["get_weather", "search", "send_email"]},
                                      "arguments": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 48},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                                          "required": ["query", "limit"], "additionalProperties": False}},
     "required": ["function", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 12},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}}, "total": {"type": "number"}},
     "required": ["items", "total"], "additionalProperties": False},
]
PROMPT = "Answer with JSON only. Request {i}: {task}\nJSON:"
TASKS = ["describe the user who wrote this code", "call a tool to find the weather in Paris",
         "list the items of order 1234 and its total", "describe the author of the last commit"]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int, float]:
    """(seconds, generated tokens, α) of one batched generate call."""
    before = (llm.batch_metrics.num_draft_tokens, llm.batch_metrics.num_accepted_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    drafted = llm.batch_metrics.num_draft_tokens - before[0]
    accepted = llm.batch_metrics.num_accepted_tokens - before[1]
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs), accepted / drafted if drafted else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model"), parser.add_argument("--draft")
    parser.add_argument("--method", default="draft_model"), parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--device", default="auto"), parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    target, draft = (args.model, args.draft) if args.model else require_default_pair()
    spec = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        spec["model"] = str(draft)
    common = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs}
    llms = {"plain": LLM(target, **common), "spec": LLM(target, speculative_config=spec, **common)}
    prompts = [PROMPT.format(i=i, task=TASKS[i % len(TASKS)]) for i in range(args.num_prompts)]
    params = {
        "free": [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i)
                 for i in range(args.num_prompts)],
        "json": [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i,
                                structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
                 for i in range(args.num_prompts)],
    }
    runs = [(m, c) for m in llms for c in params]
    for m, c in runs:  # warm-up (and grammar compilation, reported below)
        run(llms[m], prompts[: args.max_num_seqs], params[c][: args.max_num_seqs])
    totals = {r: [0.0, 0, []] for r in runs}
    for repeat in range(args.repeats):
        for m, c in runs[repeat % len(runs):] + runs[: repeat % len(runs)]:
            seconds, tokens, alpha = run(llms[m], prompts, params[c])
            totals[(m, c)][0] += seconds
            totals[(m, c)][1] += tokens
            totals[(m, c)][2].append(alpha)
    rate = {r: t[1] / t[0] for r, t in totals.items()}
    for (m, c), t in totals.items():
        print(f"{m:5s} {c:4s} {rate[(m, c)]:9.1f} tok/s  {t[1]:6d} tokens  {t[0]:7.2f} s  "
              f"alpha {sum(t[2]) / len(t[2]):.3f}")
    free = rate[("spec", "free")] / rate[("plain", "free")]
    constrained = rate[("spec", "json")] / rate[("plain", "json")]
    print(f"speedup unconstrained {free:.3f}x, constrained {constrained:.3f}x: "
          f"{constrained / free:.1%} of the unconstrained speedup")
    for name, llm in llms.items():
        m = llm.batch_metrics
        print(f"{name}: {m.num_grammar_compiles} grammars compiled in {m.time_grammar_compile * 1000:.1f} ms")


if __name__ == "__main__":
    main()
