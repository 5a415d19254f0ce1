"""Drafting methods, registered by name. Importing this package registers the built-in ones."""

from specdec.drafters import (  # noqa: F401  (registration)
    auto,
    cascade,
    draft_model,
    heads,
    layer_skip,
    lookahead,
    ngram,
    suffix,
)
from specdec.drafters.base import (
    DRAFTERS,
    DraftBatch,
    Drafter,
    LoadOptions,
    SpeculativeConfig,
    create_drafter,
    register_drafter,
)

__all__ = [
    "DRAFTERS", "DraftBatch", "Drafter", "LoadOptions", "SpeculativeConfig", "create_drafter", "register_drafter",
]
