"""Lookahead decoding (Jacobi iteration plus an n-gram pool): drafts without a second model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.drafters.base import (
    MAX_CANDIDATES,
    MAX_SPECULATIVE_TOKENS,
    DraftBatch,
    Drafter,
    LoadOptions,
    SpeculativeConfig,
    register_drafter,
)
from specdec.drafters.jacobi import JacobiWindow, NgramPool, lookahead_tree
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.models.families import FAST_BACKEND
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

MAX_LOOKAHEAD_NGRAM = 16
"""The longest n-gram (``lookahead_ngram``) the pool collects."""


@dataclass
class _State:
    """One sequence's lookahead state: its window and pool, the window's node indices in the last
    proposed tree, and the target's argmax after the pending token and each of them (None until
    the step's read arrives)."""

    window: JacobiWindow
    pool: NgramPool
    window_nodes: list[int] = field(default_factory=list)
    out: list[int] | None = None


@register_drafter
class LookaheadDrafter(Drafter):
    """Lookahead decoding (Fu et al., 2024) in the batched engine, one tree per row and step.

    Per sequence (keyed by request id, freed on ``release``): a Jacobi window of ``W =
    lookahead_window`` guessed tokens with the last ``N - 1`` iterations of its trajectory
    (:class:`~specdec.drafters.jacobi.JacobiWindow`, ``N = lookahead_ngram``), and an n-gram pool
    (:class:`~specdec.drafters.jacobi.NgramPool`, at most ``G = lookahead_guesses`` continuations per
    first token) filled with the trajectory's n-grams, the prompt's and the committed output's.

    Each step a row proposes one tree of at most ``k`` (``num_speculative_tokens``) nodes
    (:func:`~specdec.drafters.jacobi.lookahead_tree`): the verification branch, up to ``G`` pooled
    continuations of the pending token merged as a trie, and the lookahead branch, the window as one
    more chain from the root. Every node is deterministic (verified against a one-hot ``q``), so
    greedy and sampled output stay exactly the target's. After the forward the engine hands over the
    target's argmax at every node (``wants_node_argmax``): the argmax along the window is its Jacobi
    update, whose diagonals with the older levels give new n-grams; the window then shifts by the
    tokens committed and its tail is refilled with random context tokens (seeded per sequence).
    Trees need a target with tree masks (the fast backend).
    """

    method = "lookahead"
    description = "lookahead decoding: Jacobi window and n-gram pool, verified as one tree (no draft model)"
    wants_node_argmax = True
    reads = frozenset({"lookahead_window", "lookahead_ngram", "lookahead_guesses"})

    def __init__(self, width: int, ngram: int, guesses: int, device: torch.device) -> None:
        self.width, self.ngram, self.guesses, self.device = width, ngram, guesses, device
        self._states: dict[str, _State] = {}

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        for name, low, high in (("lookahead_window", 1, MAX_SPECULATIVE_TOKENS),
                                ("lookahead_ngram", 2, MAX_LOOKAHEAD_NGRAM),
                                ("lookahead_guesses", 0, MAX_CANDIDATES)):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SpecDecError(f"{name} must be an integer in {low}..{high}, got {value!r}")
        if config.model is not None:
            raise SpecDecError("speculative method 'lookahead' takes no 'model' (it drafts by Jacobi iteration)")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> LookaheadDrafter:
        if not target.supports_tree_mask:
            raise SpecDecError(
                f"lookahead proposes trees, which need {FAST_BACKEND}; {target.name!r} "
                "runs on transformers' forward"
            )
        return cls(config.lookahead_window, config.lookahead_ngram, config.lookahead_guesses, options.device)

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            pool = NgramPool(self.ngram, self.guesses)
            pool.add_context(s.token_ids)
            self._states[s.request_id] = _State(JacobiWindow(self.width, self.ngram - 1, s.token_ids), pool)

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        rows = []
        for s, k in zip(seqs, ks):
            state = self._states[s.request_id]
            candidates = state.pool.candidates(s.token_ids[-1], self.guesses) if k > 0 else []
            tokens, parents, state.window_nodes = lookahead_tree(candidates, state.window.window, k)
            rows.append((tokens, parents))
        return DraftBatch.from_trees(rows, self.device)

    def observe_node_argmax(self, seqs: list[Sequence], argmax_rows: list[list[int]]) -> None:
        for s, row in zip(seqs, argmax_rows):
            state = self._states[s.request_id]
            state.out = [row[0], *(row[node + 1] for node in state.window_nodes)]

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Jacobi-update the window from the step's argmax (when the row drafted), pool the new
        n-grams, then shift the window past the committed tokens."""
        for s in seqs:
            state = self._states[s.request_id]
            if state.out is not None:
                for gram in state.window.update(state.out):
                    state.pool.add(gram)
                state.out = None
            state.pool.add_context(s.token_ids, state.window.start)
            state.window.advance(s.token_ids)

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.request_id, None)
