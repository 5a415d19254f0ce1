"""Reading JSON objects given by the user (JSONL files of prompts and questions, configuration flags)
with errors that name where they came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError


def json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; ``where`` (a file and line, a flag) starts the error messages."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecDecError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SpecDecError(f"{where}: JSON must be an object, got {text.strip()[:80]!r}")
    return value


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
        rows.append((number, json_object(line, f"{path}:{number}")))
    if not rows:
        raise SpecDecError(f"{what} {str(path)!r} is empty")
    return rows
