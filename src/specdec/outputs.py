"""What the offline API returns (shaped like vLLM's): a :class:`RequestOutput` per prompt, with a
:class:`CompletionOutput` per generated sequence, and a :class:`StreamOutput` per streamed increment."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specdec.logprobs import Logprob
from specdec.metrics import RequestMetrics

TokenLogprobDict = dict[int, Logprob]
"""One output position's logprobs as vLLM returns them: the chosen token first, then the request's
``logprobs`` most likely tokens best first (one entry less when the chosen token is among them)."""


@dataclass
class CompletionOutput:
    """One generated sequence: its text (stop string excluded), token ids and why it ended. With
    ``SamplingParams(logprobs=N)``: ``logprobs`` (one :data:`TokenLogprobDict` per token) and
    ``cumulative_logprob`` (the chosen tokens' logprobs summed), else None. ``stop_reason`` (vLLM's): the stop
    string or the ``stop_token_ids`` token that ended it, None when it ended otherwise (end-of-sequence too)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobDict] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        """Whether the sequence ended (vLLM's method): it has a ``finish_reason``."""
        return self.finish_reason is not None

    @classmethod
    def of_stream(cls, index: int, stream: Iterable[StreamOutput], wants_logprobs: bool,
                  text: Callable[[], str]) -> CompletionOutput:
        """Output number ``index`` of a request, from its stream outputs (consumed to the finished one), and
        ``text()``, its whole text once finished; ``wants_logprobs``: the request asked for logprobs."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprobDict] | None = [] if wants_logprobs else None
        for out in stream:
            token_ids.extend(out.token_ids)
            if logprobs is not None:
                logprobs.extend(out.logprobs or ())
            if out.finished:
                break
        cumulative = None if logprobs is None else sum(d[t].logprob for d, t in zip(logprobs, token_ids))
        return cls(index, text(), token_ids, out.finish_reason, logprobs, cumulative, out.stop_reason)


@dataclass
class RequestOutput:
    """The result of one prompt (vLLM's fields of that name; ``num_cached_tokens``: the prompt tokens read from
    the prefix cache, not computed; ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, None for the
    first prompt token and a :data:`TokenLogprobDict` for each other one, else None)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics

    prompt_logprobs: list[TokenLogprobDict | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


@dataclass
class StreamOutput:
    """One streamed increment: the new ``token_ids`` and ``text`` of a step; the last one has
    ``finished=True``, the ``finish_reason``, the ``stop_reason`` (:class:`CompletionOutput`'s) and the request's
    final ``metrics``. ``logprobs``: one :data:`TokenLogprobDict` per token of ``token_ids`` when the request asked
    for them, else None. ``prompt_logprobs``: :class:`RequestOutput`'s, on a request's first output (None on the
    others, as in vLLM's streams)."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[TokenLogprobDict] | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprobDict | None] | None = None
