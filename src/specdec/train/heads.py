"""``specdec train medusa|eagle|mtp|early-exit``: self-distil heads on a frozen target's own features.

The target runs over blocks of the corpus without gradients; its final normed hidden states (the
*features*, the vectors its output head scores) and its next-token distributions ``p`` are the
teachers, so the heads learn to predict the target, not the corpus. Losses (``KL(p || q)`` summed
over the vocabulary, averaged over positions; ``q`` is the target's head applied to a predicted
feature):

- medusa: head ``i`` on the feature of position ``j`` against ``p`` of position ``j + i``.
- eagle: the layer over ``(f_j, t_{j+1})`` against ``p`` of position ``j + 1``, plus ``feature_weight``
  times a smooth-L1 regression of the predicted feature onto ``f_{j+1}``; a second pass feeds the first
  pass's own predictions as inputs (what drafting does after its first token), with the same targets.
  With ``feature_layers`` (EAGLE-3) the first pass's ``f_j`` is the layer's fusion of those hidden
  states of the target (trained with it); the regression target stays the final feature, the space
  the target's head scores.
- mtp: depth ``k`` on depth ``k - 1``'s feature of position ``j`` and ``t_{j+k}`` against ``p`` of
  position ``j + k``.
- early_exit: the adapter on the output of the target's layer ``L - 1`` at position ``j``, then the
  target's final norm and head, against ``p`` of position ``j`` (layer_skip's trained form).

Training shares :func:`specdec.train.loop.train` (presets, time budget, resume, progress bar,
held-out loss) with the other trainers. At the end the saved heads run in specdec's engine on
held-out code prompts (greedy): acceptance per draft position and τ go into ``train_summary.json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.errors import SpecDecError
from specdec.models.loader import load_hf_model, load_tokenizer, resolve_device
from specdec.train.corpus import code_prompts
from specdec.train.lm import check_eos, corpus_blocks
from specdec.train.loop import TrainSettings, autocast_dtype, checkpoint_dir, train, update_summary

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

HEAD_METHODS = ("medusa", "eagle", "mtp", "early_exit")
SPECULATIVE_METHOD = {"early_exit": "layer_skip"}
"""The speculative method that runs heads of a kind, where it is not the kind's own name."""
FEATURE_WEIGHT = 1.0
"""Weight of eagle's feature regression next to its KL term."""


@dataclass(frozen=True)
class HeadPreset:
    """``num_heads``: Medusa heads / MTP depths; ``intermediate_size``: MLP width of the eagle layer or of
    each MTP depth; ``context``: training block length in tokens."""

    num_heads: int
    intermediate_size: int
    context: int


HEAD_PRESETS = {
    "tiny": HeadPreset(num_heads=2, intermediate_size=32, context=32),
    "base": HeadPreset(num_heads=4, intermediate_size=1024, context=256),
}


def resolve_head_preset(name: str, num_heads: int | None, intermediate_size: int | None,
                        context: int | None) -> HeadPreset:
    """The named preset with the non-None overrides applied, validated."""
    if name not in HEAD_PRESETS:
        raise SpecDecError(f"unknown heads preset {name!r}; choose one of {', '.join(HEAD_PRESETS)}")
    base = HEAD_PRESETS[name]
    preset = HeadPreset(num_heads if num_heads is not None else base.num_heads,
                        intermediate_size if intermediate_size is not None else base.intermediate_size,
                        context if context is not None else base.context)
    for flag, value in (("num-heads", preset.num_heads), ("intermediate-size", preset.intermediate_size),
                        ("context", preset.context)):
        if value < 1:
            raise SpecDecError(f"--{flag} must be at least 1, got {value}")
    if preset.context < preset.num_heads + 2:
        raise SpecDecError(f"--context {preset.context} is too short for {preset.num_heads} heads")
    return preset


def build_module(method: str, spec: Any, embed: torch.Tensor, lm_head: torch.Tensor) -> nn.Module:
    """A fresh module of ``method`` for ``spec``, on the device and dtype of ``embed``."""
    from specdec.drafters.heads.eagle import eagle_config
    from specdec.drafters.heads.modules import EagleLayer, EarlyExitAdapter, MedusaHeads, MTPModules

    if method == "medusa":
        module: nn.Module = MedusaHeads(spec.hidden_size, spec.num_heads)
    elif method == "early_exit":
        module = EarlyExitAdapter(spec.hidden_size, spec.intermediate_size, spec.rms_norm_eps)
    elif method == "eagle":
        return EagleLayer(eagle_config(spec), embed, lm_head, len(spec.feature_layers))
    else:
        module = MTPModules(spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.rms_norm_eps)
    return module.to(device=embed.device, dtype=embed.dtype)


def _kl(logits: torch.Tensor, target_logp: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` summed over the vocabulary, mean over positions; both ``[..., V]``."""
    import torch.nn.functional as F

    logq = F.log_softmax(logits.float(), dim=-1)
    return F.kl_div(logq, target_logp, log_target=True, reduction="none").sum(-1).mean()


def head_loss(method: str, module: nn.Module, target: PreTrainedModel, ids: torch.Tensor,
              feature_layers: Sequence[int] = (), feature_weight: float = FEATURE_WEIGHT) -> torch.Tensor:
    """The self-distillation loss of ``module`` on ``ids`` ``[B, T]`` (see the module docstring);
    ``feature_layers`` and ``feature_weight``: eagle's fused target layers and regression weight."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = out.hidden_states[-1].float()  # [B, T, H], the final normed hidden state
        logp = F.log_softmax(out.logits.float(), dim=-1)  # [B, T, V]
    lm_head = target.get_output_embeddings().weight
    T = ids.shape[1]
    if method == "early_exit":  # hidden_states[L]: the output of layer L - 1, before any norm
        exit_hidden = out.hidden_states[module.config.exit_layer].float()
        return _kl(F.linear(target.model.norm(module(exit_hidden)), lm_head), logp)
    if method == "medusa":
        heads = module(feats)  # [B, T, K, H]
        losses = [_kl(F.linear(heads[:, : T - i, i - 1], lm_head), logp[:, i:]) for i in range(1, heads.shape[2] + 1)]
        return torch.stack(losses).mean()
    if method == "eagle3":  # the published EAGLE-3 layout (eagle3_format): the token loss alone
        source = module.fused(torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1).float())
        inputs, loss = source[:, :-1], 0.0
        for _ in range(2):  # teacher-forced, then on its own outputs (what drafting feeds after the first token)
            pred = module(inputs, ids[:, 1:])
            loss = loss + _kl(module.logits(pred), logp[:, 1:])
            inputs = torch.cat([source[:, :1], pred[:, :-1]], dim=1)
        return loss / 2
    if method == "eagle":
        source = module.fused(torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1).float()
                              if feature_layers else feats)  # [B, T, H]
        inputs, loss = source[:, :-1], 0.0
        for _ in range(2):  # teacher-forced, then on its own predicted features
            pred = module(inputs, ids[:, 1:])  # [B, T-1, H]: features of positions 1..T-1
            loss = loss + _kl(F.linear(pred, lm_head), logp[:, 1:]) + feature_weight * F.smooth_l1_loss(
                pred.float(), feats[:, 1:])
            inputs = torch.cat([source[:, :1], pred[:, :-1]], dim=1)
        return loss / 2
    embed = target.get_input_embeddings().weight
    h, losses = feats[:, :-1], []
    for k in range(1, len(module.depths) + 1):
        h = module.depths[k - 1](h[:, : T - k], F.embedding(ids[:, k:], embed))
        losses.append(_kl(F.linear(h, lm_head), logp[:, k:]))
    return torch.stack(losses).mean()


def measure_heads(target_dir: Path, heads_dir: Path, method: str, k: int, prompts: list[str],
                  max_tokens: int) -> dict[str, Any]:
    """Greedy speculative decoding with the saved heads (or draft model) in ``heads_dir`` on ``prompts``:
    τ and acceptance per position."""
    from specdec import LLM, SamplingParams

    spec = {"method": SPECULATIVE_METHOD.get(method, method), "model": str(heads_dir), "num_speculative_tokens": k}
    llm = LLM(target_dir, speculative_config=spec, dtype="float32", max_num_seqs=8)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    accepted, drafted = [0] * k, [0] * k
    for out in outputs:
        m = out.metrics
        for i, (a, d) in enumerate(zip(m.accepted_per_position, m.drafted_per_position)):
            accepted[i] += a
            drafted[i] += d
    batch = llm.batch_metrics
    return {
        "heldout_k": k,
        "heldout_prompts": len(prompts),
        "heldout_tau": round(batch.num_generated_tokens / max(sum(o.metrics.num_steps for o in outputs), 1), 4),
        "heldout_acceptance_rate": round(batch.num_accepted_tokens / max(batch.num_draft_tokens, 1), 4),
        "heldout_acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
    }


def write_token_counts(target_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                       corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
                       cache_dir: str | os.PathLike[str] | None = None, draft_vocab_size: int = 0) -> int:
    """Write the counts of the training split's tokens (the target's tokenizer) into ``out`` (a head or draft
    model folder), with ``draft_vocab_size`` its default draft vocabulary: what the trainers write at the start
    of a run, for folders trained before they did; returns the tokens counted."""
    from transformers import AutoConfig

    from specdec.drafters.draft_vocab import check_draft_vocab_size, save_token_counts
    from specdec.train.corpus import split_files, token_stream

    check_draft_vocab_size(draft_vocab_size, "--draft-vocab-size")
    if not Path(out).is_dir():
        raise SpecDecError(f"{str(out)!r} is not a folder")
    tokenizer = check_eos(load_tokenizer(target_dir, required=True), target_dir)
    try:
        vocab = int(AutoConfig.from_pretrained(target_dir).vocab_size)
    except (OSError, ValueError) as exc:
        raise SpecDecError(f"cannot read the target's config in {str(target_dir)!r}: {exc}") from exc
    stream = token_stream(split_files(corpus_dirs)["train"], tokenizer, cache_dir)
    save_token_counts(out, stream, vocab, draft_vocab_size)
    return len(stream)


def _check_format(head_format: str, method: str, feature_weight: float, draft_vocab_size: int) -> bool:
    """Whether ``head_format`` is the published EAGLE-3 layout (checked against the other options)."""
    from specdec.train.eagle3_format import FORMATS

    if head_format not in FORMATS:
        raise SpecDecError(f"unknown head format {head_format!r}; choose one of {', '.join(FORMATS)}")
    if head_format == "specdec":
        return False
    if method != "eagle":
        raise SpecDecError(f"--format {head_format} is an eagle option, not a {method} one")
    if feature_weight != FEATURE_WEIGHT:
        raise SpecDecError("--feature-weight does not apply to --format eagle3 (EAGLE-3 trains on the token loss)")
    if draft_vocab_size:
        raise SpecDecError("--draft-vocab-size does not apply to --format eagle3 (its head scores the whole "
                           "vocabulary)")
    return True


def _exit_layer(exit_layer: int | None, num_layers: int) -> int:
    """``exit_layer`` checked against a target of ``num_layers`` layers (None: half of them)."""
    layer = num_layers // 2 if exit_layer is None else exit_layer
    if not 1 <= layer < num_layers:
        raise SpecDecError(f"--exit-layer must be in 1..{num_layers - 1} for a target of {num_layers} layers, "
                           f"got {layer}")
    return layer


def train_heads(
    method: str,
    target_dir: str | os.PathLike[str],
    preset: HeadPreset,
    settings: TrainSettings,
    corpus_dirs: Sequence[str | os.PathLike[str]] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    acceptance_prompts: int = 32,
    acceptance_tokens: int = 64,
    exit_layer: int | None = None,
    feature_layers: Sequence[int] = (),
    feature_weight: float = FEATURE_WEIGHT,
    draft_vocab_size: int = 0,
    head_format: str = "specdec",
) -> dict[str, Any]:
    """Train ``method`` heads for the target in ``target_dir`` into ``settings.out_dir``; return the summary.
    ``exit_layer`` (early_exit): the adapter reads the output of layers ``0..L-1`` (None: half the layers).
    ``feature_layers`` (eagle): the target's hidden states fused into the layer's input (EAGLE-3);
    ``feature_weight`` (eagle): the weight of the feature regression. ``draft_vocab_size``: the folder's default
    draft vocabulary (0: the whole one), stored with the training split's token counts the folder always gets.
    ``head_format`` (eagle): ``"specdec"`` (specdec's head folder) or ``"eagle3"`` (an EAGLE-3 head in the layout
    vLLM and SGLang load, :mod:`specdec.train.eagle3_format`; ``feature_layers``: its three target layers, by
    default vLLM's)."""
    import torch

    from specdec.drafters.draft_vocab import check_draft_vocab_size, save_token_counts
    from specdec.drafters.heads.common import HeadSpec, save_heads, spec_for
    from specdec.drafters.heads.eagle import check_feature_layers
    from specdec.drafters.heads.published import aux_layer_ids
    from specdec.train.eagle3_format import Eagle3Training, save_eagle3

    if method not in HEAD_METHODS:
        raise SpecDecError(f"unknown head method {method!r}; choose one of {', '.join(HEAD_METHODS)}")
    if method != "eagle" and (feature_layers or feature_weight != FEATURE_WEIGHT):
        raise SpecDecError(f"feature layers and the feature weight are eagle options, not {method} ones")
    if not feature_weight >= 0:
        raise SpecDecError(f"the feature weight must be a non-negative number, got {feature_weight}")
    check_draft_vocab_size(draft_vocab_size, "--draft-vocab-size")
    eagle3 = _check_format(head_format, method, feature_weight, draft_vocab_size)
    settings.validate()
    target_dir = Path(target_dir)
    device = resolve_device("auto")
    target, _ = load_hf_model(target_dir, torch.float32, device)
    target.requires_grad_(False)
    tokenizer = check_eos(load_tokenizer(target_dir, required=True), target_dir)
    embed = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings().weight
    if settings.resume:
        spec = HeadSpec.load(checkpoint_dir(settings.out_dir))
    elif eagle3:
        layers = aux_layer_ids({"eagle_aux_hidden_state_layer_ids": check_feature_layers(
            list(feature_layers), target.config.num_hidden_layers)} if feature_layers else {},
            target.config.num_hidden_layers, target_dir)
        spec = spec_for(method, target_dir.name, lm_head, target.config, intermediate_size=preset.intermediate_size,
                        feature_layers=layers)
    else:
        spec = spec_for(method, target_dir.name, lm_head, target.config, num_heads=preset.num_heads,
                        intermediate_size=preset.intermediate_size,
                        exit_layer=_exit_layer(exit_layer, target.config.num_hidden_layers) if method == "early_exit"
                        else 0,
                        feature_layers=check_feature_layers(list(feature_layers), target.config.num_hidden_layers))
    context = min(preset.context, target.config.max_position_embeddings)
    train_blocks, heldout_blocks = corpus_blocks(corpus_dirs, tokenizer, context, settings.seed, cache_dir)
    save_token_counts(settings.out_dir, train_blocks.blocks, int(lm_head.shape[0]), draft_vocab_size)
    torch.manual_seed(settings.seed)
    if eagle3:
        module = Eagle3Training(spec, embed, lm_head)
    else:
        module = build_module(method, spec, embed, lm_head)
        module.config = spec  # the loop's checkpoints write it as config.json
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in target.parameters())
    print(f"{method}: {trained / 1e6:.2f}M trained parameters on a frozen {frozen / 1e6:.2f}M target, "
          f"{len(train_blocks)} train blocks of {context} tokens", flush=True)

    def save(model: nn.Module, out: Path, save_dtype: str) -> None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[save_dtype]
        if eagle3:
            save_eagle3(model, out, dtype)
        else:
            save_heads(model, spec, out, dtype)

    kind = "eagle3" if eagle3 else method
    train(module, tokenizer, lambda i: train_blocks.batch(i, settings.batch_size),
          heldout_blocks.first(settings.eval_blocks),
          lambda m, ids: head_loss(kind, m, target, ids, spec.feature_layers, feature_weight), settings,
          extra_summary={"role": method, "context": context, "target": str(target_dir),
                         "trained_parameters": trained, "autocast_target": str(autocast_dtype(device))},
          save_fn=save)
    prompts = code_prompts(acceptance_prompts, corpus_dirs, split="heldout", seed=settings.seed)
    k = spec.num_heads if method == "medusa" else 4
    measured = measure_heads(target_dir, Path(settings.out_dir), method, k, prompts, acceptance_tokens)
    print(f"held-out greedy tau {measured['heldout_tau']:.3f} at k={k}, acceptance per position "
          f"{measured['heldout_acceptance_per_position']}", flush=True)
    return update_summary(settings.out_dir, measured)
