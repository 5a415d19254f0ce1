"""What the head drafters share: the head folder format, the target check, and the feature buffer.

A head folder holds ``config.json`` (:class:`HeadSpec`: the method, the shapes, and the target the
heads were trained for, by name and by a fingerprint of its output head) and ``model.safetensors``
(the trained weights only; the target's embedding and output head are never copied). Loading heads
for another target is a :class:`~specdec.errors.SpecDecError`.

The drafters read the target's *features*: its final normed hidden state (``hidden_layers = (-1,)``),
the vector its output head turns into logits; an eagle folder with ``feature_layers`` reads those
layers instead (EAGLE-3's low, mid and high features, fused by a linear layer). The engine hands them
over through
:meth:`~specdec.drafters.base.Drafter.observe_hidden`: the prompt's (all tokens but the pending one)
before ``add``, and after every step those of the verified positions (the pending token and the
accepted drafts). So a sequence always has features for every committed token but the pending one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from specdec.drafters.base import Drafter, LoadOptions, SpeculativeConfig
from specdec.drafters.draft_vocab import DraftVocab, full_logits
from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.models.cpu_linear import linear, pack_linears
from specdec.sequence import Sequence
from specdec.tensor_files import save_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEADS_DIR = Path(__file__).resolve().parents[2] / "assets" / "default_pair" / "heads"
"""The embedded target's trained heads, one folder per method."""


@dataclass
class HeadSpec:
    """``config.json`` of a head folder. ``num_heads``: Medusa heads / MTP depths (unused by eagle);
    ``intermediate_size``: MLP width of the eagle layer, of each MTP depth or of the early-exit
    adapter; ``exit_layer``: the early-exit adapter's exit layer ``L`` (it reads the output of the
    target's layers ``0..L-1``; unused by the others); ``layer``: extra Llama config fields of the
    eagle layer (heads, rope) taken from the target; ``feature_layers`` (eagle only): the target's hidden
    states fused into the eagle layer's input feature (indices into transformers' ``hidden_states``: 0
    the embeddings, ``i`` layer ``i``'s output, the layer count the final normed state), empty for the
    final normed state alone (and in folders written before the field existed)."""

    method: str
    target_name: str
    target_fingerprint: str
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    exit_layer: int = 0
    layer: dict[str, Any] = field(default_factory=dict)
    feature_layers: list[int] = field(default_factory=list)

    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        """Write ``config.json`` into ``folder`` (the training loop's checkpoints call this)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> HeadSpec:
        path = Path(folder) / CONFIG_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError) as exc:
            raise SpecDecError(f"{str(path)!r} is not a specdec head config: {exc}") from exc


def target_weights(target: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding ``[V, H]`` and output head ``[V, H]`` (fast or transformers backend)."""
    if hasattr(target, "lm_head") and hasattr(target, "embed"):
        return target.embed, target.lm_head
    model = target.model
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise SpecDecError(f"head drafters need an output head without a bias; {target.name!r} has one")
    return model.get_input_embeddings().weight, head.weight


def fingerprint(lm_head: torch.Tensor) -> str:
    """A short hash of an output head ``[V, H]`` rounded to bfloat16 (the same for any load dtype)."""
    data = lm_head.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy()
    return hashlib.sha256(str(tuple(lm_head.shape)).encode() + data.tobytes()).hexdigest()[:16]


def spec_for(method: str, target_name: str, lm_head: torch.Tensor, config: Any, **shape: Any) -> HeadSpec:
    """A :class:`HeadSpec` for heads of ``method`` trained for a target (its ``lm_head`` and transformers
    ``config``); ``shape``: ``num_heads``, ``intermediate_size``, ``exit_layer``."""
    layer = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "max_position_embeddings": config.max_position_embeddings,
             "rope_parameters": getattr(config, "rope_parameters", None)}
    return HeadSpec(method, target_name, fingerprint(lm_head), int(lm_head.shape[1]), int(lm_head.shape[0]),
                    rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6), layer=layer, **shape)


def save_heads(module: nn.Module, spec: HeadSpec, folder: str | os.PathLike[str], dtype: torch.dtype) -> None:
    """Write ``config.json`` and the trained weights of ``module`` in ``dtype`` into ``folder``."""
    state = module.trained_state() if hasattr(module, "trained_state") else module.state_dict()
    spec.save_pretrained(folder)
    save_tensors({k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}, Path(folder) / WEIGHTS_FILE)


EARLY_EXIT = "early_exit"
"""The head folder kind of layer_skip's trained early-exit adapter (``specdec train early-exit``)."""


def _user(method: str) -> str:
    """Who loads heads of ``method``, for messages."""
    return "layer_skip's early exit" if method == EARLY_EXIT else f"speculative method {method!r}"


def _train_command(method: str) -> str:
    return f"specdec train {method.replace('_', '-')}"


def resolve_folder(model: Any, method: str, lm_head: torch.Tensor, target_name: str) -> Path:
    """The head folder to load: ``model``, or with none the heads of ``method`` trained for this target
    found in ``heads/<method>`` beside the target's folder (a pair folder, as ``specdec inflate`` writes)
    or among the embedded heads."""
    if model is not None:
        folder = Path(model)
        if not (folder / CONFIG_FILE).is_file():
            raise SpecDecError(f"{_user(method)}: {str(folder)!r} is not a folder of heads (no {CONFIG_FILE})")
        return folder
    candidates = [HEADS_DIR / method]
    if Path(target_name).is_dir():  # a pair folder's layout: target/, heads/<method>/
        candidates.insert(0, Path(target_name).parent / "heads" / method)
    for folder in candidates:
        if (folder / CONFIG_FILE).is_file() and HeadSpec.load(folder).target_fingerprint == fingerprint(lm_head):
            return folder
    raise SpecDecError(f"{_user(method)} needs a 'model': a folder of heads trained for the target "
                       f"{target_name!r} (`{_train_command(method)} --target ...`); none was found in heads/{method} "
                       "beside the target's folder or among the embedded heads")


def load_spec_and_state(folder: Path, method: str, lm_head: torch.Tensor,
                        target_name: str) -> tuple[HeadSpec, dict[str, torch.Tensor]]:
    """The spec and weights of a head folder, after checking that they fit ``method`` and the target."""
    spec = HeadSpec.load(folder)
    if spec.method != method:
        raise SpecDecError(f"{str(folder)!r} holds {spec.method!r} heads, not {method!r} heads")
    if spec.target_fingerprint != fingerprint(lm_head) or spec.hidden_size != lm_head.shape[1]:
        raise SpecDecError(f"the {method} heads in {str(folder)!r} were trained for the target "
                           f"{spec.target_name!r}, not for {target_name!r} (its output head differs); "
                           f"train heads for this target with `{_train_command(method)}`")
    try:
        state = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise SpecDecError(f"cannot read the head weights in {str(folder)!r}: {exc}") from exc
    return spec, state


def load_module(module: nn.Module, state: dict[str, torch.Tensor], folder: Path, keep_plain: tuple[str, ...] = ()
                ) -> nn.Module:
    """``module`` with ``state`` loaded (the target's shared tensors excepted), in eval mode, for inference: its
    ``nn.Linear`` layers packed for the CPU's products (:func:`~specdec.models.cpu_linear.pack_linears`), but
    under the children named in ``keep_plain`` (a decoder the fast backend reads and packs itself)."""
    expected = module.trained_state() if hasattr(module, "trained_state") else module.state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in state):
        raise SpecDecError(f"the head weights in {str(folder)!r} do not match its config.json")
    module.load_state_dict(state, strict=False)
    return pack_linears(module.eval().requires_grad_(False), skip=keep_plain)


class HeadDrafter(Drafter):
    """A drafter on the target's features: loads its head folder and buffers each sequence's features
    that it has not consumed yet (``features[request_id]``, a list of ``[n, H]`` tensors)."""

    hidden_layers: ClassVar[tuple[int, ...]] = (-1,)
    optional_model: ClassVar[bool] = True
    draft_vocab = True
    #: Whether the method fuses the target layers of ``HeadSpec.feature_layers`` (else a folder with them is refused).
    fuses_features: ClassVar[bool] = False

    def __init__(self, target: CausalLM, spec: HeadSpec, module: nn.Module) -> None:
        self.target, self.spec, self.module = target, spec, module
        self.embed, self.lm_head = target_weights(target)
        self.features: dict[str, list[torch.Tensor]] = {}
        self.num_candidates = 1  # > 1: tree drafts (methods with ``tree_drafts``), set by ``from_config``
        self.vocab: DraftVocab | None = None  # a reduced draft vocabulary, set by ``from_config``

    @classmethod
    def check_config(cls, config: SpeculativeConfig) -> None:
        if config.model is not None and not isinstance(config.model, (str, os.PathLike)):
            raise SpecDecError(f"speculative method {cls.method!r} takes a folder of heads as 'model', "
                               f"got {type(config.model).__name__}")

    @classmethod
    def unavailable_without_model(cls, target) -> str | None:
        name = getattr(target.config, "_name_or_path", "") or type(target).__name__
        try:
            resolve_folder(None, cls.method, target.get_output_embeddings().weight, name)
        except SpecDecError as exc:
            return str(exc)
        return None

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: CausalLM, options: LoadOptions) -> HeadDrafter:
        from specdec.drafters.heads.published import is_published

        _, lm_head = target_weights(target)
        folder = resolve_folder(config.model, cls.method, lm_head, target.name)
        if config.num_candidates > 1 and not target.supports_tree_mask:
            raise SpecDecError(
                f"{cls.method} with num_candidates > 1 proposes trees, which need the fast backend (Llama, Qwen2, "
                f"Mistral); {target.name!r} runs on transformers' forward: use num_candidates=1")
        if is_published(folder):
            if config.draft_vocab_size:
                raise SpecDecError(f"{str(folder)!r} holds published heads, which score their own vocabulary: "
                                   "draft_vocab_size applies to heads trained by specdec")
            drafter = cls.build_published(target, folder, options)
        else:
            spec, state = load_spec_and_state(folder, cls.method, lm_head, target.name)
            if spec.feature_layers and not cls.fuses_features:
                raise SpecDecError(f"{str(folder)!r} sets feature_layers, which {cls.method} heads do not take "
                                   "(an eagle option)")
            drafter = cls.build(target, spec, state, folder, options)
            drafter.vocab = DraftVocab.load(folder, config.draft_vocab_size, lm_head)
        drafter.num_candidates = config.num_candidates
        return drafter

    @classmethod
    def build(cls, target: CausalLM, spec: HeadSpec, state: dict[str, torch.Tensor], folder: Path,
              options: LoadOptions) -> HeadDrafter:
        """The drafter with its loaded module (each method builds its own)."""
        raise NotImplementedError

    @classmethod
    def build_published(cls, target: CausalLM, folder: Path, options: LoadOptions) -> HeadDrafter:
        """The drafter of heads in a layout vLLM and SGLang load (:mod:`.published`), for the methods that
        take one."""
        raise SpecDecError(f"{str(folder)!r} is not a specdec head folder (its config.json has no target_fingerprint) "
                           f"and {cls.method} loads no published layout: use heads from `{_train_command(cls.method)}`")

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` ``[..., H]`` scored by the target's head (its draft vocabulary's rows, ``-inf`` for the
        other tokens): ``[..., V]``."""
        if self.vocab is not None:
            return full_logits(self.vocab, linear(features, self.vocab.scorer))
        return linear(features, self.lm_head if self.target.packed_head is None else self.target.packed_head)

    @property
    def num_scored(self) -> int:
        """How many tokens the drafter can propose (``V'``, or ``V`` without a draft vocabulary)."""
        return int(self.lm_head.shape[0] if self.vocab is None else self.vocab.ids.shape[0])

    def observe_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:
        """Buffers ``hidden[b]`` ``[n, len(hidden_layers), H]`` as ``[n, len(hidden_layers) * H]``."""
        for s, h in zip(seqs, hidden):
            if h.shape[0]:
                self.features.setdefault(s.request_id, []).append(h.flatten(1))

    def take_features(self, seq: Sequence) -> torch.Tensor | None:
        """The sequence's unconsumed features ``[n, len(hidden_layers) * H]`` (consumed now), or None."""
        parts = self.features.pop(seq.request_id, None)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def last_feature(self, seq: Sequence) -> torch.Tensor | None:
        """The feature ``[H]`` of the token before the pending one (kept for the next call), or None."""
        parts = self.features.get(seq.request_id)
        if not parts:
            return None
        last = parts[-1][-1]
        self.features[seq.request_id] = [last[None]]
        return last

    def add(self, seqs: list[Sequence]) -> None:
        """Nothing to do beyond the prompt features already handed over."""

    def observe(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Nothing to roll back: the verified positions' features came through ``observe_hidden``."""

    def release(self, seq: Sequence) -> None:
        self.features.pop(seq.request_id, None)
