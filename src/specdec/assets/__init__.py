"""Files shipped inside the package: the embedded default target/draft pair."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecDecError

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_PAIR_DIR = ASSETS_DIR / "default_pair"
DEFAULT_CHAT_TEMPLATE = DEFAULT_PAIR_DIR / "chat_template.jinja"
"""A simple chat template for the embedded pair (a code model: each message becomes comment lines).
``specdec serve`` uses it for the embedded pair; it is kept out of the tokenizer's folder so that
text prompts elsewhere (``generate``, ``bench``) stay plain completions."""


def default_pair() -> tuple[Path, Path] | None:
    """Return ``(target_dir, draft_dir)`` of the embedded default pair, or None if it is not shipped."""
    target, draft = DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft"
    if (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft
    return None


def require_default_pair() -> tuple[Path, Path]:
    """:func:`default_pair`, or a :class:`SpecDecError` that says it is missing and what to pass instead."""
    pair = default_pair()
    if pair is None:
        raise SpecDecError(
            f"no --model given and the embedded default pair is missing from this install ({DEFAULT_PAIR_DIR}); "
            "pass --model (and a draft model)"
        )
    return pair
