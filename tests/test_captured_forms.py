"""The forms a CUDA graph captures, run eagerly on a CPU (CI has no GPU; ``scripts/gpu_greedy_check.py``
checks the graphs themselves on a device).

- A captured forward's dense layers run as one function, :func:`~specdec.models.layers.decoder_layer` (what
  torch.compile fuses there): for every family it gives bit for bit what the pieces give (the same
  operations in the same order), over ragged rows and a block table that is not consecutive, and the
  keys and values it writes are the same.
- :func:`~specdec.models.cuda_graphs.graph_shape` keys a graph by the hidden states it returns too, so the
  verification forward of EAGLE, Medusa and MTP is captured; trees, hidden rows apart from the logits' rows
  and wide rows stay eager.
- The bodies of the EAGLE layer's graphs, run once on a CPU in place of a capture and replay (the other
  rows of the slot-dense grid dummies): a forward fed hidden states instead of tokens gives the eager forward's
  logits and states, and the whole greedy feature chain gives the eager chain's tokens and cache, with the
  whole head and with a draft vocabulary (rows of the head, their argmax mapped to token ids).
- Every method that runs on the fast backend, with the target and every drafter model marked as capturing
  and each graph's body run once in place of its capture and replay: greedy output equals transformers'.
  So a GPU runs the same arithmetic as the CPU's eager path (the graphs themselves are checked on a device).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILY_ARCHS, run_graph_bodies_eagerly
from test_early_exit import make_adapter
from test_families import models
from test_forward_contract import TOL, reference_chain
from test_greedy_equality import check_outputs, run_batch
from test_heads import llama, make_heads, references  # noqa: F401 - module fixtures

from specdec import LLM
from specdec.models.base import CausalLM, ForwardBatch
from specdec.models.cuda_graphs import MAX_GRAPH_WIDTH, GraphSet, graph_shape, replay, replay_greedy_chain
from specdec.models.fast_llama import FastLlamaLM
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


def test_graph_shape_keys_the_hidden_states_and_leaves_hidden_rows_eager():
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
    assert graph_shape(lm, tree, cache) == (1, 4, lm.key_bucket(3, cache.capacity), ())  # keyed as a tree in replay
    wide = ForwardBatch.from_rows([list(range(1, MAX_GRAPH_WIDTH + 2))], [0], [0], CPU)
    assert graph_shape(lm, wide, cache) is None


def _prefilled(lm, prompts: dict[int, list[int]]):
    cache = lm.new_cache(4, 64)
    for slot, prompt in prompts.items():
        lm.forward(ForwardBatch.from_rows([prompt], [0], [slot], CPU, logits="none"), cache)
    return cache


def _feature_inputs(lm):
    """An EAGLE-like input function: ``fc([feature, embedding])`` with a random ``fc``."""
    width = lm.embed.shape[1]
    fc = torch.randn(width, 2 * width, generator=torch.Generator().manual_seed(5), dtype=lm.dtype) / width
    return lambda feature, tokens: torch.cat([feature, F.embedding(tokens, lm.embed)], dim=-1) @ fc.T


@pytest.mark.parametrize("reduced", [False, True], ids=["whole head", "draft vocabulary"])
def test_graph_bodies_fed_hidden_states_equal_the_eager_forms(monkeypatch, reduced):
    run_graph_bodies_eagerly(monkeypatch)
    _, lm = models("llama")
    ids = torch.randperm(lm.vocab_size, generator=torch.Generator().manual_seed(7))[:40] if reduced else None
    head = None if ids is None else lm.lm_head[ids]
    prompts = {0: [5, 17, 3, 44, 9], 2: [8, 2, 71]}  # slot 1 and 3: dummy rows of the graphs' grids
    inputs = _feature_inputs(lm)
    width = lm.embed.shape[1]
    # The catch-up forward: ragged rows fed hidden states, the last row's logits and final states wanted.
    fed = torch.randn(5, width, generator=torch.Generator().manual_seed(6), dtype=lm.dtype)
    outs = []
    for graphed in (False, True):
        cache = _prefilled(lm, prompts)
        batch = ForwardBatch.from_rows([[1, 2, 3], [4, 6]], [5, 3], [0, 2], CPU, logits="last")
        batch.input_hidden, batch.hidden_layers, batch.output_head = fed, (-1,), head
        if graphed:
            cache.graphs = GraphSet.allocate(cache, CPU)
            shape = graph_shape(lm, batch, cache)
            logits, states, cells = replay(lm, batch, cache, shape)
            rows_key = None if head is None else (head.data_ptr(), len(head))
            assert ("forward", *shape, True, rows_key, None, None, False) in cache.graphs.graphs
            for slot, count in zip(batch.slots, batch.num_tokens):  # what the forward does after a replay
                cache.lengths[slot] += count
            wanted = cells[batch.logits_rows]
            outs.append((logits[wanted], states[wanted], cache))
        else:
            out = lm.forward(batch, cache)
            outs.append((out.logits, out.hidden, cache))
    (logits, states, eager_cache), (glogits, gstates, graph_cache) = outs
    torch.testing.assert_close(glogits, logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gstates, states, rtol=1e-12, atol=1e-12)
    # The greedy feature chain from there, in one graph body against the eager loop.
    assert logits.shape[-1] == (lm.vocab_size if ids is None else len(ids))
    tokens, features = logits.argmax(-1), states[:, 0]
    if ids is not None:
        tokens = ids[tokens]
    eager = CausalLM.greedy_chain(lm, tokens, [0, 2], eager_cache, 5, head, ids, features, inputs)
    for s in (0, 2):
        graph_cache.reserve(s, graph_cache.lengths[s] + 5)
    graphed = replay_greedy_chain(lm, tokens, [0, 2], graph_cache, 5, head, ids, features, inputs)
    key = ("greedy_chain", 4, lm.key_bucket(8 + 5, 64), 5, True, None if ids is None else (head.data_ptr(), len(head)))
    assert key in graph_cache.graphs.graphs
    assert torch.equal(graphed, eager)
    assert ids is None or set(eager.flatten().tolist()) <= set(ids.tolist())
    assert eager_cache.lengths == graph_cache.lengths
    for s in (0, 2):
        rows = torch.tensor([b * eager_cache.block_size + i for b in eager_cache.tables[s]
                             for i in range(eager_cache.block_size)])[: eager_cache.lengths[s]]
        for a, b in zip(eager_cache.keys + eager_cache.values, graph_cache.keys + graph_cache.values):
            torch.testing.assert_close(b[rows], a[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["plain", "draft_model", "layer_skip", "early_exit", "eagle", "medusa", "mtp",
                                    "eagle_tree", "medusa_tree"])
def test_every_method_through_the_graph_bodies_matches_transformers(model_dirs, llama, references, tmp_path,  # noqa: F811
                                                                    monkeypatch, method):
    run_graph_bodies_eagerly(monkeypatch)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "plain":
        spec = None
    elif method == "draft_model":
        spec["model"] = str(model_dirs["llama"]["truncated"])
    elif method == "early_exit":
        make_adapter(llama, tmp_path / "ee", 1, seed=3)
        spec.update(method="layer_skip", model=str(tmp_path / "ee"))
    elif method in ("eagle", "medusa", "mtp", "eagle_tree", "medusa_tree"):
        kind = method.removesuffix("_tree")
        make_heads(llama, kind, tmp_path / kind, seed=1)
        spec.update(method=kind, model=str(tmp_path / kind))
        if method.endswith("_tree"):
            spec.update(num_candidates=2, num_speculative_tokens=6)
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    drafter = llm.engine.drafter
    models = [m for m in (llm.engine.target, getattr(drafter, "model", None), getattr(drafter, "layer", None))
              if isinstance(m, FastLlamaLM)]
    for m in models:
        m.use_cuda_graphs = True
    check_outputs(run_batch(llm), references)
    replayed = {key[0] for key in llm.engine.cache.graphs.graphs}
    assert "forward" in replayed, "the target's steps replayed no graph"
    if method in ("draft_model", "eagle"):
        assert "greedy_chain" in {key[0] for key in drafter.cache.graphs.graphs}
    if method in ("layer_skip", "early_exit"):  # the drafts' layer subsets and the verification of the rest
        assert len({key[-3] for key in llm.engine.cache.graphs.graphs if key[0] == "forward"}) >= 2
    if method.endswith("_tree"):  # the target verified trees in graphs (and eagle drafted them in some)
        assert any(key[-1] for key in llm.engine.cache.graphs.graphs if key[0] == "forward")
    if method == "eagle_tree":
        assert any(key[-1] for key in drafter.cache.graphs.graphs if key[0] == "forward")
