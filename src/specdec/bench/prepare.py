"""From ``specdec bench`` flags to what the harness runs: models, runners, prompts and calibration.

:func:`resolve_source` reads what the flags name (the target: a folder or a synthetic shape; the
draft: a folder, a synthetic shape, the target itself or none; the workload's questions) without
loading a model, so that bad input fails fast. :func:`load_bench` then loads or builds the models
on the device, builds one runner per method, and measures what the summary needs beside the runs:
direct cost ratios (``--cost-ratio direct``), the ideal ratio of a draft equal to the target, and
the roofline's least step time (bytes a plain step reads / the measured memory read bandwidth).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bench.methods import REFERENCE, MethodSpec, Runner
from specdec.bench.summary import Calibration
from specdec.bench.synthetic import SAME, SHAPES, random_questions
from specdec.bench.workloads import Question, default_spec_bench_path, load_workload
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from specdec.bench.harness import BenchSettings, PromptSource

DIRECT_COST_CONTEXT = 256
"""Most tokens of context (from the first prompt) before the forwards timed for --cost-ratio direct and
for the ideal ratio of a draft equal to the target."""


@dataclass
class Source:
    """What the flags name. ``target`` is a folder or hub id, or None with ``synthetic`` (a shape name);
    the draft is ``draft`` (a folder), ``draft_synthetic`` (a shape), the target (``draft_is_target``)
    or none."""

    target: str | None
    synthetic: str | None
    draft: str | None
    draft_synthetic: str | None
    draft_is_target: bool
    workload: str
    data: Path | None
    questions: list[Question]
    shape: str | None = None
    """With ``--shape``: what the inflated pair is (the shape, parameter counts, that it is inflated)."""

    @property
    def has_draft(self) -> bool:
        return self.draft is not None or self.draft_synthetic is not None or self.draft_is_target


@dataclass
class Bench:
    """What the harness runs: runners, a prompt source, the calibration and the run's description."""

    runners: list[Runner]
    prompts: PromptSource
    calibration: Calibration
    info: dict[str, Any] = field(default_factory=dict)


def split_names(text: str) -> list[str]:
    """The non-empty items of a comma-separated flag value."""
    return [name.strip() for name in text.split(",") if name.strip()]


def resolve_source(args: argparse.Namespace) -> Source:
    """The models and questions the flags name (questions loaded, models not)."""
    draft_is_target = bool(args.draft_equals_target) or args.draft_synthetic == SAME
    draft_synthetic = None if args.draft_synthetic == SAME else args.draft_synthetic
    if args.synthetic is not None:
        questions = random_questions(args.num_prompts)
        return Source(None, args.synthetic, None, draft_synthetic, draft_is_target, "random", None, questions)
    target, draft, embedded = args.model, args.draft_model, False
    shape = getattr(args, "shape", None)
    if shape is not None:
        given = [flag for flag, value in (("--model", args.model), ("--draft-model", args.draft_model),
                                          ("--synthetic", args.synthetic)) if value is not None]
        if given:
            raise SpecDecError(f"--shape runs the embedded pair inflated to {shape}; drop {', '.join(given)}")
        from specdec.inflate.pair import cached_pair

        pair = cached_pair(shape, args.shape_cache)
        target, draft, embedded = str(pair.target), str(pair.draft), True
        shape = pair.describe()
    elif getattr(args, "shape_cache", None) is not None:
        raise SpecDecError("--shape-cache needs --shape")
    if target is None:
        from specdec.assets import require_default_pair

        pair = require_default_pair()
        target, embedded = str(pair[0]), True
        draft = draft or str(pair[1])
    if draft_is_target:
        draft = None
    workload = args.workload or ("code" if embedded else "spec_bench")
    categories = split_names(args.categories) if args.categories else None
    data = default_spec_bench_path() if args.data is None and workload == "spec_bench" else args.data
    questions = load_workload(workload, data, categories, args.num_prompts)
    return Source(target, None, draft, None, draft_is_target, workload, data, questions, shape)


def _load_models(
    source: Source, args: argparse.Namespace, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedModel | str | None]:
    """The loaded (or built) target, and the draft: a built synthetic model, a folder, or None."""
    from types import SimpleNamespace

    import torch

    from specdec.bench.synthetic import build_synthetic
    from specdec.drafters.draft_lm import resolve_draft_dtype
    from specdec.models.loader import load_hf_model, resolve_dtype

    if source.synthetic is None:
        target, _ = load_hf_model(source.target, args.dtype, device)
        return target, source.draft
    # A synthetic checkpoint counts as stored in bfloat16 for --dtype auto.
    dtype = resolve_dtype(args.dtype, SimpleNamespace(dtype=torch.bfloat16), device)
    print(f"specdec bench: building a random-weight {source.synthetic} model ({dtype}, {device})", file=sys.stderr)
    target = build_synthetic(source.synthetic, dtype, device, seed=0)
    draft = None
    if source.draft_synthetic is not None:
        draft = build_synthetic(
            source.draft_synthetic,
            resolve_draft_dtype(args.draft_dtype, dtype, device),
            device,
            seed=1,
            vocab_size=target.config.vocab_size,
            max_positions=target.config.max_position_embeddings,
        )
    return target, draft


def _longest(ks: list[int | str]) -> int:
    """The most drafts per step of any ``--k`` value (``auto``: its default maximum)."""
    from specdec.adaptive import DEFAULT_MAX_SPECULATIVE_TOKENS

    return max(DEFAULT_MAX_SPECULATIVE_TOKENS if k == "auto" else k for k in ks)


def _max_model_len(source: Source, args: argparse.Namespace, target: PreTrainedModel, ks: list[int]) -> int | None:
    """``--max-model-len``, else for a synthetic target what its prompts, outputs and drafts need."""
    if args.max_model_len is not None or source.synthetic is None:
        return args.max_model_len
    needed = args.prompt_len + args.max_tokens + _longest(ks) + 1
    return min(needed, target.config.max_position_embeddings)


def _calibrate(
    runners: list[Runner],
    reference: Any,
    context: list[int],
    source: Source,
    args: argparse.Namespace,
    step_bytes: int,
    bandwidth_gbs: float | None,
) -> Calibration:
    from specdec.bench.hardware import direct_cost_ratio, draft_equals_target_ideals
    from specdec.bench.runners import SpecDecRunner

    drafting = [r for r in runners if isinstance(r, SpecDecRunner) and r.spec.kind.needs_draft]
    calibration = Calibration()
    if args.cost_ratio == "direct":
        calibration.cost_ratios = {r.spec.label: direct_cost_ratio(r.llm, context) for r in drafting}
    if source.draft_is_target and drafting:
        ks = {r.spec.label: r.spec.k for r in drafting}
        seconds, ideals = draft_equals_target_ideals(reference.target, context, ks)
        calibration.forward_seconds, calibration.ideal_ratios = seconds, ideals
    if bandwidth_gbs:
        calibration.min_step_seconds = step_bytes / (bandwidth_gbs * 1e9)
    return calibration


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Where a benchmark ran: dtype, device, versions, CPU threads and features (a run on a host without AMX, say,
    is then told from a regression)."""
    import torch
    import transformers

    from specdec import __version__
    from specdec.models.loader import cpu_features

    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "device name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": __version__,
        "cpu threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu features": cpu_features(),
    }


def load_bench(
    source: Source, specs: list[MethodSpec], args: argparse.Namespace, settings: BenchSettings, ks: list[int]
) -> Bench:
    """Load the models, build the runners (specdec LLMs sized for the largest batch size), set the
    settings' context window, and measure the calibration."""
    from transformers.utils import logging as hf_logging

    from specdec.bench.hardware import (
        device_bandwidth_gbs,
        measure_read_bandwidth_gbs,
        parameter_bytes,
        step_read_bytes,
    )
    from specdec.bench.methods import runnable_by_default
    from specdec.bench.runners import RunnerOptions, SpecDecRunner, build_runners
    from specdec.bench.synthetic import RandomTokenPrompts
    from specdec.bench.workloads import PromptBuilder
    from specdec.models.loader import resolve_device

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = resolve_device(args.device)
    target, draft = _load_models(source, args, device)
    options = RunnerOptions(
        tokenizer=source.target,
        backend=args.backend,
        draft_dtype=args.draft_dtype,
        draft_is_target=source.draft_is_target,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        num_candidates=args.num_candidates,
        max_num_seqs=max(settings.batch_sizes),
        max_model_len=_max_model_len(source, args, target, ks),
        enforce_eager=args.enforce_eager,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    if args.methods is None and args.speculative_config is None:  # the default list: what this target can run
        specs = runnable_by_default(specs, target)
    runners = build_runners(specs, target, draft, options)
    reference = next(r for r in runners if isinstance(r, SpecDecRunner) and r.spec.method == REFERENCE).llm
    settings.context_window = reference.max_model_len
    if source.synthetic is None:
        prompts: PromptSource = PromptBuilder(reference.tokenizer)
    else:
        prompts = RandomTokenPrompts(target.config.vocab_size, args.prompt_len)
    first = prompts.build(source.questions[0].turns[:1], [])
    longest = _longest(ks) + 1
    context = first[-min(DIRECT_COST_CONTEXT, settings.context_window - longest) :]
    measured = None if args.bandwidth_gbs else measure_read_bandwidth_gbs(device)
    bandwidth = args.bandwidth_gbs or measured
    param_bytes = parameter_bytes(target)
    weight_bytes, kv_bytes = step_read_bytes(target, len(first) + args.max_tokens // 2)
    weight_bytes = reference.target.step_weight_bytes() or weight_bytes  # as stored (bfloat16 weights: half)
    calibration = _calibrate(runners, reference, context, source, args, weight_bytes + kv_bytes, bandwidth)
    info = {
        "shape": source.shape,
        "target": source.target or f"synthetic {source.synthetic} ({SHAPES[source.synthetic].description})",
        "draft": "the target itself" if source.draft_is_target else _draft_name(source),
        "workload": source.workload,
        "data": str(source.data) if source.data is not None else None,
        "questions": len(source.questions),
        "prompt tokens": args.prompt_len if source.synthetic is not None else None,
        "backend": args.backend,
        "deterministic": args.deterministic or "off",
        "max model len": reference.max_model_len,
        "parameter bytes": param_bytes,
        "bytes read per step": weight_bytes + kv_bytes,
        "KV bytes per step": kv_bytes,
        "bandwidth GB/s": round(bandwidth, 1),
        "measured read bandwidth GB/s": None if measured is None else round(measured, 1),
        "spec-sheet bandwidth GB/s": device_bandwidth_gbs(device),
        **environment(device, target.dtype),
    }
    return Bench(runners, prompts, calibration, info)


def _draft_name(source: Source) -> str | None:
    if source.draft_synthetic is not None:
        return f"synthetic {source.draft_synthetic} ({SHAPES[source.draft_synthetic].description})"
    return source.draft
