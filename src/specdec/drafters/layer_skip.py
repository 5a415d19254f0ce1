"""Self-speculation by layer skipping: the target drafts with a subset of its own layers and its
own head, and verifies with all of them, reusing what the draft computed that is its own.

Two forms: training-free (a skip set chosen by calibration, or given) and trained early exit (the
first ``L`` layers, a small adapter from ``specdec train early-exit``, the target's final norm and
head; :class:`~specdec.drafters.heads.modules.EarlyExitAdapter`)."""

from __future__ import annotations

import os

import torch
from torch import nn

from specdec.argmax import argmax
from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    LoadOptions,
    SpeculativeConfig,
    draft_probs,
    draw_column,
    register_drafter,
)
from specdec.drafters.draft_vocab import DraftVocab, full_logits, head_rows
from specdec.drafters.heads.common import (
    EARLY_EXIT,
    load_module,
    load_spec_and_state,
    resolve_folder,
    target_weights,
)
from specdec.drafters.heads.modules import EarlyExitAdapter
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, KVCache, to_device
from specdec.models.families import FAST_BACKEND
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence

CALIBRATION_TOKENS = 64
"""Positions over which candidate skip sets are compared (a short prompt is extended by the
target's own greedy continuation up to this length)."""
MAX_CALIBRATION_TOKENS = 256


def candidate_skip_sets(num_layers: int) -> list[tuple[int, ...]]:
    """A few skip sets for a target of ``num_layers`` layers: early exits (the last layer, the last
    third, the last half) and every other layer (of the second half, of all but the first)."""
    n = num_layers
    ranges = [range(n - 1, n), range(n - max(1, n // 3), n), range(n // 2, n), range(n // 2, n, 2), range(1, n, 2)]
    sets: list[tuple[int, ...]] = []
    for r in ranges:
        skip = tuple(r)
        if skip and len(skip) < n and skip not in sets:
            sets.append(skip)
    return sets


def predicted_speedup(alpha: float, k: int, run_fraction: float, verify_fraction: float) -> float:
    """Expected tokens per step ``(1 − α^(k+1)) / (1 − α)`` over the step's cost in full forwards:
    ``k`` drafts through ``run_fraction`` of the layers plus a verification through ``verify_fraction``."""
    tokens = k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * run_fraction + verify_fraction)


@register_drafter
class LayerSkipDrafter(Drafter):
    """Drafts with the target's layers minus a skip set, directly in the target's KV pool.

    With ``s`` the first skipped layer, the draft's layers ``0..s-1`` compute exactly what the
    target computes for the same tokens: their cache entries, written at the positions the
    verification uses (``L..L+n`` for ``[pending, d_1..d_n]``), are the target's own, and the
    draft hands the hidden state entering layer ``s`` of each of those tokens to the engine
    (``DraftBatch.hidden``), so verification runs only layers ``s..``. The draft's later layers
    read the target's entries for the committed context and write draft entries at the step's
    positions, which verification overwrites; skipped layers are neither read nor written. After
    drafting each slot is set back to its committed length ``L``: the pool keeps the target's
    invariant. Row ``b`` feeds ``ks[b] + 1`` tokens (the last only for its hidden state).

    The skip set is ``skip_layers`` when given, else chosen once, at the first ``add``, among
    :func:`candidate_skip_sets` by :func:`predicted_speedup` from each set's greedy agreement with
    the full model over the longest prompt added (teacher-forced, one forward per set).
    Sampled rows draw drafts from the draft's own distribution ``q`` (returned for verification).

    The trained early-exit form (``early_exit``, or a ``model`` folder) is the skip set ``L..n-1``
    with ``adapter`` applied to layer ``L - 1``'s output before the target's final norm and head
    (:attr:`~specdec.models.base.ForwardBatch.exit_adapter`); everything else is the same, so
    verification runs only layers ``L..``. Its folder's draft vocabulary (``draft_vocab_size``,
    :mod:`specdec.drafters.draft_vocab`) scores only the most frequent tokens
    (:attr:`~specdec.models.base.ForwardBatch.output_head`), and the last forward, which feeds the
    last draft only for its hidden state, runs no output head at all.
    """

    method = "layer_skip"
    description = ("self-speculation: the target drafts with a subset of its layers (skip set by calibration), "
                   "or an early exit with a trained adapter")
    optional_model = True
    reads = frozenset({"skip_layers", "early_exit"})
    draft_vocab = True

    def __init__(self, target: CausalLM, skip: tuple[int, ...] | None, k: int, adapter: nn.Module | None = None,
                 vocab: DraftVocab | None = None) -> None:
        self.target, self.k, self.adapter, self.vocab = target, k, adapter, vocab
        self.no_head = target_weights(target)[1][:0]  # [0, H]: a forward for hidden states only
        self.cache: KVCache | None = None
        self.skip: tuple[int, ...] | None = None
        self.calibration: dict[tuple[int, ...], float] = {}
        if skip is not None:
            self._use(skip)

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if not isinstance(config.early_exit, bool):
            raise SpecDecError(f"early_exit must be true or false, got {config.early_exit!r}")
        if config.model is not None and not isinstance(config.model, (str, os.PathLike)):
            raise SpecDecError("speculative method 'layer_skip' takes as 'model' a folder with an early-exit adapter "
                               f"(`specdec train early-exit`), got {type(config.model).__name__}")
        trained = config.early_exit or config.model is not None
        if config.draft_vocab_size and not trained:
            raise SpecDecError("layer_skip takes a draft_vocab_size only with its trained early exit (the adapter "
                               "folder's token counts choose the tokens)")
        skip = config.skip_layers
        if skip is None:
            return
        if trained:
            raise SpecDecError("layer_skip's early exit takes no skip_layers: its adapter's exit layer sets them")
        if (not isinstance(skip, (list, tuple)) or not skip
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in skip)
                or len(set(skip)) != len(skip)):
            raise SpecDecError(f"skip_layers must be a non-empty list of distinct layer indices >= 0, got {skip!r}")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> LayerSkipDrafter:
        if not target.supports_layer_subsets:
            raise SpecDecError(f"speculative method 'layer_skip' needs {FAST_BACKEND}; "
                               f"{target.name!r} runs on {type(target).__name__}")
        n = target.num_layers
        if config.early_exit or config.model is not None:
            return cls._early_exit(config, target)
        skip = config.skip_layers
        if skip is not None and (max(skip) >= n or len(skip) >= n):
            raise SpecDecError(f"skip_layers {list(skip)} must leave at least one of the target's {n} layers "
                               f"(indices 0..{n - 1})")
        if skip is None and not candidate_skip_sets(n):
            raise SpecDecError(f"layer_skip needs a target with at least 2 layers, {target.name!r} has {n}")
        return cls(target, tuple(sorted(skip)) if skip is not None else None, config.max_k)

    @classmethod
    def _early_exit(cls, config: SpeculativeConfig, target: CausalLM) -> LayerSkipDrafter:
        """The trained form: the adapter folder ``config.model`` (None: the one shipped for the embedded target)."""
        _, lm_head = target_weights(target)
        folder = resolve_folder(config.model, EARLY_EXIT, lm_head, target.name)
        spec, state = load_spec_and_state(folder, EARLY_EXIT, lm_head, target.name)
        n = target.num_layers
        if not 1 <= spec.exit_layer < n:
            raise SpecDecError(f"the early-exit adapter in {str(folder)!r} exits after layer {spec.exit_layer}, "
                               f"outside 1..{n - 1} for the {n} layers of {target.name!r}")
        adapter = EarlyExitAdapter(spec.hidden_size, spec.intermediate_size, spec.rms_norm_eps)
        adapter = load_module(adapter.to(target.device, target.dtype), state, folder)
        return cls(target, tuple(range(spec.exit_layer, n)), config.max_k, adapter,
                   DraftVocab.load(folder, config.draft_vocab_size, lm_head))

    def _use(self, skip: tuple[int, ...]) -> None:
        n = self.target.num_layers
        self.skip = skip
        self.run_layers = tuple(i for i in range(n) if i not in skip)
        self.reuse = min(skip)  # layers before it are the target's own
        self.remaining = tuple(range(self.reuse, n)) if self.reuse > 0 else None

    def bind_target_cache(self, cache: KVCache) -> None:
        self.cache = cache

    # ------------------------------------------------------------------ calibration
    def _calibrate(self, prompt: list[int]) -> None:
        """Choose the skip set from measured greedy agreement over ``prompt`` (extended if short)."""
        target, device = self.target, self.target.device
        tokens = list(prompt[:MAX_CALIBRATION_TOKENS])
        capacity = min(target.max_length, max(len(tokens), CALIBRATION_TOKENS))
        cache = target.new_cache(1, capacity)
        logits = target.forward(ForwardBatch.from_rows([tokens], [0], [0], device, logits="last"), cache).logits
        while len(tokens) < capacity:
            token = argmax(logits)
            tokens.append(int(token[0]))
            logits = target.forward(ForwardBatch.one_token_per_row(token, [0], cache), cache).logits

        def greedy(layers: tuple[int, ...] | None) -> torch.Tensor:
            cache.release(0)
            batch = ForwardBatch.from_rows([tokens[:-1]], [0], [0], device)
            batch.layers = layers
            return argmax(target.forward(batch, cache).logits)

        full = greedy(None)
        n = target.num_layers
        best, best_speedup = None, 0.0
        for skip in candidate_skip_sets(n):
            run = tuple(i for i in range(n) if i not in skip)
            alpha = (greedy(run) == full).double().mean().item()
            speedup = predicted_speedup(alpha, self.k, len(run) / n, (n - min(skip)) / n)
            self.calibration[skip] = alpha
            if speedup > best_speedup:
                best, best_speedup = skip, speedup
        self._use(best)

    # ------------------------------------------------------------------ the drafter interface
    def add(self, seqs: list[Sequence]) -> None:
        if self.skip is None and seqs:
            self._calibrate(max((s.prompt_ids for s in seqs), key=len))

    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        cache, target, device = self.cache, self.target, self.target.device
        slots = [s.slot for s in seqs]
        starts = [cache.lengths[slot] for slot in slots]
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        hidden = probs = None
        active, rows = list(range(len(seqs))), sampling
        feed = to_device([s.token_ids[-1] for s in seqs], device)
        for i in range(width + 1):
            # Every row in ``active`` feeds its token i (the pending token, then its drafts); the last forward
            # (no row drafts on) is only for the hidden states verification resumes from.
            drafts_on = any(ks[b] > i for b in active)
            if not drafts_on and self.remaining is None:
                break
            batch = ForwardBatch.one_token_per_row(feed, [slots[b] for b in active], cache)
            batch.layers, batch.exit_adapter = self.run_layers, self.adapter
            batch.output_head = head_rows(self.vocab) if drafts_on else self.no_head
            batch.hidden_layers = (self.reuse,) if self.remaining is not None else ()
            out = target.forward(batch, cache)
            index = to_device(active, device)
            if out.hidden is not None:
                if hidden is None:
                    hidden = out.hidden.new_zeros(len(seqs), width + 1, out.hidden.shape[-1])
                hidden[index, i] = out.hidden[:, 0]
            drafting = [j for j, b in enumerate(active) if ks[b] > i]
            if not drafting:
                break
            logits = full_logits(self.vocab, out.logits)
            if len(drafting) < len(active):
                keep = to_device(drafting, device)
                logits, index, rows = logits[keep], index[keep], rows.select(drafting)
                active = [active[j] for j in drafting]
            if probs is None and not rows.all_greedy:
                probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
            feed = draw_column(logits, rows, probs, index, i, tokens)
        for slot, start in zip(slots, starts):
            cache.rewind(slot, start)  # the draft's entries of the reused layers stay in their blocks
        remaining = self.remaining if hidden is not None else None
        return DraftBatch(tokens, ks, probs, hidden, remaining)

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Nothing to roll back: the engine sets the target's slots to their committed lengths."""
