"""Reading JSONL input files (prompts, questions) with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError


def read_jsonl(path: Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of ``path``; ``what`` names the file in errors."""
    if not path.is_file():
        raise SpecDecError(f"{what} {str(path)!r} does not exist")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
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
