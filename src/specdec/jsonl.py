"""Reading JSONL input files (prompts, questions) with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError


def read_jsonl(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of ``path``; ``what`` names the file in errors."""
    if path.is_dir():
        raise SpecDecError(f"{what} {str(path)!r} is a directory, not a file")
    if not path.exists():
        raise SpecDecError(f"{what} {str(path)!r} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecDecError(f"{what} {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    rows = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecDecError(f"{path}:{number}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                               f"{exc.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecDecError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise SpecDecError(f"{path}:{number}: each line must be a JSON object")
        rows.append((number, row))
    if not rows:
        raise SpecDecError(f"{what} {str(path)!r} is empty")
    return rows
