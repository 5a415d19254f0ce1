"""The ``specdec train`` command: ``tokenizer``, ``lm``, ``draft``, ``medusa``/``eagle``/``mtp``/``early-exit`` and
``token-counts`` sub-commands.

torch and transformers are imported inside the handlers so that the CLI starts fast.
``python -m specdec.train.cli ...`` runs the same sub-commands without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specdec.cli_checks import check_new_folder, check_output_folder, number
from specdec.errors import SpecDecError

if TYPE_CHECKING:
    from specdec.train.loop import TrainSettings
    from specdec.train.presets import ModelPreset


def _add_corpus(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus",
        nargs="+",
        metavar="DIR",
        default=None,
        help="corpus folders of text/code files (default: this Python's standard library)",
    )


def _add_model_flags(parser: argparse.ArgumentParser, default_preset: str) -> None:
    group = parser.add_argument_group("model shape (overrides win over the preset)")
    group.add_argument(
        "--preset", default=default_preset, help=f"size preset: tiny, small, base (default {default_preset})"
    )
    group.add_argument("--layers", type=int, default=None, help="number of transformer layers")
    group.add_argument("--hidden-size", type=int, default=None, help="hidden size")
    group.add_argument("--heads", type=int, default=None, help="attention heads")
    group.add_argument("--intermediate-size", type=int, default=None, help="MLP intermediate size")
    group.add_argument("--context", type=int, default=None, help="training block length in tokens")


def _add_train_flags(parser: argparse.ArgumentParser, default_lr: float) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--out", required=True, type=Path,
                       help="output model folder: new or empty (with --resume, the folder of the run to continue)")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    group.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)"
    )
    group.add_argument(
        "--lr", type=number(float, 0, above=True), default=default_lr,
        help=f"peak learning rate (default {default_lr:g})",
    )
    group.add_argument("--warmup-steps", type=int, default=200, help="linear warm-up steps (default 200)")
    group.add_argument("--weight-decay", type=number(float, 0), default=0.1, help="AdamW weight decay (default 0.1)")
    group.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    group.add_argument(
        "--time-budget",
        type=number(float, 0, above=True),
        default=None,
        metavar="SECONDS",
        help="stop and save after this many seconds in the training loop (set-up and data preparation "
        "excluded); the cosine schedule is time-based and ends with the budget",
    )
    group.add_argument(
        "--eval-every", type=int, default=250, help="held-out loss every N steps (default 250)"
    )
    group.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks evaluated (default 64)")
    group.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (default 500)")
    group.add_argument("--log-every", type=int, default=10, help="log row every N steps (default 10)")
    group.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    group.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    group.add_argument(
        "--save-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="saved weight dtype"
    )
    group.add_argument(
        "--cache-dir", type=Path, default=None, help="token cache folder (default ~/.cache/specdec)"
    )


def _settings(args: argparse.Namespace) -> TrainSettings:
    from specdec.train.loop import TrainSettings

    return TrainSettings(
        out_dir=args.out,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_steps=args.max_steps,
        time_budget=args.time_budget,
        eval_every=args.eval_every,
        eval_blocks=args.eval_blocks,
        save_every=args.save_every,
        log_every=args.log_every,
        seed=args.seed,
        resume=args.resume,
        save_dtype=args.save_dtype,
    )


def _preset(args: argparse.Namespace, role: Literal["lm", "draft"]) -> ModelPreset:
    from specdec.train.presets import resolve_preset

    return resolve_preset(
        role,
        args.preset,
        layers=args.layers,
        hidden_size=args.hidden_size,
        heads=args.heads,
        intermediate_size=args.intermediate_size,
        context=args.context,
    )


def _print_summary(summary: dict[str, Any], keys: list[str]) -> None:
    print(" ".join(f"{k}={summary[k]}" for k in keys if k in summary), flush=True)


RESUME_HINT = " (--resume continues the run saved there)"


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` of a training run, before anything slow: a new or empty folder that can be written (one
    run's files never mix with another's, as ``specdec inflate`` refuses a non-empty DST), or with
    ``--resume`` the folder of the run to continue."""
    if getattr(args, "resume", False):
        check_output_folder(args.out, "--out")
    else:
        check_new_folder(args.out, "--out", RESUME_HINT if hasattr(args, "resume") else "")


def _run_tokenizer(args: argparse.Namespace) -> int:
    from specdec.train.tokenizer import train_tokenizer

    _check_out(args)
    out = train_tokenizer(args.out, vocab_size=args.vocab_size, corpus_dirs=args.corpus)
    print(f"tokenizer saved to {out}", flush=True)
    return 0


def _run_lm(args: argparse.Namespace) -> int:
    from specdec.train.lm import train_lm

    _check_out(args)
    summary = train_lm(args.tokenizer, _preset(args, "lm"), _settings(args), args.corpus, args.cache_dir)
    _print_summary(
        summary, ["steps", "tokens", "wall_time_s", "tokens_per_s", "final_train_loss", "final_heldout_loss"]
    )
    return 0


def _run_draft(args: argparse.Namespace) -> int:
    from specdec.train.draft import DistillSettings, train_draft

    _check_out(args)
    distill = DistillSettings(
        ce_weight=args.ce_weight,
        generated_fraction=args.generated_fraction,
        generated_sequences=args.generated_sequences,
        generated_temperature=args.generated_temperature,
        acceptance_prompts=args.acceptance_prompts,
        acceptance_tokens=args.acceptance_tokens,
    )
    summary = train_draft(
        args.target,
        _preset(args, "draft"),
        _settings(args),
        distill,
        corpus_dirs=args.corpus,
        tokenizer_dir=args.tokenizer,
        cache_dir=args.cache_dir,
        draft_vocab_size=args.draft_vocab_size,
    )
    _print_summary(
        summary,
        [
            "steps",
            "tokens",
            "wall_time_s",
            "tokens_per_s",
            "final_train_loss",
            "final_heldout_loss",
            "acceptance_rate_greedy",
            "expected_chain_length_k4",
            "heldout_tau",
            "heldout_acceptance_per_position",
        ],
    )
    return 0


def _run_heads(args: argparse.Namespace) -> int:
    from specdec.train.heads import FEATURE_WEIGHT, resolve_head_preset, train_heads

    _check_out(args)
    preset = resolve_head_preset(args.preset, getattr(args, "num_heads", None), args.intermediate_size, args.context)
    summary = train_heads(args.train_command.replace("-", "_"), args.target, preset, _settings(args),
                          corpus_dirs=args.corpus, cache_dir=args.cache_dir,
                          acceptance_prompts=args.acceptance_prompts, acceptance_tokens=args.acceptance_tokens,
                          exit_layer=getattr(args, "exit_layer", None),
                          feature_layers=getattr(args, "feature_layers", None) or (),
                          feature_weight=getattr(args, "feature_weight", FEATURE_WEIGHT),
                          draft_vocab_size=args.draft_vocab_size,
                          head_format=getattr(args, "head_format", "specdec"))
    _print_summary(summary, ["steps", "tokens", "wall_time_s", "final_train_loss", "final_heldout_loss",
                             "heldout_tau", "heldout_acceptance_per_position"])
    return 0


def _run_token_counts(args: argparse.Namespace) -> int:
    from specdec.train.heads import write_token_counts

    check_output_folder(args.out, "--out")  # a model folder that exists (checked next) and can be written
    total = write_token_counts(args.target, args.out, args.corpus, args.cache_dir, args.draft_vocab_size)
    print(f"wrote the counts of {total} training tokens to {args.out}")
    return 0


def _layer_list(text: str) -> list[int]:
    """``--feature-layers``: comma-separated integers."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}") from None


EARLY_EXIT_INTERMEDIATE = 128
"""Default MLP width of an early-exit adapter (about 200K parameters on a 512-wide target)."""


def _add_draft_vocab_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab-size", type=int, default=0, metavar="N",
                        help="the folder's default draft vocabulary: draft with only the N most frequent training "
                        "tokens (speculative_config's draft_vocab_size overrides; default 0: the whole vocabulary)")


def _add_heads(sub: argparse._SubParsersAction) -> None:
    """``train medusa``, ``train eagle``, ``train mtp`` and ``train early-exit``: heads on a frozen target's
    features (early-exit: an adapter after one of its layers, for layer_skip)."""
    helps = {"medusa": "train Medusa heads on a target's last hidden state",
             "eagle": "train an EAGLE feature drafter layer for a target",
             "mtp": "train sequential multi-token-prediction modules for a target",
             "early-exit": "train an early-exit adapter (layer_skip's trained form) for a target"}
    for method, text in helps.items():
        p = sub.add_parser(method, help=text)
        _add_corpus(p)
        p.add_argument("--target", required=True, type=Path, help="target model folder (stays frozen)")
        shape = p.add_argument_group("head shape (overrides win over the preset)")
        shape.add_argument("--preset", default="base", help="heads preset: tiny, base (default base)")
        if method == "early-exit":
            shape.add_argument("--exit-layer", type=int, default=None,
                               help="the adapter reads the output of the target's layers 0..L-1 (default: half)")
            shape.add_argument("--intermediate-size", type=int, default=EARLY_EXIT_INTERMEDIATE,
                               help=f"MLP width of the adapter (default {EARLY_EXIT_INTERMEDIATE})")
        else:
            shape.add_argument("--num-heads", type=int, default=None, help="Medusa heads / MTP depths (preset: 4)")
            shape.add_argument("--intermediate-size", type=int, default=None,
                               help="MLP width of the eagle layer or of each MTP depth (preset: 1024)")
        shape.add_argument("--context", type=int, default=None, help="training block length in tokens (preset: 256)")
        if method == "eagle":
            shape.add_argument("--feature-layers", type=_layer_list, default=None, metavar="I,J,...",
                               help="EAGLE-3: fuse these hidden states of the target (0 the embeddings, i layer "
                               "i's output, -1 the final normed one), e.g. 2,3,-1 (default: the final one alone)")
            shape.add_argument("--feature-weight", type=number(float, 0), default=1.0,
                               help="weight of the feature regression next to the KL term (default 1)")
            shape.add_argument("--format", dest="head_format", choices=("specdec", "eagle3"), default="specdec",
                               help="specdec: specdec's head folder (default); eagle3: an EAGLE-3 head in the layout "
                               "vLLM and SGLang load (LlamaForCausalLMEagle3), on three target layers (default "
                               "vLLM's 2, L/2, L-3; or --feature-layers)")
        _add_train_flags(p, 1e-3)
        _add_draft_vocab_size(p)
        evaluation = p.add_argument_group("held-out measurement")
        evaluation.add_argument("--acceptance-prompts", type=int, default=32,
                                help="held-out code prompts decoded with the heads at the end (default 32)")
        evaluation.add_argument("--acceptance-tokens", type=int, default=64,
                                help="tokens generated per prompt (default 64)")
        p.set_defaults(func=_run_heads)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` command with its ``tokenizer``, ``lm`` and ``draft`` sub-commands."""
    train = subparsers.add_parser("train", help="train a tokenizer, a target LM, a draft model or heads")
    sub = train.add_subparsers(dest="train_command", required=True, metavar="WHAT")

    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus")
    _add_corpus(tok)
    tok.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (default 8192)")
    tok.add_argument("--out", required=True, type=Path, help="output tokenizer folder (new or empty)")
    tok.set_defaults(func=_run_tokenizer)

    lm = sub.add_parser("lm", help="pretrain a Llama target model on a corpus")
    _add_corpus(lm)
    lm.add_argument("--tokenizer", required=True, type=Path, help="tokenizer folder (from `train tokenizer`)")
    _add_model_flags(lm, "base")
    _add_train_flags(lm, 1e-3)
    lm.set_defaults(func=_run_lm)

    draft = sub.add_parser("draft", help="distill a small Llama draft model from a target")
    _add_corpus(draft)
    draft.add_argument("--target", required=True, type=Path, help="target model folder")
    draft.add_argument(
        "--tokenizer", type=Path, default=None,
        help="the draft's tokenizer folder (default: the target's); another tokenizer makes a draft that learns "
        "from the target's text (set --generated-fraction) and drafts through text",
    )
    _add_model_flags(draft, "base")
    _add_train_flags(draft, 2e-3)
    distill = draft.add_argument_group("distillation")
    distill.add_argument(
        "--ce-weight", type=number(float, 0, 1), default=None,
        help="weight of data cross-entropy against KL to the target (default 0.1; 1 with another tokenizer)",
    )
    distill.add_argument(
        "--generated-fraction",
        type=number(float, 0, 1),
        default=0.0,
        help="fraction of each batch taken from target-generated continuations (default 0)",
    )
    distill.add_argument(
        "--generated-sequences",
        type=int,
        default=256,
        help="target continuations generated up front (default 256)",
    )
    distill.add_argument(
        "--generated-temperature",
        type=number(float, 0),
        default=1.0,
        help="sampling temperature of those continuations; 0 means greedy (default 1.0)",
    )
    distill.add_argument(
        "--acceptance-prompts", type=int, default=64, help="held-out prompts for acceptance (default 64)"
    )
    distill.add_argument(
        "--acceptance-tokens", type=int, default=64, help="target tokens per prompt (default 64)"
    )
    _add_draft_vocab_size(distill)
    draft.set_defaults(func=_run_draft)
    _add_heads(sub)

    counts = sub.add_parser("token-counts", help="write the token counts of a head or draft model folder (its draft "
                            "vocabulary)")
    _add_corpus(counts)
    counts.add_argument("--target", required=True, type=Path, help="the target the heads were trained for")
    counts.add_argument("--out", required=True, type=Path, help="the head or draft model folder")
    counts.add_argument("--cache-dir", type=Path, default=None, help="token cache folder (default ~/.cache/specdec)")
    _add_draft_vocab_size(counts)
    counts.set_defaults(func=_run_token_counts)


def main(argv: list[str] | None = None) -> int:
    """Run ``specdec train`` sub-commands alone: ``python -m specdec.train.cli lm ...``."""
    from specdec.cli import OneLineParser

    parser = OneLineParser(prog="python -m specdec.train.cli")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    args = parser.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    try:
        return int(args.func(args) or 0)
    except SpecDecError as exc:
        print(f"specdec train: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
