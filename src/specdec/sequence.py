"""One request being generated: its tokens, parameters, generator, slot and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.logprobs import TokenLogprobs
from specdec.metrics import RequestMetrics
from specdec.sampling import SamplingParams

if TYPE_CHECKING:
    from specdec.structured.state import GrammarState


@dataclass(eq=False)
class Sequence:
    """A request inside the engine (DESIGN: *sequence*).

    ``token_ids`` is the committed context, prompt then output; its last token is the
    *pending* token, which the target has not cached yet. ``max_new_tokens`` is
    ``params.max_tokens`` capped by the context that is left; ``stop_ids`` the token ids that
    end it (``stop_token_ids`` plus end-of-sequence unless ``ignore_eos``). ``slot`` is the
    KV-pool row it owns while running (-1 while waiting or after it finished). ``grammar``: the
    state of its ``params.structured_outputs`` constraint (None without one). ``bad_words``: the token sequences
    its ``params.bad_words`` ban (:func:`specdec.penalties.bad_word_ids`). ``prompt_logprobs``: with
    ``params.prompt_logprobs``, those of its prompt tokens ``1, 2, ...`` as they are fed
    (:class:`~specdec.prompt_feed.PromptFeed`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    max_new_tokens: int
    stop_ids: frozenset[int]
    token_ids: list[int] = field(init=False)
    slot: int = -1
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    grammar: GrammarState | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.metrics.num_prompt_tokens = len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens it may still emit."""
        return self.max_new_tokens - self.num_generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, candidates: list[int]) -> list[int]:
        """Append the step's emitted tokens, stopping exactly at a stop token or the token budget;
        returns the tokens kept and sets ``finish_reason`` ("stop" or "length") when it ends."""
        kept = []
        for token in candidates:
            kept.append(token)
            self.token_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return kept
