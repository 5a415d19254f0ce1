"""The prefill pacer of this checkout against the one of an earlier commit, interleaved: every method of
``bench-serve --in-process``'s workloads (default: code) runs under both pacers in each round (the order reversed every
other round), and the ratios to plain decoding are taken within a round under the same pacer (the flood's
p99 ITL against the same method without the flood, ``itl_p99_vs_baseline``, in the JSON). A benchmark,
not a test: ``docs/lab-notes/2026-11-28-pacer-fit.md`` used it with the default baseline (the pacer that priced a
prompt token against the mean step without prompts).

    python scripts/pacer_fit_ab.py --concurrency 16 64 --rounds 3 --json pacer_ab.json
    python scripts/pacer_fit_ab.py --shape 1b --shape-cache /tmp/inflate_1b --methods plain,draft_model,eagle \
        --concurrency 16 --num-requests 32 --max-step-time-ratio 1.25 --rounds 2

Flags other than this script's own go to ``bench-serve`` (its defaults otherwise, e.g. 1, 4, 16 and 64 streams).
The baseline's module is read with ``git show REV:src/specdec/prefill_pacer.py`` (so the repository's history
must be there) and given the scheduler's current ``observe(tokens, decoding, seconds, drafting, drafted)``.
"""

from __future__ import annotations

import subprocess
import types
from pathlib import Path

from specdec import scheduler as scheduler_module
from specdec.bench import interleaved

ROOT = Path(__file__).resolve().parents[1]


def baseline_pacer(rev: str) -> type:
    """The ``PrefillPacer`` of commit ``rev``, taking (and ignoring, if it predates them) the decoding tokens, the
    drafting seconds and the drafts verified."""
    source = subprocess.run(["git", "show", f"{rev}:src/specdec/prefill_pacer.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"prefill_pacer_{rev}")
    exec(compile(source, module.__name__, "exec"), module.__dict__)  # noqa: S102 - the repository's own history
    pacer = module.PrefillPacer
    takes = pacer.observe.__code__.co_varnames[1:pacer.observe.__code__.co_argcount]  # after self

    class Baseline(pacer):
        def observe(self, tokens: int, decoding: int, seconds: float, drafting: float = 0.0, drafted: int = 0) -> None:
            given = {"tokens": tokens, "decoding": decoding, "seconds": seconds, "drafting": drafting,
                     "drafted": drafted}
            super().observe(*(given[name] for name in takes))

    return Baseline


def main() -> None:
    parser = interleaved.arguments(__doc__.split("\n\n")[0], rounds=3)
    parser.add_argument("--baseline", default="aadac41", help="the commit whose pacer is compared (default aadac41)")
    cli, rest = parser.parse_known_args()
    pacers = {"this checkout": scheduler_module.PrefillPacer, cli.baseline: baseline_pacer(cli.baseline)}
    interleaved.main(cli, rest, {name: (lambda pacer=pacer: setattr(scheduler_module, "PrefillPacer", pacer))
                                 for name, pacer in pacers.items()})


if __name__ == "__main__":
    main()
