"""Structured output: constraints (JSON schema, regex, choice, grammar) on what a request generates,
exact under speculation. :mod:`.params` says what a constraint is, :mod:`.grammar` compiles it with
llguidance (cached per constraint), :mod:`.state` holds one sequence's grammar state and builds the
step's token masks."""

from specdec.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
