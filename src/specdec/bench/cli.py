"""The ``specdec bench`` command: plain decoding, speculative methods and transformers peers, compared.

torch, transformers and matplotlib are imported inside the handler so that the CLI starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bench.harness import METHODS, REFERENCE, BenchSettings, expand_methods, run_benchmark
from specdec.bench.workloads import WORKLOADS, PromptBuilder, default_spec_bench_path, load_workload
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.llm import LLM

DIRECT_COST_CONTEXT = 256
"""Tokens of context (from the first prompt) before the single-token forwards timed by --cost-ratio direct."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` sub-command."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark plain decoding, speculative methods and transformers peers on the same prompts",
        description="Run plain decoding, speculative configurations and transformers generate peers in one "
        "process on the same prompts (method order rotating per prompt, after warm-up), check greedy outputs "
        "against plain greedy decoding, and report tokens/s, speedup, τ, α, the cost ratio c, the predicted "
        "speedup and efficiency per category. Writes bench.md, bench.json and PNG plots to --out. With no "
        "--model, the embedded default pair (a code model and its draft) is used. Exits with status 1 when a "
        "greedy output differs from plain decoding.",
    )
    models = p.add_argument_group("models")
    models.add_argument(
        "--model", help="target model folder or hub id (default: the embedded default target)"
    )
    models.add_argument(
        "--draft-model",
        help="draft model folder or hub id (default with no --model: the embedded default draft)",
    )
    models.add_argument(
        "--dtype",
        default="auto",
        help="target dtype: auto, float32, float64, float16 or bfloat16 (default auto: the "
        "checkpoint's dtype on GPU; on CPU bf16 for a bf16 checkpoint where the CPU has bf16 "
        "instructions, else float32)",
    )
    models.add_argument(
        "--draft-dtype",
        default=None,
        help="draft dtype, for specdec and transformers' assistant alike (default: the target's; "
        "float32 for a bf16/fp16 target on CPU)",
    )
    models.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    models.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "fast", "hf"],
        help="specdec model backend (default auto)",
    )

    methods = p.add_argument_group("methods")
    methods.add_argument(
        "--methods",
        default=None,
        help="comma-separated, from: "
        + ", ".join(METHODS)
        + f" (default: all; {REFERENCE!r} is always run as the reference)",
    )
    methods.add_argument(
        "--k",
        nargs="+",
        default=["4"],
        metavar="K",
        help="draft tokens per step; several values run each speculative method once per k "
        "(e.g. --k 2 4 8 or --k 2,4,8; default 4)",
    )
    methods.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=3,
        help="longest n-gram matched by ngram and hf_prompt_lookup (default 3)",
    )
    methods.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=1,
        help="shortest n-gram matched by ngram (default 1; transformers always goes down to 1)",
    )
    methods.add_argument(
        "--cost-ratio",
        choices=["metrics", "direct"],
        default="metrics",
        help="how c of draft_model is measured: from specdec's metrics (draft time per drafted "
        "token / target time per step) or directly by timing a single-token forward of each "
        "model (default metrics)",
    )

    work = p.add_argument_group("workload")
    work.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="code (held-out code prompts), spec_bench (Spec-Bench questions) or jsonl (any JSONL "
        "with a 'prompt' or 'turns' field); default code with the embedded pair, else spec_bench",
    )
    work.add_argument(
        "--data",
        type=Path,
        default=None,
        help="question file (spec_bench: default "
        "../shared/data/spec_bench/question.jsonl relative to the repository; jsonl: required) "
        "or a corpus folder (code)",
    )
    work.add_argument(
        "--categories",
        default=None,
        help="comma-separated categories (or Spec-Bench sub-categories) to keep (default: all)",
    )
    work.add_argument("--num-prompts", type=int, default=10, help="questions per category (default 10)")

    run = p.add_argument_group("run")
    run.add_argument(
        "--max-tokens", type=int, default=128, help="tokens generated per turn by every method (default 128)"
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy, checked against plain decoding (default 0)",
    )
    run.add_argument(
        "--seeds",
        nargs="+",
        default=["0"],
        metavar="SEED",
        help="each question runs once per seed (default 0)",
    )
    run.add_argument("--repeats", type=int, default=1, help="timed runs per question and seed (default 1)")
    run.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per method (default 1)")
    run.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output folder for bench.md, bench.json, speedup.png, acceptance.png (default ./bench-results)",
    )
    p.set_defaults(func=run_bench)


def _int_list(values: Sequence[str], flag: str) -> list[int]:
    items = [item for value in values for item in value.split(",") if item.strip()]
    try:
        return [int(item) for item in items]
    except ValueError as exc:
        raise SpecDecError(f"{flag} takes integers, got {' '.join(values)!r}") from exc


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _models(args: argparse.Namespace) -> tuple[str, str | None, bool]:
    """(target, draft or None, whether the embedded default pair is used)."""
    if args.model is not None:
        return args.model, args.draft_model, False
    from specdec.assets import require_default_pair

    pair = require_default_pair()
    return str(pair[0]), args.draft_model or str(pair[1]), True


def _method_names(args: argparse.Namespace, draft: str | None) -> list[str]:
    if args.methods is not None:
        names = _names(args.methods)
        if not names:
            raise SpecDecError("--methods is empty")
        return names
    names = list(METHODS)
    if draft is None:
        dropped = [n for n in names if METHODS[n].needs_draft]
        print(f"specdec bench: no --draft-model, skipping {', '.join(dropped)}", file=sys.stderr)
        names = [n for n in names if not METHODS[n].needs_draft]
    return names


def _environment(llm: LLM) -> dict[str, Any]:
    import torch
    import transformers

    from specdec import __version__

    return {
        "dtype": str(llm.target.dtype).removeprefix("torch."),
        "device": str(llm.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": __version__,
        "cpu threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``specdec bench``; returns 1 when a greedy output differs from plain decoding."""
    ks = _int_list(args.k, "--k")
    seeds = _int_list(args.seeds, "--seeds")
    lo, hi = args.prompt_lookup_min, args.prompt_lookup_max
    if not 1 <= lo <= hi:
        raise SpecDecError(f"need 1 <= --prompt-lookup-min <= --prompt-lookup-max, got {lo} and {hi}")
    target, draft, embedded = _models(args)
    specs = expand_methods(_method_names(args, draft), ks)
    settings = BenchSettings(args.max_tokens, args.temperature, tuple(seeds), args.repeats, args.warmup)
    workload = args.workload or ("code" if embedded else "spec_bench")
    categories = _names(args.categories) if args.categories else None
    data = default_spec_bench_path() if args.data is None and workload == "spec_bench" else args.data
    questions = load_workload(workload, data, categories, args.num_prompts)

    from transformers.utils import logging as hf_logging

    from specdec.bench.report import mismatch_warning, to_markdown, write_report
    from specdec.bench.runners import SpecDecRunner, build_runners, direct_cost_ratio

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    print(
        f"specdec bench: {len(questions)} {workload} questions, {len(specs)} methods: "
        f"{', '.join(s.label for s in specs)}",
        file=sys.stderr,
    )
    runners = build_runners(specs, target, draft, args.dtype, args.device, args.backend, hi, lo, args.draft_dtype)
    reference = next(r for r in runners if isinstance(r, SpecDecRunner) and r.spec.method == REFERENCE).llm
    settings.context_window = reference.target.max_length
    prompts = PromptBuilder(reference.tokenizer)
    cost_ratios = {}
    if args.cost_ratio == "direct":
        length = min(DIRECT_COST_CONTEXT, settings.context_window - 1)
        context = prompts.build(questions[0].turns[:1], [])[-length:]
        cost_ratios = {
            r.spec.label: direct_cost_ratio(r.llm, context)
            for r in runners
            if isinstance(r, SpecDecRunner) and r.spec.method == "draft_model"
        }

    result = run_benchmark(runners, questions, prompts, settings, cost_ratios)
    result.info = {
        "target": target,
        "draft": draft,
        "workload": workload,
        "data": str(data) if data is not None else None,
        "questions": len(questions),
        "backend": args.backend,
        **_environment(reference),
    }
    print(to_markdown(result))
    written = write_report(result, args.out)
    print("specdec bench: wrote " + ", ".join(str(path) for path in written.values()), file=sys.stderr)
    warning = mismatch_warning(result)
    if warning:
        print(warning, file=sys.stderr)
        return 1
    return 0
