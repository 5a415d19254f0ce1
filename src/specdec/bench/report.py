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

from specdec.bench.harness import BenchResult
from specdec.bench.methods import REFERENCE
from specdec.bench.summary import OVERALL, UNRELIABLE_SPREAD, SummaryRow

NOTES = (
    "Every method generates exactly max_tokens tokens per turn: end-of-sequence is ignored "
    "(specdec `SamplingParams(ignore_eos=True)`, transformers `eos_token_id=None`), so tokens/s compare like "
    "for like.",
    "batch = prompts per generate call (the last call of a category may hold fewer). tok/s = throughput: "
    "generated tokens / wall-clock seconds of the generate calls (prefill included), summed over the category; "
    "req tok/s = mean over requests of the request's tokens / the seconds of its call; speedup = tok/s / tok/s "
    "of specdec plain decoding at the same batch size on the same prompts.",
    "transformers peers run at batch 1 only.",
    "det = the method in deterministic mode (batch-invariant kernels, `--deterministic`): its speedup and greedy "
    "check are against plain decoding in deterministic mode (plain det), where every difference is a mismatch; "
    "transformers peers always run in the default mode. det. cost (`--deterministic both`) = the method's tok/s "
    "in the default mode / its tok/s in deterministic mode, at the same batch size on the same prompts: the "
    "time the mode costs (above 1: slower).",
    "Methods run in one process on the same prompts, in an order that rotates per group of prompts, after "
    "untimed warm-up calls at each batch size.",
    "τ = tokens per target step; α = accepted / drafted; c = (time_drafting / drafted tokens) / "
    "(time_target / steps) from specdec's metrics (for draft_model: one draft forward / one target "
    "verification forward), or measured directly where marked.",
    "predicted = (1 - α^(k+1)) / ((1 - α)(k c + 1)); efficiency = speedup / predicted.",
    "inner α (cascade) = the middle model's accepted / the small model's drafted tokens (α is then the target's "
    "acceptance of the middle model's tokens); auto k = the auto-k policy's mean k over request steps, and the "
    "share of steps it drafted nothing for the request (only columns some row fills are shown).",
    "roofline (plain decoding) = bytes read per step × steps/s / bandwidth, a step emitting one token per "
    "request; bytes read per step = every weight a forward reads, as the backend stores it (the output head "
    "included; bfloat16-stored weights of a float32 model at 2 bytes) + the KV cache at "
    "batch 1 (the first prompt's length + half the output); bandwidth = measured by a read probe on the bench's "
    "threads (a GPU's spec sheet figure is listed beside it), or --bandwidth-gbs.",
    "ideal (draft equal to the target, batch 1) = (k+1) / (k + t(k+1)/t(1)), t(n) the median time of one "
    "n-token target forward.",
    "transformers peers expose no step metrics: τ, α and c are left blank.",
    "per prompt = median over prompts of (tok/s / plain decoding's tok/s on the same prompt), with the min and "
    "max; one slow call moves it less than it moves the totals.",
    "Greedy check: every output is compared token for token with specdec plain greedy output at the same batch "
    "size (mismatched / checked). At the first differing token the target's logits are recomputed: when the two "
    "tokens' logits are within 2 units in the last place of the target's dtype (half precision: kernels for "
    "different shapes round differently and flip such ties) it is a rounding tie, counted apart and not a "
    "failure; anything else is a mismatch. 'greedy_check' in bench.json has each position and logit gap.",
)

COLUMNS: tuple[tuple[str, Callable[[SummaryRow], str]], ...] = (
    ("tok/s", lambda r: _num(r.tokens_per_second, 1)),
    ("req tok/s", lambda r: _num(r.request_tokens_per_second, 1)),
    ("speedup", lambda r: _num(r.speedup, 2, "x")),
    ("det. cost", lambda r: _num(r.deterministic_cost, 2, "x")),
    ("per prompt", lambda r: "" if r.speedup_median is None else
        f"{r.speedup_median:.2f}x ({r.speedup_min:.2f}–{r.speedup_max:.2f})"),
    ("τ", lambda r: _num(r.tau, 2)),
    ("α", lambda r: _num(r.alpha, 3)),
    ("inner α", lambda r: _num(r.inner_alpha, 3)),
    ("auto k", lambda r: _k_choices(r.k_choices)),
    ("c", lambda r: _num(r.cost_ratio, 3)),
    ("predicted", lambda r: _num(r.predicted_speedup, 2, "x")),
    ("efficiency", lambda r: _num(r.efficiency, 2)),
    ("roofline", lambda r: _num(None if r.roofline is None else 100 * r.roofline, 1, "%")),
    ("ideal", lambda r: _num(r.ideal_speedup, 2, "x")),
    ("mismatches", lambda r: "" if r.mismatches is None else
        f"{r.mismatches}/{r.checked}" + (f" ({r.ties} ties)" if r.ties else "")),
)
OPTIONAL_COLUMNS = {"roofline": lambda r: r.roofline, "ideal": lambda r: r.ideal_speedup,
                    "inner α": lambda r: r.inner_alpha, "auto k": lambda r: r.k_choices,
                    "det. cost": lambda r: r.deterministic_cost}
"""Columns shown only when some row has a value."""


def _num(value: float | None, digits: int, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def _k_choices(choices: dict[int, int] | None) -> str:
    """The auto-k policy's choices of a row: mean k over request steps, and the share with speculation off."""
    steps = sum(choices.values()) if choices else 0
    if not steps:
        return ""
    mean = sum(k * n for k, n in choices.items()) / steps
    return f"{mean:.1f} ({100 * choices.get(0, 0) / steps:.0f}% off)"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def mismatch_warning(result: BenchResult) -> str | None:
    """The WARNING line naming each method whose greedy outputs differ from plain greedy decoding."""
    if not result.mismatches:
        return None
    checked = result.checked
    parts = ", ".join(f"{label}: {count}/{checked[label]}" for label, count in result.mismatches.items())
    return (
        f"WARNING: greedy outputs differ from plain greedy decoding ({parts} generations); "
        "see 'greedy_check' in bench.json"
    )


def tie_notice(result: BenchResult) -> str | None:
    """The line counting greedy differences that were rounding ties (not failures)."""
    if not result.ties:
        return None
    checked = result.checked
    parts = ", ".join(f"{label}: {count}/{checked[label]}" for label, count in result.ties.items())
    return (
        f"note: greedy outputs first differ at a rounding tie of the target's logits ({parts} generations); "
        "ties are not failures (rerun in float32 to see identical outputs); see 'greedy_check' in bench.json"
    )


def timing_warning(result: BenchResult) -> str | None:
    """A WARNING when plain decoding's per-request tok/s varies by more than UNRELIABLE_SPREAD x."""
    spreads = [(r.batch_size, r.tokens_per_second_spread) for r in result.summary
               if r.category == OVERALL and r.method == REFERENCE and r.tokens_per_second_spread]
    bad = [(b, x) for b, x in spreads if x > UNRELIABLE_SPREAD]
    if not bad:
        return None
    where = ", ".join(f"{x:.1f}x at batch {b}" for b, x in bad)
    return (
        f"WARNING: timings are unreliable: plain decoding's tok/s varies by {where} across prompts (more than "
        f"{UNRELIABLE_SPREAD}x; a busy machine or too little warm-up); prefer the per-prompt medians, or rerun "
        "with more --warmup and --repeats"
    )


REPEAT_PERIOD = 8  # a generation that repeats a run of at most this many tokens from its first quarter on ...
DEGENERATE_SHARE = 0.25  # ... in this share of plain decoding's generations or more draws a warning


def repeats_short_run(tokens: Sequence[int], max_period: int = REPEAT_PERIOD) -> bool:
    """Whether ``tokens``, from their first quarter on, repeat one run of at most ``max_period`` tokens
    (at least four times over): ``#\n#\n#\n...``, one short line again and again, one token."""
    tail = list(tokens[len(tokens) // 4 :])
    return any(len(tail) >= 4 * p and tail[p:] == tail[:-p] for p in range(1, max_period + 1))


def degenerate_warning(result: BenchResult) -> str | None:
    """A WARNING when plain decoding's output is a short repeat in ``DEGENERATE_SHARE`` of its generations
    or more: every drafter predicts a repeat almost perfectly, so such a run overstates every speedup
    (a wrong chat template once made the code model answer every prompt with ``#\n#\n...``)."""
    plains = _plain_labels(result)
    plain = [m.token_ids for m in result.measurements if m.method in plains]
    degenerate = sum(repeats_short_run(tokens) for tokens in plain)
    if not plain or degenerate < DEGENERATE_SHARE * len(plain):
        return None
    return (
        f"WARNING: plain decoding's output repeats a run of at most {REPEAT_PERIOD} tokens in {degenerate}/"
        f"{len(plain)} generations: drafters predict a repeat almost perfectly, so these speedups overstate "
        "real text; check the prompts (a chat template, a prompt that invites a loop) or the model"
    )


def _plain_labels(result: BenchResult) -> set[str]:
    """The labels of plain decoding (``plain``, and ``plain det`` in deterministic mode)."""
    return {r.label for r in result.summary if r.method == REFERENCE}


def _columns(rows: Sequence[SummaryRow]) -> list[tuple[str, Callable[[SummaryRow], str]]]:
    shown = {name for name, value in OPTIONAL_COLUMNS.items() if any(value(r) is not None for r in rows)}
    return [(name, fmt) for name, fmt in COLUMNS if name not in OPTIONAL_COLUMNS or name in shown]


def _summary_table(rows: Sequence[SummaryRow], with_category: bool) -> str:
    columns = _columns(rows)
    header = ["batch", *(["category"] if with_category else []), "method", *(name for name, _ in columns)]
    body = [
        [str(r.batch_size), *([r.category] if with_category else []), r.label, *(fmt(r) for _, fmt in columns)]
        for r in rows
    ]
    return markdown_table(header, body)


def _acceptance_table(rows: Sequence[SummaryRow]) -> str:
    width = max(len(r.acceptance_per_position) for r in rows)
    body = [
        [
            str(r.batch_size),
            r.label,
            *(_num(a, 3) for a in r.acceptance_per_position),
            *([""] * (width - len(r.acceptance_per_position))),
        ]
        for r in rows
    ]
    return markdown_table(["batch", "method", *(str(i + 1) for i in range(width))], body)


def _draft_equals_target_section(result: BenchResult) -> list[str]:
    """The engine-overhead table: per method whose draft is the target, at batch 1, the ideal ratio from
    timed target forwards against the measured speedup over plain decoding; also the ratio expected at
    the measured τ, which separates acceptance lost to rounding (bf16) from the engine's overhead."""
    seconds = result.calibration.forward_seconds
    rows = [
        r
        for r in result.summary
        if r.category == OVERALL and r.batch_size == 1 and r.label in result.calibration.ideal_ratios
    ]
    if not seconds or not rows:
        return []
    body = []
    for r in rows:
        cost = seconds[r.k + 1] / seconds[1]
        at_tau = r.tau / (r.k + cost) if r.tau else None
        body.append(
            [
                r.label,
                str(r.k),
                f"{1000 * seconds[1]:.3f}",
                f"{1000 * seconds[r.k + 1]:.3f}",
                f"{cost:.3f}",
                _num(r.ideal_speedup, 3, "x"),
                _num(r.tau, 2),
                _num(at_tau, 3, "x"),
                _num(r.speedup, 3, "x"),
                _num(r.speedup / r.ideal_speedup if r.speedup and r.ideal_speedup else None, 3),
                _num(r.speedup / at_tau if r.speedup and at_tau else None, 3),
            ]
        )
    header = ["method", "k", "t(1) ms", "t(k+1) ms", "t(k+1)/t(1)", "ideal", "τ", "ideal at τ", "measured",
              "measured / ideal", "measured / ideal at τ"]
    return [
        "## Draft equal to the target (batch 1)",
        "",
        "ideal = (k+1) / (k + t(k+1)/t(1)): k draft forwards and one (k+1)-token verification per k+1 tokens, "
        "against k+1 plain steps; ideal at τ = τ / (k + t(k+1)/t(1)), the same with the measured tokens per "
        "step (below k+1 when rounding makes the draft and the verification disagree, or max tokens cuts a "
        "request's last step); measured = tok/s over plain decoding. measured / ideal at τ is the share the "
        "engine's overhead leaves.",
        "",
        markdown_table(header, body),
        "",
    ]


def _generations(result: BenchResult) -> int:
    """Generations of one plain decoding at the first batch size (every method makes as many there)."""
    plain = min(_plain_labels(result), default=None)
    return sum(1 for m in result.measurements if m.method == plain and m.batch_size == result.settings.batch_sizes[0])


def to_markdown(result: BenchResult) -> str:
    """The report: run description, overall table, per-category table, acceptance by draft position,
    the draft-equals-target comparison when measured."""
    settings = result.settings
    head = [f"{key}: {value}" for key, value in result.info.items() if value is not None]
    head += [
        f"batch sizes: {', '.join(map(str, settings.batch_sizes))}",
        f"max tokens: {settings.max_tokens}",
        "greedy" if settings.greedy else f"temperature: {settings.temperature}",
        f"seeds: {', '.join(map(str, settings.seeds))}",
        f"repeats: {settings.repeats}",
        f"warm-up calls: {settings.warmup}",
        f"generations per method and batch size: "
        f"{_generations(result)}",
    ]
    if result.calibration.cost_ratios:
        head.append(
            "c measured directly (single-token forwards) for: " + ", ".join(result.calibration.cost_ratios)
        )
    parts = ["# specdec bench", "", " · ".join(head), ""]

    overall = [r for r in result.summary if r.category == OVERALL]
    parts += ["## Overall", "", _summary_table(overall, with_category=False), ""]
    per_category = [r for r in result.summary if r.category != OVERALL]
    if len({r.category for r in per_category}) > 1:
        parts += ["## Per category", "", _summary_table(per_category, with_category=True), ""]
    with_positions = [r for r in overall if r.acceptance_per_position]
    if with_positions:
        parts += ["## Acceptance rate by draft position (overall)", "", _acceptance_table(with_positions), ""]
    parts += _draft_equals_target_section(result)
    if result.skipped:
        parts += [
            f"Skipped {len(result.skipped)} generations whose prompt plus max tokens exceed the context "
            f"window ({settings.context_window} tokens); see 'skipped' in bench.json.",
            "",
        ]
    parts += ["## Notes", "", *(f"- {note}" for note in NOTES), ""]
    for line in (mismatch_warning(result), tie_notice(result), timing_warning(result), degenerate_warning(result)):
        if line:
            parts += [f"**{line}**", ""]
    return "\n".join(parts)


def to_json(result: BenchResult) -> dict[str, Any]:
    """Every raw measurement (per question, turn, method, batch size, seed, repeat) plus settings,
    calibration and aggregates."""
    return {
        "info": result.info,
        "settings": asdict(result.settings),
        "notes": list(NOTES),
        "methods": result.methods,
        "calibration": asdict(result.calibration),
        "mismatches": result.mismatches,
        "ties": result.ties,
        "summary": [asdict(r) for r in result.summary],
        "skipped": result.skipped,
        "measurements": [m.to_dict() for m in result.measurements],
    }


def _plot_label(result: BenchResult, row: SummaryRow) -> str:
    """The method label, with its batch size when several were swept."""
    return row.label if len(result.settings.batch_sizes) == 1 else f"{row.label} b={row.batch_size}"


def plot_speedup(result: BenchResult, path: Path) -> Path | None:
    """Grouped bars: speedup over plain decoding per category (and overall), one bar per method and batch size."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    rows = [r for r in result.summary if r.method != REFERENCE]
    if not rows:
        return None
    categories = list(dict.fromkeys(r.category for r in rows))
    if len(categories) == 2 and OVERALL in categories:  # one category: "overall" would repeat it
        categories.remove(OVERALL)
    labels = list(dict.fromkeys(_plot_label(result, r) for r in rows))
    by_key = {(r.category, _plot_label(result, r)): r.speedup for r in rows}
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
    """Acceptance rate by draft position (overall), one line per method (and batch size) that drafts."""
    from matplotlib.figure import Figure

    rows = [r for r in result.summary if r.category == OVERALL and r.acceptance_per_position]
    if not rows:
        return None
    figure = Figure(figsize=(6.0, 4.5))
    axes = figure.subplots()
    for r in rows:
        positions = range(1, len(r.acceptance_per_position) + 1)
        axes.plot(positions, r.acceptance_per_position, marker="o", label=_plot_label(result, r))
    axes.set_xticks(range(1, max(len(r.acceptance_per_position) for r in rows) + 1))
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    axes.set_ylim(0.0, 1.05)
    axes.set_title("Acceptance by draft position")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def plot_throughput(result: BenchResult, path: Path) -> Path | None:
    """Overall throughput against batch size, one line per method that ran at several batch sizes."""
    from matplotlib.figure import Figure

    rows = [r for r in result.summary if r.category == OVERALL and r.tokens_per_second]
    by_label: dict[str, list[SummaryRow]] = {}
    for r in rows:
        by_label.setdefault(r.label, []).append(r)
    lines = {label: group for label, group in by_label.items() if len(group) > 1}
    if not lines:
        return None
    figure = Figure(figsize=(6.0, 4.5))
    axes = figure.subplots()
    for label, group in lines.items():
        axes.plot([r.batch_size for r in group], [r.tokens_per_second for r in group], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size (prompts per generate call)")
    axes.set_ylabel("throughput (generated tokens/s)")
    axes.set_title("Throughput by batch size")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


PLOTS = {"speedup": plot_speedup, "acceptance": plot_acceptance, "throughput": plot_throughput}


def plotting_available() -> bool:
    """Whether matplotlib (the ``bench`` extra) can be imported."""
    from importlib.util import find_spec

    return find_spec("matplotlib") is not None


def write_report(result: BenchResult, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write ``bench.md``, ``bench.json`` and, with ``plots``, the plots of :data:`PLOTS` that have data
    (``<name>.png``); returns the paths written, by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"markdown": out / "bench.md", "json": out / "bench.json"}
    written["markdown"].write_text(to_markdown(result), encoding="utf-8")
    written["json"].write_text(json.dumps(to_json(result), indent=1), encoding="utf-8")
    for name, plot in PLOTS.items() if plots else ():
        path = plot(result, out / f"{name}.png")
        if path is not None:
            written[name] = path
    return written
