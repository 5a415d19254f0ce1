"""Benchmark output: markdown tables, a JSON file of every raw measurement, and PNG plots.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no display), imported only
when a plot is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.bench.harness import OVERALL, REFERENCE, BenchResult, SummaryRow

NOTES = (
    "Every method generates exactly max_tokens tokens per turn: end-of-sequence is ignored "
    "(specdec `SamplingParams(ignore_eos=True)`, transformers `eos_token_id=None`), so tokens/s compare like "
    "for like.",
    "tok/s = generated tokens / wall-clock seconds of the generate calls (prefill included), summed over the "
    "category; speedup = tok/s / tok/s of specdec plain decoding on the same prompts.",
    "Methods run in one process on the same prompts, in an order that rotates per prompt, after untimed "
    "warm-up runs.",
    "τ = tokens per target step; α = accepted / drafted; c = (time_drafting / drafted tokens) / "
    "(time_target / steps) from specdec's metrics (for draft_model: one draft forward / one target "
    "verification forward), or measured directly where marked.",
    "predicted = (1 - α^(k+1)) / ((1 - α)(k c + 1)); efficiency = speedup / predicted.",
    "transformers peers expose no step metrics: τ, α and c are left blank.",
    "Greedy check: every output is compared token for token with specdec plain greedy output (mismatched / "
    "checked). In float16/bfloat16 a mismatch can come from kernel numerics flipping a near-tie; rerun in "
    "float32 or float64 to tell it from a lossy method.",
)

COLUMNS: tuple[tuple[str, Callable[[SummaryRow], str]], ...] = (
    ("tok/s", lambda r: _num(r.tokens_per_second, 1)),
    ("speedup", lambda r: _num(r.speedup, 2, "x")),
    ("τ", lambda r: _num(r.tau, 2)),
    ("α", lambda r: _num(r.alpha, 3)),
    ("c", lambda r: _num(r.cost_ratio, 3)),
    ("predicted", lambda r: _num(r.predicted_speedup, 2, "x")),
    ("efficiency", lambda r: _num(r.efficiency, 2)),
    ("mismatches", lambda r: "" if r.mismatches is None else f"{r.mismatches}/{r.checked}"),
)


def _num(value: float | None, digits: int, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def mismatch_warning(result: BenchResult) -> str | None:
    """The WARNING line naming each method whose greedy outputs differ from plain greedy decoding."""
    if not result.mismatches:
        return None
    checked = {r.label: r.checked for r in result.summary if r.category == OVERALL}
    parts = ", ".join(f"{label}: {count}/{checked[label]}" for label, count in result.mismatches.items())
    return (
        f"WARNING: greedy outputs differ from plain greedy decoding ({parts} generations); "
        "see 'matches_reference' and 'first_mismatch' in bench.json"
    )


def to_markdown(result: BenchResult) -> str:
    """The report: run description, overall table, per-category table, acceptance by draft position."""
    settings = result.settings
    head = [f"{key}: {value}" for key, value in result.info.items() if value is not None]
    head += [
        f"max tokens: {settings.max_tokens}",
        "greedy" if settings.greedy else f"temperature: {settings.temperature}",
        f"seeds: {', '.join(map(str, settings.seeds))}",
        f"repeats: {settings.repeats}",
        f"warm-up runs: {settings.warmup}",
        f"generations per method: {sum(1 for m in result.measurements if m.method == REFERENCE)}",
    ]
    if result.cost_ratios:
        head.append("c measured directly (single-token forwards) for: " + ", ".join(result.cost_ratios))
    parts = ["# specdec bench", "", " · ".join(head), ""]

    overall = [r for r in result.summary if r.category == OVERALL]
    parts += [
        "## Overall",
        "",
        markdown_table(
            ["method", *(name for name, _ in COLUMNS)],
            [[r.label, *(fmt(r) for _, fmt in COLUMNS)] for r in overall],
        ),
        "",
    ]
    per_category = [r for r in result.summary if r.category != OVERALL]
    if len({r.category for r in per_category}) > 1:
        parts += [
            "## Per category",
            "",
            markdown_table(
                ["category", "method", *(name for name, _ in COLUMNS)],
                [[r.category, r.label, *(fmt(r) for _, fmt in COLUMNS)] for r in per_category],
            ),
            "",
        ]
    with_positions = [r for r in overall if r.acceptance_per_position]
    if with_positions:
        width = max(len(r.acceptance_per_position) for r in with_positions)
        parts += [
            "## Acceptance rate by draft position (overall)",
            "",
            markdown_table(
                ["method", *(str(i + 1) for i in range(width))],
                [
                    [
                        r.label,
                        *(_num(a, 3) for a in r.acceptance_per_position),
                        *([""] * (width - len(r.acceptance_per_position))),
                    ]
                    for r in with_positions
                ],
            ),
            "",
        ]
    if result.skipped:
        parts += [
            f"Skipped {len(result.skipped)} generations whose prompt plus max tokens exceed the context "
            f"window ({settings.context_window} tokens); see 'skipped' in bench.json.",
            "",
        ]
    parts += ["## Notes", "", *(f"- {note}" for note in NOTES), ""]
    warning = mismatch_warning(result)
    if warning:
        parts += [f"**{warning}**", ""]
    return "\n".join(parts)


def to_json(result: BenchResult) -> dict[str, Any]:
    """Every raw measurement (per question, turn, method, seed, repeat) plus settings and aggregates."""
    return {
        "info": result.info,
        "settings": asdict(result.settings),
        "notes": list(NOTES),
        "methods": result.methods,
        "cost_ratios_direct": result.cost_ratios,
        "mismatches": result.mismatches,
        "summary": [asdict(r) for r in result.summary],
        "skipped": result.skipped,
        "measurements": [m.to_dict() for m in result.measurements],
    }


def plot_speedup(result: BenchResult, path: Path) -> Path | None:
    """Grouped bars: speedup over plain decoding per category (and overall), one bar per method."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    rows = [r for r in result.summary if r.method != REFERENCE]
    if not rows:
        return None
    categories = list(dict.fromkeys(r.category for r in rows))
    if len(categories) == 2 and OVERALL in categories:  # one category: "overall" would repeat it
        categories.remove(OVERALL)
    labels = list(dict.fromkeys(r.label for r in rows))
    by_key = {(r.category, r.label): r.speedup for r in rows}
    width = 0.8 / len(labels)
    palette = colormaps["tab20"]
    figure = Figure(figsize=(max(6.0, 1.2 * len(categories) + 0.25 * len(labels)) + 2.5, 4.5))
    axes = figure.subplots()
    for i, label in enumerate(labels):
        xs = [c + (i - (len(labels) - 1) / 2) * width for c in range(len(categories))]
        heights = [by_key.get((cat, label)) or 0.0 for cat in categories]
        axes.bar(xs, heights, width, label=label, color=palette(i % palette.N))
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(categories)), categories, rotation=20)
    axes.set_ylabel("speedup over specdec plain decoding")
    axes.set_title("Speedup per category")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_acceptance(result: BenchResult, path: Path) -> Path | None:
    """Acceptance rate by draft position (overall), one line per method that drafts."""
    from matplotlib.figure import Figure

    rows = [r for r in result.summary if r.category == OVERALL and r.acceptance_per_position]
    if not rows:
        return None
    figure = Figure(figsize=(6.0, 4.5))
    axes = figure.subplots()
    for r in rows:
        positions = range(1, len(r.acceptance_per_position) + 1)
        axes.plot(positions, r.acceptance_per_position, marker="o", label=r.label)
    axes.set_xticks(range(1, max(len(r.acceptance_per_position) for r in rows) + 1))
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0.0, 1.05)
    axes.set_title("Acceptance by draft position")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def write_report(result: BenchResult, out_dir: str | Path) -> dict[str, Path]:
    """Write ``bench.md``, ``bench.json``, ``speedup.png`` and ``acceptance.png`` (plots only with data);
    returns the paths written, by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"markdown": out / "bench.md", "json": out / "bench.json"}
    written["markdown"].write_text(to_markdown(result), encoding="utf-8")
    written["json"].write_text(json.dumps(to_json(result), indent=1), encoding="utf-8")
    for name, plot in (("speedup", plot_speedup), ("acceptance", plot_acceptance)):
        path = plot(result, out / f"{name}.png")
        if path is not None:
            written[name] = path
    return written
