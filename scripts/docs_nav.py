"""mkdocs hook: keep the nav's entries whose page exists, and add every lab notes page.

The nav names pages that other branches add (``models.md``, ``heads.md``, ...). An entry whose file is
absent is dropped before mkdocs validates the nav, so ``mkdocs build --strict`` passes before and after
they land. Every ``lab-notes/*.md`` page is listed under "Lab notes", newest last, so a new day's notes
need no edit here. Links to a missing page still fail the strict build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAB_NOTES = "Lab notes"


def _present(item: Any, docs: Path) -> Any:
    """``item`` (a nav entry) with its absent pages removed, or None when nothing is left."""
    if isinstance(item, str):
        return item if (docs / item).is_file() else None
    if isinstance(item, dict):
        kept = {}
        for title, value in item.items():
            if title == LAB_NOTES:
                notes = sorted(p.relative_to(docs).as_posix() for p in (docs / "lab-notes").glob("*.md"))
                index = "lab-notes/index.md"
                value = [index, *(n for n in notes if n != index)] if index in notes else notes
            value = _present(value, docs)
            if value is not None:
                kept[title] = value
        return kept or None
    if isinstance(item, list):
        kept_items = [v for v in (_present(i, docs) for i in item) if v is not None]
        return kept_items or None
    return item


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    config["nav"] = _present(config["nav"], docs) or []
    return config
