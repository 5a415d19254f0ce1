"""Engine overhead per step on tiny random models, on CPU: a benchmark, not a test.

For plain decoding, ``draft_model`` and ``ngram`` at several k, it runs one request through
``LLM.generate`` (token-id prompts: no text) and reports per target step, in milliseconds:

- ``wall``: wall-clock time of the request minus its prefill, per step;
- ``target`` and ``drafting``: ``RequestMetrics.time_target`` and ``time_drafting`` per step;
- ``other``: ``RequestMetrics.time_other`` per step, the engine's own timer over verification,
  cache rollback, stop handling and bookkeeping;
- ``overhead`` = wall - target - drafting: everything that is neither a model forward nor the
  drafter, i.e. the engine's cost per step; ``overhead %`` is its share of the step;
- ``untimed`` = overhead - other: time inside a step that no engine timer covers.

The draft model is an identical copy of the target, so every draft is accepted and each step
commits k + 1 tokens (the longest commit path). Models are random: the numbers say nothing about
acceptance or speedup, only about the engine's cost around the forwards.

    python scripts/engine_overhead.py --tokens 128 --ks 1 4 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from specdec import LLM, RequestMetrics, SamplingParams

COLUMNS = (
    "method",
    "k",
    "steps",
    "τ",
    "wall",
    "target",
    "drafting",
    "other",
    "untimed",
    "overhead",
    "overhead %",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Engine overhead per step (wall - target forward - drafter) for plain, draft_model and "
        "ngram decoding on tiny random Llama models on CPU; prints a markdown table in milliseconds."
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8], help="draft lengths (default 1 4 8)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per configuration; the median run by wall time is reported (default 5)",
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="model hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    parser.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    parser.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"], help="default auto")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    return parser.parse_args(argv)


def save_model(folder: Path, args: argparse.Namespace) -> Path:
    """A random Llama with the requested shape, saved to ``folder``."""
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        max_position_embeddings=args.prompt_len + args.tokens + 16,
        eos_token_id=None,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def make_prompt(args: argparse.Namespace) -> list[int]:
    """A prompt made of a repeated random phrase, so that n-gram lookup finds matches."""
    generator = torch.Generator().manual_seed(args.seed)
    phrase = torch.randint(0, args.vocab, (max(1, args.prompt_len // 4),), generator=generator).tolist()
    return (phrase * 4 + phrase)[: args.prompt_len]


def time_run(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, RequestMetrics]:
    """Wall-clock seconds of the steps of one greedy request (prefill excluded) and its metrics."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    tic = time.perf_counter()
    metrics = llm.generate({"prompt_token_ids": prompt}, params)[0].metrics
    return time.perf_counter() - tic - metrics.time_prefill, metrics


def measure(llm: LLM, prompt: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Per-step times in milliseconds of the median of ``args.repeats`` runs (after one warm-up)."""
    time_run(llm, prompt, args.tokens)
    runs = sorted((time_run(llm, prompt, args.tokens) for _ in range(args.repeats)), key=lambda run: run[0])
    wall, metrics = runs[len(runs) // 2]
    steps = metrics.num_steps
    per_step = {
        "wall": wall,
        "target": metrics.time_target,
        "drafting": metrics.time_drafting,
        "other": metrics.time_other,
    }
    per_step = {name: 1000 * value / steps for name, value in per_step.items()}
    per_step["overhead"] = per_step["wall"] - per_step["target"] - per_step["drafting"]
    per_step["untimed"] = per_step["overhead"] - per_step["other"]
    per_step["overhead %"] = 100 * per_step["overhead"] / per_step["wall"]
    per_step["steps"] = steps
    per_step["τ"] = metrics.mean_acceptance_length
    return per_step


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    prompt = make_prompt(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = save_model(Path(tmp) / "target", args)
        configs: list[tuple[str, int, dict | None]] = [("plain", 0, None)]
        for k in args.ks:
            configs.append(
                (
                    "draft_model",
                    k,
                    {"method": "draft_model", "model": str(target), "num_speculative_tokens": k},
                )
            )
            configs.append(("ngram", k, {"method": "ngram", "num_speculative_tokens": k}))
        for method, k, config in configs:
            llm = LLM(target, speculative_config=config, dtype=args.dtype, device="cpu", backend=args.backend)
            result = measure(llm, prompt, args)
            rows.append(
                [
                    method,
                    str(k) if config else "-",
                    str(result["steps"]),
                    f"{result['τ']:.2f}",
                    *(f"{result[name]:.3f}" for name in COLUMNS[4:10]),
                    f"{result['overhead %']:.1f}",
                ]
            )
    print(
        f"Engine overhead per step, ms (CPU, {args.threads} thread(s), {args.dtype}, {args.layers} layers "
        f"x {args.hidden_size} hidden, {args.tokens} tokens, prompt {args.prompt_len}, "
        f"median of {args.repeats})\n"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join(" --- " for _ in COLUMNS) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
