"""One query per row in bfloat16 on a CPU is attended as a pair of copies (torch's CPU flash attention
is 2.6-4x slower for a single bfloat16 query, see ``PAIR_SINGLE_QUERIES``): the same answers, every
one-token forward of a bfloat16 model takes that path, and no other forward does."""

import pytest
import torch
from helpers import build_model

from specdec.models.base import ForwardBatch
from specdec.models.layers import attend
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("masked", [True, False])
def test_a_paired_query_gets_the_single_query_answer(heads, kv_heads, masked):
    torch.manual_seed(0)
    rows, keys, dim = 3, 37, 16
    q = torch.randn(rows, heads, 1, dim).bfloat16()
    k, v = torch.randn(rows, kv_heads, keys, dim).bfloat16(), torch.randn(rows, kv_heads, keys, dim).bfloat16()
    mask = None
    if masked:  # each row sees a different prefix of the keys (a ragged batch)
        mask = torch.arange(keys)[None, None, None, :] < torch.tensor([5, 20, keys])[:, None, None, None]
    gqa = heads != kv_heads
    single = attend(q, k, v, mask, 0.25, gqa, pair=False)
    paired = attend(q, k, v, mask, 0.25, gqa, pair=True)
    assert paired.shape == single.shape == (rows, heads, 1, dim)
    # Against float64 arithmetic on the same bfloat16 inputs: both within bfloat16 rounding.
    reference = attend(q.double(), k.double(), v.double(), mask, 0.25, gqa, pair=False)
    torch.testing.assert_close(paired.double(), reference, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(paired, single, atol=2e-2, rtol=2e-2)
    if masked:  # a row's masked keys do not count: changing them changes nothing
        k2 = k.clone()
        k2[0, :, 5:] = 100.0
        torch.testing.assert_close(attend(q, k2, v, mask, 0.25, gqa, pair=True)[0], paired[0], atol=0, rtol=0)


def _query_lengths(monkeypatch, lm, batch, cache) -> tuple[torch.Tensor, list[int]]:
    """The logits of ``batch`` and the query length of every attention call it made."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logits = lm.forward(batch, cache).logits
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    return logits, seen


@pytest.mark.parametrize("dtype, pairs", [(torch.bfloat16, True), (torch.float32, False), (torch.float64, False)])
def test_one_token_forwards_pair_their_queries_in_bfloat16_only(monkeypatch, dtype, pairs):
    lm = load_causal_lm(build_model("llama", seed=3), dtype=dtype, device=CPU, backend="fast")
    assert lm.pair_single_queries is pairs
    cache = lm.new_cache(3, 64)
    prefixes = [[5, 9, 14], [2] * 11, [7, 1, 3, 8, 30, 31, 32]]
    lm.forward(ForwardBatch.from_rows(prefixes, [0, 0, 0], [0, 1, 2], CPU), cache)
    lengths = [len(p) for p in prefixes]
    one = ForwardBatch.from_rows([[4], [6], [8]], lengths, [0, 1, 2], CPU)  # one token per row, ragged lengths
    logits, seen = _query_lengths(monkeypatch, lm, one, cache)
    assert seen == [2 if pairs else 1] * lm.num_layers
    for slot, n in enumerate(lengths):
        cache.set_length(slot, n)
    lm.pair_single_queries = not pairs  # the other path over the same cache: the same logits
    other, seen = _query_lengths(monkeypatch, lm, one, cache)
    assert seen == [1 if pairs else 2] * lm.num_layers
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(logits, other, atol=tol, rtol=tol)
    for slot, n in enumerate(lengths):
        cache.set_length(slot, n)
    lm.pair_single_queries = pairs
    _, seen = _query_lengths(monkeypatch, lm, ForwardBatch.from_rows([[4, 5, 6], [6], [8]], lengths, [0, 1, 2], CPU),
                             cache)
    assert seen == [3] * lm.num_layers  # a wider grid is attended as it is
