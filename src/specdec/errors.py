"""Errors raised by specdec for bad input.

Every user mistake (a bad parameter, a missing folder, an incompatible model) is a
``SpecDecError``, which is a ``ValueError``: the API raises it, the CLI prints its
message on one line and exits with status 2.
"""


class SpecDecError(ValueError):
    """A bad input or an unsupported model, with a message that names the problem."""
