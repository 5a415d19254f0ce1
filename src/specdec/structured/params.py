"""What a constraint is: vLLM's ``StructuredOutputsParams`` (one of ``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), validated at construction. Compiling it needs llguidance
(:mod:`specdec.structured.grammar`); this module does not."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field, fields
from typing import Any

from specdec.errors import SpecDecError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
ANY_JSON_OBJECT = '{"type":"object"}'


def _text(value: object, name: str) -> str:
    from specdec.sampling import check_text

    if not isinstance(value, str) or not value:
        raise SpecDecError(f"structured_outputs {name!r} must be a non-empty string, got {value!r}")
    check_text(value, f"structured_outputs {name!r}")
    return value


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names); exactly one of:

    ``json``: a JSON schema (a dict, or its JSON text) the output must be an instance of;
    ``regex``: a regular expression the whole output must match (Rust ``regex`` syntax);
    ``choice``: a list of strings, the output is one of them;
    ``grammar``: a context-free grammar in Lark or GBNF (llama.cpp) syntax, llguidance's formats;
    ``json_object=True``: any JSON object.

    ``disable_any_whitespace``: JSON outputs carry no whitespace between tokens (compact JSON). The
    output ends with the end-of-sequence token once the constraint is complete (or at ``max_tokens``,
    ``finish_reason="length"``, whether or not it is). ``key`` ``(kind, compact text, compact)``
    identifies the constraint (equal keys compile to the same grammar; a schema's key order is part of it,
    since properties are generated in that order).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    key: tuple[str, str, bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecError(f"structured_outputs {name!r} must be True or False, got {getattr(self, name)!r}")
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise SpecDecError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            text = self._schema(self.json)
        elif kind == "json_object":
            kind, text = "json", ANY_JSON_OBJECT
        elif kind == "choice":
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise SpecDecError(f"structured_outputs 'choice' must be a non-empty list of non-empty strings, "
                                   f"got {choice!r}")
            for c in choice:
                _text(c, "choice")
            object.__setattr__(self, "choice", tuple(choice))
            text = json_module.dumps(list(choice))
        else:
            text = _text(getattr(self, kind), kind)
        object.__setattr__(self, "key", (kind, text, self.disable_any_whitespace))

    @staticmethod
    def _schema(schema: object) -> str:
        """The compact JSON text of a schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json_module.loads(schema)
            except ValueError as exc:
                raise SpecDecError(f"structured_outputs 'json' is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise SpecDecError(f"structured_outputs 'json' must be a JSON schema (an object), got {schema!r}")
        try:
            # Key order is kept: llguidance generates an object's properties in the schema's order.
            return json_module.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise SpecDecError(f"structured_outputs 'json' is not a JSON value: {exc}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def from_dict(cls, data: object) -> StructuredOutputsParams:
        """Build from a plain dict (vLLM's ``structured_outputs`` request field), rejecting unknown keys."""
        if isinstance(data, StructuredOutputsParams):
            return data
        if not isinstance(data, dict):
            raise SpecDecError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecDecError(f"unknown structured_outputs keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)
