"""``specdec bench``: plain decoding, speculative methods and transformers peers measured side by side.

- :mod:`specdec.bench.workloads` loads questions (Spec-Bench, any JSONL, held-out code prompts) and
  turns conversations into prompt ids;
- :mod:`specdec.bench.runners` runs one method (specdec's ``LLM`` or transformers ``generate``);
- :mod:`specdec.bench.harness` schedules, warms up, repeats, checks greedy outputs and aggregates;
- :mod:`specdec.bench.report` writes the markdown table, the JSON of raw measurements and the plots;
- :mod:`specdec.bench.cli` is the ``specdec bench`` sub-command.
"""

from specdec.bench.harness import (
    BenchResult,
    BenchSettings,
    MethodSpec,
    expand_methods,
    predicted_speedup,
    run_benchmark,
)
from specdec.bench.workloads import PromptBuilder, Question, load_workload

__all__ = [
    "BenchResult",
    "BenchSettings",
    "MethodSpec",
    "PromptBuilder",
    "Question",
    "expand_methods",
    "load_workload",
    "predicted_speedup",
    "run_benchmark",
]
