"""EAGLE: a one-layer autoregressive drafter on the target's features, with its own KV pool."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from specdec.argmax import argmax
from specdec.drafters.base import (
    DraftBatch,
    LoadOptions,
    SpeculativeConfig,
    draft_probs,
    draw_column,
    narrow_rows,
    register_drafter,
)
from specdec.drafters.draft_vocab import full_logits, head_rows
from specdec.drafters.heads.common import HeadDrafter, HeadSpec, load_module, target_weights
from specdec.drafters.heads.modules import EagleLayer
from specdec.drafters.heads.published import load_eagle
from specdec.drafters.heads.published_eagle import PublishedEagle, PublishedEagleLM
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM, ForwardBatch, ForwardOutput, to_device
from specdec.models.fast_llama import FastLlamaLM
from specdec.sampling import SamplingBatch
from specdec.sequence import Sequence
from specdec.tree import DynamicTree, ancestor_mask, depths, expand, prune

CATCH_UP_WINDOW = 16
"""The most buffered pairs a row back from a pause feeds the layer (the pairs before them are left out)."""


def tree_levels(budget: int, width: int) -> int:
    """How many levels an EAGLE-2 tree of ``budget`` nodes grows with ``width`` children per node and
    ``width`` nodes expanded per level: ``budget // width + 1`` (EAGLE-2's 60 nodes of top-10: 7),
    at most ``budget``."""
    return max(1, min(budget, budget // width + 1))


def check_feature_layers(layers: list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """EAGLE-3 feature layers (indices into transformers' ``hidden_states`` of a target with ``num_layers``
    decoder layers: 0 the embeddings, ``i`` layer ``i``'s output, ``num_layers`` the final normed state;
    negative ones count from the end) as distinct non-negative indices, or a :class:`SpecDecError`."""
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise SpecDecError(f"feature layers must be a list of integers, got {layers!r}")
    resolved = [i + num_layers + 1 if i < 0 else i for i in layers]
    if any(not 0 <= i <= num_layers for i in resolved):
        raise SpecDecError(f"feature layers {list(layers)} out of range for a target with {num_layers} layers "
                           f"(0 the embeddings .. {num_layers} the final normed state, or negative from the end)")
    if len(set(resolved)) != len(resolved):
        raise SpecDecError(f"feature layers {list(layers)} name a layer twice")
    return resolved


def eagle_config(spec: HeadSpec) -> LlamaConfig:
    """The one-layer Llama config of the eagle layer of ``spec``."""
    layer = {k: v for k, v in spec.layer.items() if v is not None}
    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                       intermediate_size=spec.intermediate_size, num_hidden_layers=1,
                       rms_norm_eps=spec.rms_norm_eps, **layer)


class PairKeys:
    """The prefix-cache keys of an EAGLE pool's entries, for a sequence of tokens ``t``: entry ``j`` holds the
    pair ``(f_j, t_{j+1})``, which depends on ``t_0 .. t_{j+1}`` (``f_j`` on ``t_0 .. t_j``), so its key is
    ``t_{j+1}``, and entry 0's folds in ``t_0`` as ``t_0 V + t_1`` (``V`` the vocabulary size): a block's key
    with its parents' then covers every token its entries depend on. ``len`` is the entries ``t`` gives
    pairs for (``len(t) - 1``); only slices are read (what the pool's prefix caching reads)."""

    def __init__(self, token_ids: list[int], vocab_size: int) -> None:
        self.ids, self.vocab_size = token_ids, vocab_size

    def __len__(self) -> int:
        return max(0, len(self.ids) - 1)

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(len(self))
        keys = self.ids[start + 1 : stop + 1]
        if start == 0 and keys:
            keys[0] += self.ids[0] * self.vocab_size
        return keys


@register_drafter
class EagleDrafter(HeadDrafter):
    """Chain drafts from an EAGLE layer run by specdec's fast backend over its own KV pool.

    Entry ``j`` of a slot is the layer's key/value for the pair ``(f_j, t_{j+1})``: the target's
    feature of position ``j`` and the token after it. The pool holds the pairs of every position
    whose feature the target has computed (all committed tokens but the pending one). ``propose``
    first feeds each row's new pairs (its prompt, or the step's verified positions, the last pair
    ending in the pending token); the layer's output there predicts the feature of the pending
    position, whose logits under the target's head give ``d_1``; each further draft feeds
    ``(predicted feature, d_i)``. Afterwards the pool is set back to the target-feature pairs.
    A row back from a pause (it sat out a step since its last feed, and has buffered more than
    ``catch_up_window`` features) feeds only its last ``catch_up_window`` pairs: the pairs before them
    are left out (``skipped``) and the pool's entries stop following the context's positions (the
    layer's rotary positions are entry indices, so the kept pairs sit at their true distance from one
    another, next to the context before the pause). A probe after a long pause then costs what a
    drafting step costs, not a forward over every position the row sat out. Drafts only, so exact.
    Sampled rows draw from the layer's distribution ``q`` (returned for exact verification).

    With ``num_candidates = r > 1`` a row proposes an EAGLE-2 dynamic tree of at most ``k`` nodes
    (``k`` = ``num_speculative_tokens``): from the pending position, :func:`~specdec.tree.expand` gives
    each of the ``r`` best nodes of the last level its ``r`` most probable children (scored by
    cumulative draft log-probability) for :func:`tree_levels` levels, the layer running over the
    expanded nodes with their ancestor mask (node ``i`` fed ``(its parent's predicted feature, its
    token)`` at position ``L - 2 + depth``); :func:`~specdec.tree.prune` keeps the ``k`` best nodes.
    The tree is a deterministic function of the context (top-k, no sampling), so greedy and sampled
    rows alike verify it with one-hot ``q`` (``probs`` None), which is exact. The pool is set back to
    the target-feature pairs afterwards; the accepted path's target features arrive through
    ``observe_hidden``, so nothing needs compacting.

    A folder with ``feature_layers`` (EAGLE-3) reads those layers of the target (``hidden_layers``) and
    ``f_j`` is their fusion by the layer's ``fuse``; drafting past the first token is unchanged."""

    method = "eagle"
    catch_up_window = CATCH_UP_WINDOW
    tree_drafts = True
    fuses_features = True
    description = ("EAGLE: one-layer feature drafter on the target's hidden states (trained folder, embedded "
                   "for the default pair, or a published EAGLE-1/2/3 head)")

    def __init__(self, target: CausalLM, spec: HeadSpec, module: EagleLayer | PublishedEagle, num_slots: int,
                 capacity: int, layer: CausalLM | None = None, embed: torch.Tensor | None = None,
                 prefix_caching: bool = False) -> None:
        """``layer``: the backend running the layer (None: specdec's fast backend over ``module.decoder``, whose
        pool caches prefixes with ``prefix_caching``, see :class:`PairKeys`); ``embed``: the layer's own token
        embedding ``[V, H]`` (None: the target's)."""
        super().__init__(target, spec, module)
        self.skipped: dict[str, int] = {}  # per request whose prompt was fed: pairs left out after pauses (0: none)
        self.hidden_layers = tuple(spec.feature_layers) or (-1,)  # EAGLE-3: the fused layers
        if embed is not None:
            self.embed = embed
        if layer is None:
            head = module.decoder.lm_head.weight  # the target's head: its packed copy serves the layer too
            shared = head.data_ptr() == self.lm_head.data_ptr() and head.dtype == self.lm_head.dtype
            layer = FastLlamaLM(module.decoder, f"eagle layer of {target.name}",
                                use_cuda_graphs=getattr(target, "use_cuda_graphs", False),
                                packed_head=target.packed_head if shared else None)
            self.cache = layer.new_cache(num_slots, capacity, prefix_caching=prefix_caching)
        else:
            self.cache = layer.new_cache(num_slots, capacity)
        self.layer = layer

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> EagleDrafter:
        embed, lm_head = target_weights(target)
        try:
            layers = check_feature_layers(spec.feature_layers, target.num_layers)
        except SpecDecError as exc:
            raise SpecDecError(f"the eagle heads in {str(folder)!r}: {exc}") from exc
        if layers != spec.feature_layers:
            raise SpecDecError(f"the eagle heads in {str(folder)!r}: feature layers {spec.feature_layers} must be "
                               "distinct non-negative indices")
        module = load_module(EagleLayer(eagle_config(spec), embed, lm_head, len(layers)), state, folder,
                             keep_plain=("decoder",))
        return cls(target, spec, module, options.num_slots, options.max_model_len,
                   prefix_caching=options.prefix_caching)

    @classmethod
    def build_published(cls, target: CausalLM, folder: Path, options: LoadOptions) -> EagleDrafter:
        """An EAGLE-3 head (``LlamaForCausalLMEagle3``) or, for ``eagle``, an EAGLE-1/2 head in its published
        layout (:mod:`.published_eagle`), run over its own pool."""
        _, lm_head = target_weights(target)
        module, spec, embed = load_eagle(folder, target, lm_head, cls.method, eagle3_only=cls.method == "eagle3")
        head = lm_head if target.packed_head is None else target.packed_head  # what EAGLE-1's product reads
        layer = PublishedEagleLM(module, head, f"{spec.method} head {str(folder)!r}")
        return cls(target, spec, module, options.num_slots, options.max_model_len, layer=layer, embed=embed)

    def add(self, seqs: list[Sequence]) -> None:
        """Start each sequence's pool from the cached blocks of its context's pairs, if any: their features
        (handed over for the whole context) are then not fed again."""
        for s in seqs:
            self.cache.release(s.slot)
            self.skipped.pop(s.request_id, None)
            cached = self.cache.match_prefix(s.slot, PairKeys(s.token_ids, self.target.vocab_size))
            if cached:
                parts = self.features[s.request_id]
                self.features[s.request_id] = [(parts[0] if len(parts) == 1 else torch.cat(parts))[cached:]]

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """The pairs each row's next ``propose`` feeds the layer: its buffered target features (the whole
        prompt's on its first), at most ``catch_up_window`` of them for a row back from a pause (:meth:`_kept`)."""
        return [min(sum(part.shape[0] for part in self.features.get(s.request_id, ())), self._kept(s)) for s in seqs]

    def _kept(self, seq: Sequence) -> int | float:
        """The most buffered pairs the row's next feed keeps: ``catch_up_window`` for a row fed before that sat
        out a step since (its features came in several parts, one a step), else all (``inf``)."""
        paused = seq.request_id in self.skipped and len(self.features.get(seq.request_id, ())) > 1
        return self.catch_up_window if paused else float("inf")

    def _commit(self, seqs: list[Sequence], committed: dict[int, int]) -> None:
        """Set the pool back to the target-feature pairs (``committed``: slot -> entries) and register their
        full blocks for later contexts that begin the same way."""
        by_slot = {s.slot: s for s in seqs}
        for slot, length in committed.items():
            self.cache.set_length(slot, length)
            if self.cache.caches_prefixes and not self.skipped[by_slot[slot].request_id]:
                self.cache.commit_prefix(slot, PairKeys(by_slot[slot].token_ids, self.target.vocab_size))

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.cache.release(seq.slot)
        self.skipped.pop(seq.request_id, None)

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        """The layer's forward over its pool, logits ``[M, V]`` (scored with the draft vocabulary, if any)."""
        batch.output_head = head_rows(self.vocab)
        out = self.layer.forward(batch, self.cache)
        return ForwardOutput(full_logits(self.vocab, out.logits), out.hidden)

    def _inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.module.inputs(features, F.embedding(tokens, self.embed))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], sampling: SamplingBatch) -> DraftBatch:
        device, cache = self.target.device, self.cache
        width = max(ks, default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
        # 1. The new (feature, next token) pairs of each row that drafts, ragged, into the pool (a row that sits
        #    the step out keeps its features for its next draft: a probe catches up only the rows it drafts).
        fed, features, pair_tokens, positions, cu = [], [], [], [], [0]
        for b, s in enumerate(seqs):
            keep = self._kept(s)
            new = self.take_features(s) if ks[b] > 0 else None
            if new is None:
                continue
            start, skipped = cache.lengths[s.slot], self.skipped.get(s.request_id, 0)
            if new.shape[0] > keep:  # back from a pause: its last pairs only
                skipped += new.shape[0] - keep
                new = new[-keep:]
            self.skipped[s.request_id] = skipped
            fed.append(b)
            features.append(new)
            first = start + skipped + 1  # the position of the first pair's token
            pair_tokens.extend(s.token_ids[first : first + new.shape[0]])
            positions.extend(range(start, start + new.shape[0]))
            cu.append(cu[-1] + new.shape[0])
        ks = [k if b in fed else 0 for b, k in enumerate(ks)]
        if not fed:
            return DraftBatch(tokens, ks)
        host = to_device(pair_tokens + positions + [c - 1 for c in cu[1:]], device)
        n = len(pair_tokens)
        batch = ForwardBatch(host[:n], host[n : 2 * n], [seqs[b].slot for b in fed], cu,
                             logits_rows=host[2 * n :], hidden_layers=(-1,))
        batch.input_hidden = self._inputs(self.module.fused(torch.cat(features)), host[:n])
        committed = {seqs[b].slot: cache.lengths[seqs[b].slot] + c for b, c in zip(fed, batch.num_tokens)}
        out = self._forward(batch)
        if self.num_candidates > 1:
            return self._propose_tree(seqs, ks, fed, out, committed)
        # 2. Draft autoregressively, the rows that still draft feeding (predicted feature, last draft).
        keep = [j for j, b in enumerate(fed) if ks[b] > 0]
        active = [fed[j] for j in keep]
        probs = None
        if active:
            part = to_device(keep, device)
            logits, feature = out.logits[part], out.hidden[part, 0]
            rows = sampling.select(active) if len(active) < len(seqs) else sampling
            if not rows.all_greedy:
                probs = draft_probs(logits, len(seqs), width, logits.shape[-1])
            index = to_device(active, device)
            if self._chains(seqs, active, ks, rows, width):
                self._draft_chain(seqs, active, logits, feature, tokens, index)
            else:
                self._draft_loop(seqs, active, ks, rows, probs, logits, feature, tokens, index)
        self._commit(seqs, committed)
        return DraftBatch(tokens, ks, probs)

    def _draft_loop(self, seqs: list[Sequence], active: list[int], ks: list[int], rows: SamplingBatch,
                    probs: torch.Tensor | None, logits: torch.Tensor, feature: torch.Tensor, tokens: torch.Tensor,
                    index: torch.Tensor) -> None:
        """Draft the rows ``active`` token by token (sampled or constrained rows, or rows of different ``k``
        without a captured chain) from the layer's logits ``[A, V]`` and predicted feature ``[A, H]``, a row
        stopping at its ``k``: into ``tokens`` ``[B, K]`` and, for sampled rows, ``probs`` ``[B, K, V]``."""
        for i in range(tokens.shape[1]):
            token = draw_column(logits, rows, probs, index, i, tokens)
            still = [j for j, b in enumerate(active) if ks[b] > i + 1]
            if not still:
                break
            active, rows, (token, feature, index) = narrow_rows(still, active, rows, token, feature, index)
            step = ForwardBatch.one_token_per_row(token, [seqs[b].slot for b in active], self.cache)
            step.hidden_layers = (-1,)
            step.input_hidden = self._inputs(feature, token)
            out = self._forward(step)
            logits, feature = out.logits, out.hidden[:, 0]

    def _chains(self, seqs: list[Sequence], active: list[int], ks: list[int], rows: SamplingBatch, width: int) -> bool:
        """Whether the rows ``active`` draft their tokens after the first in one :meth:`~CausalLM.greedy_chain`
        call fed their features (one graph on a GPU): every row greedy, unconstrained and unadjusted, room in the
        pool for ``width - 1`` more entries a row, and the rows' widths equal unless the layer captures the chain (a
        row then drafts past its own ``k`` inside the graph and keeps its first ``k`` tokens)."""
        if width < 2 or not rows.all_greedy or rows.shapes_drafts:
            return False
        if any(self.cache.lengths[seqs[b].slot] + width - 1 > self.cache.capacity for b in active):
            return False
        return len({ks[b] for b in active}) == 1 or getattr(self.layer, "use_cuda_graphs", False)

    def _draft_chain(self, seqs: list[Sequence], active: list[int], logits: torch.Tensor, feature: torch.Tensor,
                     tokens: torch.Tensor, index: torch.Tensor) -> None:
        """Greedy drafts of the rows ``active`` (batch rows ``index`` ``[A]``) from the layer's logits ``[A, V]``
        and predicted feature ``[A, H]`` at their pending position, written into ``tokens`` ``[B, K]`` (a row's
        columns past its ``k`` are padding)."""
        first = argmax(logits)
        chain = self.layer.greedy_chain(first, [seqs[b].slot for b in active], self.cache, tokens.shape[1] - 1,
                                        head_rows(self.vocab), None if self.vocab is None else self.vocab.ids,
                                        feature, self._inputs)
        tokens[index] = torch.cat([first[:, None], chain], dim=1)

    def _propose_tree(self, seqs: list[Sequence], ks: list[int], fed: list[int], out: ForwardOutput,
                      committed: dict[int, int]
                      ) -> DraftBatch:
        """EAGLE-2 trees for the rows ``fed`` with ``ks[b] > 0`` from ``out``, the layer's output at each fed
        row's last pair (logits ``[len(fed), V]``, hidden ``[len(fed), 1, H]``); resets the pool to ``committed``."""
        device, cache, r = self.target.device, self.cache, self.num_candidates
        # Every row's tree grows the same levels, and each expansion writes its nodes into the layer's pool past
        # the row's committed length: a row without room for the deepest expansion (near the end of its context,
        # where the engine gave it a smaller k) sits this step out rather than write past its slot.
        levels = tree_levels(max(ks[b] for b in fed), r)
        keep = [j for j, b in enumerate(fed)
                if ks[b] > 0 and committed[seqs[b].slot] + (levels - 1) * r <= cache.capacity]
        rows = [fed[j] for j in keep]
        if not rows:
            self._commit(seqs, committed)
            return DraftBatch(torch.zeros(len(seqs), 0, dtype=torch.long, device=device), [0] * len(seqs))
        part = to_device(keep, device)
        logits, root = out.logits[part], out.hidden[part, 0]  # [A, V], [A, H]
        count, slots = len(rows), [seqs[b].slot for b in rows]
        score_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        tree = DynamicTree.empty(count, device, score_dtype)
        frontier = torch.full((count, 1), -1, dtype=torch.long, device=device)
        logprobs = F.log_softmax(logits.to(score_dtype), dim=-1)[:, None]  # [A, F, V]
        predicted = root.new_zeros(count, 0, root.shape[-1])  # [A, M, H]: each node's predicted feature
        expanded = frontier.new_zeros(count, 0)  # [A, E]: the nodes run through the layer so far
        for level in range(levels):
            tree, frontier = expand(tree, frontier, logprobs, r, r)
            if level == levels - 1:
                break
            expanded = torch.cat([expanded, frontier], dim=1)
            width = expanded.shape[1]
            node_parents = tree.parents.gather(1, expanded)  # [A, E] node indices, -1 the root
            where = torch.full((count, tree.tokens.shape[1]), -1, dtype=torch.long, device=device)
            where.scatter_(1, expanded, torch.arange(width, device=device).expand(count, width).contiguous())
            local = torch.where(node_parents >= 0, where.gather(1, node_parents.clamp_min(0)), -1)
            mask = ancestor_mask(local, to_device([width] * count, device))  # [A, E+1, E+1], root at 0
            lengths = to_device([committed[slot] for slot in slots], device)
            positions = lengths[:, None] - 1 + depths(mask)[:, 1:]
            parent_features = torch.cat([root[:, None], predicted], dim=1).gather(
                1, (node_parents + 1)[:, :, None].expand(count, width, root.shape[-1]))
            tokens = tree.tokens.gather(1, expanded)
            for slot in slots:
                cache.set_length(slot, committed[slot])
            columns = torch.arange(width - r, width, device=device)  # the new frontier, last in each row
            wanted = (torch.arange(count, device=device)[:, None] * width + columns).reshape(-1)
            batch = ForwardBatch(tokens.reshape(-1), positions.reshape(-1), slots,
                                 list(range(0, count * width + 1, width)),
                                 tree_mask=mask[:, 1:, 1:].reshape(count * width, width), logits_rows=wanted,
                                 hidden_layers=(-1,))
            batch.input_hidden = self._inputs(parent_features.reshape(-1, root.shape[-1]), tokens.reshape(-1))
            step = self._forward(batch)
            grown = root.new_zeros(count, tree.tokens.shape[1], root.shape[-1])
            grown[:, : predicted.shape[1]] = predicted
            grown.scatter_(1, frontier[:, :, None].expand(count, r, root.shape[-1]),
                           step.hidden[:, 0].view(count, r, -1))
            predicted = grown
            logprobs = F.log_softmax(step.logits.to(score_dtype), dim=-1).view(count, r, -1)
        self._commit(seqs, committed)
        tokens, parents, num_draft = prune(tree, [ks[b] for b in rows])
        index = to_device(rows, device)
        full_tokens = tokens.new_zeros(len(seqs), tokens.shape[1])
        full_parents = parents.new_full((len(seqs), parents.shape[1]), -1)
        full_tokens[index], full_parents[index] = tokens, parents
        sizes = [0] * len(seqs)
        for b, n in zip(rows, num_draft):
            sizes[b] = n
        return DraftBatch(full_tokens, sizes, parents=full_parents)


@register_drafter
class Eagle3Drafter(EagleDrafter):
    """vLLM's and SGLang's ``eagle3`` method: a published EAGLE-3 head (``LlamaForCausalLMEagle3``: ``fc`` over
    three of the target's layers, ``midlayer``, ``d2t``/``t2d``), drafted like :class:`EagleDrafter`."""

    method = "eagle3"
    optional_model = False
    needs_model = True
    description = "EAGLE-3: a published EAGLE-3 head folder (the layout vLLM and SGLang load) on three target layers"

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        super().check_config(config)
        if config.model is None:
            raise SpecDecError("speculative method 'eagle3' needs a 'model': a folder with an EAGLE-3 head "
                               "(config.json with LlamaForCausalLMEagle3 and its weights)")
