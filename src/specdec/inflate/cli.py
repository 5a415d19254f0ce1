"""``specdec inflate SRC DST --shape NAME``: build an inflated checkpoint or pair folder.

``SRC`` is a Llama/Qwen2 checkpoint folder (inflated to ``NAME``), a pair folder (``target/``,
``draft/``, ``heads/<method>/``: the target to ``NAME``, the draft to its draft shape, the heads along
with the target), or ``default`` for the embedded pair. Prints one line per model with its parameter count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec.cli_checks import check_new_folder
from specdec.errors import SpecDecError
from specdec.shapes import SHAPES, TARGET_SHAPES

DEFAULT = "default"
"""``SRC`` naming the embedded pair."""


def register(subparsers: argparse._SubParsersAction) -> None:
    shapes = "; ".join(f"{name}: {shape.description}" + (f" (draft: {shape.draft})" if shape.draft else "")
                       for name, shape in SHAPES.items())
    p = subparsers.add_parser(
        "inflate", help="inflate a checkpoint, or a pair with its heads, to a real model shape with the same logits",
        description="Zero-pad a Llama/Qwen2 checkpoint to a named shape without changing its function: the hidden "
        "width zero-padded, extra heads, MLP units and layers with zero output projections, RMSNorm weights x "
        "sqrt(d/D) and eps x d/D (docs/shapes.md). SRC: a checkpoint folder, a pair folder (target/, draft/, "
        f"heads/<method>/), or '{DEFAULT}' for the embedded pair (target to the shape, draft to the shape's draft "
        f"shape: {', '.join(TARGET_SHAPES)}). Shapes: {shapes}.",
    )
    p.add_argument("source", metavar="SRC", help=f"checkpoint folder, pair folder, or '{DEFAULT}'")
    p.add_argument("dest", metavar="DST", type=Path, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--shape", required=True, metavar="NAME", help=f"one of {', '.join(SHAPES)}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.inflate.checkpoint import inflate_checkpoint
    from specdec.inflate.pair import default_source, inflate_pair
    from specdec.shapes import get_shape

    get_shape(args.shape)
    src = default_source() if args.source == DEFAULT else Path(args.source)
    dest = Path(args.dest)
    check_new_folder(dest, "DST")
    if (src / "config.json").is_file():
        inflated = inflate_checkpoint(src, dest, args.shape)
        print(f"{dest}: {args.shape}, {inflated.num_parameters:,} parameters (inflated from {src})")
    elif (src / "target" / "config.json").is_file():
        pair = inflate_pair(src, dest, args.shape)
        print(f"{pair.target}: {pair.shape}, {pair.target_parameters:,} parameters (inflated from {src / 'target'})")
        if pair.draft_parameters:
            print(f"{pair.draft}: {pair.draft_shape}, {pair.draft_parameters:,} parameters "
                  f"(ratio {pair.target_parameters / pair.draft_parameters:.1f}:1)")
        if pair.heads.is_dir():
            print(f"{pair.heads}: {', '.join(sorted(p.name for p in pair.heads.iterdir()))}")
    else:
        raise SpecDecError(f"{str(src)!r} is neither a checkpoint folder (config.json) nor a pair folder "
                           "(target/config.json)")
    return 0
