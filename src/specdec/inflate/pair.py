"""Inflating a pair folder (``target/``, ``draft/``, ``heads/<method>/``, the layout of the embedded
pair) to a target shape and its draft shape, and the cache of inflated embedded pairs that
``specdec bench --shape`` runs on.

The cache lives in ``$SPECDEC_SHAPES_DIR`` (default ``$XDG_CACHE_HOME/specdec/shapes``, else
``~/.cache/specdec/shapes``), one folder per shape and content key (a hash of the source files and
the shapes), built once into a temporary folder and renamed into place, then reused. torch is
imported when a pair is built, so that the CLI can name the cache without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.shapes import TARGET_SHAPES, get_shape

CACHE_ENV = "SPECDEC_SHAPES_DIR"
FORMAT = 1
"""Bumped when the construction changes, so that older cached folders are rebuilt."""


@dataclass(frozen=True)
class InflatedPair:
    """The folders of an inflated pair and the parameter counts of its models."""

    root: Path
    shape: str
    draft_shape: str
    target_parameters: int
    draft_parameters: int

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def draft(self) -> Path:
        return self.root / "draft"

    @property
    def heads(self) -> Path:
        return self.root / "heads"

    def describe(self) -> str:
        """One line for reports: the shape, the parameter counts, and that the weights are inflated."""
        return (f"{self.shape}, the embedded pair inflated with zero padding (same logits): target "
                f"{_count(self.target_parameters)}, draft {_count(self.draft_parameters)} ({self.draft_shape}) "
                "parameters")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def default_source() -> Path:
    """The embedded pair's folder."""
    from specdec.assets import DEFAULT_PAIR_DIR, require_default_pair

    require_default_pair()
    return DEFAULT_PAIR_DIR


def inflate_pair(source: str | os.PathLike[str], dest: str | os.PathLike[str], shape: str) -> InflatedPair:
    """Inflate the pair folder ``source`` (``target/``, optional ``draft/``, optional ``heads/<method>/``
    trained for the target) into ``dest``: the target to ``shape``, the draft to the shape's draft shape,
    every head folder along with the target (:func:`~specdec.inflate.heads.inflate_heads`)."""
    from specdec.inflate.checkpoint import inflate_checkpoint
    from specdec.inflate.heads import inflate_heads

    src, out = Path(source), Path(dest)
    target_shape = get_shape(shape)
    if target_shape.draft is None:
        raise SpecDecError(f"shape {shape!r} is not a target shape; a pair inflates to one of "
                           f"{', '.join(TARGET_SHAPES)}")
    if not (src / "target" / "config.json").is_file():
        raise SpecDecError(f"{str(src)!r} is not a pair folder (no target/config.json)")
    target = inflate_checkpoint(src / "target", out / "target", shape)
    draft_parameters = 0
    if (src / "draft" / "config.json").is_file():
        draft_parameters = inflate_checkpoint(src / "draft", out / "draft", target_shape.draft).num_parameters
    heads = src / "heads"
    for folder in sorted(heads.iterdir()) if heads.is_dir() else ():
        if (folder / "config.json").is_file():
            inflate_heads(folder, out / "heads" / folder.name, target.layout, target.lm_head, f"target ({shape})")
    pair = InflatedPair(out, shape, target_shape.draft, target.num_parameters, draft_parameters)
    (out / "pair.json").write_text(json.dumps({k: str(v) for k, v in asdict(pair).items()}, indent=2) + "\n")
    return pair


def add_shape_flags(group: argparse._ActionsContainer, instead: str) -> None:
    """``--shape`` and ``--shape-cache`` (``specdec bench`` and ``bench-serve``): the embedded pair inflated to a
    shape, ``instead`` of what the command runs otherwise (for the help)."""
    group.add_argument("--shape", choices=list(TARGET_SHAPES), metavar="SHAPE",
                       help=f"instead of {instead}, the embedded pair and its heads inflated to a real shape with the "
                       f"same logits ({', '.join(TARGET_SHAPES)}; docs/shapes.md), built once into --shape-cache")
    group.add_argument("--shape-cache", type=Path, default=None, metavar="DIR",
                       help=f"with --shape, where inflated pairs are kept (default ${CACHE_ENV}, else "
                       "~/.cache/specdec/shapes)")


def cache_dir() -> Path:
    """Where inflated embedded pairs are kept (``$SPECDEC_SHAPES_DIR`` or the user cache)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / "shapes"


def _content_key(source: Path, shape: str) -> str:
    """A hash of every file of ``source`` (names and bytes), the shapes' dimensions and :data:`FORMAT`."""
    target = get_shape(shape)
    dims = [dataclasses.replace(s, description="") for s in (target, get_shape(target.draft or shape))]
    digest = hashlib.sha256(f"{FORMAT} {dims}".encode())
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(source)).encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def cached_pair(shape: str, cache: str | os.PathLike[str] | None = None,
                source: str | os.PathLike[str] | None = None) -> InflatedPair:
    """The embedded pair (or the pair folder ``source``) inflated to ``shape`` in ``cache`` (default
    :func:`cache_dir`): built on first use, reused while the sources and shapes are the same."""
    src = Path(source) if source is not None else default_source()
    root = Path(cache) if cache is not None else cache_dir()
    final = root / f"{shape}-{_content_key(src, shape)}"
    if not (final / "pair.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        building = root / f".{final.name}.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        print(f"specdec: inflating {src} to shape {shape} into {final} (once)", file=sys.stderr)
        try:
            inflate_pair(src, building, shape)
            shutil.rmtree(final, ignore_errors=True)
            building.rename(final)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    data = json.loads((final / "pair.json").read_text())
    return InflatedPair(final, shape, data["draft_shape"], int(data["target_parameters"]),
                        int(data["draft_parameters"]))
