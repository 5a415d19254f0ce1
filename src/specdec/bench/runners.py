"""One runner per benchmarked method, all with the same shape:
``run(prompt_ids, max_tokens, temperature, seed) -> (token_ids, seconds, metrics | None)``.

Every runner generates exactly ``max_tokens`` tokens (end-of-sequence ignored: specdec's
``SamplingParams(ignore_eos=True)``, transformers' ``eos_token_id=None``), so tokens/s compare
like for like. ``seconds`` is the wall-clock time of the whole generate call, prefill included,
with the device synchronized before and after. All runners share one loaded target model (and
the transformers peers one loaded assistant), in one dtype on one device.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specdec.bench.harness import MethodSpec
from specdec.drafters.draft_model import resolve_draft_dtype
from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.metrics import RequestMetrics
from specdec.models.base import CachedLM
from specdec.models.loader import load_hf_model, resolve_device
from specdec.sampling import SamplingParams

RunOutput = tuple[list[int], float, RequestMetrics | None]
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
# Neutralise logits processors a checkpoint's generation_config may switch on: specdec applies none.
NEUTRAL_PROCESSING = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner(ABC):
    """Generates for one method; ``spec`` names the method and its k."""

    spec: MethodSpec

    @abstractmethod
    def run(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        """Generate exactly ``max_tokens`` tokens after ``prompt_ids``: (ids, seconds, metrics or None)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The method's settings, for the JSON report."""


class SpecDecRunner(Runner):
    """specdec's :class:`~specdec.LLM` (plain decoding or a speculative configuration)."""

    def __init__(self, spec: MethodSpec, llm: LLM) -> None:
        self.spec, self.llm = spec, llm

    def run(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        _synchronize(self.llm.device)
        tic = time.perf_counter()
        output = self.llm.generate({"prompt_token_ids": list(prompt_ids)}, params)[0]
        _synchronize(self.llm.device)
        return output.outputs[0].token_ids, time.perf_counter() - tic, output.metrics

    def describe(self) -> dict[str, Any]:
        config = self.llm.speculative_config
        return {
            "label": self.spec.label,
            "description": self.spec.kind.description,
            "method": self.spec.method,
            "k": self.spec.k,
            "library": "specdec",
            "target_backend": type(self.llm.target).__name__,
            "speculative_config": None
            if config is None
            else {key: _describe_value(value) for key, value in vars(config).items()},
        }


def _describe_value(value: Any) -> Any:
    """A JSON-ready stand-in: a loaded model by its folder, a path or dtype as text."""
    if isinstance(value, PreTrainedModel):
        return getattr(value.config, "_name_or_path", "") or type(value).__name__
    if isinstance(value, (Path, torch.dtype)):
        return str(value)
    return value


class HFRunner(Runner):
    """transformers ``generate``, alone or with an assistant model or prompt lookup.

    ``assistant_settings`` are written to the assistant's ``generation_config`` before every call:
    transformers 5.x reads ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and
    ``assistant_confidence_threshold`` from there (not from ``generate()`` keyword arguments), and
    the heuristic schedule writes its state back there, so re-applying them keeps runs independent.
    """

    def __init__(
        self,
        spec: MethodSpec,
        model: PreTrainedModel,
        generate_kwargs: dict[str, Any] | None = None,
        assistant: PreTrainedModel | None = None,
        assistant_settings: dict[str, Any] | None = None,
    ) -> None:
        self.spec, self.model, self.assistant = spec, model, assistant
        self.generate_kwargs = dict(generate_kwargs or {})
        self.assistant_settings = dict(assistant_settings or {})

    def run(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.model.device)
        kwargs: dict[str, Any] = {
            **NEUTRAL_PROCESSING,
            **self.generate_kwargs,
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": max_tokens,
            "eos_token_id": None,
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
            for name, value in self.assistant_settings.items():
                setattr(self.assistant.generation_config, name, value)
        torch.manual_seed(seed)
        _synchronize(self.model.device)
        tic = time.perf_counter()
        output = self.model.generate(input_ids, **kwargs)
        _synchronize(self.model.device)
        seconds = time.perf_counter() - tic
        return output[0, input_ids.shape[1] :].tolist(), seconds, None

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.spec.label,
            "description": self.spec.kind.description,
            "method": self.spec.method,
            "k": self.spec.k,
            "library": "transformers",
            "generate_kwargs": {**NEUTRAL_PROCESSING, **self.generate_kwargs, "eos_token_id": None},
            "assistant_generation_config": self.assistant_settings if self.assistant is not None else None,
        }


def build_runners(
    specs: Sequence[MethodSpec],
    target: str | Path,
    draft: str | Path | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    backend: str = "auto",
    prompt_lookup_max: int = 3,
    prompt_lookup_min: int = 1,
    draft_dtype: str | torch.dtype | None = None,
) -> list[Runner]:
    """Load the target once (and the draft once) and build a runner per spec.

    The target's dtype is resolved from ``dtype`` by :func:`~specdec.models.loader.resolve_dtype`
    and used by every target runner; the draft's from ``draft_dtype`` by
    :func:`~specdec.drafters.draft_model.resolve_draft_dtype`. specdec's draft_model runners and
    transformers' assistant share the one loaded draft, so both run it in the same dtype.
    """
    if draft is None and any(spec.kind.needs_draft for spec in specs):
        needing = sorted({spec.method for spec in specs if spec.kind.needs_draft})
        raise SpecDecError(f"methods {needing} need a draft model (--draft-model)")
    device = resolve_device(device)
    target_model, _ = load_hf_model(str(target), dtype, device)
    dtype = target_model.dtype
    assistant = None
    if any(spec.kind.needs_draft for spec in specs):
        assistant, _ = load_hf_model(str(draft), resolve_draft_dtype(draft_dtype, dtype, device), device)
    loaded_settings = (
        {name: getattr(assistant.generation_config, name, None) for name in ASSISTANT_FIELDS}
        if assistant is not None
        else {}
    )

    runners: list[Runner] = []
    for spec in specs:
        if spec.method == "plain":
            runners.append(
                SpecDecRunner(spec, LLM(target_model, str(target), None, dtype, device, backend=backend))
            )
        elif spec.method in ("draft_model", "ngram"):
            config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.k}
            if spec.method == "draft_model":
                config["model"] = assistant
            else:
                config.update(prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min)
            llm = LLM(target_model, str(target), config, dtype, device, backend=backend)
            runners.append(SpecDecRunner(spec, llm))
        elif spec.method == "hf":
            runners.append(HFRunner(spec, target_model))
        elif spec.method == "hf_assisted":
            settings = {
                "num_assistant_tokens": spec.k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
            runners.append(HFRunner(spec, target_model, assistant=assistant, assistant_settings=settings))
        elif spec.method == "hf_assisted_default":
            runners.append(
                HFRunner(spec, target_model, assistant=assistant, assistant_settings=loaded_settings)
            )
        elif spec.method == "hf_prompt_lookup":
            kwargs = {"prompt_lookup_num_tokens": spec.k, "max_matching_ngram_size": prompt_lookup_max}
            runners.append(HFRunner(spec, target_model, generate_kwargs=kwargs))
        else:
            raise SpecDecError(f"no runner for method {spec.method!r}")
    return runners


def forward_seconds(lm: CachedLM, context_ids: Sequence[int], trials: int = 20) -> float:
    """Median wall-clock time of one single-token forward of ``lm`` after ``context_ids[:-1]`` is cached."""
    ids = torch.tensor([list(context_ids)], dtype=torch.long, device=lm.device)
    lm.reset()
    if ids.shape[1] > 1:
        lm.forward(ids[:, :-1], num_logits=0)
    times = []
    for _ in range(trials):
        _synchronize(lm.device)
        tic = time.perf_counter()
        lm.forward(ids[:, -1:], num_logits=1)
        _synchronize(lm.device)
        times.append(time.perf_counter() - tic)
        lm.crop(ids.shape[1] - 1)
    lm.reset()
    return statistics.median(times)


def direct_cost_ratio(llm: LLM, context_ids: Sequence[int], trials: int = 20) -> float:
    """c measured directly: one forward of ``llm``'s draft model over one forward of its target, each a
    single token after ``context_ids`` (median of ``trials``). ``llm`` must use the draft_model method."""
    draft = getattr(llm.engine.drafter, "model", None)
    if not isinstance(draft, CachedLM):
        raise SpecDecError(
            "a directly measured cost ratio needs a speculative configuration with a draft model"
        )
    return forward_seconds(draft, context_ids, trials) / forward_seconds(llm.target, context_ids, trials)
