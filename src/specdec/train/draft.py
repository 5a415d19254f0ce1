"""``specdec train draft``: distill a small ``LlamaForCausalLM`` draft from a target model.

A draft with the target's tokenizer and vocabulary learns, on a block of tokens,
``(1 - ce_weight) * KL(target || draft) + ce_weight * CE(data)``, where the KL divergence is taken
over the full vocabulary at temperature 1 at every position, and CE is the next-token
cross-entropy on the block itself. Blocks come from the corpus's train split and, for a
``generated_fraction`` of the rows, from continuations the target generates from corpus prompts
(precomputed once at start and kept with the checkpoint, so a resumed run reuses them).

A draft with another tokenizer (``--tokenizer``; drafting goes through text, see
:mod:`specdec.drafters.cross_tokenizer`) cannot be compared with the target token by token, so it
learns from the target's text instead (sequence-level distillation): the same target continuations, decoded and
re-encoded with the draft's tokenizer, with the next-token cross-entropy alone (``ce_weight`` 1).

At the end the saved draft is measured against the saved target and the result is stored in
``train_summary.json``: with the target's vocabulary by :func:`greedy_acceptance` (teacher-forced),
with another tokenizer by speculative decoding through the engine (τ and acceptance per position).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec.errors import SpecDecError
from specdec.models.loader import load_hf_model, load_tokenizer, resolve_device
from specdec.train.corpus import TokenBlocks, code_prompts
from specdec.train.lm import causal_lm_loss, check_eos, corpus_blocks
from specdec.train.loop import (
    BatchFn,
    TrainSettings,
    autocast_dtype,
    checkpoint_config,
    checkpoint_dir,
    train,
    update_summary,
)
from specdec.train.presets import ModelPreset, count_parameters, llama_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GENERATED_FILE = "generated.npy"
CHAIN_K = 4
#: ``ce_weight`` when none is given and the draft shares the target's vocabulary.
DEFAULT_CE_WEIGHT = 0.1


@dataclass
class DistillSettings:
    """The distillation-specific settings of a draft run."""

    ce_weight: float | None = None
    generated_fraction: float = 0.0
    generated_sequences: int = 256
    generated_temperature: float = 1.0
    acceptance_prompts: int = 64
    acceptance_tokens: int = 64

    def validate(self) -> None:
        """Raise :class:`SpecDecError` for settings that cannot run."""
        if self.ce_weight is not None and not 0.0 <= self.ce_weight <= 1.0:
            raise SpecDecError(f"--ce-weight must be in [0, 1], got {self.ce_weight}")
        if not 0.0 <= self.generated_fraction <= 1.0:
            raise SpecDecError(f"--generated-fraction must be in [0, 1], got {self.generated_fraction}")
        if self.generated_fraction > 0 and self.generated_sequences < 1:
            raise SpecDecError(f"--generated-sequences must be at least 1, got {self.generated_sequences}")
        if not 0 <= self.generated_temperature < float("inf"):
            raise SpecDecError(
                f"--generated-temperature must be a finite non-negative number, got {self.generated_temperature}"
            )
        if self.acceptance_prompts < 1 or self.acceptance_tokens < CHAIN_K:
            raise SpecDecError(
                f"--acceptance-prompts must be >= 1 and --acceptance-tokens >= {CHAIN_K}, "
                f"got {self.acceptance_prompts} and {self.acceptance_tokens}"
            )


    def loss_weight(self, cross: bool) -> float:
        """The cross-entropy weight to train with: 1 for a draft with another tokenizer (``cross``), which
        has no KL term to weigh; raises :class:`SpecDecError` for a weight below 1 there."""
        if not cross:
            return DEFAULT_CE_WEIGHT if self.ce_weight is None else self.ce_weight
        if self.ce_weight not in (None, 1.0):
            raise SpecDecError(
                f"--ce-weight {self.ce_weight} needs the target's vocabulary for its KL term; a draft with "
                "another tokenizer learns from the target's text by cross-entropy alone (leave it out or use 1)"
            )
        return 1.0


def other_tokenizer(
    tokenizer: PreTrainedTokenizerBase, target: PreTrainedModel, target_dir: Path
) -> PreTrainedTokenizerBase | None:
    """The target's own tokenizer when ``tokenizer`` differs from it (the draft then learns from the
    target's text), or None when ``tokenizer`` is the target's; raises :class:`SpecDecError` for another
    tokenizer that does not fit the target's vocabulary while the target has none to convert text with."""
    own = load_tokenizer(target_dir, required=True) if (target_dir / "tokenizer_config.json").is_file() else None
    if own is not None:
        return None if own.get_vocab() == tokenizer.get_vocab() else own
    vocab = target.config.vocab_size
    if len(tokenizer) > vocab:
        raise SpecDecError(
            f"tokenizer has {len(tokenizer)} tokens but the target's vocabulary has only {vocab}, and the "
            f"target {str(target_dir)!r} has no tokenizer of its own to convert text with; use the target's tokenizer"
        )
    return None


def distill_loss(
    draft: PreTrainedModel, target: PreTrainedModel, input_ids: torch.Tensor, ce_weight: float
) -> torch.Tensor:
    """``(1 - ce_weight) * KL(target || draft) + ce_weight * CE`` on ``input_ids`` ``(batch, block)``.

    KL is summed over the vocabulary and averaged over all ``batch * block`` positions; both
    log-softmaxes are computed in fp32 from logits of shape ``(batch, block, vocab)``. With ``ce_weight`` 1
    the target is not run.
    """
    import torch
    import torch.nn.functional as F

    if ce_weight == 1:
        return causal_lm_loss(draft, input_ids)
    with torch.no_grad():
        target_logp = F.log_softmax(target(input_ids=input_ids).logits.float(), dim=-1)
    draft_logits = draft(input_ids=input_ids).logits.float()
    vocab = target_logp.shape[-1]
    draft_logp = F.log_softmax(draft_logits[..., :vocab], dim=-1)
    kl = F.kl_div(draft_logp, target_logp, log_target=True, reduction="none").sum(-1).mean()
    if ce_weight == 0:
        return kl
    ce = F.cross_entropy(
        draft_logits[:, :-1].reshape(-1, draft_logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )
    return (1.0 - ce_weight) * kl + ce_weight * ce


def generate_continuations(
    target: PreTrainedModel,
    prompts: np.ndarray,
    new_tokens: int,
    temperature: float,
    seed: int,
    batch: int = 32,
) -> np.ndarray:
    """Target continuations of ``prompts`` ``(n, p)``: returns ``(n, p + new_tokens)`` token ids.

    Sampled at ``temperature`` (greedy when 0); EOS is suppressed so every row has full length.
    """
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    device = next(target.parameters()).device
    rows = []
    for start in tqdm(range(0, len(prompts), batch), desc="target continuations", unit="batch"):
        ids = torch.from_numpy(prompts[start : start + batch].astype(np.int64)).to(device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                **sampling,
            )
        rows.append(out.cpu().numpy())
    return np.concatenate(rows).astype(prompts.dtype)


def greedy_acceptance(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    new_tokens: int = 64,
    k: int = CHAIN_K,
) -> dict[str, float]:
    """How often the draft's greedy token equals the target's along the target's greedy continuation.

    For each prompt the target generates up to ``new_tokens`` tokens greedily (``generate``, no
    sampling); the draft, teacher-forced on prompt + continuation, predicts each continuation
    token by argmax. ``acceptance_rate_greedy`` is the fraction of matching positions over all
    prompts. ``expected_chain_length_k{k}`` is the mean, over positions ``j`` with ``k`` tokens left,
    of ``1 + min(k, consecutive matches from j)``: the tokens a greedy speculative step with ``k``
    drafted tokens would produce from that position.
    """
    import torch
    from tqdm.auto import tqdm

    device = next(target.parameters()).device
    matches_all: list[np.ndarray] = []
    with torch.no_grad():
        for ids in tqdm(prompt_ids, desc="acceptance check", unit="prompt"):
            prompt = torch.tensor([list(ids)], device=device)
            out = target.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                do_sample=False,
            )
            continuation = out[0, prompt.shape[1] :]
            if len(continuation) == 0:
                continue
            logits = draft(input_ids=out[:, :-1]).logits[0, prompt.shape[1] - 1 :]
            matches_all.append((logits.argmax(-1) == continuation).cpu().numpy())
    if not matches_all:
        raise SpecDecError("the target generated no tokens for any acceptance prompt")
    chains = []
    for matches in matches_all:
        for j in range(len(matches) - k + 1):
            run = 0
            while run < k and matches[j + run]:
                run += 1
            chains.append(1 + run)
    return {
        "acceptance_rate_greedy": round(float(np.concatenate(matches_all).mean()), 4),
        f"expected_chain_length_k{k}": round(float(np.mean(chains)), 4) if chains else float("nan"),
        "acceptance_positions": int(sum(len(m) for m in matches_all)),
        "acceptance_prompts": len(matches_all),
    }


def _mixed_batches(
    corpus: TokenBlocks, generated: TokenBlocks | None, fraction: float, batch_size: int
) -> BatchFn:
    """A ``batch_fn(micro)`` whose rows come from ``generated`` for ``fraction`` of them over time."""

    def batch_fn(micro: int) -> np.ndarray:
        rows = corpus.batch(micro, batch_size)
        if generated is None:
            return rows
        n_gen = int((micro + 1) * fraction * batch_size) - int(micro * fraction * batch_size)
        if n_gen == 0:
            return rows
        return np.concatenate([rows[: batch_size - n_gen], generated.batch(micro, batch_size)[:n_gen]])

    return batch_fn


def retokenize(rows: np.ndarray, source: PreTrainedTokenizerBase, dest: PreTrainedTokenizerBase) -> np.ndarray:
    """Rows of ``source`` token ids ``(n, L)`` as one stream of ``dest`` token ids ``(m,)``: each row's text
    re-encoded, followed by ``dest``'s EOS (the rows are separate documents)."""
    stream: list[int] = []
    options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    for text in source.batch_decode(rows.tolist(), **options):
        stream.extend(dest.encode(text, add_special_tokens=False))
        stream.append(dest.eos_token_id)
    return np.asarray(stream, dtype=rows.dtype)


def _generated_blocks(
    target: PreTrainedModel, prompt_blocks: Callable[[], TokenBlocks], distill: DistillSettings,
    settings: TrainSettings, context: int,
) -> np.ndarray:
    """Target continuations ``(n, context)`` of the first halves of ``n`` random blocks of ``prompt_blocks()``
    (target tokens, built only when generating): generated once, saved with the checkpoint and reused by a
    resumed run."""
    gen_file = checkpoint_dir(settings.out_dir) / GENERATED_FILE
    if settings.resume and gen_file.is_file():
        return np.load(gen_file)
    half = context // 2
    rng = np.random.default_rng(settings.seed + 1)
    n = distill.generated_sequences
    blocks = prompt_blocks()
    chosen = rng.choice(len(blocks), size=n, replace=n > len(blocks))
    prompts = blocks.blocks[chosen, :half]
    print(f"generating {len(prompts)} target continuations of {context - half} tokens", flush=True)
    gen = generate_continuations(target, prompts, context - half, distill.generated_temperature, settings.seed)
    gen_file.parent.mkdir(parents=True, exist_ok=True)
    np.save(gen_file, gen)
    return gen


def train_draft(
    target_dir: str | os.PathLike[str],
    preset: ModelPreset,
    settings: TrainSettings,
    distill: DistillSettings,
    corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    draft_vocab_size: int = 0,
) -> dict[str, Any]:
    """Distill a draft with the shape of ``preset`` from the target in ``target_dir``; return the summary.

    ``tokenizer_dir`` (default: the target's folder) is the draft's tokenizer; one other than the
    target's makes a draft for :class:`~specdec.drafters.cross_tokenizer.CrossTokenizerDrafter`, trained
    on the target's text (see the module docstring). The summary includes the draft's acceptance on
    held-out code prompts. A draft with the target's vocabulary also gets the training split's token
    counts, with ``draft_vocab_size`` its default draft vocabulary (:mod:`specdec.drafters.draft_vocab`).
    """
    import torch
    from transformers import LlamaForCausalLM

    from specdec.drafters.draft_vocab import check_draft_vocab_size, save_token_counts

    settings.validate()
    distill.validate()
    check_draft_vocab_size(draft_vocab_size, "--draft-vocab-size")
    target_dir = Path(target_dir)
    device = resolve_device("auto")
    amp = autocast_dtype(device)
    target, _ = load_hf_model(target_dir, amp or torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    try:
        folder = tokenizer_dir if tokenizer_dir is not None else target_dir
        tokenizer = check_eos(load_tokenizer(folder, required=True), folder)
    except SpecDecError as exc:
        raise SpecDecError(
            f"cannot use a tokenizer for target {str(target_dir)!r} ({exc}); pass --tokenizer"
        ) from exc
    target_tok = other_tokenizer(tokenizer, target, target_dir)
    cross = target_tok is not None
    ce_weight = distill.loss_weight(cross)
    if cross and draft_vocab_size:
        raise SpecDecError("--draft-vocab-size needs the target's vocabulary; a draft with another tokenizer "
                           "drafts from its whole vocabulary")

    target_params = sum(p.numel() for p in target.parameters())
    max_positions = target.config.max_position_embeddings
    if settings.resume:
        config = checkpoint_config(settings.out_dir)
    else:
        if preset.context > max_positions:
            raise SpecDecError(f"context {preset.context} exceeds the target's {max_positions} positions")
        vocab = len(tokenizer) if cross else target.config.vocab_size
        config = llama_config(preset, vocab, tokenizer.eos_token_id)
        config.max_position_embeddings = max_positions
    draft_params = count_parameters(config)
    if draft_params >= target_params:
        raise SpecDecError(
            f"draft would have {draft_params / 1e6:.2f}M parameters, not fewer than the target's "
            f"{target_params / 1e6:.2f}M; choose a smaller preset or shape"
        )
    context = min(preset.context, max_positions)
    train_blocks, heldout_blocks = corpus_blocks(corpus_dirs, tokenizer, context, settings.seed, cache_dir)
    if not cross:
        save_token_counts(settings.out_dir, train_blocks.blocks, int(target.config.vocab_size), draft_vocab_size)

    generated = None
    if distill.generated_fraction > 0:
        def prompt_blocks() -> TokenBlocks:  # the target's tokens
            return corpus_blocks(corpus_dirs, target_tok, context, settings.seed, cache_dir)[0] if cross \
                else train_blocks

        gen = _generated_blocks(target, prompt_blocks, distill, settings, context)
        stream = retokenize(gen, target_tok, tokenizer) if cross else gen.reshape(-1)
        generated = TokenBlocks(stream, context, settings.seed)

    torch.manual_seed(settings.seed)
    draft = LlamaForCausalLM(config).to(device)
    print(
        f"draft: {draft_params / 1e6:.2f}M parameters (target {target_params / 1e6:.2f}M), "
        f"{len(train_blocks)} train blocks of {context} tokens"
        + (f", another tokenizer ({len(tokenizer)} tokens): trained on the target's text" if cross else ""),
        flush=True,
    )

    def loss_fn(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
        return distill_loss(model, target, ids, ce_weight)

    train(
        draft,
        tokenizer,
        _mixed_batches(train_blocks, generated, distill.generated_fraction, settings.batch_size),
        heldout_blocks.first(settings.eval_blocks),
        loss_fn,
        settings,
        extra_summary={
            "role": "draft",
            "context": context,
            "target": str(target_dir),
            "target_parameters": target_params,
            "ce_weight": ce_weight,
            "generated_fraction": distill.generated_fraction,
            "own_tokenizer": cross,
        },
    )
    prompts = code_prompts(distill.acceptance_prompts, corpus_dirs, split="heldout", seed=settings.seed)
    if cross:
        from specdec.train.heads import measure_heads

        measured = measure_heads(target_dir, settings.out_dir, "draft_model", CHAIN_K, prompts,
                                 distill.acceptance_tokens)
        print(f"speculative decoding on {len(prompts)} held-out prompts (k={CHAIN_K}): "
              f"tau {measured['heldout_tau']:.3f}, acceptance {measured['heldout_acceptance_rate']:.3f}", flush=True)
        return update_summary(settings.out_dir, measured)
    saved_target, _ = load_hf_model(target_dir, "auto", device)
    saved_draft, _ = load_hf_model(settings.out_dir, "auto", device)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    limit = max_positions - distill.acceptance_tokens
    prompt_ids = [ids[-limit:] for ids in prompt_ids if ids]
    acceptance = greedy_acceptance(saved_target, saved_draft, prompt_ids, distill.acceptance_tokens)
    print(
        f"greedy acceptance on {acceptance['acceptance_prompts']} held-out prompts: "
        f"{acceptance['acceptance_rate_greedy']:.3f}, expected chain length (k={CHAIN_K}): "
        f"{acceptance[f'expected_chain_length_k{CHAIN_K}']:.3f}",
        flush=True,
    )
    return update_summary(settings.out_dir, acceptance)
