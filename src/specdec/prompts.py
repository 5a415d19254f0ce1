"""Prompts as the offline API and the server take them (vLLM's forms), turned into token ids and checked
against the model: a string, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; and the model's
end-of-sequence ids."""

from __future__ import annotations

import operator
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Any

from specdec.errors import SpecDecError
from specdec.models.base import CausalLM
from specdec.sampling import SamplingParams, check_text

Prompt = str | dict[str, Any]


def encode(prompt: Prompt, tokenizer, target: CausalLM, max_model_len: int,
           model_name: str | None = None) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of ``prompt`` for ``target`` (its vocabulary, its context window) with
    ``tokenizer`` (None: only token-id prompts) and at most ``max_model_len - 1`` tokens, so that one remains for
    the output. Beside ids, ``"prompt"`` is the text shown for them (echo), not tokenized. A bad prompt is a
    :class:`SpecDecError` that names what is wrong, and the model as ``model_name`` (a server's served name, not
    the folder it loaded; None: ``target.name``)."""
    name = target.name if model_name is None else model_name
    if isinstance(prompt, dict):
        unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
        if unknown:
            raise SpecDecError(f"unknown key {unknown[0]!r} in a prompt: it takes 'prompt' (a string) or "
                               f"'prompt_token_ids' (sampling settings go in SamplingParams)")
        if "prompt_token_ids" not in prompt:  # a text prompt
            if not isinstance(prompt.get("prompt"), str):
                raise SpecDecError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
            prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise SpecDecError("empty prompt")
        if tokenizer is None:
            raise SpecDecError(f"model {name!r} has no tokenizer: pass prompts as {{'prompt_token_ids': [...]}}")
        check_text(prompt, "prompt")
        text, ids = prompt, tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        if text is not None and not isinstance(text, str):
            raise SpecDecError(f"a prompt's 'prompt' must be a string, got {type(text).__name__}")
        ids = token_ids_of(ids)
        check_length(len(ids), target, max_model_len, name)
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise SpecDecError(f"prompt_token_ids {bad[:5]} are outside the vocabulary (0..{target.vocab_size - 1})")
    else:
        raise SpecDecError(f"a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got "
                           f"{type(prompt).__name__}")
    if not ids:
        raise SpecDecError("empty prompt")
    check_length(len(ids), target, max_model_len, name)
    return text, ids


def token_ids_of(value: object) -> list[int]:
    """``prompt_token_ids`` as a list of Python ints: a list or tuple of integers (NumPy's and torch's integer
    scalars too), or a one-dimensional NumPy array or torch tensor of integers; anything else (floats, bools,
    nested lists, a tokenizer's ``BatchEncoding``) is a :class:`SpecDecError` that names what it got."""
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        hint = ": pass its ['input_ids']" if hasattr(value, "keys") and "input_ids" in value else ""
        raise SpecDecError(f"prompt_token_ids must be a list of integers, got {type(value).__name__}{hint}")
    for token in value:
        if isinstance(token, bool) or not hasattr(token, "__index__") or getattr(token, "ndim", 0) != 0:
            raise SpecDecError(f"prompt_token_ids must be a list of integers, got a list holding "
                               f"{type(token).__name__} {token!r:.40}")
    return [operator.index(token) for token in value]


def check_length(num_tokens: int, target: CausalLM, max_model_len: int, model_name: str) -> None:
    """A :class:`SpecDecError` when a prompt of ``num_tokens`` leaves no token of ``max_model_len`` for the output,
    naming the limit (``max_model_len``, or the context window of model ``model_name`` where that is the limit)."""
    if num_tokens >= max_model_len:
        limit = (f"max_model_len is {max_model_len}" if max_model_len < target.max_length
                 else f"the context window of {model_name!r} is {target.max_length} tokens")
        raise SpecDecError(
            f"prompt of {num_tokens} tokens is too long: {limit} (at least one token must remain for the output)")


def eos_token_ids(tokenizer, target: CausalLM) -> set[int]:
    """The end-of-sequence ids of the tokenizer and of the model's config (either may be an id or a list)."""
    ids: set[int] = set()
    config = getattr(target, "config", None)
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return ids


def paired(prompts: Prompt | Sequence_[Prompt], sampling_params: SamplingParams | Sequence_[SamplingParams] | None,
           check: Callable[[object], SamplingParams]) -> tuple[list[Prompt], list[SamplingParams]]:
    """``LLM.generate``'s arguments as a list of prompts (one prompt alone is a list of one) and their checked
    sampling parameters, one per prompt (``sampling_params`` one for all, or one per prompt; ``check``:
    ``LLM.check_params``)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if prompts is None or isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise SpecDecError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [check(sampling_params)] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):
        raise SpecDecError(
            f"sampling_params must be SamplingParams or a list of them, got {type(sampling_params).__name__}")
    params = [check(p) for p in sampling_params]
    if len(params) != len(prompts):
        raise SpecDecError(f"got {len(params)} sampling_params for {len(prompts)} prompts; pass one, or one per prompt")
    return prompts, params
