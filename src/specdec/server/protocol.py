"""The OpenAI wire format: request models with their validation, error bodies, response pieces (the chat
endpoint's own request: :mod:`specdec.server.chat_request`).

Requests are validated strictly: an unknown field is named, types are not coerced (``"5"`` is
not a number), and an OpenAI field this server does not implement (``functions``, ``best_of``, ...) is refused by
name unless it has its neutral value (:data:`UNSUPPORTED`). ``null`` for an optional field
is its default, as in OpenAI's API.

Logprobs (:mod:`specdec.server.logprobs` builds the shapes): completions take ``logprobs`` (null or an
integer in 0 to :data:`~specdec.logprobs.MAX_LOGPROBS`, 20; ``false`` is null) and ``echo`` (the prompt's
text before each choice's text; with ``logprobs``, the prompt's tokens lead the logprobs, the first with null
values); chat takes ``logprobs`` (a boolean) and ``top_logprobs`` (null or ``0..20``; above 0 only with
``logprobs: true``). Both take vLLM's ``prompt_logprobs`` (``0..20``: each choice gets vLLM's
``prompt_logprobs`` list, in whole responses only, as in vLLM: a stream asking for them is a 400). A stream
with ``echo`` and ``logprobs`` starts each choice with the prompt's text and its logprobs, once they are scored.
Sampling values are checked by :class:`~specdec.sampling.SamplingParams` itself, so the server
accepts exactly what the Python API accepts. Every problem is an :class:`APIError` carrying
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

Structured output: ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"schema": ...}}``; ``{"type": "text"}`` is no constraint) and vLLM's request fields
``structured_outputs`` (its ``StructuredOutputsParams`` as an object), ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar`` become the request's
:class:`~specdec.structured.StructuredOutputsParams`; at most one of them per request.

Usage extension: every ``usage`` object also has a ``specdec`` key with the request's
speculative metrics summed over its choices (:data:`USAGE_EXTENSION`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.errors import SpecDecError
from specdec.logprobs import MAX_LOGPROBS
from specdec.metrics import RequestMetrics
from specdec.sampling import MAX_SEED, SamplingParams
from specdec.structured import StructuredOutputsParams
from specdec.structured.params import KINDS as STRUCTURED_KINDS

USAGE_EXTENSION = "specdec"
"""The key under ``usage`` that carries the speculative metrics of a response: ``num_steps``,
``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_position``,
``mean_acceptance_length`` (τ) and ``acceptance_rate`` (α)."""

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": ("",), "best_of": (1,),
    "functions": ([],), "function_call": ("none",), "store": (False,), "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
"""OpenAI (and vLLM) fields this server does not implement, with their neutral values (null is neutral
too): a neutral value is accepted and ignored, any other is refused by name. ``metadata`` (OpenAI's tags for a
stored completion) and ``user`` are accepted whatever they hold and have no effect."""


def _neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    """``value`` is None or one of ``neutrals`` (a boolean equals only a boolean: ``0`` is not ``False``)."""
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutrals)


MAX_N = 16
DESCRIPTIONS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts ('input_text' in the Responses API)",
    "input": "a string or a list of items (messages, function_call, function_call_output, reasoning)",
    "system": "a string or a list of {'type': 'text', 'text': ...} blocks",
}


class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _describe(error: dict[str, Any]) -> tuple[str, str]:
    """(param, message) of one pydantic error."""
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "extra_forbidden":
        return ".".join(loc), f"unknown field {'.'.join(loc)!r}"
    if error["type"] == "value_error":  # raised by a validator of ours: its message is complete
        return ".".join(loc), str(error["ctx"]["error"])
    path = []
    for part in loc:  # a union's failed branch names its type (``prompt.list[int]``): cut there
        if part in DESCRIPTIONS or not part.isidentifier() and not part.isdigit():
            if part in DESCRIPTIONS:
                path.append(part)
            break
        path.append(part)
    param = ".".join(path)
    leaf = path[-1] if path else ""
    if leaf in DESCRIPTIONS:
        return param, f"{param} must be {DESCRIPTIONS[leaf]}"
    return param, f"{param}: {error['msg'].lower()}, got {error['input']!r}"


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into ``model``; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        param, message = _describe(exc.errors(include_url=False)[0])
        raise APIError(400, message, param=param or None) from None


class StrictModel(BaseModel):
    """Strict validation (no unknown fields, no coercion), where ``null`` for an optional field means its default,
    as in OpenAI's API (the ``openai`` client sends ``null`` for an argument passed as ``None``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = {field.alias or name for name, field in cls.model_fields.items() if not field.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: every chunk carries the usage of its choice so far."""


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                 ("guided_grammar", "grammar"))
"""vLLM's older request fields for a constraint, and the :class:`StructuredOutputsParams` field each sets."""


class SamplingFields(StrictModel):
    """The fields both endpoints share: model, sampling (penalties and biases too), stops, ``n`` and streaming."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    thinking_token_budget: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    unsupported_here: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """The endpoint's own fields of the other endpoint, refused as :data:`UNSUPPORTED` ones are."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutrals in {**UNSUPPORTED, **cls.unsupported_here}.items():
                if name in data:
                    if not _neutral(data[name], neutrals):
                        shown = " or ".join(json.dumps(v) for v in neutrals)
                        raise APIError(400, f"{name!r} is not supported by specdec serve: only null or {shown} is "
                                            f"accepted, got {json.dumps(data[name])[:80]}", param=name)
                    data = {k: v for k, v in data.items() if k != name}
        return data

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
        """The :class:`SamplingParams` of choice number ``choice`` (a seeded request's choices use
        ``seed + choice``, so choice 0 is what the same request with ``n=1`` returns)."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be an integer in 1..{MAX_N}, got {self.n}", param="n")
        if self.seed is not None and self.seed <= MAX_SEED < self.seed + self.n - 1:
            raise APIError(400, f"seed is {self.seed} and n is {self.n}: choice i samples with seed + i, and seed + "
                                f"n - 1 must be at most 2**64-1", param="seed")
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, seed=seed, structured_outputs=self.constraint(),
                              logprobs=self.num_logprobs(), min_tokens=self.min_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              thinking_token_budget=self.thinking_token_budget,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.token_biases(),
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              prompt_logprobs=self.num_prompt_logprobs() if choice == 0 else None)

    def num_prompt_logprobs(self) -> int | None:
        """How many top tokens to report per prompt position (None: no prompt logprobs); the first choice of a
        prompt computes them for all its choices."""
        return self.prompt_logprobs

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value: int | None) -> int | None:
        return check_logprobs(value, "prompt_logprobs")

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingFields:
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs come in a whole response only, as in vLLM: send stream false",
                           param="prompt_logprobs")
        return self

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with token ids for keys: OpenAI's JSON object maps token ids, written as strings, to
        biases in [-100, 100]."""
        if self.logit_bias is None:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise APIError(400, f"logit_bias keys must be token ids (integers >= 0 written as strings), got "
                                    f"{json.dumps(key)[:40]}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                               param="logit_bias")
            biases[int(key)] = bias
        return biases

    def num_logprobs(self) -> int | None:
        """How many top tokens to report per position (None: no logprobs)."""
        return None

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, from whichever of ``response_format``,
        ``structured_outputs`` and the ``guided_*`` fields it sets (more than one is a 400). A ``structured_outputs``
        that holds only options (``disable_any_whitespace``) applies them to the constraint of another field, as
        vLLM merges them."""
        given = self.constraint_fields()
        if len(given) > 1:
            raise APIError(400, f"a request takes one structured-output constraint, got {', '.join(given)}",
                           param=given[0])
        options = self.structured_outputs if given and given[0] != "structured_outputs" else None
        if not given:
            if self.structured_outputs is None:
                return None
            given = ["structured_outputs"]  # options alone: refused below, naming the constraints it may take
        name, fmt = given[0], self.response_format
        try:
            if name == "structured_outputs":
                return StructuredOutputsParams.from_dict(self.structured_outputs)
            if name != "response_format":
                constraint = {dict(GUIDED_FIELDS)[name]: getattr(self, name)}
            elif fmt.type == "json_object":
                constraint = {"json_object": True}
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema",
                               param="response_format.json_schema")
            else:
                constraint = {"json": fmt.json_schema.schema_}
        except SpecDecError as exc:  # named by the field that carries it
            raise APIError(400, str(exc), param=name) from None
        try:
            if options is not None:  # the options alone first, so that their error names their field
                StructuredOutputsParams.from_dict({**options, "json_object": True})
        except SpecDecError as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None
        try:
            return StructuredOutputsParams.from_dict({**(options or {}), **constraint})
        except SpecDecError as exc:
            raise APIError(400, str(exc), param=name) from None

    def constraint_fields(self) -> list[str]:
        """The fields that carry a structured-output constraint (a request may set one); a ``structured_outputs``
        without a constraint kind holds options only."""
        names = ["response_format"] if self.response_format is not None and self.response_format.type != "text" else []
        carried = self.structured_outputs is not None and any(self.structured_outputs.get(k) not in (None, False)
                                                              for k in STRUCTURED_KINDS)
        return names + (["structured_outputs"] if carried else []) + [
            name for name, _ in GUIDED_FIELDS if getattr(self, name) is not None]

    def constraint_source(self) -> str | None:
        """The field a constraint that does not compile is blamed on."""
        return next(iter(self.constraint_fields()), None)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def check_logprobs(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be null or an integer in 0..{MAX_LOGPROBS}, got {value}", param=name)
    return value


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``; ``max_tokens`` defaults to 16 as in OpenAI's API."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False

    unsupported_here: ClassVar[dict[str, tuple[Any, ...]]] = {
        "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False)}

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_null(cls, value: Any) -> Any:
        """``false`` means no logprobs (clients that send the chat field's neutral value here); ``true`` is refused."""
        return None if value is False else value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        return check_logprobs(value, "logprobs")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` (the prompt's tokens lead the logprobs) as many
        as ``logprobs``."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        """Checked by hand, one pass per list: pydantic's union would validate a long list of token ids
        as strings first, building an error per item (seconds for a million ids)."""
        if isinstance(value, str) or isinstance(value, list) and (
                all(type(t) is int for t in value) or all(isinstance(t, str) for t in value)
                or all(isinstance(p, list) and all(type(t) is int for t in p) for p in value)):
            return value
        raise ValueError(f"prompt must be {DESCRIPTIONS['prompt']}")

    def prompts(self) -> list[str | dict[str, Any]]:
        """The prompts as :meth:`specdec.llm.LLM.encode_prompt` takes them."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt is an empty list", param="prompt")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, metrics: RequestMetrics | None,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage`` (with ``prompt_tokens_details.cached_tokens``, the prompt tokens read from the prefix
    cache, where ``cached_tokens`` is known) plus the :data:`USAGE_EXTENSION` speculative metrics."""
    data: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        data["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if metrics is not None:
        data[USAGE_EXTENSION] = {
            "num_steps": metrics.num_steps, "num_drafts": metrics.num_drafts,
            "num_draft_tokens": metrics.num_draft_tokens, "num_accepted_tokens": metrics.num_accepted_tokens,
            "accepted_per_position": list(metrics.accepted_per_position),
            "mean_acceptance_length": metrics.mean_acceptance_length, "acceptance_rate": metrics.acceptance_rate,
        }
    return data


def usage_parts(data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Of a :func:`usage`: its prompt tokens read from the prefix cache (0 where unknown) and its
    :data:`USAGE_EXTENSION` entry (empty without one), for an API that counts usage its own way."""
    cached = (data.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return cached, {USAGE_EXTENSION: data[USAGE_EXTENSION]} if USAGE_EXTENSION in data else {}
