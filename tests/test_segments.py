"""A fast forward of a decoding step's rows with prompt chunks as its last rows (``ForwardBatch.chunk_rows``,
:mod:`specdec.models.segments`) equals the step and the chunks as forwards of their own: the step's logits,
every wanted token's hidden states, and the cache both leave (a later step reads it), in every family of the
fast backend (windows, soft-capping, experts, partial rotary) and in bfloat16 within its rounding; and rows
grouped by width or by how far back they attend give one padded grid's results."""

import pytest
import torch
from helpers import FAMILY_ARCHS, build_model

from specdec.models import segments as segments_module
from specdec.models.base import ForwardBatch
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.segments import SEGMENT_KEYS, key_groups, segments, width_groups

CONTEXT = [(5 * i + 2) % 90 + 1 for i in range(30)]
STEP = [[11], [12, 13, 14]]  # two decoding rows: a pending token, and one with two drafts
CHUNKS = [[(3 * i) % 80 + 4 for i in range(20)], [(7 * i) % 70 + 9 for i in range(9)]]
HIDDEN = (0, 1, -1)



def _cache(lm: FastLlamaLM):
    """Slots 0-1 hold a 30-token context (the decoding rows), slot 2 its first 10 (a prompt being fed), slot 3
    nothing (a prompt's first chunk)."""
    cache = lm.new_cache(4, 96)
    lm.forward(ForwardBatch.from_rows([CONTEXT, CONTEXT[::-1], CONTEXT[:10]], [0, 0, 0], [0, 1, 2], lm.device,
                                      logits="none"), cache)
    return cache


def _forward(lm: FastLlamaLM, cache, rows: list[list[int]], slots: list[int], chunk_rows: int = 0):
    """Rows fed at their slots' lengths with the ``HIDDEN`` states of every token; with ``chunk_rows``, logits of
    the other rows' tokens only."""
    batch = ForwardBatch.from_rows(rows, [cache.lengths[s] for s in slots], slots, lm.device)
    batch.hidden_layers, batch.chunk_rows = HIDDEN, chunk_rows
    if chunk_rows:
        batch.logits_rows = slice(0, sum(len(r) for r in rows[: len(rows) - chunk_rows]))
        batch.hidden_rows = slice(0, batch.cu_seqlens[-1])
    return lm.forward(batch, cache)


def test_segments_are_the_step_then_each_chunk():
    batch = ForwardBatch.from_rows([*STEP, *CHUNKS], [0] * 4, [0, 1, 2, 3], torch.device("cpu"))
    assert segments(batch, [0] * 4) == [[0, 1, 3], [2]]  # no chunk rows: by padded width (16 and under, then 24)
    batch.chunk_rows = 2
    assert segments(batch, [0] * 4) == [[0, 1], [2], [3]]
    batch.chunk_rows = 4
    assert segments(batch, [0] * 4) == [[0], [1], [2], [3]]
    batch = ForwardBatch.from_rows(STEP, [0] * 2, [0, 1], torch.device("cpu"))
    assert segments(batch, [30, 30]) is None  # every row in one grid of width 3
    assert segments(batch, [30, 600]) == [[0], [1]]  # one attends 20 times as far: a grid each


def test_width_groups_split_only_where_it_saves_cells():
    assert width_groups([1, 1, 3, 9], [0, 1, 2, 3]) == [[0, 1, 2, 3]]  # one grid of width 9
    assert width_groups([1, 1, 20], [0, 1, 2]) == [[0, 1], [2]]  # 3 x 24 cells against 2 + 24: 46 saved, > 16
    assert width_groups([1] * 40 + [100], list(range(41))) == [list(range(40)), [40]]
    assert width_groups([14, 104, 98, 40, 44, 10], list(range(6))) == [[0, 5], [3, 4], [1, 2]]
    assert width_groups([17, 16], [0, 1]) == [[0, 1]]  # 2 x 24 against 16 + 24: 8 saved
    assert width_groups([5], [0]) == [[0]]


def test_key_groups_split_only_where_it_saves_attended_entries():
    # 17 x 448 entries against 16 x 150 + 448
    assert key_groups([150] * 16 + [448], list(range(17))) == [list(range(16)), [16]]
    assert key_groups([150, 160, 140, 155], [0, 1, 2, 3]) == [[0, 1, 2, 3]]  # one bucket
    assert key_groups([100, 200], [0, 1]) == [[0, 1]]  # 2 x 200 = 400 against 100 + 200 + SEGMENT_KEYS
    assert key_groups([20, 1000], [0, 1]) == [[0], [1]]  # 2000 against 20 + 1000 + SEGMENT_KEYS
    assert key_groups([1000, 20, 990, 30], [3, 2, 1, 0]) == [[1, 3], [2, 0]]  # shortest first
    # three lengths: the middle one joins whichever side costs less
    needed = [60] * 10 + [700] + [1000] * 10  # the 700 alone: 700 + SEGMENT_KEYS, with the 1000s: 1000
    assert key_groups(needed, list(range(21))) == [list(range(10)), list(range(10, 21))]
    assert key_groups([7], [0]) == [[0]] and key_groups([], []) == [[]]
    total = lambda groups: sum(len(g) * max(needed[b] for b in g) + SEGMENT_KEYS for g in groups)  # noqa: E731
    assert total(key_groups(needed, list(range(21)))) < min(total([list(range(21))]),
                                                             total([list(range(10)), [10], list(range(11, 21))]))


@pytest.mark.parametrize("arch", ["llama", *FAMILY_ARCHS])
def test_a_fused_forward_is_the_step_and_the_chunks_apart(arch):
    # Gemma's norms compute in float32 (as transformers' do), whose rounding follows the tensors' shapes.
    _check(arch, torch.float64, {"atol": 1e-6, "rtol": 1e-4} if arch.startswith("gemma") else
           {"atol": 1e-9, "rtol": 1e-9})


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_bfloat16_within_its_rounding(arch):
    _check(arch, torch.bfloat16, {"atol": 0.05, "rtol": 0.05})


def _check(arch: str, dtype: torch.dtype, tol: dict) -> None:
    lm = FastLlamaLM(build_model(arch, seed=3, scale=2.0).to(dtype), arch)
    assert lm.fuses_prefill
    fused_cache, apart_cache = _cache(lm), _cache(lm)
    fused = _forward(lm, fused_cache, [*STEP, *CHUNKS], [0, 1, 2, 3], chunk_rows=2)
    step = _forward(lm, apart_cache, STEP, [0, 1])
    chunks = _forward(lm, apart_cache, CHUNKS, [2, 3])
    torch.testing.assert_close(fused.logits, step.logits, **tol)
    torch.testing.assert_close(fused.hidden, torch.cat([step.hidden, chunks.hidden]), **tol)
    assert fused_cache.lengths == apart_cache.lengths == [31, 33, 30, 9]
    nxt = [[20], [21], [22], [23]]  # one more token in every slot reads the cache each left
    torch.testing.assert_close(_forward(lm, fused_cache, nxt, [0, 1, 2, 3]).logits,
                               _forward(lm, apart_cache, nxt, [0, 1, 2, 3]).logits, **tol)


RAGGED = [[31], [(5 * i) % 60 + 3 for i in range(40)], [41, 42], [(11 * i) % 50 + 7 for i in range(20)]]


@pytest.mark.parametrize("variant", ["tokens", "input_hidden", "layer_subset"])
def test_a_ragged_forward_in_width_groups_is_one_grid(variant, monkeypatch):
    """Rows of 1-40 tokens (a drafter catching up, prompts fed together) computed as width groups give one
    padded grid's logits, hidden states and cache, fed token embeddings, given inputs (``input_hidden``, as the
    EAGLE layer is) or a subset of the layers."""
    lm = FastLlamaLM(build_model("llama", seed=5, scale=2.0).to(torch.float64), "llama")

    def build():
        cache = _cache(lm)
        batch = ForwardBatch.from_rows(RAGGED, [cache.lengths[s] for s in range(4)], [0, 1, 2, 3], lm.device)
        batch.hidden_layers = HIDDEN if variant != "layer_subset" else (1,)
        if variant == "input_hidden":
            batch.input_hidden = torch.randn(batch.cu_seqlens[-1], lm.embed.shape[1], dtype=torch.float64,
                                             generator=torch.Generator().manual_seed(0))
        if variant == "layer_subset":
            batch.layers = (0, 1)
        return cache, batch

    assert segments(ForwardBatch.from_rows(RAGGED, [0] * 4, [0, 1, 2, 3], lm.device), [0] * 4) == [[0, 2], [3], [1]]
    _split_against_whole(lm, monkeypatch, build, {"atol": 1e-9, "rtol": 1e-9})


def _split_against_whole(lm: FastLlamaLM, monkeypatch, build, tol: dict) -> list[int]:
    """``build()``'s batch (with its cache: slots 0-3) fed as :func:`segments` cuts it and as one padded grid,
    each then followed by one more token in every slot: the same logits, hidden states and next logits within
    ``tol``, and the same cached lengths, which are returned."""
    from specdec.models import fast_llama

    runs = []
    for split in (True, False):
        monkeypatch.setattr(fast_llama, "segments", segments if split else lambda batch, starts: None)
        cache, batch = build()
        out = lm.forward(batch, cache)
        nxt = ForwardBatch.from_rows([[20], [21], [22], [23]], [cache.lengths[s] for s in range(4)], [0, 1, 2, 3],
                                     lm.device)
        runs.append((out, lm.forward(nxt, cache).logits, list(cache.lengths)))
    (split_out, split_next, split_lengths), (whole_out, whole_next, whole_lengths) = runs
    torch.testing.assert_close(split_out.logits, whole_out.logits, **tol)
    torch.testing.assert_close(split_out.hidden, whole_out.hidden, **tol)
    torch.testing.assert_close(split_next, whole_next, **tol)
    assert split_lengths == whole_lengths
    return split_lengths

LENGTHS = [4, 40, 180, 100]  # cached tokens of slots 0-3 before the step
STEP_ROWS = [[31], [32, 33, 34], [35], [36, 37]]


@pytest.mark.parametrize("arch", ["llama", *FAMILY_ARCHS])
def test_rows_split_by_key_length_give_one_grid(arch, monkeypatch):
    """Decoding rows that attend 5 to 181 entries, each split into a grid of its own by key length (the threshold
    set to 0), give one grid's logits, hidden states and cache, windows and every family's attention included."""
    lm = FastLlamaLM(build_model(arch, seed=7, scale=2.0).to(torch.float64), arch)
    monkeypatch.setattr(segments_module, "SEGMENT_KEYS", 0)

    def build():
        cache = lm.new_cache(4, 192)
        contexts = [[(13 * i + 3 * s) % 90 + 1 for i in range(n)] for s, n in enumerate(LENGTHS)]
        lm.forward(ForwardBatch.from_rows(contexts, [0] * 4, [0, 1, 2, 3], lm.device, logits="none"), cache)
        batch = ForwardBatch.from_rows(STEP_ROWS, LENGTHS, [0, 1, 2, 3], lm.device)
        batch.hidden_layers = HIDDEN
        return cache, batch

    step = ForwardBatch.from_rows(STEP_ROWS, LENGTHS, [0, 1, 2, 3], lm.device)
    assert segments(step, LENGTHS) == [[0], [1], [3], [2]]
    tol = {"atol": 1e-6, "rtol": 1e-4} if arch.startswith("gemma") else {"atol": 1e-9, "rtol": 1e-9}
    assert _split_against_whole(lm, monkeypatch, build, tol) == [6, 44, 182, 103]
