"""The offline Python API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``.

Token generation is the scheduler's and the engine's; this layer turns prompts into
sequences, step outputs into text (stop strings, streaming deltas) and returns
:class:`RequestOutput` objects. ``generate`` submits all its prompts at once, so they run
batched; ``stream`` is a loop over the same steps.

Concurrency: one lock guards the model state. Whichever caller holds it runs the next
step for *every* running sequence and files each sequence's output with its request, so
several threads calling ``generate``, or several ``stream`` generators consumed in any
interleaving, share batches and each get exactly their own tokens. A stream that is closed
or garbage-collected early aborts its sequence and frees its slot.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Sequence_
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from specdec.adaptive import make_policy
from specdec.chat import chat_prompts
from specdec.drafters import LoadOptions, SpeculativeConfig, create_drafter
from specdec.engine import Engine, StepOutput
from specdec.engine_metrics import Latencies, watch_engine
from specdec.errors import SpecDecError
from specdec.inflight import InFlight, Request
from specdec.llm_args import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, VLLM_NEUTRAL, check_arguments
from specdec.metrics import BatchMetrics, RequestMetrics
from specdec.metrics_reader import Metric, read_metrics
from specdec.models.kv_budget import KVBudget, feature_bytes_per_token
from specdec.models.loader import ModelSource, load_causal_lm, load_tokenizer, resolve_device
from specdec.outputs import CompletionOutput, RequestOutput, StreamOutput
from specdec.penalties import bad_word_ids, check_adjustments
from specdec.prompts import Prompt, encode, eos_token_ids, paired
from specdec.reasoning import PARSERS, check_reasoning_parser, output_thinking
from specdec.sampling import SamplingParams
from specdec.scheduler import Scheduler, max_num_batched_tokens_of, prefill_share_of
from specdec.sequence import Sequence
from specdec.structured.grammar import GrammarCache
from specdec.structured.state import GrammarState
from specdec.structured.thinking import check_budget_tags
from specdec.text import TextTracker, TokenTexts
from specdec.vllm_names import VLLMNames, check_neutral


class LLM(metaclass=VLLMNames):
    """A target model, an optional drafter, and the scheduler and engine that run them.

    ``model``: a local folder, a hub id or a loaded ``PreTrainedModel``. ``tokenizer``
    defaults to the model's folder; without one, prompts must be token ids.
    ``speculative_config``: None for plain decoding (the baseline), else a dict such as
    ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`` or
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}``.
    ``backend``: ``"auto"``, ``"fast"`` or ``"hf"`` (see :func:`specdec.models.load_causal_lm`).
    ``max_num_seqs``: sequences run at once (slots of the KV pool, allocated once); more
    requests wait in a queue. ``max_model_len``: tokens per sequence, prompt and output
    (default: the model's context window, at most :data:`DEFAULT_MAX_MODEL_LEN`); a KV pool that
    does not fit the available memory raises :class:`SpecDecError` before it is allocated.
    ``enforce_eager``: never capture CUDA graphs (on a GPU the fast backend captures its decode
    and verify forwards lazily, per shape bucket). ``enable_chunked_prefill`` (default on, as vLLM's
    V1): prompts are fed in chunks beside the running sequences' steps (in the same forward where the
    backend ``fuses_prefill``: the fast one on a CPU), at most ``max_num_batched_tokens`` tokens per step (default: see
    :func:`specdec.scheduler.max_num_batched_tokens_of`; on a CPU the default is also paced by measured
    time in a server, :mod:`specdec.prefill_pacer`); off, each prompt is fed whole at admission.
    ``serving``: the defaults of an online server (``specdec serve`` sets it), like vLLM's usage context:
    on a CPU, chunked prefill's default budget is paced to keep the running streams' latency, which
    offline would cost a batch's throughput. ``prefill_share``: where it is paced, what a step's prompt
    tokens may add to it, as a share of a decoding step (default
    :data:`~specdec.prefill_pacer.SHARE`, 0.5): more feeds waiting prompts sooner (time to first token)
    and makes the running streams wait longer between tokens; where nothing is paced it raises
    :class:`SpecDecError`.
    ``kv_cache_memory``: bytes (or ``"4GiB"``) of the target's paged KV pool (default: room for
    ``max_num_seqs`` full sequences); a draft model's pool holds as many tokens. Sequences are admitted
    while blocks are free and the least advanced one is preempted (recomputed later) when they run out.
    ``gpu_memory_utilization``: instead, the share of the device's memory (a GPU's; on a CPU, the machine's)
    that the weights, the KV pools and a step's activations take together, as vLLM's; the pools get what the
    loaded weights and an estimate of a step leave (:mod:`specdec.models.kv_budget`). ``kv_cache_description``
    says in a line how the target's pool was sized, however it was (None on transformers' forward).
    ``enable_prefix_caching``: reuse the KV blocks of earlier prompts' and outputs' common prefixes
    (exact: outputs are the same with it or without it; see ``docs/serving.md``). ``deterministic``: the
    target computes every row with batch-invariant kernels (:mod:`specdec.models.deterministic`; fast
    backend on a CPU), so a request's tokens do not depend on the batch and greedy speculation equals
    plain greedy decoding bit for bit in any dtype; sampled rows draw noise keyed by their seed and each
    token's index (:mod:`specdec.keyed_noise`), so a seeded request's tokens are also those plain decoding
    samples with that seed, whatever the method drafted; a target that cannot run so raises
    :class:`SpecDecError`. ``reasoning_parser``: ``"deepseek_r1"`` or ``"qwen3"`` (vLLM's names,
    :mod:`specdec.reasoning`): a constrained request's constraint holds for the answer after the model's
    thinking, which runs free until ``</think>`` (:mod:`specdec.structured.thinking`), unless the prompt closed the
    thinking itself (:meth:`thinking`); without it, from the output's first token.
    """

    vllm_names = (VLLM_NEUTRAL, {
        "tensor_parallel_size": " (one device per LLM; `specdec serve --replicas N` runs copies side by side)",
        "pipeline_parallel_size": " (one device per LLM; `specdec serve --replicas N` runs copies side by side)",
        "block_size": " (the paged pool's blocks are 16 tokens)"}, "argument")

    def __init__(
        self,
        model: ModelSource,
        tokenizer: str | Path | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        seed: int | None = 0,
        backend: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_chunked_prefill: bool | None = True,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory: int | str | None = None,
        gpu_memory_utilization: float | None = None,
        enable_prefix_caching: bool | None = True,
        deterministic: bool = False,
        serving: bool = False,
        prefill_share: float | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        enable_chunked_prefill, enable_prefix_caching = check_arguments(
            max_num_seqs, max_model_len, seed, enable_chunked_prefill=enable_chunked_prefill, serving=serving,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager, deterministic=deterministic)
        KVBudget.check(kv_cache_memory, gpu_memory_utilization)  # before the weights load
        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.speculative_config = speculative_config
        self.device = resolve_device(device)
        self.prefill_share = prefill_share_of(prefill_share, enable_chunked_prefill, max_num_batched_tokens,
                                              self.device, serving)
        self.deterministic = deterministic
        self.target = load_causal_lm(model, dtype=dtype, device=self.device, backend=backend,
                                     enforce_eager=enforce_eager, deterministic=deterministic)
        if max_model_len is not None and max_model_len > self.target.max_length:
            raise SpecDecError(
                f"max_model_len {max_model_len} is larger than the context window of {self.target.name!r} "
                f"({self.target.max_length} tokens)"
            )
        self.max_model_len = max_model_len or min(self.target.max_length, DEFAULT_MAX_MODEL_LEN)
        self.max_num_seqs = max_num_seqs
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else model, required=tokenizer is not None)
        k = speculative_config.max_k if speculative_config else 0
        self.max_num_batched_tokens = max_num_batched_tokens_of(enable_chunked_prefill, max_num_batched_tokens,
                                                                max_num_seqs, self.device)
        budget = KVBudget(self.target, self.max_model_len, kv_cache_memory, gpu_memory_utilization,
                          # without chunked prefill a whole prompt is one forward
                          step_tokens=max(self.max_num_batched_tokens or self.max_model_len, max_num_seqs * (k + 1)),
                          logit_rows=max_num_seqs * (k + 1))
        self.token_texts = TokenTexts(self.tokenizer)
        drafter = None
        if speculative_config is not None:
            options = LoadOptions(device=self.device, backend=backend, num_slots=max_num_seqs,
                                  max_model_len=self.max_model_len, target_tokenizer=self.tokenizer,
                                  enforce_eager=enforce_eager, kv_budget=budget,
                                  prefix_caching=enable_prefix_caching)
            drafter = create_drafter(speculative_config, self.target, options)
        # With prefix caching, the target's hidden states a drafter reads are kept beside the blocks.
        features = len(drafter.hidden_layers) if drafter is not None and enable_prefix_caching else 0
        num_blocks = budget.blocks(feature_bytes_per_token(self.target, features))
        policy = (make_policy(speculative_config.num_speculative_tokens, k, self.target.pads_rows,
                              speculative_config.num_speculative_tokens_per_batch_size,
                              speculative_config.max_step_time_ratio)
                  if speculative_config else None)
        self.engine = Engine(self.target, drafter, k, max_num_seqs, self.max_model_len, policy, num_blocks,
                             enable_prefix_caching, deterministic)
        self.kv_cache_description = budget.describe(self.engine.cache.num_blocks, max_num_seqs)
        self.scheduler = Scheduler(self.engine, max_num_seqs, self.max_num_batched_tokens, self.prefill_share)
        self._eos_ids = frozenset(eos_token_ids(self.tokenizer, self.target))
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._grammar_cache: GrammarCache | None = None  # built at the first constrained request
        self._grammar_lock = threading.Lock()  # not the model's: a server handler compiles while a step runs
        # bad_words -> the token sequences they ban: tokenized once per list (checked, then each choice submitted)
        self._bad_word_ids = functools.lru_cache(maxsize=64)(
            functools.partial(bad_word_ids, self.tokenizer, vocab=self.target.vocab_size))
        self._registry: CollectorRegistry | None = None  # get_metrics' collectors, registered at its first call
        self.latencies = Latencies()  # of the requests' outputs as they are filed
        self._inflight = InFlight(self.engine, self.scheduler, self.token_texts, self._eos_ids, self.latencies)

    @property
    def model_name(self) -> str:
        return self.target.name

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params``: the parameters a request without its own gets
        (``SamplingParams()``; no checkpoint's ``generation_config.json`` changes them here)."""
        return SamplingParams()

    def get_tokenizer(self):
        """The target's tokenizer (None for a model without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    @property
    def batch_metrics(self) -> BatchMetrics:
        """:class:`~specdec.metrics.BatchMetrics` over every step this LLM has run."""
        return self.engine.metrics

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as vLLM's ``LLM.get_metrics()`` returns them (:mod:`specdec.metrics_reader`:
        ``Counter``, ``Gauge``, ``Vector`` and ``Histogram`` objects under vLLM's names, the figures of
        ``specdec serve``'s ``/metrics``)."""
        if self._registry is None:
            self._registry = CollectorRegistry()
            watch_engine(self._registry, self.engine.metrics, self.engine.cache, self.scheduler, self.latencies,
                         self.model_name)
        return read_metrics(self._registry)

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: Prompt, model_name: str | None = None) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt, validated against the model (:func:`specdec.prompts.encode`):
        a string, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (vLLM's text and tokens prompts); beside
        ids, ``"prompt"`` is the text shown for them (echo), not tokenized. Errors name the model as
        ``model_name`` (None: its folder or hub id)."""
        return encode(prompt, self.tokenizer, self.target, self.max_model_len, model_name)

    def check_params(self, params: object, single: bool = False) -> SamplingParams:
        """``params`` (None for the defaults) checked against the model: a :class:`SamplingParams`
        whose token ids (``stop_token_ids``, ``logit_bias``, ``allowed_token_ids``) are inside the vocabulary;
        ``single``: with ``n`` 1 (a stream is one output)."""
        if params is None:
            return self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise SpecDecError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if single and params.n != 1:
            raise SpecDecError(f"n is {params.n}, but a stream is one output: n > 1 is for generate and chat (or "
                               f"submit the prompt n times, each with its own seed)")
        vocab = self.target.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise SpecDecError(f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        check_adjustments(params, vocab, self._bad_word_ids(params.bad_words),
                          set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_ids))
        if params.thinking_token_budget is not None:
            if self.reasoning_parser is None:
                raise SpecDecError("thinking_token_budget needs a reasoning model's parser, LLM(reasoning_parser=...)"
                                   " (serve --reasoning-parser): it bounds the thinking between <think> and </think>")
            if self.tokenizer is None:
                raise SpecDecError("thinking_token_budget needs the model's tokenizer (it finds the thinking's tags)")
            check_budget_tags(self.tokenizer, PARSERS[self.reasoning_parser])
        if params.structured_outputs is not None:  # compiled (and cached) now: an invalid one fails here
            with self._grammar_lock:
                self._grammars().compile(params.structured_outputs)
        return params

    def _grammars(self) -> GrammarCache:
        if self._grammar_cache is None:
            self._grammar_cache = GrammarCache(self.tokenizer, self.target.vocab_size, self._eos_ids)
        return self._grammar_cache

    def thinking(self, prompt: str | None, prompt_ids: list[int]) -> bool | None:
        """How an output after this prompt (its text, or None: its ids decoded) thinks, with this LLM's
        ``reasoning_parser``: :func:`specdec.reasoning.output_thinking`."""
        if self.reasoning_parser is None:
            return None
        if prompt is None:
            prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False) if self.tokenizer else ""
        return output_thinking(self.reasoning_parser, prompt)

    def _grammar(self, params: SamplingParams, opens_inside: bool | None, budget: int | None
                 ) -> tuple[GrammarState | None, float]:
        """A new grammar state for ``params.structured_outputs`` (after the thinking unless ``opens_inside`` is None:
        :meth:`thinking`) and a thinking ``budget`` (a free answer without a constraint; None with neither, or a
        budget for an output that does not think) and the seconds spent compiling it (reported to the first
        request after its compilation, 0.0 for later ones), counted in the batch metrics."""
        if opens_inside is None:
            budget = None
        if params.structured_outputs is None and budget is None:
            return None, 0.0
        with self._grammar_lock:
            matcher, seconds = self._grammars().matcher(params.structured_outputs, opens_inside, budget)
            if seconds:
                self.engine.metrics.num_grammar_compiles += 1
                self.engine.metrics.time_grammar_compile += seconds
        return GrammarState(matcher, self._grammar_cache.eos_ids), seconds

    # ------------------------------------------------------------------ requests
    def _submit(self, text: str | None, prompt_ids: list[int], params: SamplingParams, streaming: bool,
                arrival: float | None = None) -> Request:
        with self._lock:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            stop_ids = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                stop_ids |= self._eos_ids
            seq = Sequence(
                request_id=str(next(self._ids)), prompt_ids=prompt_ids, params=params,
                generator=torch.Generator(device=self.device).manual_seed(seed),
                max_new_tokens=min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt_ids)),
                stop_ids=frozenset(stop_ids),
            )
            # a budget of at least the output's most tokens never binds: no budget (a budget of 10^30 was a
            # repetition count the grammar compiler could not parse), and no decoding of the prompt for it
            budget = params.thinking_token_budget
            if budget is not None and budget >= seq.max_new_tokens:
                budget = None
            grammar = params.structured_outputs is not None or budget is not None
            thinking = self.thinking(text, prompt_ids) if grammar else None
            seq.grammar, seq.metrics.time_grammar_compile = self._grammar(params, thinking, budget)
            seq.bad_words = self._bad_word_ids(params.bad_words)
            request = Request(seq, text, TextTracker(self.tokenizer, params.stop_strings, streaming=streaming,
                                                       min_tokens=params.min_tokens,
                                                       include_stop=params.include_stop_str_in_output,
                                                       skip_special_tokens=params.skip_special_tokens),
                               arrival=time.perf_counter() if arrival is None else arrival)
            self._inflight.add(request)
            self.scheduler.add(seq)
            self.engine.metrics.num_prompt_tokens += len(prompt_ids)
            return request

    def abort(self, request_id: str) -> None:
        """Stop a request and free its slot; an unknown or finished id is a no-op (one that is not a string is a
        :class:`SpecDecError`)."""
        if not isinstance(request_id, str):
            raise SpecDecError(f"request_id must be a string (a request's id), got {type(request_id).__name__}")
        with self._lock:
            self._inflight.abort(request_id)

    def _next(self, request: Request) -> StreamOutput:
        """The request's next stream output, running steps (for every sequence) until it has one."""
        while True:
            with self._lock:
                if request.error is not None:
                    raise request.error
                if request.pending:
                    return request.pending.popleft()
                if request.done:
                    raise SpecDecError(f"request {request.seq.request_id} was aborted")
                self.step()

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               arrival: float | None = None) -> Request:
        """Queue one prompt for a serving loop that calls :meth:`step` itself; returns its handle.

        After each ``step`` the handle's ``pending`` deque holds the request's new
        :class:`StreamOutput` objects (text deltas; the last one ``finished``); ``error`` is set when a
        step failed. A bad prompt or bad parameters raise here (the checks of :meth:`generate`).
        ``abort(handle.seq.request_id)`` cancels it. ``arrival``: when the request arrived
        (``time.perf_counter()``; None: now), the start of its latencies.
        """
        params = self.check_params(sampling_params, single=True)
        text, prompt_ids = self.encode_prompt(prompt)
        return self._submit(text, prompt_ids, params, streaming=True, arrival=arrival)

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix the target's and the drafter's pools cache that no request in flight uses (vLLM's
        ``LLM.reset_prefix_cache``): the next prompts are fed whole, as on a fresh engine. A benchmark calls it
        between levels that send the same prompts. True (vLLM's answer when the cache was reset), False when
        requests in flight kept the prefixes they use."""
        with self._lock:
            for pool in self.engine.kv_pools():
                pool.reset_prefix_cache()
            return not self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """Run one step for every running sequence (admitting waiting ones) and file each output with
        its request; returns the step's outputs as the requests keep them (none when idle). A failing step fails
        every request in flight and re-raises."""
        with self._lock:
            try:
                outputs = self.scheduler.step()
            except BaseException as exc:
                self._inflight.fail_all(exc)
                raise
            return [self._inflight.file(out) for out in outputs]

    # ------------------------------------------------------------------ generation
    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamOutput]:
        """Yield token ids and text deltas of one prompt as each step completes. Streams of one
        ``LLM`` may be consumed interleaved; closing one early aborts its request. A bad prompt
        raises here, at the call; the request joins the batch at the first ``next()``."""
        params = self.check_params(sampling_params, single=True)
        text, prompt_ids = self.encode_prompt(prompt)
        return self._stream(text, prompt_ids, params)

    def _stream(self, text: str | None, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamOutput]:
        request = self._submit(text, prompt_ids, params, streaming=True)
        try:
            while True:
                out = self._next(request)
                yield out
                if out.finished:
                    return
        finally:
            if not request.done:
                self.abort(request.seq.request_id)

    def generate(
        self,
        prompts: Prompt | Sequence_[Prompt],
        sampling_params: SamplingParams | Sequence_[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched (``max_num_seqs`` at a time, the rest queued);
        outputs in prompt order. ``sampling_params`` is one for all or one per prompt. ``use_tqdm``: show a
        progress bar of the prompts done on stderr (vLLM's argument; off by default here), or a tqdm-like class
        to build it with. ``lora_request``
        (vLLM's): only None, specdec serves no LoRA adapters."""
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise SpecDecError(f"use_tqdm must be True, False or a tqdm-like class, got {use_tqdm!r}")
        if lora_request is not None:
            raise SpecDecError("lora_request is not supported by specdec: it serves no LoRA adapters (only None)")
        prompts, params_list = paired(prompts, sampling_params, self.check_params)
        encoded = [self.encode_prompt(p) for p in prompts]
        # A prompt with n > 1 is n requests (choice i seeded with seed + i), batched with the others.
        groups = [[self._submit(text, ids, choice, streaming=False) for choice in params.choices()]
                  for (text, ids), params in zip(encoded, params_list)]
        bar = _progress(len(groups), None if use_tqdm is True else use_tqdm) if use_tqdm else None

        def progress() -> None:
            if bar is not None:
                bar.update(sum(all(r.seq.finished for r in group) for group in groups) - bar.n)

        try:
            return [self._request_output(group, progress) for group in groups]
        finally:
            if bar is not None:
                bar.close()
            for request in (r for group in groups for r in group):
                if not request.done:
                    self.abort(request.seq.request_id)

    def _request_output(self, group: list[Request], progress: Callable[[], None]) -> RequestOutput:
        """The :class:`RequestOutput` of one prompt's requests (its ``n`` choices), running steps until each
        finished; ``progress`` is called after every step."""

        def stream(request: Request) -> Iterator[StreamOutput]:
            while True:
                out = self._next(request)
                progress()
                yield out

        completions = [CompletionOutput.of_stream(i, stream(r), r.seq.params.logprobs is not None, r.tracker.finish)
                       for i, r in enumerate(group)]
        first = group[0].seq
        metrics = first.metrics if len(group) == 1 else RequestMetrics.of_choices([r.seq.metrics for r in group])
        scores = None if first.params.prompt_logprobs is None else self._inflight.prompt_logprobs(first)
        return RequestOutput(first.request_id, group[0].prompt, first.prompt_ids, completions, True, metrics, scores)

    def chat(
        self,
        messages: Sequence_[dict[str, Any]] | Sequence_[Sequence_[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence_[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: :meth:`generate` for one conversation (a list of ``{"role", "content"}``
        messages) or a list of them, each rendered by ``chat_template`` (None: the tokenizer's own) with the
        assistant's turn opened (``add_generation_prompt``), or its last message continued
        (``continue_final_message``); ``chat_template_kwargs``: more template variables. A message's content
        reaches the template as a string (``chat_template_content_format`` ``"auto"`` or ``"string"``). ``tools``:
        OpenAI's function tools, offered to the model by the template (as vLLM's ``LLM.chat``, the output is text:
        the server parses calls, :mod:`specdec.tools`). ``mm_processor_kwargs`` (vLLM's): only None, specdec takes
        text alone. See :mod:`specdec.chat`."""
        check_neutral("chat_template_content_format", chat_template_content_format, ("auto", "string"))
        check_neutral("mm_processor_kwargs", mm_processor_kwargs, (None,))
        prompts = chat_prompts(self.tokenizer, self.model_name, messages, chat_template, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, tools)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)


def _progress(total: int, bar_class: Callable[..., Any] | None = None):
    """A progress bar of ``total`` prompts on stderr (vLLM's "Processed prompts"), built by ``bar_class`` (None:
    tqdm's)."""
    if bar_class is None:
        from tqdm.auto import tqdm as bar_class

    return bar_class(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
