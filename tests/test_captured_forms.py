"""The forms a CUDA graph captures, run eagerly on a CPU (CI has no GPU; ``scripts/gpu_greedy_check.py``
checks the graphs themselves on a device).

- A captured forward's dense layers run as one function, :func:`~specdec.models.layers.decoder_layer` (what
  torch.compile fuses there): for every family it gives bit for bit what the pieces give (the same
  operations in the same order), over ragged rows and a block table that is not consecutive, and the
  keys and values it writes are the same.
- :func:`~specdec.models.cuda_graphs.graph_shape` keys a graph by the hidden states it returns too, so the
  verification forward of EAGLE, Medusa and MTP is captured; trees, hidden rows apart from the logits' rows
  and wide rows stay eager.
"""

import pytest
import torch
from helpers import FAMILY_ARCHS
from test_families import models
from test_forward_contract import TOL, reference_chain

from specdec.models.base import ForwardBatch
from specdec.models.cuda_graphs import MAX_GRAPH_WIDTH, graph_shape
from specdec.models.layers import decoder_layer

CPU = torch.device("cpu")
ROWS = [[5, 17, 3, 44, 9, 21, 60, 2, 8], [8, 2, 71], [30, 31]]
DENSE = [a for a in FAMILY_ARCHS if a not in ("qwen3_moe", "mixtral")]


def _captured_form(lm, fused: bool) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    """Logits and hidden states (layer 1) of ``ROWS`` through ``compute(capturable=True)``, in the fused form
    (the layer function uncompiled) or the pieces, over a pool whose blocks interleave; and the keys written."""
    saved = lm.fuse_layers, lm._decoder_layer
    lm.fuse_layers, lm._decoder_layer = fused, decoder_layer if fused else None
    try:
        cache = lm.new_cache(3, 64)
        for length in range(1, 10):  # the slots take blocks in turn: tables that are not consecutive
            for slot, row in enumerate(ROWS):
                cache.reserve(slot, min(length * 4, len(row) + 4))
        grid, cells = lm.grid(ForwardBatch.from_rows(ROWS, [0, 0, 0], [0, 1, 2], CPU), cache)
        assert grid.write_range is None and grid.table is not None
        x, hidden = lm.compute(grid, cache, frozenset({1}), capturable=True)
        return lm.head(x)[cells], {i: h.reshape(x.shape[0], -1)[cells] for i, h in hidden.items()}, cache.keys
    finally:
        lm.fuse_layers, lm._decoder_layer = saved


@pytest.mark.parametrize("arch", DENSE)
def test_fused_decoder_layer_equals_the_pieces(arch):
    model, lm = models(arch)
    logits, hidden, keys = _captured_form(lm, fused=True)
    pieces, pieces_hidden, pieces_keys = _captured_form(lm, fused=False)
    assert torch.equal(logits, pieces)
    assert torch.equal(hidden[1], pieces_hidden[1])
    assert all(torch.equal(a, b) for a, b in zip(keys, pieces_keys))
    reference = torch.cat([reference_chain(model, row)[0] for row in ROWS])
    torch.testing.assert_close(logits, reference, **(TOL if arch != "gemma2" else {"rtol": 1e-6, "atol": 1e-6}))


def test_graph_shape_keys_the_hidden_states_and_leaves_trees_eager():
    _, lm = models("llama")
    cache = lm.new_cache(4, 512)
    step = ForwardBatch.from_rows([[1, 2, 3], [4]], [0, 0], [0, 2], CPU)
    key_len = lm.key_bucket(3, cache.capacity)  # on CUDA a power of two >= 256, here the length
    assert graph_shape(lm, step, cache) == (4, 4, key_len, ())  # rows to a power of two past slot 2
    step.hidden_layers = (-1, 1)
    assert graph_shape(lm, step, cache) == (4, 4, key_len, (lm.num_layers, 1))
    step.hidden_rows = slice(0, 4)
    assert graph_shape(lm, step, cache) is None
    tree = ForwardBatch.from_rows([[1, 2, 3]], [0], [0], CPU)
    tree.tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    assert graph_shape(lm, tree, cache) is None
    wide = ForwardBatch.from_rows([list(range(1, MAX_GRAPH_WIDTH + 2))], [0], [0], CPU)
    assert graph_shape(lm, wide, cache) is None
