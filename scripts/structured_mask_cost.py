"""The host cost of structured output's per-step work (a benchmark, not a test): wrapping the tokenizer,
compiling a schema, the target's masks of a step (``step_masks``), masking a drafter's logits over its
columns (``constrain_draft`` + ``advance_draft``) and expanding masks onto logits, for 16 rows with 4 drafts
each under a tool-call JSON schema, with the embedded pair's tokenizer (8192 tokens). CPU seconds of this
process (llguidance's threads included), so that a shared machine's load inflates them less than wall time.

    PYTHONPATH=src python3 scripts/structured_mask_cost.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import AutoTokenizer

from specdec.assets import require_default_pair
from specdec.structured import StructuredOutputsParams
from specdec.structured.grammar import GrammarCache
from specdec.structured.state import GrammarState, advance_draft, apply_bitmask, constrain_draft, step_masks

ROWS, K, REPEATS = 16, 4, 50
SCHEMA = {"type": "object", "properties": {
    "function": {"enum": ["get_weather", "search"]},
    "arguments": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 48},
                                                   "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
                  "required": ["query", "limit"]}}, "required": ["function", "arguments"]}
TEXT = '{"function": "search", "arguments": {"query": "weather in paris", "limit": 5}}'


def cpu_us(fn: Callable[[], object]) -> float:
    """Mean CPU microseconds of ``fn()`` over REPEATS calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    start = time.process_time()
    for _ in range(REPEATS):
        fn()
    return (time.process_time() - start) / REPEATS * 1e6


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(require_default_pair()[0])
    vocab, eos = len(tokenizer), frozenset([tokenizer.eos_token_id])
    start = time.perf_counter()
    cache = GrammarCache(tokenizer, vocab, eos)
    print(f"tokenizer wrapped in {(time.perf_counter() - start) * 1e3:.0f} ms (vocabulary {vocab})")
    constraint = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    cache.compile(constraint)
    print(f"schema compiled in {(time.perf_counter() - start) * 1e3:.1f} ms")
    ids = tokenizer(TEXT)["input_ids"]
    for offset in (2, 10):
        grammars = []
        for b in range(ROWS):
            state = GrammarState(cache.matcher(constraint)[0], eos)
            state.commit(ids[: offset + b % 4])
            grammars.append(state)
        drafts = [ids[offset + b % 4 : offset + b % 4 + K] for b in range(ROWS)]
        masks = step_masks(grammars, drafts, [K] * ROWS, None, [False] * ROWS, vocab)[1]
        logits, target_logits = torch.randn(ROWS, vocab), torch.randn(ROWS, K + 1, vocab)

        def draft_step(grammars=grammars, logits=logits) -> None:
            for g in grammars:
                g.end_draft()
            for _ in range(K):
                advance_draft(constrain_draft(logits, grammars).argmax(-1), grammars)

        print(f"after {offset} committed tokens, {ROWS} rows x {K} drafts: step masks "
              f"{cpu_us(lambda g=grammars, d=drafts: step_masks(g, d, [K] * ROWS, None, [False] * ROWS, vocab)):.0f}"
              f" us, draft masking {cpu_us(draft_step):.0f} us, applying the masks to [{ROWS}, {K + 1}, {vocab}] "
              f"logits {cpu_us(lambda t=target_logits, m=masks: apply_bitmask(t, m)):.0f} us")


if __name__ == "__main__":
    main()
