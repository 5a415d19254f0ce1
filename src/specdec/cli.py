"""The ``specdec`` command line: ``generate``, ``train``, ``bench``, ``serve``, ``bench-serve``, ``verify`` and
``inflate``.

Each sub-command lives in its own module and registers itself with :func:`build_parser`.
Any :class:`~specdec.errors.SpecDecError` (a bad input) is printed as one line and the
process exits with status 2, as argparse does for a bad flag.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from specdec.errors import SpecDecError


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors (a bad flag or value) are one line on stderr and exit status 2,
    like a :class:`SpecDecError`; its sub-command parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__
    from specdec.bench.cli import register as register_bench
    from specdec.generate_cli import register as register_generate
    from specdec.inflate.cli import register as register_inflate
    from specdec.server.cli import register as register_serve
    from specdec.server.loadgen import register as register_bench_serve
    from specdec.train.cli import register as register_train
    from specdec.verify_cli import register as register_verify

    parser = OneLineParser(
        prog="specdec", description="Lossless speculative decoding for Hugging Face causal LMs."
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_generate(sub)
    register_train(sub)
    register_bench(sub)
    register_serve(sub)
    register_bench_serve(sub)
    register_verify(sub)
    register_inflate(sub)
    return parser


LOADING_COMMANDS = ("generate", "train", "bench", "serve", "verify")
"""Commands that import torch and transformers (about ten seconds) before they can say anything else."""


def announce(argv: list[str]) -> None:
    """On a terminal, one line before the slow imports of a command that runs, so that the first seconds
    are not silent (not under a pipe, where stderr keeps its one-line errors)."""
    if argv and argv[0] in LOADING_COMMANDS and not {"-h", "--help"} & set(argv) and sys.stderr.isatty():
        print(f"specdec {argv[0]}: importing torch and transformers ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    announce(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = ["specdec", *argv]  # what a report records as its command
    try:
        return int(args.func(args) or 0)
    except SpecDecError as exc:
        message = " ".join(str(exc).split())  # one line, whatever a library's message it quotes
        print(f"specdec {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
