"""A separate, smaller causal LM that samples the draft from its own distribution ``q``."""

from __future__ import annotations

import torch

from specdec.drafters.base import Draft, Drafter, LoadOptions, SpeculativeConfig, register_drafter
from specdec.errors import SpecDecError
from specdec.models.base import CachedLM
from specdec.models.loader import load_cached_lm, load_tokenizer, resolve_dtype
from specdec.sampling import SamplingParams, logits_to_probs, sample

HALF_DTYPES = (torch.bfloat16, torch.float16)


def resolve_draft_dtype(requested: str | torch.dtype | None, target_dtype: torch.dtype,
                        device: torch.device) -> torch.dtype:
    """The draft's dtype: ``requested`` when given, else the target's, except float32 for a
    half-precision target on CPU (a small model's single-token forward is fastest in float32
    there, while the target's (k+1)-token verification gains from bf16)."""
    if requested is not None and requested != "auto":
        return resolve_dtype(requested, None, device)
    if device.type == "cpu" and target_dtype in HALF_DTYPES:
        return torch.float32
    return target_dtype


@register_drafter
class DraftModelDrafter(Drafter):
    """Runs the draft model autoregressively for k tokens per step.

    Its cache follows the target's invariant: it holds a prefix of the committed context,
    plus the drafts of the current step. ``propose`` first feeds the committed tokens it has
    not cached yet (the pending token, and after a fully accepted step the last draft too),
    and ``observe`` crops away the drafts that were rejected.
    """

    method = "draft_model"
    deterministic = False

    def __init__(self, model: CachedLM) -> None:
        self.model = model
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if config.model is None or config.model == "":
            raise SpecDecError("speculative method 'draft_model' needs a draft 'model' (a folder or hub id)")

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CachedLM, options: LoadOptions) -> DraftModelDrafter:
        dtype = resolve_draft_dtype(config.dtype, target.dtype, options.device)
        model = load_cached_lm(config.model, dtype=dtype, device=options.device, backend=options.backend)
        if model.vocab_size != target.vocab_size:
            raise SpecDecError(
                f"draft model {model.name!r} has a vocabulary of {model.vocab_size} tokens but the target "
                f"{target.name!r} has {target.vocab_size}; the draft and the target must share a vocabulary"
            )
        if options.target_tokenizer is not None:
            draft_tokenizer = load_tokenizer(config.model, required=False)
            if draft_tokenizer is not None and draft_tokenizer.get_vocab() != options.target_tokenizer.get_vocab():
                raise SpecDecError(
                    f"the draft model {model.name!r} uses a different tokenizer vocabulary from the target "
                    f"{target.name!r}; the draft and the target must share a vocabulary"
                )
        return cls(model)

    def begin(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator) -> None:
        self.params, self.generator = params, generator
        self.model.reset()
        if len(prompt_ids) > 1:
            self._feed(prompt_ids[:-1], num_logits=0)

    def _feed(self, token_ids: list[int], num_logits: int) -> torch.Tensor:
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.model.device)
        return self.model.forward(ids, num_logits=num_logits)

    def propose(self, context: list[int], k: int) -> Draft:
        k = min(k, self.model.max_length - len(context))
        if k <= 0:
            return Draft(torch.empty(1, 0, dtype=torch.long, device=self.model.device))
        logits = self._feed(context[self.model.length:], num_logits=1)[:, -1]
        tokens, probs = [], []
        for i in range(k):
            if self.params.greedy:
                token = logits.argmax(-1)
            else:
                q = logits_to_probs(logits, self.params)
                token = sample(q, self.generator)
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = self.model.forward(token.view(1, 1))[:, -1]
        return Draft(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)

    def observe(self, context: list[int], num_accepted: int) -> None:
        self.model.crop(min(self.model.length, len(context) - 1))
