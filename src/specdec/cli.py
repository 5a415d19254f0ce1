"""The ``specdec`` command line: ``generate``, ``train`` and ``bench``.

Each sub-command lives in its own module and registers itself with :func:`build_parser`.
Any :class:`~specdec.errors.SpecDecError` (a bad input) is printed as one line and the
process exits with status 2, as argparse does for a bad flag.
"""

from __future__ import annotations

import argparse
import sys

from specdec.errors import SpecDecError


def build_parser() -> argparse.ArgumentParser:
    from specdec.bench.cli import register as register_bench
    from specdec.generate_cli import register as register_generate
    from specdec.train.cli import register as register_train

    parser = argparse.ArgumentParser(
        prog="specdec", description="Lossless speculative decoding for Hugging Face causal LMs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_generate(sub)
    register_train(sub)
    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SpecDecError as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
