"""``specdec bench``: plain decoding, speculative methods and transformers peers measured side by side.

- :mod:`specdec.bench.methods` is the method catalogue (derived from the drafter registry) and the
  runner interface;
- :mod:`specdec.bench.workloads` loads questions (Spec-Bench, any JSONL, held-out code prompts) and
  turns conversations into prompt ids; :mod:`specdec.bench.synthetic` builds random-weight models of
  real shapes and random-token prompts;
- :mod:`specdec.bench.runners` runs one method (specdec's ``LLM``, batched, or transformers ``generate``);
- :mod:`specdec.bench.harness` schedules batch sizes, warms up, repeats and checks greedy outputs;
- :mod:`specdec.bench.summary` aggregates; :mod:`specdec.bench.hardware` measures what the hardware
  allows (bandwidth, timed forwards);
- :mod:`specdec.bench.report` writes the markdown tables, the JSON of raw measurements and the plots;
- :mod:`specdec.bench.prepare` turns the flags into models, runners and prompts, and
  :mod:`specdec.bench.cli` is the ``specdec bench`` sub-command.

``specdec bench-serve --in-process`` is :mod:`specdec.bench.serving` (the serving benchmark's workloads and
its driver of the server's submit/step loop); :mod:`specdec.bench.arrivals` times an open loop's requests.
"""

from specdec.bench.harness import BenchResult, BenchSettings, run_benchmark
from specdec.bench.methods import MethodSpec, expand_methods
from specdec.bench.summary import predicted_speedup
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
