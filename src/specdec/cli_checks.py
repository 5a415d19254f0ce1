"""Checks of command-line values that every command shares, made before any slow work (model loads, training,
whole benchmark runs), so that a bad value is a one-line error with exit status 2 (:class:`SpecDecError`, or
argparse's own error for :func:`number`) instead of a traceback at the end of a run.

- :func:`check_output_folder` and :func:`check_output_file`: an output path can be written (``--out``,
  ``--json``, ``DST``), tried for real: the missing folders are created and a temporary file written in the
  folder, then whatever the check created is removed again;
- :func:`check_new_folder`: an output folder that must not exist or be empty (a run never mixes its files with
  another's);
- :func:`number`: an argparse ``type`` for a finite int or float within bounds (``nan`` and ``inf``
  refused).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError

PathLike = str | os.PathLike[str]


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _probe_folder(folder: Path, given: Path) -> None:
    """Raise :class:`OSError` unless ``folder`` is (or can be made) a folder a file can be written in; folders
    made by the probe are removed again. ``given``: the path the user named (``folder`` or a file in it)."""
    missing = []
    for path in (folder, *folder.parents):
        if path.is_dir():
            break
        if path.exists():
            what = "exists and is not a folder" if path == given else f"{str(path)!r} is not a folder"
            raise NotADirectoryError(0, what)
        missing.append(path)
    created: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
        with tempfile.TemporaryFile(dir=folder):
            pass
    finally:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()


def check_output_folder(path: PathLike, flag: str) -> None:
    """Raise :class:`SpecDecError` ("cannot write --out 'x': reason") unless the folder ``path`` exists and can
    be written in, or can be created."""
    try:
        _probe_folder(Path(path), Path(path))
    except OSError as exc:
        raise SpecDecError(f"cannot write {flag} {str(path)!r}: {_reason(exc)}") from None


def check_output_file(path: PathLike, flag: str) -> None:
    """Raise :class:`SpecDecError` unless the file ``path`` can be written: an existing file opened for
    appending (not truncated), or a new one's folder writable or creatable."""
    file = Path(path)
    try:
        if file.is_dir():
            raise IsADirectoryError(0, "is a folder")
        if file.exists():
            with file.open("ab"):
                pass
        else:
            _probe_folder(file.parent, file)
    except OSError as exc:
        raise SpecDecError(f"cannot write {flag} {str(path)!r}: {_reason(exc)}") from None


def check_new_folder(path: PathLike, flag: str, hint: str = "") -> None:
    """Raise :class:`SpecDecError` unless ``path`` does not exist or is an empty folder (``hint`` is added to
    the message), then :func:`check_output_folder`."""
    folder = Path(path)
    try:
        taken = folder.exists() and (not folder.is_dir() or any(folder.iterdir()))
    except OSError as exc:
        raise SpecDecError(f"cannot write {flag} {str(path)!r}: {_reason(exc)}") from None
    if taken:
        raise SpecDecError(f"{flag} {str(path)!r} exists and is not an empty folder{hint}")
    check_output_folder(folder, flag)


def number(kind: type, low: float | None = None, high: float | None = None, note: str = "", *,
           above: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind`` (int or float) of the text, finite, at least ``low`` (greater than ``low``
    with ``above``) and at most ``high`` where given; else argparse's one-line error (exit status 2) naming the
    flag and the range (``note``: what an edge value means)."""
    if low is not None and high is not None and not above:
        bounds = [f"in {low:g}..{high:g}"]
    else:
        bounds = [f"{'>' if above else '>='} {low:g}"] if low is not None else []
        bounds += [f"<= {high:g}"] if high is not None else []
    wanted = ("a finite number " if kind is float else "") + " and ".join(bounds)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if (not math.isfinite(value) or (low is not None and (value <= low if above else value < low))
                or (high is not None and value > high)):
            raise argparse.ArgumentTypeError(f"must be {wanted.strip()}{note}, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse's messages call the type
    return parse
