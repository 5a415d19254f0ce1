"""vLLM's keyword names that specdec does not implement, accepted where their value changes nothing, so that code
written for vLLM runs; any other value is a :class:`SpecDecError` that names it, and an unknown name one that
suggests the closest known name (where Python raises a bare ``TypeError``).

A table maps each name to the values that change nothing here (``ANY``: every value, for a name whose setting
only tunes what specdec does another way, such as vLLM's CPU swap space)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterable
from typing import Any

from specdec.errors import SpecDecError

ANY = None
"""A table entry: every value of the name changes nothing here."""


def is_neutral(value: Any, neutrals: tuple[Any, ...] | None) -> bool:
    """Whether ``value`` is one of ``neutrals`` (a bool equals only a bool; an empty list, tuple or dict matches
    an empty container), or ``neutrals`` is :data:`ANY`."""
    if neutrals is ANY:
        return True
    return any(value is v or (type(value) is type(v) and value == v) or (
        isinstance(v, (list, dict)) and isinstance(value, (list, tuple, dict)) and not value) for v in neutrals)


def check_neutral(name: str, value: Any, neutrals: tuple[Any, ...] | None, shown: str | None = None,
                  hint: str = "") -> None:
    """A :class:`SpecDecError` when ``value`` of vLLM's ``name`` (``shown`` so in the message) is not one of its
    ``neutrals`` (see :func:`is_neutral`), naming the values accepted and ending with ``hint``."""
    if not is_neutral(value, neutrals):
        accepted = " or ".join(repr(v) for v in neutrals)
        raise SpecDecError(f"{shown or name} is not supported by specdec: only {accepted} is accepted, got "
                           f"{value!r:.80}{hint}")


def drop_neutral(owner: str, given: dict[str, Any], own: Iterable[str], table: dict[str, tuple[Any, ...] | None],
                 hints: dict[str, str] | None = None, noun: str = "argument") -> dict[str, Any]:
    """``given`` (keyword arguments of ``owner``) without the names of ``table`` at a neutral value. A name of
    ``table`` at another value is a :class:`SpecDecError` (:func:`check_neutral`, ``hints[name]`` a parenthesis
    saying what to do instead); a name neither in ``own`` nor in ``table``, one that says ``hints[name]`` (a name
    of vLLM's that means something else here) or else suggests the closest of ``own`` (``noun``: what ``owner``
    calls its names)."""
    own = list(own)
    kept = {}
    for name, value in given.items():
        if name in own:
            kept[name] = value
        elif name in table:
            check_neutral(name, value, table[name], hint=(hints or {}).get(name, ""))
        elif name in (hints or {}):
            raise SpecDecError(f"{owner} has no {noun} {name!r}{hints[name]}")
        else:
            close = difflib.get_close_matches(name, own, n=1)
            raise SpecDecError(f"{owner} has no {noun} {name!r}"
                               + (f"; did you mean {close[0]!r}?" if close else f" (its {noun}s: {', '.join(own)})"))
    return kept


@functools.cache
def _parameters(cls: type) -> tuple[list[str], list[str]]:
    """(names taken by keyword, names taken by position) of ``cls``'s constructor, read once per class."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return ([p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)],
            [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD])


class VLLMNames(type):
    """A metaclass: the class's constructor takes vLLM's names of its table ``cls.vllm_names``, a
    ``(table, hints, noun)`` (see :func:`drop_neutral`), and too many positional arguments are a
    :class:`SpecDecError` too."""

    def __call__(cls, *args, **kwargs):
        table, hints, noun = cls.vllm_names
        own, positional = _parameters(cls)
        if len(args) > len(positional):
            raise SpecDecError(f"{cls.__name__} takes at most {len(positional)} positional arguments "
                               f"({', '.join(positional)}), got {len(args)}" if positional else
                               f"{cls.__name__} takes keyword arguments only, got {len(args)} positional")
        return super().__call__(*args, **drop_neutral(cls.__name__, kwargs, own, table, hints, noun))
