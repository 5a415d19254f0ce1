"""Errors raised by specdec for bad input.

Every user mistake (a bad parameter, a missing folder, an incompatible model) is a
``SpecDecError``, which is a ``ValueError``: the API raises it, the CLI prints its
message on one line and exits with status 2.
"""


class SpecDecError(ValueError):
    """A bad input or an unsupported model, with a message that names the problem."""


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a refused value may be huge, or nested
    past the recursion limit)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."
