"""Write the results page (``docs/results.md``), its plots and the README's results table from the
benchmark files in ``docs/results/``.

Each ``docs/results/<name>.json`` is a ``bench.json`` exactly as ``specdec bench`` writes it (its
``info.command`` is the command that made it). A file's group is its ``info.shape`` when the bench
recorded one (``specdec bench --shape 1b``), else the file name's first word when it is a group
(``1b-h100.json``), else ``embedded`` for the embedded pair. Adding a
measurement is adding a file and running this script; ``tests/test_docs.py`` fails when the page or
the README's table differs from what the files say.

    PYTHONPATH=src python3 scripts/docs_results.py            # rewrite the page, the plots and the README table
    PYTHONPATH=src python3 scripts/docs_results.py --check    # exit 1 if the page or the README table is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
GROUPS = {
    "8b": "8B shape on a GPU (the embedded pair inflated to Llama-3-8B's shape, on an H200)",
    "1b": "1B shape (the embedded pair inflated to a 1B Llama shape)",
    "embedded": "embedded pair (20M target, 3.6M draft)",
}
"""Row groups, in the order the README shows them."""
OVERALL = "overall"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def load(folder: Path = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """(name, bench JSON) of every results file, by name."""
    return [(path.stem, json.loads(path.read_text(encoding="utf-8"))) for path in sorted(folder.glob("*.json"))]


def group_of(bench: dict[str, Any], name: str = "") -> str:
    """The shape's name of ``info.shape`` when the bench recorded one (``specdec bench --shape`` writes "1b,
    the embedded pair inflated ..."), else the file name's first word when it names a group
    (``1b-h100.json``), else ``embedded`` for the embedded pair, else ``other``."""
    info = bench.get("info", {})
    if info.get("shape"):
        return str(info["shape"]).split(",", 1)[0].strip()
    prefix = name.split("-", 1)[0]
    if prefix in GROUPS:
        return prefix
    return "embedded" if "default_pair" in str(info.get("target", "")) else "other"


def anchor(name: str, label: str) -> str:
    """The id of a row on the results page (the README links to it)."""
    return re.sub(r"[^a-z0-9]+", "-", f"{name}-{label}".lower()).strip("-")


def row_label(row: dict[str, Any], bench: dict[str, Any]) -> str:
    """A summary row's label, with its batch size where the file ran several (their labels repeat)."""
    several = len(bench["settings"]["batch_sizes"]) > 1
    return f"{row['label']}, batch {row['batch_size']}" if several else row["label"]


def is_plain(row: dict[str, Any]) -> bool:
    """Whether a summary row is plain decoding's (``plain``, or ``plain det`` from ``bench --deterministic``)."""
    return row.get("method", row["label"]) == "plain"


def _auto_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Plain decoding's and every auto-k row of a file, or [] when it ran no auto k."""
    rows = overall_rows(bench)
    auto = [r for r in rows if is_plain(r) or "k=auto" in r["label"].split()]
    return auto if len(auto) > sum(map(is_plain, rows)) else []


def readme_files(files: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """What the README shows of a group's files, ``(name, bench, rows)``: plain decoding and the auto-k rows
    (the setting the README recommends) of the files that ran auto k, or, where none did, every row of every
    file. The results page has every row."""
    auto = [(name, bench, _auto_rows(bench)) for name, bench in files if _auto_rows(bench)]
    return auto or [(name, bench, overall_rows(bench)) for name, bench in files]


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def overall_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in bench["summary"] if r["category"] == OVERALL]


UNRELIABLE_SPREAD = 1.5
"""Above this spread of plain decoding's tokens/s across prompts ``specdec bench`` calls timings unreliable."""


def plain_spread(bench: dict[str, Any]) -> float | None:
    """How much plain decoding's tokens/s varied across prompts (max / min), when the bench measured it."""
    plain = next((r for r in overall_rows(bench) if is_plain(r)), None)
    return None if plain is None else plain.get("tokens_per_second_spread")


def _noise(bench: dict[str, Any]) -> str:
    spread = plain_spread(bench)
    if spread is None:
        return "plain decoding's spread across prompts not recorded"
    verdict = "noisy: a busy machine" if spread > UNRELIABLE_SPREAD else "steady"
    return f"plain decoding's tokens/s varied {spread:.1f}x across prompts ({verdict})"


def _conditions(bench: dict[str, Any]) -> list[str]:
    info, settings = bench["info"], bench["settings"]
    device = info.get("device name") or info.get("device")
    return [
        f"- timing: {_noise(bench)}; the per-prompt median speedup is the steadier figure",
        f"- command: `{info.get('command') or 'not recorded'}`",
        f"- target `{Path(str(info.get('target'))).name}`, draft `{Path(str(info.get('draft'))).name}`, "
        f"{info.get('dtype')} on {device} ({info.get('cpu threads')} threads of {info.get('cpus')} CPUs"
        f"{', ' + info['cpu features'] if info.get('cpu features') else ''}), "
        f"backend {info.get('backend')}",
        f"- workload {info.get('workload')}: {info.get('questions')} questions, {settings['max_tokens']} tokens each, "
        f"temperature {settings['temperature']}, batch sizes {settings['batch_sizes']}, seeds {settings['seeds']}, "
        f"{settings['repeats']} repeat(s), {settings['warmup']} warm-up call(s)",
        f"- specdec {info.get('specdec')}, torch {info.get('torch')}, transformers {info.get('transformers')}",
    ]


def _table(name: str, bench: dict[str, Any]) -> list[str]:
    """The results page's table of a file; a file from ``bench --deterministic both`` gets a det. cost column
    (the method's tokens/s in the default mode / in deterministic mode)."""
    costed = any(r.get("deterministic_cost") is not None for r in overall_rows(bench))
    cost = " det. cost |" if costed else ""
    rows = ["| method | batch | tokens/s | speedup vs plain |" + cost + " per-prompt median (min–max) | τ | α | c "
            "| greedy check |",
            "| --- | --- | --- | --- |" + " --- |" * costed + " --- | --- | --- | --- | --- |"]
    for r in overall_rows(bench):
        check = "–" if r["mismatches"] is None else (
            f"{r['checked'] - r['mismatches'] - (r['ties'] or 0)}/{r['checked']} equal"
            + (f", {r['ties']} ties" if r["ties"] else "")
            + (f", {r['mismatches']} MISMATCH" if r["mismatches"] else ""))
        cell = f" {_num(r.get('deterministic_cost'), 2, 'x')} |" if costed else ""
        rows.append(f"| <span id=\"{anchor(name, row_label(r, bench))}\"></span>{r['label']} | {r['batch_size']} | "
                    f"{_num(r['tokens_per_second'], 1)} | {_num(r['speedup'], 2, 'x')} |{cell} {_median(r)} | "
                    f"{_num(r['tau'])} | {_num(r['alpha'])} | {_num(r['cost_ratio'])} | {check} |")
    return rows


def _median(row: dict[str, Any]) -> str:
    if row.get("speedup_median") is None:
        return "–"
    return f"{row['speedup_median']:.2f}x ({row['speedup_min']:.2f}–{row['speedup_max']:.2f})"


def render_page(results: list[tuple[str, dict[str, Any]]]) -> str:
    out = [
        "# Results",
        "",
        "<!-- Generated by scripts/docs_results.py from docs/results/*.json; do not edit by hand. -->",
        "",
        "Every row below is read from a `specdec bench` JSON file in `docs/results/` by `scripts/docs_results.py`,",
        "and every file names the command that wrote it. Speedups are against specdec's own plain decoding in the",
        "same process, on the same prompts, methods alternating (see [methodology](benchmarking.md)); τ, α and c",
        "are defined on the [metrics page](metrics.md). Older measurements, with the code of their day, are in",
        "the [lab notes](lab-notes/index.md).",
        "",
    ]
    for group, title in [*GROUPS.items(), ("other", "other models")]:
        files = [(n, b) for n, b in results if group_of(b, n) == group]
        out += [f"## {title[0].upper()}{title[1:]}", ""]
        if not files:
            out += ["No results file in this group yet.", ""]
            continue
        for name, bench in files:
            out += [f"### `{name}.json`", "", *_conditions(bench), "", *_table(name, bench), ""]
            out += [f"![speedup of {name}](results/img/{name}-speedup.png)", ""]
    return "\n".join(out).rstrip() + "\n"


def _method(row: dict[str, Any]) -> str:
    """A README row's method: plain decoding, or the summary label without the auto-k the README's rows all
    share (``det`` marks the deterministic mode)."""
    if is_plain(row):
        return "plain decoding" + (", deterministic" if row.get("deterministic") else "")
    return " ".join(word for word in row["label"].split() if word != "k=auto")


def _column(row: dict[str, Any], bench: dict[str, Any]) -> tuple[float, int]:
    """A README column's key: (temperature, batch size)."""
    return float(bench["settings"]["temperature"]), int(row["batch_size"])


def _column_title(column: tuple[float, int]) -> str:
    temperature, batch = column
    return f"batch {batch}, " + ("greedy" if temperature == 0 else f"T = {temperature:g}")


def render_readme_table(results: list[tuple[str, dict[str, Any]]]) -> str:
    """The README's results: per shape, one table of methods (rows) by setting (columns: batch size and
    temperature), each cell a speedup linked to its results-page row. Where two files measured a method in
    one setting, the first file's figure is shown (the results page has both). The first row is plain
    decoding's tokens/s."""
    out: list[str] = []
    for group, title in GROUPS.items():
        files = [(n, b) for n, b in results if group_of(b, n) == group]
        if not files:
            out += [f"**{title}**: not measured yet (`docs/results/` has no file for it).", ""]
            continue
        cells: dict[str, dict[tuple[float, int], str]] = {}
        devices = set()
        for name, bench, rows in readme_files(files):
            info = bench["info"]
            device = info.get("device name") or f"{info.get('cpu threads')} CPU threads"
            for r in rows:
                link = f"(docs/results.md#{anchor(name, row_label(r, bench))})"
                value = (f"[{_num(r['tokens_per_second'], 1)} tok/s]{link}" if is_plain(r)
                         else f"[{_num(r['speedup'], 2, 'x')}]{link}")
                row = cells.setdefault(_method(r), {})
                if _column(r, bench) not in row:  # a cell of this file: its conditions head the table
                    row[_column(r, bench)] = value
                    devices.add(f"{info.get('dtype')}, {device}")
        columns = sorted({c for row in cells.values() for c in row})
        out += [f"**{title}**, {'; '.join(sorted(devices))}:", "",
                "| method | " + " | ".join(_column_title(c) for c in columns) + " |",
                "| --- |" + " --- |" * len(columns)]
        out += [f"| {m} | " + " | ".join(row.get(c, "–") for c in columns) + " |" for m, row in cells.items()]
        out.append("")
    return "\n".join(out).rstrip()


def readme_with_table(readme: str, table: str, results: list[tuple[str, dict[str, Any]]]) -> str:
    """The README with its results table replaced, and each method chooser cell ``<!-- speedup:LABEL -->``
    filled with that label's speedup in the last embedded-pair file that has it, linked to its row."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    readme = f"{head}{START}\n{table}\n{END}{tail}"

    def speedup(match: re.Match) -> str:
        label = match.group(1)
        for name, bench in reversed([(n, b) for n, b in results if group_of(b, n) == "embedded"]):
            row = next((r for r in overall_rows(bench) if r["label"] == label and r["speedup"] is not None), None)
            if row is not None:
                return (f"<!-- speedup:{label} --> [{_num(row['speedup'], 2, 'x')}]"
                        f"(docs/results.md#{anchor(name, label)}) ")
        return f"<!-- speedup:{label} --> not measured yet "

    return re.sub(r"<!-- speedup:(.+?) -->[^|\n]*", speedup, readme)


def plot(name: str, bench: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in overall_rows(bench) if r["speedup"] is not None]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([r["label"] for r in rows], [r["speedup"] for r in rows], color="#4a7ebb")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup vs specdec plain decoding (tokens/s ratio)")
    ax.set_title(name)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page or the README table is stale")
    options = parser.parse_args(argv)
    results = load()
    page = render_page(results)
    readme = readme_with_table(README.read_text(encoding="utf-8"), render_readme_table(results), results)
    if options.check:
        stale = [str(p) for p, text in ((PAGE, page), (README, readme)) if p.read_text(encoding="utf-8") != text]
        if stale:
            print(f"stale: {', '.join(stale)}: run scripts/docs_results.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    README.write_text(readme, encoding="utf-8")
    for name, bench in results:
        plot(name, bench, RESULTS / "img" / f"{name}-speedup.png")
    print(f"wrote {PAGE}, the README's results table and {len(results)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
