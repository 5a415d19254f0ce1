"""Write ``docs/configuration.md``, the configuration reference, from the code itself.

Every table comes from an object the program uses: the fields of ``SpeculativeConfig`` and
``SamplingParams`` (dataclasses), the parameters of ``LLM`` (its signature), the drafter registry, and
the argparse parsers of every ``specdec`` command. ``tests/test_docs.py`` fails when the committed page
differs from what this script writes, so the reference cannot drift from the code.

    PYTHONPATH=src python3 scripts/docs_config_reference.py            # rewrite the page
    PYTHONPATH=src python3 scripts/docs_config_reference.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _cell(text: object) -> str:
    """Text for one table cell: one line, pipes escaped, reST markup as Markdown code."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", str(text))
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def _doc(obj: object) -> str:
    """The docstring of ``obj`` as Markdown paragraphs."""
    text = inspect.cleandoc(obj.__doc__ or "")
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "required"


def _dataclass_table(cls: type) -> list[str]:
    rows = ["| field | type | default |", "| --- | --- | --- |"]
    for field in dataclasses.fields(cls):
        if field.name.startswith("_") or not field.init:  # derived (``stop_strings``): not an argument
            continue
        rows.append(f"| `{field.name}` | `{_cell(field.type)}` | {_default(field)} |")
    return rows


def _signature_table(func) -> list[str]:
    rows = ["| parameter | default |", "| --- | --- |"]
    for name, param in inspect.signature(func).parameters.items():
        if name == "self":
            continue
        default = "required" if param.default is inspect.Parameter.empty else f"`{param.default!r}`"
        rows.append(f"| `{name}` | {default} |")
    return rows


def _methods_table() -> list[str]:
    from specdec.drafters import DRAFTERS

    rows = ["| method | needs | what it is |", "| --- | --- | --- |"]
    for name, drafter in DRAFTERS.items():
        needs = ("a draft `model`" if drafter.needs_model else "`candidates`" if drafter.composite
                 else "`stages`" if drafter.staged else "optional `model` (a trained folder)" if drafter.optional_model
                 else "nothing")
        rows.append(f"| `{name}` | {needs} | {_cell(drafter.description)} |")
    return rows


def _flags_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue  # a hidden flag is one the command refuses
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or default == [] else f"`{default!r}`"
        help_text = action.help or ""
        if "default" in help_text or "$" in help_text:  # the help says it (an environment default is not shown)
            shown = ""
        if action.choices is not None and "%(choices)s" in help_text:
            help_text = help_text.replace("%(choices)s", ", ".join(action.choices))
        help_text = help_text.replace("%(default)s", str(default))
        rows.append(f"| {names} | {_cell(shown)} | {_cell(help_text)} |")
    return rows


def _prometheus_table() -> list[str]:
    """The server's Prometheus collectors, read from a fresh registry with an engine's collectors registered as
    ``specdec serve`` registers them (over an empty pool and scheduler; process collectors left out)."""
    from types import SimpleNamespace

    from specdec.engine_metrics import Latencies
    from specdec.metrics import BatchMetrics
    from specdec.server.metrics import ServerMetrics

    metrics = ServerMetrics("model")
    empty_pool = SimpleNamespace(num_used_blocks=0, num_blocks=0, block_size=16, prefix_cache_counts=lambda: (0, 0))
    metrics.watch_engine(BatchMetrics(), empty_pool, SimpleNamespace(num_preemptions=0, num_running=0, waiting=()),
                         Latencies())
    rows = ["| name | type | meaning |", "| --- | --- | --- |"]
    for family in metrics.registry.collect():
        if family.name.startswith("process_"):
            continue
        name = f"{family.name}_total" if family.type == "counter" else family.name
        rows.append(f"| `{name}` | {family.type} | {_cell(family.documentation)} |")
    return rows


def _commands() -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each ``specdec`` command's parser and its one-line help."""
    from specdec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    return {name: (command, helps.get(name, "")) for name, command in sub.choices.items()}


def render() -> str:
    from specdec.drafters.base import SpeculativeConfig
    from specdec.llm import LLM
    from specdec.sampling import SamplingParams

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/docs_config_reference.py from the code; do not edit by hand. -->",
        "",
        "Every table on this page is read from the code (dataclass fields, signatures, the drafter registry,",
        "the command line parsers) by `scripts/docs_config_reference.py`; a test fails when the page and the",
        "code differ. The [methods guide](methods.md) says when to use which method.",
        "",
        "## Methods (the drafter registry)",
        "",
        *_methods_table(),
        "",
        "## `speculative_config` (`SpeculativeConfig`)",
        "",
        "The same fields in the Python API (`LLM(..., speculative_config={...})`), in "
        "`--speculative-config JSON` on every command, and in `bench --method-config NAME=JSON`.",
        "",
        *_dataclass_table(SpeculativeConfig),
        "",
        _doc(SpeculativeConfig),
        "",
        "## `LLM(...)`",
        "",
        *_signature_table(LLM.__init__),
        "",
        _doc(LLM),
        "",
        "## `SamplingParams`",
        "",
        *_dataclass_table(SamplingParams),
        "",
        _doc(SamplingParams),
        "",
        "## Prometheus metrics (`specdec serve`, `GET /metrics`)",
        "",
        "vLLM's names where vLLM has the metric (so its dashboards work), `specdec:` for specdec's own; every",
        "series carries a `model_name` label. The [metrics page](metrics.md) relates them to τ, α and c.",
        "`LLM.get_metrics()` returns the engine's own (from `vllm:num_requests_running` to",
        "`specdec:spec_decode_speculation_off_steps`) as vLLM's does, without a counter's `_total`",
        "([Python API](python-api.md)); the rest are the server's.",
        "",
        *_prometheus_table(),
        "",
        "## Command line",
        "",
        "The speculative flags have the same names in every command: vLLM's (`--speculative-model`, "
        "`--speculative-dtype`, `--num-speculative-tokens`, `--speculative-method`, `--speculative-config`) "
        "and the short aliases `--draft-model`, `--draft-dtype`, `--k`. `--num-speculative-tokens auto` works "
        "wherever k is taken.",
        "",
    ]
    for name, (parser, summary) in _commands().items():
        out += _command_section(f"specdec {name}", parser, "###", summary)
    return "\n".join(out).rstrip() + "\n"


def _command_section(name: str, parser: argparse.ArgumentParser, heading: str, summary: str = "") -> list[str]:
    """A command's description (or its one-line ``summary``) and flags, then each of its subcommands'
    (``specdec train lm``) a level down."""
    out = [f"{heading} `{name}`", "", _cell(parser.description or summary), ""]
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if flags or not subcommands:
        out += [*_flags_table(parser), ""]
    for action in subcommands:
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for sub, subparser in action.choices.items():
            out += _command_section(f"{name} {sub}", subparser, heading + "#", helps.get(sub, ""))
    return out


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 when the committed page is stale")
    options = args.parse_args(argv)
    text = render()
    if options.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is stale: run scripts/docs_config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
