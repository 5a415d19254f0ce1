"""Load a causal LM (local folder, hub id or model object) into a :class:`CachedLM` backend."""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.models.fast_llama import FastLlamaLM, unsupported_reason
from specdec.models.hf import HFCausalLM
from specdec.models.hub import check_hub_id

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}
"""Other names of :data:`DTYPES` (vLLM's and torch's)."""
BACKENDS = ("auto", "fast", "hf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

ModelSource = str | Path | PreTrainedModel


DEVICE_TYPES = ("cpu", "cuda")
"""The devices a model runs on (the fast backend's kernels, CUDA graphs and the KV pool are written for these)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU; anything else must name a usable device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SpecDecError(f"unknown device {device!r}") from exc
    if resolved.type not in DEVICE_TYPES:
        raise SpecDecError(f"device {device!r} is not supported: choose 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device {device!r} was requested but CUDA is not available")
    return resolved


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (avx512_bf16 / AMX), where bf16 forwards are fast."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def cpu_features() -> str:
    """The CPU's vector level as torch dispatches to it (``AVX2``, ``AVX512``, ...), with ``avx512_bf16`` and
    ``amx`` where present: what decides a CPU's dtype under ``"auto"`` and which kernels its products take."""
    features = [torch.backends.cpu.get_cpu_capability()]
    if cpu_has_native_bf16():
        features.append("avx512_bf16")
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if amx is not None and amx():
        features.append("amx")
    return ", ".join(features)


def resolve_dtype(dtype: str | torch.dtype, config, device: torch.device) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype on an accelerator; on CPU, bfloat16 for a bfloat16
    checkpoint when the CPU computes in bf16 natively, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise SpecDecError(f"a dtype is a name such as 'float32' or 'auto', got {dtype!r}")
    if dtype == "auto":
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = DTYPES.get(stored)
        if device.type == "cpu":
            return torch.bfloat16 if stored == torch.bfloat16 and cpu_has_native_bf16() else torch.float32
        return stored if isinstance(stored, torch.dtype) else torch.float32
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise SpecDecError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)} "
                           f"(or {', '.join(DTYPE_ALIASES)})")
    return DTYPES[name]


def _check_source(source: str | Path) -> str:
    """Return the path or id to load, after the checks that give a clear message."""
    if not isinstance(source, (str, Path)):
        raise SpecDecError(f"model must be a folder, a hub id or a loaded PreTrainedModel, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecDecError(f"model folder {str(source)!r} has no config.json")
        return str(path)
    text = str(source)
    if path.exists():
        raise SpecDecError(f"model path {text!r} is a file; pass the model's folder")
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise SpecDecError(f"model folder {text!r} does not exist")
    check_hub_id(text, "model")
    return text


def load_hf_model(source: ModelSource, dtype: str | torch.dtype, device: torch.device) -> tuple[PreTrainedModel, str]:
    """Load (or take) a ``PreTrainedModel`` in ``dtype`` on ``device``; returns it and its name."""
    if isinstance(source, PreTrainedModel):
        name = getattr(source.config, "_name_or_path", "") or type(source).__name__
        model = source.to(device=device, dtype=resolve_dtype(dtype, source.config, device))
        return model.eval(), name
    name = _check_source(source)
    try:
        config = AutoConfig.from_pretrained(name)
    except Exception as exc:  # any failure to read a config is a bad model folder
        raise SpecDecError(f"could not load the config of model {name!r}: {_one_line(exc)}") from exc
    _check_config(config, name)
    try:
        # Mismatched tensors are loaded (and refused below, named with their shapes): transformers' own error says
        # only "look at the above report", a log the CLI hides.
        model, info = AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype, config, device),
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except SpecDecError:
        raise
    except Exception as exc:  # truncated or corrupt weights raise safetensors' and torch's own types
        raise SpecDecError(f"could not load model {name!r}: {_one_line(exc)}") from exc
    mismatched = sorted(info["mismatched_keys"])
    if mismatched:
        shown = ", ".join(f"{key} {list(saved)} where config.json makes {list(wanted)}"
                          for key, saved, wanted in mismatched[:2])
        raise SpecDecError(f"the weights of model {name!r} do not match its config.json in {len(mismatched)} tensors "
                           f"({shown}{', ...' if len(mismatched) > 2 else ''})")
    missing = sorted(info["missing_keys"])
    if missing:  # transformers would initialise them at random: a model that is not the checkpoint
        raise SpecDecError(f"the weights of model {name!r} lack {len(missing)} tensors its config.json declares "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): a config that does not "
                           "match its checkpoint")
    return model.to(device).eval(), name


SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions")
"""Config fields that, where a config has them, must be positive integers."""


def _check_config(config, name: str) -> None:
    """Raise SpecDecError naming the first size field of ``config`` that is not a positive integer."""
    for key in SIZE_FIELDS:
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpecDecError(f"model {name!r}: config.json has {key}={value!r}; it must be a positive integer")


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type when it has none)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    return text[:300] or type(exc).__name__


_FAST_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The fast backends built over each loaded model, by whether they capture CUDA graphs (see
:func:`_fast_backend`); an entry goes with its model."""


def _fast_backend(model: PreTrainedModel, name: str, use_cuda_graphs: bool, deterministic: bool = False,
                  loaded_here: bool = False) -> FastLlamaLM:
    r"""The fast backend over ``model``: one per loaded model and graph setting, shared by every ``LLM``
    built over the same model object. A backend owns copies of most of its model's weights (fused q/k/v
    and gate/up, CPU-packed o and down: about the model's size again) and holds no state a forward
    changes (the KV pools, and the graphs captured over them, are each ``LLM``'s own), so ten ``LLM``\ s
    over one target (``specdec bench`` builds one per method) cost one backend, not ten. A model
    ``loaded_here`` (from a folder, for this backend alone) is consumed layer by layer as the backend reads
    it (``FastLlamaLM(consume=True)``), so that loading peaks near one copy of the weights, not two."""
    if loaded_here:
        return FastLlamaLM(model, name, use_cuda_graphs=use_cuda_graphs, deterministic=deterministic, consume=True)
    built = _FAST_BACKENDS.setdefault(model, {})
    key = (use_cuda_graphs, model.dtype, str(model.device), deterministic)
    if key not in built:
        built[key] = FastLlamaLM(model, name, use_cuda_graphs=use_cuda_graphs, deterministic=deterministic)
    return built[key]


def load_causal_lm(
    source: ModelSource, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
    backend: str = "auto", enforce_eager: bool = False, deterministic: bool = False,
) -> CausalLM:
    """Load a model and wrap it in a backend.

    ``backend``: ``"fast"`` (static-pool forward of the families in :mod:`specdec.models.families`;
    an error for other architectures), ``"hf"`` (transformers' own forward with a cropped
    ``DynamicCache``), or ``"auto"`` (fast where supported, else hf). ``enforce_eager``: no CUDA graphs (the fast
    backend captures them on CUDA by default). ``deterministic``: the fast backend's batch-invariant mode
    (:mod:`specdec.models.deterministic`; CPU only); a model the fast backend cannot run, or
    ``backend="hf"``, is then a :class:`SpecDecError` (transformers' forward is not batch-invariant).
    """
    if backend not in BACKENDS:
        raise SpecDecError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    model, name = load_hf_model(source, dtype, resolve_device(device))
    reason = unsupported_reason(model.config)
    if backend == "fast" and reason:
        raise SpecDecError(f"the fast backend cannot run {name!r}: {reason}")
    if deterministic and (backend == "hf" or reason):
        why = "backend 'hf' was chosen" if backend == "hf" else f"the fast backend cannot run it: {reason}"
        raise SpecDecError(f"deterministic mode needs the fast backend, and {name!r} would run on transformers' "
                           f"forward ({why}), whose results depend on the batch")
    if backend == "fast" or (backend == "auto" and reason is None):
        return _fast_backend(model, name, use_cuda_graphs=not enforce_eager, deterministic=deterministic,
                             loaded_here=not isinstance(source, PreTrainedModel))
    why = f"the fast backend does not run it: {reason}" if backend == "auto" else "backend 'hf' was chosen"
    return HFCausalLM(model, name, backend_reason=why)


def backend_line(lm: CausalLM) -> str:
    """One line saying which backend runs ``lm`` and why, e.g. ``backend: fast (float32)`` or
    ``backend: hf (transformers' forward, float32): the fast backend does not run it: model type ...``."""
    dtype = str(lm.dtype).removeprefix("torch.")
    if isinstance(lm, HFCausalLM):
        line = f"backend: hf (transformers' forward, {dtype})"
        if lm.replay:
            line += ", recurrent state re-fed on rollback"
        return f"{line}: {lm.backend_reason}" if lm.backend_reason else line
    return f"backend: fast ({dtype}, deterministic)" if lm.deterministic else f"backend: fast ({dtype})"


TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken")
"""File names (glob patterns) of which a folder holds at least one when it holds a tokenizer."""


def load_tokenizer(source: ModelSource, required: bool):
    """The tokenizer in ``source`` (a folder, hub id or a loaded model's folder), or None when absent and
    not ``required``; a required one raises :class:`SpecDecError` (a missing local folder named as such)."""
    if isinstance(source, PreTrainedModel):
        source = getattr(source.config, "_name_or_path", "")
        if not source or not Path(source).is_dir():
            if required:
                raise SpecDecError("a tokenizer is needed but the model object has no folder to load one from")
            return None
    if not isinstance(source, (str, Path)):
        raise SpecDecError(f"tokenizer must be a folder or a hub id, got {type(source).__name__}")
    text, folder = str(source), Path(source).expanduser()
    if folder.is_dir():
        text = str(folder)
        if not any(next(folder.glob(pattern), None) for pattern in TOKENIZER_FILES):
            # transformers builds an empty tokenizer for some model types (GPT-2, Gemma 3) from a folder without one,
            # which turned every text prompt into unknown tokens or none
            if required:
                raise SpecDecError(f"{text!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
            return None
    elif not _HUB_ID.match(text) or text.startswith((".", "~")):
        if required:
            raise SpecDecError(f"tokenizer folder {text!r} does not exist")
        return None
    else:
        check_hub_id(text, "tokenizer")
    try:
        return AutoTokenizer.from_pretrained(text)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if required:
            raise SpecDecError(f"could not load a tokenizer from {text!r}: {exc}") from exc
        return None
