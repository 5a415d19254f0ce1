"""One :class:`~specdec.bench.methods.Runner` per benchmarked method: specdec's ``LLM`` (plain
decoding or any registered drafter, batched) or transformers ``generate`` (batch 1).

Every runner generates exactly ``max_tokens`` tokens per prompt (end-of-sequence ignored:
specdec's ``SamplingParams(ignore_eos=True)``, transformers' ``eos_token_id=None``), so tokens/s
compare like for like. ``seconds`` is the wall-clock time of the whole generate call, prefill
included, with the device synchronized before and after. All runners share one loaded target
model (and the draft-needing methods one loaded draft), in one dtype on one device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specdec.adaptive import DEFAULT_MAX_SPECULATIVE_TOKENS
from specdec.bench.hardware import synchronize
from specdec.bench.methods import MethodSpec, Runner, RunOutput
from specdec.drafters import DRAFTERS, SpeculativeConfig
from specdec.drafters.draft_lm import resolve_draft_dtype
from specdec.errors import SpecDecError
from specdec.llm import LLM
from specdec.models.loader import ModelSource, load_hf_model
from specdec.sampling import SamplingParams

ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
# Neutralise logits processors a checkpoint's generation_config may switch on: specdec applies none.
NEUTRAL_PROCESSING = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


class SpecDecRunner(Runner):
    """specdec's :class:`~specdec.LLM` (plain decoding or a speculative configuration): one
    ``generate`` call per batch of prompts, up to the LLM's ``max_num_seqs``."""

    def __init__(self, spec: MethodSpec, llm: LLM) -> None:
        self.spec, self.llm = spec, llm
        self.max_batch_size = llm.max_num_seqs

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        if len(prompts) > self.max_batch_size:
            raise SpecDecError(f"{self.spec.label} takes at most {self.max_batch_size} prompts per call")
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed)
        requests = [{"prompt_token_ids": list(ids)} for ids in prompts]
        synchronize(self.llm.device)
        tic = time.perf_counter()
        outputs = self.llm.generate(requests, params)
        synchronize(self.llm.device)
        seconds = time.perf_counter() - tic
        return RunOutput([o.outputs[0].token_ids for o in outputs], seconds, [o.metrics for o in outputs])

    def forget(self) -> None:
        if self.llm.engine.drafter is not None:
            self.llm.engine.drafter.forget()

    def describe(self) -> dict[str, Any]:
        config = self.llm.speculative_config
        return {
            "label": self.spec.label,
            "description": self.spec.kind.description,
            "method": self.spec.method,
            "k": self.spec.k,
            "deterministic": self.llm.deterministic,
            "library": "specdec",
            "max_batch_size": self.max_batch_size,
            "max_model_len": self.llm.max_model_len,
            "target_backend": type(self.llm.target).__name__,
            "speculative_config": None
            if config is None
            else {key: _describe_value(value) for key, value in vars(config).items()},
        }


def _takes_candidate(method: str, candidate: dict[str, Any]) -> bool:
    """Whether the composite ``method`` accepts ``candidate`` (it refuses drafters that run the
    target's own layers, for example)."""
    try:
        SpeculativeConfig.from_dict({"method": method, "candidates": [candidate]})
    except SpecDecError:
        return False
    return True


def _shared_draft_stages(config: dict[str, Any], draft: PreTrainedModel | None) -> dict[str, Any]:
    """``config`` with the run's loaded draft (in its own dtype) in each draft_model stage that names no model:
    a staged method's (cascade's) middle stage is by default the run's draft."""
    stages = config.get("stages")
    if draft is None or not isinstance(stages, list):
        return config
    shared = {"model": draft, "dtype": str(draft.dtype).removeprefix("torch.")}
    filled = [{**shared, **stage} if isinstance(stage, dict) and stage.get("method") == "draft_model"
              and "model" not in stage else stage for stage in stages]
    return {**config, "stages": filled}


def _describe_value(value: Any) -> Any:
    """A JSON-ready stand-in: a loaded model by its folder, a path or dtype as text, a nested
    configuration (an auto method's candidates) as a dict."""
    if isinstance(value, PreTrainedModel):
        return getattr(value.config, "_name_or_path", "") or type(value).__name__
    if isinstance(value, (Path, torch.dtype)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_describe_value(item) for item in value]
    if isinstance(value, SpeculativeConfig):
        return {key: _describe_value(item) for key, item in vars(value).items()}
    return value


class HFRunner(Runner):
    """transformers ``generate`` at batch 1, alone or with an assistant model or prompt lookup.

    ``assistant_settings`` are written to the assistant's ``generation_config`` before every call:
    transformers 5.x reads ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and
    ``assistant_confidence_threshold`` from there (not from ``generate()`` keyword arguments), and
    the heuristic schedule writes its state back there, so re-applying them keeps runs independent.
    """

    max_batch_size = 1

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

    def run(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, seed: int) -> RunOutput:
        if len(prompts) != 1:
            raise SpecDecError(f"{self.spec.label} runs one prompt per call, got {len(prompts)}")
        input_ids = torch.tensor([list(prompts[0])], dtype=torch.long, device=self.model.device)
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
        synchronize(self.model.device)
        tic = time.perf_counter()
        output = self.model.generate(input_ids, **kwargs)
        synchronize(self.model.device)
        seconds = time.perf_counter() - tic
        return RunOutput([output[0, input_ids.shape[1] :].tolist()], seconds, [None])

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.spec.label,
            "description": self.spec.kind.description,
            "method": self.spec.method,
            "k": self.spec.k,
            "deterministic": False,
            "library": "transformers",
            "max_batch_size": self.max_batch_size,
            "generate_kwargs": {**NEUTRAL_PROCESSING, **self.generate_kwargs, "eos_token_id": None},
            "assistant_generation_config": self.assistant_settings if self.assistant is not None else None,
        }


@dataclass
class RunnerOptions:
    """How the runners run the models.

    ``tokenizer``: the target's tokenizer folder (None: prompts are token ids only). The draft's dtype
    comes from ``draft_dtype`` by :func:`~specdec.drafters.draft_lm.resolve_draft_dtype`, unless
    ``draft_is_target``: then the draft is the loaded target itself. ``max_num_seqs`` and
    ``max_model_len`` size every specdec ``LLM`` (prompts per generate call, tokens per sequence);
    ``enforce_eager`` turns their CUDA graphs off; ``kv_cache_memory`` and ``enable_prefix_caching``
    size their KV pools and turn prefix caching on (off by default here: a benchmark repeats prompts).
    ``num_candidates`` goes to the methods that propose trees (``Drafter.tree_drafts``); chain methods
    run as chains.
    """

    tokenizer: str | None = None
    backend: str = "auto"
    draft_dtype: str | torch.dtype | None = None
    draft_is_target: bool = False
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    num_candidates: int = 1
    max_num_seqs: int = 1
    max_model_len: int | None = None
    enforce_eager: bool = False
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = False


def _peer_runner(
    spec: MethodSpec, target: PreTrainedModel, assistant: PreTrainedModel | None, options: RunnerOptions
) -> HFRunner:
    """The transformers ``generate`` configuration of a peer method (see :data:`~specdec.bench.methods.PEERS`)."""
    if spec.method == "hf":
        return HFRunner(spec, target)
    if spec.method == "hf_assisted":
        settings = {
            "num_assistant_tokens": spec.k,
            "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0,
        }
        return HFRunner(spec, target, assistant=assistant, assistant_settings=settings)
    if spec.method == "hf_assisted_default":
        loaded = {name: getattr(assistant.generation_config, name, None) for name in ASSISTANT_FIELDS}
        return HFRunner(spec, target, assistant=assistant, assistant_settings=loaded)
    if spec.method == "hf_prompt_lookup":
        kwargs = {"prompt_lookup_num_tokens": spec.k, "max_matching_ngram_size": options.prompt_lookup_max}
        return HFRunner(spec, target, generate_kwargs=kwargs)
    raise SpecDecError(f"no transformers runner for method {spec.method!r}")


def build_runners(
    specs: Sequence[MethodSpec], target: PreTrainedModel, draft: ModelSource | None, options: RunnerOptions
) -> list[Runner]:
    """Build a runner per spec over the loaded ``target`` (loading the draft once when a method needs it).

    Every specdec method (plain, and each registered drafter through one code path) gets its own
    ``LLM`` over the shared target, in the target's dtype on its device and in the spec's mode
    (``deterministic``: batch-invariant kernels, a second copy of the fused weights); a drafter that needs a
    model gets the shared draft (a folder, hub id or loaded model), which transformers' assistant
    runs too, in the same dtype: specdec's default for it (:func:`resolve_draft_dtype`).
    """
    needs_draft = sorted({spec.method for spec in specs if spec.kind.needs_draft})
    if needs_draft and draft is None and not options.draft_is_target:
        raise SpecDecError(f"methods {needs_draft} need a draft model (--draft-model)")
    dtype, device = target.dtype, target.device
    assistant = None
    if needs_draft:
        if options.draft_is_target:
            assistant = target
        else:
            assistant, _ = load_hf_model(draft, resolve_draft_dtype(options.draft_dtype, dtype, device), device)

    def llm(config: dict[str, Any] | None, deterministic: bool) -> LLM:
        return LLM(
            target, options.tokenizer, config, dtype, device, backend=options.backend,
            max_num_seqs=options.max_num_seqs, max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager, kv_cache_memory=options.kv_cache_memory,
            enable_prefix_caching=options.enable_prefix_caching, deterministic=deterministic,
        )

    def config(method: str, k: int | str, candidates: int) -> dict[str, Any]:
        drafter = DRAFTERS[method]
        if drafter.composite:  # its candidates: the run's other speculative methods it takes, at the same k
            others = sorted({s.method for s in specs
                             if s.kind.speculative and not s.kind.peer and not DRAFTERS[s.method].composite})
            candidates = [config(m, k if k != "auto" else DEFAULT_MAX_SPECULATIVE_TOKENS, 1) for m in others]
            candidates = [c for c in candidates if _takes_candidate(method, c)]
            if not candidates:
                raise SpecDecError(
                    f"{method!r} chooses among the run's other speculative methods; add some to --methods")
            return {"method": method, "num_speculative_tokens": k, "candidates": candidates}
        model = assistant if drafter.needs_model else None
        return drafter.fields_read({
            "method": method,
            "num_speculative_tokens": k,
            "model": model,
            # The draft's dtype is the loaded draft's own, so that a shared model is never converted.
            "dtype": None if model is None else str(model.dtype).removeprefix("torch."),
            "prompt_lookup_max": options.prompt_lookup_max,
            "prompt_lookup_min": options.prompt_lookup_min,
            "num_candidates": candidates if drafter.tree_drafts else 1,
        })

    runners: list[Runner] = []
    for spec in specs:
        if spec.kind.peer:
            runners.append(_peer_runner(spec, target, assistant, options))
        elif not spec.kind.speculative:  # plain decoding
            runners.append(SpecDecRunner(spec, llm(None, spec.deterministic)))
        else:
            settings = {**config(spec.method, spec.k, options.num_candidates), **(spec.overrides or {})}
            runners.append(SpecDecRunner(spec, llm(_shared_draft_stages(settings, assistant), spec.deterministic)))
    return runners
