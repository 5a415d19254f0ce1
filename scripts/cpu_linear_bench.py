"""Prepacked against plain bfloat16 weights in the fast backend on a CPU (``specdec.models.cpu_linear``):
a benchmark, not a test. Two backends over one random-weight model of the ``1b`` shape (Llama, hidden
2048, 22 layers, 32/8 heads of 64, MLP 5632, vocab 8192, bfloat16: 2.05 GB), built in memory, timed
alternately in one process (the order rotates every repeat), after a ``--context``-token prefill:

- ``decode``: one token per forward at batch 1 (plain decoding's step), ``--steps`` forwards a repeat;
- ``verify``: one ``--verify``-token forward at batch 1 (the check of k = verify - 1 drafts), rolled back;
- ``batch``: one token per row for ``--rows`` rows;
- ``prefill``: ``--context`` tokens of one row.

The read bandwidth is measured first in the same process (float32 ``sum`` over 1 GiB, best of 5), and
a forward's fraction of it is (bytes of weights read per forward / its time) / that bandwidth. Prints
the median and the spread (min..max) of each, in milliseconds.

    PYTHONPATH=src python3 scripts/cpu_linear_bench.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

from specdec.models.base import ForwardBatch
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.kv_pool import PagedKVPool

CPU = torch.device("cpu")


def build_1b(seed: int = 0) -> LlamaForCausalLM:
    """The ``1b`` shape in bfloat16 with ``N(0, 0.02)`` weights (norms 1), without transformers' init."""
    config = LlamaConfig(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with no_init_weights():
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second of a float32 ``sum`` over 1 GiB (best of ``repeats``)."""
    data = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - tic)
    return data.numel() * 4 / best


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a one-token forward reads: every weight but the embeddings (one row of them)."""
    skip = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


class Case:
    """One backend's pool, prefilled with the same context; each timing restores its lengths."""

    def __init__(self, lm: FastLlamaLM, context: list[int], rows: int) -> None:
        self.lm, self.context = lm, context
        self.cache: PagedKVPool = lm.new_cache(rows, len(context) + 64)
        for slot in range(rows):
            self._run(ForwardBatch.from_rows([context], [0], [slot], CPU, logits="last"))

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        return self.lm.forward(batch, self.cache).logits

    def _reset(self) -> None:
        for slot in range(self.cache.num_slots):
            self.cache.set_length(slot, len(self.context))

    def time(self, what: str, steps: int, width: int) -> float:
        """Seconds of one forward of ``what`` (``decode``: per step of ``steps``; ``verify``: ``width`` tokens)."""
        if what == "decode":
            return self.decode(steps)
        return self.verify(width) if what == "verify" else self.batch() if what == "batch" else self.prefill()

    def decode(self, steps: int) -> float:
        """Seconds per step of ``steps`` greedy one-token forwards at batch 1."""
        token = torch.tensor([self.context[-1]])
        tic = time.perf_counter()
        for _ in range(steps):
            token = self._run(ForwardBatch.one_token_per_row(token, [0], self.cache)).argmax(-1)
        elapsed = time.perf_counter() - tic
        self._reset()
        return elapsed / steps

    def verify(self, width: int) -> float:
        start = len(self.context)
        batch = ForwardBatch(torch.tensor(self.context[:width]), torch.arange(start, start + width), [0], [0, width])
        tic = time.perf_counter()
        self._run(batch)
        elapsed = time.perf_counter() - tic
        self._reset()
        return elapsed

    def batch(self) -> float:
        rows = self.cache.num_slots
        tokens = torch.tensor(self.context[:rows])
        tic = time.perf_counter()
        self._run(ForwardBatch.one_token_per_row(tokens, list(range(rows)), self.cache))
        elapsed = time.perf_counter() - tic
        self._reset()
        return elapsed

    def prefill(self) -> float:
        self.cache.set_length(0, 0)
        tic = time.perf_counter()
        self._run(ForwardBatch.from_rows([self.context], [0], [0], CPU, logits="last"))
        elapsed = time.perf_counter() - tic
        self._reset()
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="one-token forwards per decode timing")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--verify", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--measure", nargs="+", default=["decode", "verify", "batch", "prefill"],
                        choices=["decode", "verify", "batch", "prefill"])
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = read_bandwidth()
    model = build_1b()
    nbytes = weight_bytes(model)
    context = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    cases = {"plain": Case(FastLlamaLM(model, "1b", pack_weights=False), context, args.rows)}
    cases["packed"] = Case(FastLlamaLM(model, "1b"), context, args.rows)
    del model  # the plain backend keeps its own fused weights and the o/down projections
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (float32 sum, best of 5); weights read per forward {nbytes / 1e9:.3f} GB")
    times: dict[tuple[str, str], list[float]] = {}
    for repeat in range(args.repeats + 1):  # the first pass warms up
        names = list(cases) if repeat % 2 else list(cases)[::-1]
        for what in args.measure:
            for name in names:
                case = cases[name]
                seconds = case.time(what, args.steps, args.verify)
                if repeat:
                    times.setdefault((what, name), []).append(seconds)
    for (what, name), values in times.items():
        median = statistics.median(values)
        line = (f"{what:8s} {name:7s} median {median * 1e3:7.1f} ms (min {min(values) * 1e3:7.1f}, max "
                f"{max(values) * 1e3:7.1f}, n={len(values)})")
        if what in ("decode", "verify", "batch"):
            line += f"  {nbytes / median / 1e9:5.1f} GB/s = {nbytes / median / bandwidth:4.0%} of the read bandwidth"
        if what == "decode":
            line += f", {1 / median:5.2f} tok/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
