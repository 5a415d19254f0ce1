"""The training loop shared by ``specdec train lm`` and ``specdec train draft``.

AdamW (betas 0.9/0.95, weight decay on matrices only), gradient accumulation, gradient clipping at
1.0, bf16 autocast on CUDA and on CPUs where a bf16 autocast matmul works (parameters stay fp32),
periodic held-out loss, checkpoints with ``--resume``, a ``training_log.jsonl`` and a final
``train_summary.json`` next to a model folder that ``AutoModelForCausalLM.from_pretrained`` loads.

Learning-rate schedule: linear warm-up over ``warmup_steps`` optimizer steps, then a cosine decay to
10 % of the peak that is driven by *progress*, the larger of ``step / max_steps`` and
``elapsed / time_budget`` (whichever limits are given). With a time budget the schedule is thus
time-based: the rate reaches its floor exactly when the budget is spent, however fast the machine
is, and needs no throughput estimate. ``elapsed`` is the wall-clock time spent in the loop (steps,
evaluations and checkpoints; not model set-up or data preparation), summed over resumed runs, so a
resumed run continues the same schedule and the same budget.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specdec.errors import SpecDecError
from specdec.tensor_files import follow_umask

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_FILE = "state.pt"
LOG_FILE = "training_log.jsonl"
SUMMARY_FILE = "train_summary.json"
MIN_LR_RATIO = 0.1
SAVE_DTYPES = ("bf16", "fp16", "fp32")

LossFn = Callable[["PreTrainedModel", "torch.Tensor"], "torch.Tensor"]
"""``loss_fn(model, input_ids)``: ``input_ids`` is ``(batch, block)`` int64; returns a scalar loss."""

BatchFn = Callable[[int], np.ndarray]
"""``batch_fn(micro_index)``: the micro-batch of that index, an int array ``(batch, block)``."""


@dataclass
class TrainSettings:
    """Optimization and bookkeeping settings of one run (the loop's share of the CLI flags)."""

    out_dir: Path
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.1
    max_steps: int | None = None
    time_budget: float | None = None
    eval_every: int = 250
    eval_blocks: int = 64
    save_every: int = 500
    log_every: int = 10
    seed: int = 0
    resume: bool = False
    save_dtype: str = "bf16"

    def validate(self) -> None:
        """Raise :class:`SpecDecError` for settings that cannot run."""
        if self.max_steps is None and self.time_budget is None:
            raise SpecDecError("give --max-steps or --time-budget (or both) so that training ends")
        positive = {
            "batch-size": self.batch_size,
            "grad-accum": self.grad_accum,
            "eval-every": self.eval_every,
            "eval-blocks": self.eval_blocks,
            "save-every": self.save_every,
            "log-every": self.log_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise SpecDecError(f"--{name} must be at least 1, got {value}")
        if self.max_steps is not None and self.max_steps < 1:
            raise SpecDecError(f"--max-steps must be at least 1, got {self.max_steps}")
        if self.time_budget is not None and not 0 < self.time_budget < math.inf:
            raise SpecDecError(f"--time-budget must be a finite positive number, got {self.time_budget}")
        if not 0 < self.lr < math.inf:
            raise SpecDecError(f"--lr must be a finite positive number, got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise SpecDecError(f"--weight-decay must be a finite non-negative number, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise SpecDecError(f"--warmup-steps must be non-negative, got {self.warmup_steps}")
        if self.save_dtype not in SAVE_DTYPES:
            raise SpecDecError(
                f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}"
            )


@dataclass
class Schedule:
    """Warm-up then progress-driven cosine decay to ``MIN_LR_RATIO`` of the peak (see module doc)."""

    warmup_steps: int
    max_steps: int | None
    time_budget: float | None

    def progress(self, step: int, elapsed: float) -> float:
        """Fraction of the run done, in ``[0, 1]``."""
        parts = [0.0]
        if self.max_steps:
            parts.append(step / self.max_steps)
        if self.time_budget:
            parts.append(elapsed / self.time_budget)
        return min(1.0, max(parts))

    def factor(self, step: int, elapsed: float) -> float:
        """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        cosine = 0.5 * (1.0 + math.cos(math.pi * self.progress(step, elapsed)))
        return warm * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """``torch.bfloat16`` when bf16 autocast works on ``device`` (tried with a tiny matmul), else ``None``."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = torch.ones(8, 8) @ torch.ones(8, 8)
    except RuntimeError:
        return None
    return torch.bfloat16 if out.dtype == torch.bfloat16 and bool((out == 8).all()) else None


def hardware_string(device: torch.device) -> str:
    """A one-line description of the machine used, e.g. ``'cpu: Intel(R) Xeon(R) ... (2 threads)'``."""
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {name} ({torch.get_num_threads()} threads)"


def _optimizer(model: PreTrainedModel, settings: TrainSettings) -> torch.optim.AdamW:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)


def checkpoint_dir(out_dir: Path) -> Path:
    """Folder of the resumable checkpoint (fp32 weights, optimizer, schedule, RNG, counters)."""
    return Path(out_dir) / CHECKPOINT_DIR


def checkpoint_config(out_dir: Path) -> Any:
    """The ``LlamaConfig`` saved with the checkpoint that ``--resume`` continues from."""
    from transformers import LlamaConfig

    folder = checkpoint_dir(out_dir)
    if not (folder / "config.json").is_file():
        raise SpecDecError(f"--resume: no checkpoint in {str(folder)!r}")
    return LlamaConfig.from_pretrained(folder)


def _save_checkpoint(
    model: PreTrainedModel, optimizer: Any, schedule: Schedule, state: dict, out: Path
) -> None:
    import torch

    folder = checkpoint_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": asdict(schedule),
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        **state,
    }
    tmp = folder / f"{CHECKPOINT_FILE}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, folder / CHECKPOINT_FILE)


def _load_checkpoint(out: Path) -> dict:
    import torch

    path = checkpoint_dir(out) / CHECKPOINT_FILE
    if not path.is_file():
        raise SpecDecError(f"--resume: no checkpoint at {str(path)!r}")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, save_dtype: str
) -> None:
    """Save ``model`` as safetensors in ``save_dtype`` (config ``dtype`` set to match) plus the tokenizer."""
    import copy

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[save_dtype]
    export = copy.deepcopy(model).to(device="cpu", dtype=dtype)
    export.config.dtype = dtype
    export.config.use_cache = True
    gen = export.generation_config
    gen.bos_token_id = export.config.bos_token_id
    gen.eos_token_id = export.config.eos_token_id
    gen.pad_token_id = export.config.pad_token_id
    export.save_pretrained(out, safe_serialization=True)
    follow_umask(out)
    tokenizer.save_pretrained(out)


def update_summary(out: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Merge ``fields`` into ``out/train_summary.json`` and return the whole summary."""
    path = Path(out) / SUMMARY_FILE
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary.update(fields)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evaluate(model: PreTrainedModel, loss_fn: LossFn, blocks: np.ndarray, batch_size: int) -> float:
    """Mean of ``loss_fn`` over ``blocks`` ``(n, block)`` in batches, in eval mode without gradients."""
    import torch

    device = next(model.parameters()).device
    amp = autocast_dtype(device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        for start in range(0, len(blocks), batch_size):
            ids = torch.from_numpy(blocks[start : start + batch_size]).to(device)
            total += float(loss_fn(model, ids)) * len(ids)
            count += len(ids)
    model.train(was_training)
    return total / max(count, 1)


def check_finite(what: str, value: float, step: int) -> None:
    """Raise :class:`SpecDecError` when the training ``value`` (a loss or gradient norm) of optimizer step
    ``step`` is NaN or infinite: the run diverged, and its weights would be worthless."""
    if not math.isfinite(value):
        raise SpecDecError(f"training diverged at step {step}: the {what} is {value} (try a lower --lr); stopped "
                           "without saving it")


def _rewrite_log(path: Path, last_step: int) -> None:
    """Drop log rows written after the checkpoint that a run resumes from."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch_fn: BatchFn,
    heldout: np.ndarray,
    loss_fn: LossFn,
    settings: TrainSettings,
    extra_summary: dict[str, Any] | None = None,
    save_fn: Callable[[Any, Path, str], None] | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place, save it to ``settings.out_dir`` and return the summary dict.

    ``save_fn(model, out_dir, save_dtype)`` saves the final model (default: :func:`save_model`, a
    transformers folder with the tokenizer); any model with a ``config`` that has ``save_pretrained``
    can be trained.

    ``batch_fn`` yields micro-batches ``(batch_size, block)``; ``heldout`` is ``(n, block)`` and its
    first ``eval_blocks`` rows are evaluated every ``eval_every`` steps and at the end. With
    ``settings.resume`` the model, optimizer, schedule, counters and RNG come from the checkpoint
    in ``out_dir``; ``model`` must then have been built from the checkpoint's config. Stops at
    ``max_steps`` or when ``time_budget`` seconds of loop time are spent, whichever is first.
    """
    import torch
    from tqdm.auto import tqdm

    settings.validate()
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    amp = autocast_dtype(device)
    optimizer = _optimizer(model, settings)
    schedule = Schedule(settings.warmup_steps, settings.max_steps, settings.time_budget)
    step, micro, tokens, elapsed_before = 0, 0, 0, 0.0
    log_path = out / LOG_FILE
    random.seed(settings.seed)
    np.random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    if settings.resume:
        ckpt = _load_checkpoint(out)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, micro, tokens, elapsed_before = ckpt["step"], ckpt["micro"], ckpt["tokens"], ckpt["elapsed"]
        random.setstate(ckpt["rng"]["python"])
        np.random.set_state(ckpt["rng"]["numpy"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if ckpt["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
        _rewrite_log(log_path, step)
    elif log_path.exists():
        log_path.unlink()
    eval_blocks = heldout[: settings.eval_blocks]
    model.train()

    start_time, start_tokens = time.perf_counter(), tokens
    last_log_time, last_log_tokens = start_time, tokens
    interval_losses: list[float] = []
    train_loss = heldout_loss = lr = float("nan")
    bar = tqdm(
        total=settings.max_steps, initial=step, desc="train", unit="step", mininterval=2.0, file=sys.stderr
    )

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - start_time

    def state() -> dict[str, Any]:
        return {"step": step, "micro": micro, "tokens": tokens, "elapsed": elapsed()}

    def write_row(lr: float, heldout: float | None) -> None:
        """Append a log row for the steps since the last one and update the progress bar."""
        nonlocal train_loss, last_log_time, last_log_tokens
        now = time.perf_counter()
        train_loss = sum(interval_losses) / len(interval_losses)
        interval_losses.clear()
        speed = (tokens - last_log_tokens) / max(now - last_log_time, 1e-9)
        last_log_time, last_log_tokens = now, tokens
        row = {
            "step": step,
            "loss": round(train_loss, 5),
            "heldout_loss": None if heldout is None else round(heldout, 5),
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": round(speed, 1),
            "elapsed_s": round(elapsed(), 2),
        }
        with log_path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{speed:.0f}", lr=f"{lr:.2e}", refresh=False)

    def done() -> bool:
        if settings.max_steps is not None and step >= settings.max_steps:
            return True
        return settings.time_budget is not None and elapsed() >= settings.time_budget

    try:
        while not done():
            lr = settings.lr * schedule.factor(step, elapsed())
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = 0.0
            for _ in range(settings.grad_accum):
                ids = torch.from_numpy(batch_fn(micro)).to(device)
                micro += 1
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    loss = loss_fn(model, ids)
                (loss / settings.grad_accum).backward()
                step_loss += float(loss.detach()) / settings.grad_accum
                tokens += ids.numel()
            check_finite("training loss", step_loss, step + 1)  # before the optimizer applies its gradients
            check_finite("gradient norm", float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), step + 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            interval_losses.append(step_loss)
            bar.update(1)

            evaluate_now = step % settings.eval_every == 0
            if evaluate_now:
                heldout_loss = evaluate(model, loss_fn, eval_blocks, settings.batch_size)
                check_finite("held-out loss", heldout_loss, step)
            if step % settings.log_every == 0 or evaluate_now:
                write_row(lr, heldout_loss if evaluate_now else None)
            if step % settings.save_every == 0:
                _save_checkpoint(model, optimizer, schedule, state(), out)
    except KeyboardInterrupt:
        _save_checkpoint(model, optimizer, schedule, state(), out)
        raise
    finally:
        bar.close()

    heldout_loss = evaluate(model, loss_fn, eval_blocks, settings.batch_size)
    check_finite("held-out loss", heldout_loss, step)
    if interval_losses:
        write_row(lr, heldout_loss)
    total_elapsed = elapsed()
    _save_checkpoint(model, optimizer, schedule, state(), out)
    if save_fn is None:
        save_model(model, tokenizer, out, settings.save_dtype)
    else:
        save_fn(model, out, settings.save_dtype)
    session_time = time.perf_counter() - start_time
    summary = {
        "steps": step,
        "tokens": tokens,
        "wall_time_s": round(total_elapsed, 2),
        "tokens_per_s": round((tokens - start_tokens) / max(session_time, 1e-9), 1),
        "hardware": hardware_string(device),
        "autocast": str(amp).removeprefix("torch.") if amp is not None else None,
        "save_dtype": settings.save_dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": round(train_loss, 5),
        "final_heldout_loss": round(heldout_loss, 5),
        "stopped_by": "max_steps"
        if settings.max_steps is not None and step >= settings.max_steps
        else "time_budget",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "command": shlex.join(sys.orig_argv),
        **(extra_summary or {}),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
