"""The offline Python API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``.

Token generation is the engine's; this layer turns prompts into ids, ids into text, applies
stop strings, streams deltas and returns :class:`RequestOutput` objects.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.drafters import LoadOptions, SpeculativeConfig, create_drafter
from specdec.engine import SpeculativeEngine
from specdec.errors import SpecDecError
from specdec.metrics import RequestMetrics
from specdec.models.loader import ModelSource, load_cached_lm, load_tokenizer, resolve_device
from specdec.sampling import SamplingParams
from specdec.text import TextTracker

Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    """One generated sequence: its text (stop string excluded), token ids and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclass
class StreamOutput:
    """One streamed increment: the new ``token_ids`` and ``text`` of a step; the last one has
    ``finished=True``, the ``finish_reason`` and the request's final ``metrics``."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


class LLM:
    """A target model, an optional drafter and the engine that runs them.

    ``model``: a local folder, a hub id or a loaded ``PreTrainedModel``. ``tokenizer``
    defaults to the model's folder; without one, prompts must be token ids.
    ``speculative_config``: None for plain decoding (the baseline), else a dict such as
    ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`` or
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}``.
    ``backend``: ``"auto"``, ``"fast"`` or ``"hf"`` (see :func:`specdec.models.load_cached_lm`).
    """

    def __init__(
        self,
        model: ModelSource,
        tokenizer: str | Path | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        seed: int = 0,
        backend: str = "auto",
    ) -> None:
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.speculative_config = speculative_config
        self.device = resolve_device(device)
        self.target = load_cached_lm(model, dtype=dtype, device=self.device, backend=backend)
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else model, required=tokenizer is not None)
        drafter = None
        if speculative_config is not None:
            options = LoadOptions(device=self.device, backend=backend, target_tokenizer=self.tokenizer)
            drafter = create_drafter(speculative_config, self.target, options)
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        self.engine = SpeculativeEngine(self.target, drafter, k, self._eos_token_ids())
        self._seeds = random.Random(seed)
        self._request_counter = 0

    @property
    def model_name(self) -> str:
        return self.target.name

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        model = getattr(self.target, "config", None)
        for source in (getattr(self.tokenizer, "eos_token_id", None), getattr(model, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(t) for t in source)
        return ids

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt, validated against the model."""
        if isinstance(prompt, str):
            if not prompt:
                raise SpecDecError("empty prompt")
            if self.tokenizer is None:
                raise SpecDecError(
                    f"model {self.model_name!r} has no tokenizer: pass prompts as {{'prompt_token_ids': [...]}}"
                )
            text, ids = prompt, self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise SpecDecError("prompt_token_ids must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise SpecDecError(
                    f"prompt_token_ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})"
                )
            ids = list(ids)
        else:
            raise SpecDecError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if not ids:
            raise SpecDecError("empty prompt")
        if len(ids) >= self.target.max_length:
            raise SpecDecError(
                f"prompt of {len(ids)} tokens is too long for {self.model_name!r}, whose context window is "
                f"{self.target.max_length} tokens (at least one token must remain for the output)"
            )
        return text, ids

    def _generator(self, params: SamplingParams) -> torch.Generator:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """Yield token ids and text deltas of one prompt as each step completes."""
        params = sampling_params or SamplingParams()
        _, prompt_ids = self.encode_prompt(prompt)
        tracker = TextTracker(self.tokenizer, params.stop_strings, streaming=True)
        yield from self._run(prompt_ids, params, tracker)

    def _run(self, prompt_ids: list[int], params: SamplingParams, tracker: TextTracker) -> Iterator[StreamOutput]:
        metrics = RequestMetrics()
        for step in self.engine.generate(prompt_ids, params, self._generator(params), metrics):
            kept = tracker.add(step.token_ids)
            finish_reason = "stop" if tracker.stopped else step.finish_reason
            finished = finish_reason is not None
            text = tracker.delta(final=finished) if tracker.streaming else ""
            yield StreamOutput(step.token_ids[:kept], text, finished, finish_reason, metrics)
            if finished:
                return

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt, in order; ``sampling_params`` is one for all or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise SpecDecError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one, or one per prompt"
                )
        encoded = [self.encode_prompt(p) for p in prompts]
        results = []
        for (text, prompt_ids), params in zip(encoded, params_list):
            tracker = TextTracker(self.tokenizer, params.stop_strings, streaming=False)
            token_ids: list[int] = []
            for last in self._run(prompt_ids, params, tracker):
                token_ids.extend(last.token_ids)
            request_id = str(self._request_counter)
            self._request_counter += 1
            completion = CompletionOutput(0, tracker.finish(), token_ids, last.finish_reason)
            results.append(RequestOutput(request_id, text, prompt_ids, [completion], True, last.metrics))
        return results
