"""The ``specdec bench`` command: plain decoding, speculative methods and transformers peers, compared.

torch, transformers and matplotlib are imported inside the handler so that the CLI starts fast.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.bench.harness import BenchSettings, run_benchmark
from specdec.bench.methods import PEERS, REFERENCE, deterministic_modes, expand_methods, in_modes, methods
from specdec.bench.prepare import load_bench, resolve_source, split_names
from specdec.bench.synthetic import SAME, SHAPES
from specdec.bench.workloads import WORKLOADS
from specdec.cli_checks import check_output_folder, number
from specdec.errors import SpecDecError
from specdec.generate_cli import add_kv_flags
from specdec.inflate.pair import add_shape_flags
from specdec.jsonl import json_object


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    models = p.add_argument_group("models")
    models.add_argument("--model", help="target model folder or hub id (default: the embedded default target)")
    models.add_argument(
        "--speculative-model", "--draft-model", dest="draft_model",
        help="draft model folder or hub id (default with no --model: the embedded default draft)",
    )
    models.add_argument(
        "--synthetic",
        choices=list(SHAPES),
        metavar="SHAPE",
        help="instead of --model, a random-weight Llama target of a real shape, built on the device, no "
        "tokenizer (prompts are random token ids): "
        + "; ".join(f"{name}: {shape.description}" for name, shape in SHAPES.items()),
    )
    add_shape_flags(models, "--model")
    models.add_argument(
        "--draft-synthetic",
        choices=[*SHAPES, SAME],
        metavar="SHAPE",
        help=f"with --synthetic, a random-weight draft of one of those shapes (with the target's vocabulary), "
        f"or {SAME!r}: the target itself",
    )
    models.add_argument(
        "--draft-equals-target",
        action="store_true",
        help="use the target as its own draft (all drafts accepted): measures the engine's overhead against "
        "the ideal ratio (k+1)/(k + t(k+1)/t(1)) of timed target forwards",
    )
    models.add_argument(
        "--dtype",
        default="auto",
        help="target dtype: auto, float32, float64, float16 or bfloat16 (default auto: the checkpoint's dtype "
        "on GPU (bfloat16 for --synthetic); on CPU bf16 for a bf16 checkpoint where the CPU has bf16 "
        "instructions, else float32)",
    )
    models.add_argument(
        "--speculative-dtype",
        "--draft-dtype",
        dest="draft_dtype",
        default=None,
        help="draft dtype, for specdec and transformers' assistant alike (default: the target's; float32 for a "
        "float16 target on CPU)",
    )
    models.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    models.add_argument(
        "--backend", default="auto", choices=["auto", "fast", "hf"], help="specdec model backend (default auto)"
    )


def _add_method_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("methods")
    group.add_argument(
        "--methods",
        "--speculative-method",
        dest="methods",
        default=None,
        help=f"comma-separated, from: {REFERENCE}, every registered drafter (specdec's speculative methods), "
        + ", ".join(PEERS)
        + f" (default: all; {REFERENCE!r} is always run as the reference)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        "--k",
        dest="k",
        nargs="+",
        default=["4"],
        metavar="K",
        help="draft tokens per step; several values run each speculative method once per k "
        "(e.g. --k 2 4 8 or --k 2,4,8; 'auto' picks each row's k per step, at most 8; default 4)",
    )
    group.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=3,
        help="longest n-gram matched by ngram and hf_prompt_lookup (default 3)",
    )
    group.add_argument(
        "--num-candidates",
        type=int,
        default=1,
        help="methods that propose trees (see docs/methods.md) propose up to this many candidate "
        "continuations per step, k being the tree's node budget; chain methods ignore it (default 1: chains)",
    )
    group.add_argument(
        "--method-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="speculative_config fields for one method, e.g. 'suffix={\"suffix_factor\": 2}' (a method of "
        "--methods), or a further configuration under a new label, e.g. "
        "'early_exit={\"method\": \"layer_skip\", \"early_exit\": true}'; one that sets "
        "num_speculative_tokens runs once, at that k, not per --k; repeatable",
    )
    group.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help="one speculative_config, as generate and serve take it, run under its method's name (beside the "
        f"methods of --methods; alone with {REFERENCE!r} when --methods is not given); a draft_model config "
        "without a 'model' uses the run's draft",
    )
    group.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=1,
        help="shortest n-gram matched by ngram (default 1; transformers always goes down to 1)",
    )
    group.add_argument(
        "--cost-ratio",
        choices=["metrics", "direct"],
        default="metrics",
        help="how c of methods with a draft model is measured: from specdec's metrics (draft time per drafted "
        "token / target time per step) or directly by timing a single-token forward of each model "
        "(default metrics)",
    )


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    work = p.add_argument_group("workload")
    work.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="code (held-out code prompts), code_repeat (the code prompts, then each again with a small change: "
        "category code_again), spec_bench (Spec-Bench questions) or jsonl (any JSONL with a "
        "'prompt' or 'turns' field); default code with the embedded pair, else spec_bench",
    )
    work.add_argument(
        "--data",
        type=Path,
        default=None,
        help="question file (spec_bench: default the Spec-Bench questions shipped with specdec; jsonl: "
        "required) or a corpus folder (code)",
    )
    work.add_argument(
        "--categories", default=None, help="comma-separated categories (or Spec-Bench sub-categories) to keep"
    )
    work.add_argument(
        "--prompts-per-category",
        "--num-prompts",
        dest="num_prompts",
        type=int,
        default=10,
        help="questions per category, so the run has this many times the number of categories (Spec-Bench has 6: "
        "1 runs 6 questions; --categories narrows them); with --synthetic, the number of random prompts "
        "(default 10)",
    )
    work.add_argument(
        "--prompt-len", type=int, default=128, help="with --synthetic, tokens per random prompt (default 128)"
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    run = p.add_argument_group("run")
    run.add_argument(
        "--batch-size",
        nargs="+",
        default=["1"],
        metavar="N",
        help="prompts per generate call; several values sweep them (e.g. --batch-size 1 4 8). specdec methods "
        "run every batch size, transformers peers batch 1 only (default 1)",
    )
    run.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per sequence for specdec's KV pools (default: the model's context; with --synthetic, "
        "what the prompts and outputs need)",
    )
    run.add_argument("--enforce-eager", action="store_true",
                     help="specdec without CUDA graphs on a GPU (the CPU path is always eager)")
    add_kv_flags(run, prefix_caching_default=False)  # off: repeated prompts would time cache hits
    run.add_argument(
        "--deterministic", nargs="?", const="on", default=None, metavar="MODE",
        help="on (the flag alone): every specdec method, plain included, in deterministic mode (batch-invariant "
        "kernels; fast backend on a CPU), its greedy check counting every difference from plain decoding as a "
        "mismatch (no rounding ties); both: every specdec method in both modes side by side, the deterministic "
        "variants labelled 'det', their speedups and greedy checks against deterministic plain decoding, and a "
        "'det. cost' column (default tok/s / deterministic tok/s); off: the default (transformers peers always "
        "run in the default mode)",
    )
    run.add_argument("--max-tokens", type=int, default=128, help="tokens generated per turn by every method")
    run.add_argument("--temperature", type=number(float, 0), default=0.0,
                     help="0 is greedy, checked against plain decoding")
    run.add_argument("--seeds", nargs="+", default=["0"], metavar="SEED", help="each question runs once per seed")
    run.add_argument("--repeats", type=int, default=1, help="timed runs per question and seed (default 1)")
    run.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls per method and batch size")
    run.add_argument(
        "--bandwidth-gbs",
        type=number(float, 0, above=True),
        default=None,
        help="device memory bandwidth in GB/s for the roofline column of plain decoding (default: measured by "
        "a read probe on the bench's threads, or a read kernel on a GPU)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output folder for bench.md, bench.json and the PNG plots (default ./bench-results)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` sub-command."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark plain decoding, speculative methods and transformers peers on the same prompts",
        description="Run plain decoding, speculative configurations and transformers generate peers in one "
        "process on the same prompts (method order rotating per prompt, after warm-up), at one or several "
        "batch sizes, check greedy outputs against plain greedy decoding, and report throughput, per-request "
        "tokens/s, speedup, τ, α, the cost ratio c, the predicted speedup and efficiency per category. Writes "
        "bench.md, bench.json and PNG plots to --out. With no --model, the embedded default pair (a code "
        "model and its draft) is used. Exit status: 0 done, 2 bad input, 3 a greedy output differs from plain "
        "decoding beyond a rounding tie (1 is left to crashes). Without matplotlib (the bench extra) the plots "
        "are skipped with a notice.",
    )
    _add_model_flags(p)
    _add_method_flags(p)
    _add_workload_flags(p)
    _add_run_flags(p)
    p.set_defaults(func=run_bench)


def _k_list(values: Sequence[str]) -> list[int | str]:
    """``--k``: integers, and ``auto`` (the adaptive policy, at most its default maximum)."""
    items = [item.strip() for value in values for item in value.split(",") if item.strip()]
    return [item if item == "auto" else _int_list([item], "--k")[0] for item in items]


def _int_list(values: Sequence[str], flag: str) -> list[int]:
    items = [item for value in values for item in value.split(",") if item.strip()]
    try:
        return [int(item) for item in items]
    except ValueError as exc:
        raise SpecDecError(f"{flag} takes integers, got {' '.join(values)!r}") from exc


def _check_flags(args: argparse.Namespace, seeds: list[int]) -> None:
    """Reject bad values and flag combinations that contradict each other, before any model loads."""
    from specdec.sampling import is_seed

    bad = [seed for seed in seeds if not is_seed(seed)]
    if bad:
        raise SpecDecError(f"--seeds must be integers in 0..2**64-1, got {bad[0]}")
    for flag, value in (("--prompts-per-category", args.num_prompts), ("--prompt-len", args.prompt_len)):
        if value < 1:
            raise SpecDecError(f"{flag} must be at least 1, got {value}")
    if args.kv_cache_memory is not None:
        from specdec.models.kv_budget import parse_memory

        parse_memory(args.kv_cache_memory)
    lo, hi = args.prompt_lookup_min, args.prompt_lookup_max
    if not 1 <= lo <= hi:
        raise SpecDecError(f"need 1 <= --prompt-lookup-min <= --prompt-lookup-max, got {lo} and {hi}")
    from specdec.drafters.base import MAX_CANDIDATES

    if not 1 <= args.num_candidates <= MAX_CANDIDATES:
        raise SpecDecError(f"--num-candidates must be in 1..{MAX_CANDIDATES}, got {args.num_candidates}")
    if args.synthetic is not None:
        named = {
            "--model": args.model,
            "--draft-model": args.draft_model,
            "--workload": args.workload,
            "--data": args.data,
            "--categories": args.categories,
        }
        given = [flag for flag, value in named.items() if value is not None]
        if given:
            raise SpecDecError(f"--synthetic builds its own model and prompts; drop {', '.join(given)}")
    elif args.draft_synthetic is not None:
        raise SpecDecError("--draft-synthetic needs --synthetic")
    if args.draft_equals_target and (args.draft_model is not None or args.draft_synthetic is not None):
        raise SpecDecError("--draft-equals-target takes no --draft-model or --draft-synthetic")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise SpecDecError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    check_output_folder(args.out, "--out")


def _method_configs(values: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--method-config NAME=JSON`` values by NAME (each JSON an object)."""
    configs: dict[str, dict[str, Any]] = {}
    for value in values:
        name, sep, text = value.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SpecDecError(f"--method-config takes NAME=JSON, got {value!r}")
        if name in configs:
            raise SpecDecError(f"--method-config {name} is given twice")
        configs[name] = json_object(text, f"--method-config {name}")
    return configs


def _speculative_config(args: argparse.Namespace, names: list[str], configs: dict[str, dict[str, Any]],
                        given: bool) -> list[str]:
    """``--speculative-config JSON`` as a ``--method-config`` of its method (added to ``configs``); returns
    the method names to run: its method beside ``names``, or alone when --methods was not ``given``."""
    if args.speculative_config is None:
        return names
    config = json_object(args.speculative_config, "--speculative-config")
    method = config.get("method")
    if not isinstance(method, str):
        raise SpecDecError("--speculative-config needs a 'method'")
    if method in configs:
        raise SpecDecError(f"--speculative-config and --method-config {method} both configure {method!r}")
    configs[method] = config
    return [*names, method] if given else [method]


def _method_names(args: argparse.Namespace, has_draft: bool) -> list[str]:
    if args.methods is not None:
        names = split_names(args.methods)
        if not names:
            raise SpecDecError("--methods is empty")
        return names
    if args.speculative_config is not None:
        return []
    names = [n for n in methods() if not methods()[n].needs_config]  # those run only with --method-config
    if not has_draft:
        dropped = [n for n in names if methods()[n].needs_draft]
        print(f"specdec bench: no draft model, skipping {', '.join(dropped)}", file=sys.stderr)
        names = [n for n in names if not methods()[n].needs_draft]
    return names


MISMATCH_EXIT = 3
"""Exit status of a run where a greedy output differs from plain decoding (not at a rounding tie)."""


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``specdec bench``; returns :data:`MISMATCH_EXIT` when a greedy output differs from plain
    decoding beyond a rounding tie."""
    ks = _k_list(args.k)
    seeds = _int_list(args.seeds, "--seeds")
    batch_sizes = _int_list(args.batch_size, "--batch-size")
    _check_flags(args, seeds)
    modes = deterministic_modes(args.deterministic)
    settings = BenchSettings(
        args.max_tokens, args.temperature, tuple(seeds), args.repeats, args.warmup, batch_sizes=tuple(batch_sizes)
    )
    source = resolve_source(args)
    configs = _method_configs(args.method_config)
    names = _speculative_config(args, _method_names(args, source.has_draft), configs, args.methods is not None)
    specs = in_modes(expand_methods(names, ks, configs), modes)
    if any(s.kind.peer for s in specs) and 1 not in settings.batch_sizes:
        print("specdec bench: transformers peers run at batch 1 only, which is not swept", file=sys.stderr)
    print(
        f"specdec bench: {len(source.questions)} {source.workload} questions, batch sizes "
        f"{', '.join(map(str, settings.batch_sizes))}, {len(specs)} methods: {', '.join(s.label for s in specs)}",
        file=sys.stderr,
    )
    from specdec.bench.report import (
        degenerate_warning,
        mismatch_warning,
        plotting_available,
        tie_notice,
        timing_warning,
        to_markdown,
        write_report,
    )

    plots = plotting_available()
    if not plots:
        print("specdec bench: matplotlib is not installed (pip install 'specdec[bench]'): tables only, no plots",
              file=sys.stderr)
    bench = load_bench(source, specs, args, settings, ks)
    result = run_benchmark(bench.runners, source.questions, bench.prompts, settings, bench.calibration)
    command = getattr(args, "command_line", None)
    result.info = {"command": shlex.join(command) if command else None, **bench.info}
    print(to_markdown(result))
    written = write_report(result, args.out, plots=plots)
    print("specdec bench: wrote " + ", ".join(str(path) for path in written.values()), file=sys.stderr)
    for line in (tie_notice(result), timing_warning(result), degenerate_warning(result)):
        if line:
            print(line, file=sys.stderr)
    warning = mismatch_warning(result)
    if warning:
        print(warning, file=sys.stderr)
        return MISMATCH_EXIT
    return 0
