"""What a constraint is: vLLM's ``StructuredOutputsParams`` (one of ``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), validated at construction. Compiling it needs llguidance
(:mod:`specdec.structured.grammar`); this module does not."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field, fields
from typing import Any

from specdec.errors import SpecDecError, short_repr

KINDS = ("json", "regex", "choice", "grammar", "json_object")
ANY_JSON_OBJECT = '{"type":"object"}'
# llguidance compiles a choice in time quadratic in its entries (10,000: 0.3 s; 60,000: 7 s) and panics past
# about 65,000 grammar symbols.
MAX_CHOICES = 10_000
# llguidance refuses a schema nested past about 124 levels (serde_json's limit); Python's json fails near 1,000.
MAX_SCHEMA_DEPTH = 100


def _text(value: object, name: str) -> str:
    from specdec.sampling import check_text

    if not isinstance(value, str) or not value:
        raise SpecDecError(f"structured_outputs {name!r} must be a non-empty string, got {value!r}")
    check_text(value, f"structured_outputs {name!r}")
    return value


def _depth(value: object, limit: int) -> int:
    """How deeply ``value``'s dicts and lists nest (a scalar: 0), counted without recursion and only up to
    ``limit + 1`` (deeper is not looked at): a schema can be nested far past Python's recursion limit."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if depth <= limit:
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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
            if isinstance(choice, (list, tuple)) and len(choice) > MAX_CHOICES:
                raise SpecDecError(f"structured_outputs 'choice' has {len(choice)} entries; at most {MAX_CHOICES}")
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise SpecDecError(f"structured_outputs 'choice' must be a non-empty list of non-empty strings, "
                                   f"got {short_repr(choice)}")
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
        too_deep = f"structured_outputs 'json' is nested more than {MAX_SCHEMA_DEPTH} levels deep"
        if isinstance(schema, str):
            try:
                schema = json_module.loads(schema)
            except RecursionError:
                raise SpecDecError(too_deep) from None
            except ValueError as exc:
                raise SpecDecError(f"structured_outputs 'json' is not valid JSON: {exc}") from None
        if schema is False:
            raise SpecDecError("structured_outputs 'json' is the schema false, which matches no text")
        if schema is True:  # the schema that any JSON value satisfies
            schema = {}
        if not isinstance(schema, dict):
            raise SpecDecError(f"structured_outputs 'json' must be a JSON schema (an object), got {short_repr(schema)}")
        if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise SpecDecError(too_deep)
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
