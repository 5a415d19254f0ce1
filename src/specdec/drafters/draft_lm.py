"""What every drafter that runs a separate causal LM keeps: the model and its own KV pool.

:class:`~specdec.drafters.draft_model.DraftModelDrafter` (a draft with the target's vocabulary) and
:class:`~specdec.drafters.cross_tokenizer.CrossTokenizerDrafter` (a draft with a tokenizer of its own)
both build on it; ``draft_model`` picks one of the two when it loads the draft, so this layer sits
below both and neither imports the other's module for its base.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from specdec.drafters.base import Drafter, LoadOptions, SpeculativeConfig
from specdec.models.base import CausalLM
from specdec.models.loader import load_causal_lm, resolve_dtype
from specdec.sequence import Sequence


def resolve_draft_dtype(requested: str | torch.dtype | None, target_dtype: torch.dtype,
                        device: torch.device) -> torch.dtype:
    """The draft's dtype: ``requested`` when given, else the target's, except float32 on a CPU under a
    float16 target (float16 arithmetic is slow there). Under a bfloat16 target on a CPU the draft runs
    in bfloat16: its one-token attention used to take torch's slow path for a single bfloat16 query,
    which made float32 the faster default; the fast backend now attends such a query as a pair
    (:data:`~specdec.models.fast_llama.PAIR_SINGLE_QUERIES`)."""
    if requested is not None and requested != "auto":
        return resolve_dtype(requested, None, device)
    if device.type == "cpu" and target_dtype == torch.float16:
        return torch.float32
    return target_dtype


class DraftLM(Drafter):
    """A draft causal LM with its own pool of ``num_slots`` slots, slot for slot the target's, each of
    ``capacity`` tokens (the smaller of ``max_model_len`` and the draft's context), in ``num_blocks``
    blocks (None: every slot can be full), caching prefixes with ``prefix_caching``. Not registered:
    the ``draft_model`` method builds its subclasses."""

    method = "draft_model"
    needs_model = True
    reads = frozenset({"dtype"})

    def __init__(self, model: CausalLM, num_slots: int, max_model_len: int, num_blocks: int | None = None,
                 prefix_caching: bool = False) -> None:
        self.model = model
        self.capacity = min(max_model_len, model.max_length)
        self.cache = model.new_cache(num_slots, self.capacity, num_blocks, prefix_caching)

    def kv_pools(self) -> list:
        return [self.cache]

    def catch_up(self, seqs: list[Sequence], ks: list[int]) -> None:
        """:meth:`_catch_up` of the rows that draft (:meth:`_drafting`)."""
        self._catch_up([seqs[b] for b in self._drafting(seqs, ks)])

    @abstractmethod
    def _drafting(self, seqs: list[Sequence], ks: list[int]) -> list[int]:
        """The rows (indices into ``seqs``) that draft when asked for ``ks[b]`` positions: ``k > 0`` and room
        in the draft's context."""

    @abstractmethod
    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Feed each of ``seqs`` what the proposal's own forward will not: the context its pool lacks but its
        last two tokens (nothing, where the proposal's forward feeds it all)."""

    @staticmethod
    def load_model(config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> CausalLM:
        """The draft ``config.model`` on the target's device and backend, in :func:`resolve_draft_dtype`'s dtype
        (in default numerics in the deterministic mode too: what a draft proposes changes no emitted token,
        greedy or keyed, only how many are kept)."""
        dtype = resolve_draft_dtype(config.dtype, target.dtype, options.device)
        return load_causal_lm(config.model, dtype=dtype, device=options.device, backend=options.backend,
                              enforce_eager=options.enforce_eager)

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq.slot)
