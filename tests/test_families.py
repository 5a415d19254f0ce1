"""The fast backend's families (``FAMILY_ARCHS``: Qwen3, Mistral and Qwen2 with sliding windows, Phi-3,
Gemma 2 and 3, Qwen3-MoE, Mixtral) against transformers' own forward, float64.

- Ragged chains across the window: logits and hidden states of every new token equal transformers'
  forward of each whole sequence (whose windows transformers applies itself); then one-row steps
  (the CPU single-row grid, which skips the causal mask) and ``greedy_chain`` on one row (the CPU
  one-row loop) and two rows, past the window.
- Trees after a context longer than the window: equal transformers' forward with the equivalent 4-D
  masks, the window applied to the sliding layers only (a dict of masks for families with
  ``layer_types``).
- Sharpness: the same model with its windows dropped fails the chain comparison.
- Routed experts: the capturable dense form equals the batched routed form (both routers), and a
  capturable forward of a mixture-of-experts model equals transformers'.
- ``unsupported_reason`` names what it refuses; ``backend="auto"`` picks the fast backend.
"""

import functools

import pytest
import torch
from helpers import FAMILY_ARCHS, WINDOW, build_model
from test_forward_contract import (
    LAYERS,
    TOL,
    ancestors_mask,
    depths,
    forward_matches_chains,
    prefill,
    reference_chain,
    tree_batch,
)
from transformers import Gemma3TextConfig, Phi3Config, Qwen2Config

from specdec.models.base import ForwardBatch
from specdec.models.families import decoder_spec, unsupported_reason
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.layers import dense_experts, routed_experts
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
FAMILIES = list(FAMILY_ARCHS)
WINDOWED = [a for a in FAMILIES if any(decoder_spec(build_model(a, seed=0, layers=2).config).windows)]
SOFT_TOL = {"rtol": 1e-6, "atol": 1e-6}  # gemma2: transformers' eager softmax runs in float32


@functools.cache
def models(arch):
    """(transformers model, the fast backend chosen by ``backend="auto"`` over the same weights)."""
    model = build_model(arch, seed=41)
    model.config._experts_implementation = "eager"  # transformers' grouped experts refuse float64
    lm = load_causal_lm(model, dtype=torch.float64, device=CPU, backend="auto")
    assert isinstance(lm, FastLlamaLM), f"backend='auto' did not pick the fast backend for {arch}"
    return model, lm


def tol(arch):
    return SOFT_TOL if arch == "gemma2" else TOL


def check_chains(arch, model, lm, tolerance):
    """Ragged chains after prefixes longer than the window (one prefilled as a wide, padded grid), then
    one-row steps and greedy chains."""
    cache = lm.new_cache(4, 64)
    contexts = {0: ([4, 8, 15, 16, 23, 42, 7, 1, 9], [7]), 2: ([1], [2, 3, 5, 8]),
                3: ([11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 3, 5, 7, 2, 4, 6, 8, 10, 12], [53, 59])}
    prefill(lm, cache, {s: prefix for s, (prefix, _) in contexts.items()})
    order = [3, 0, 2]
    forward_matches_chains(lm, model, cache, contexts, order, tolerance)
    tokens = {s: contexts[s][0] + contexts[s][1] for s in order}
    for step in range(3):  # one row at a time: the single-row grid (one token, exact key length)
        for slot in order:
            token = 60 + step + slot
            row = lm.forward(ForwardBatch.from_rows([[token]], [cache.lengths[slot]], [slot], CPU), cache).logits
            tokens[slot].append(token)
            torch.testing.assert_close(row[0], reference_chain(model, tokens[slot])[0][-1], **tolerance)
    for slots in ([0], [2, 3]):  # greedy chains: the one-row loop, then one forward per step
        chain = lm.greedy_chain(torch.tensor([70 + s for s in slots]), slots, cache, 4)
        for row, s in zip(chain.tolist(), slots):
            tokens[s].append(70 + s)
            expected = list(tokens[s])
            for _ in range(4):
                expected.append(int(reference_chain(model, expected)[0][-1].argmax()))
            assert row == expected[len(tokens[s]):], f"{arch}: greedy chain of slot {s}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_ragged_chains_and_single_rows_match_transformers(arch):
    model, lm = models(arch)
    check_chains(arch, model, lm, tol(arch))


@pytest.mark.parametrize("arch", WINDOWED)
def test_dropping_the_window_is_caught(arch, monkeypatch):
    """Sharpness: attending past the window (a mask or a single-row path that ignored it) fails."""
    model, lm = models(arch)
    for layer in lm.layers:
        monkeypatch.setattr(layer, "window", None)
    with pytest.raises(AssertionError):
        check_chains(arch, model, lm, tol(arch))


def window_masks(model, allowed: torch.Tensor, positions: list[int]):
    """The 4-D additive masks transformers takes for ``allowed`` ``[L, L]``: one, windowed, for a model
    whose layers all slide; a dict by layer type for a model with ``layer_types``; one for no window."""
    config = model.config
    pos = torch.tensor(positions)
    inside = pos[None, :] > pos[:, None] - (config.sliding_window or 0)

    def additive(mask):
        blocked = torch.finfo(torch.float64).min
        return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, blocked)[None, None]

    windows = decoder_spec(config).windows
    if not any(windows):
        return additive(allowed)
    if hasattr(config, "layer_types") and config.model_type != "mistral":
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & inside)}
    return additive(allowed & inside)


@pytest.mark.parametrize("arch", FAMILIES)
def test_trees_across_the_window_match_transformers(arch):
    model, lm = models(arch)
    cache = lm.new_cache(4, 64)
    prefixes = {1: [5, 17, 3, 44, 9, 21, 60, 2, 8, 30], 3: [8, 2, 71]}
    prefill(lm, cache, prefixes)
    trees = [([12, 33, 7, 90], [-1, 0, 0, 1]), ([4, 50, 61, 19, 2, 6], [-1, 0, 1, 2, 3, 0])]
    out = lm.forward(tree_batch(trees, [1, 3], cache), cache)
    offset = 0
    for (nodes, parents), slot in zip(trees, [1, 3]):
        prefix = prefixes[slot]
        length, t = len(prefix), len(nodes)
        allowed = torch.zeros(length + t, length + t, dtype=torch.bool)
        allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
        allowed[length:, :length] = True
        allowed[length:, length:] = ancestors_mask(parents)
        positions = list(range(length)) + [length + d for d in depths(parents)]
        with torch.no_grad():
            masks = window_masks(model, allowed, positions)
            ref = model(input_ids=torch.tensor([prefix + nodes]), attention_mask=masks,
                        position_ids=torch.tensor([positions]), output_hidden_states=True, use_cache=False)
        hidden = torch.stack([ref.hidden_states[i][0, length:] for i in LAYERS], dim=1)
        torch.testing.assert_close(out.logits[offset : offset + t], ref.logits[0, length:], **tol(arch))
        torch.testing.assert_close(out.hidden[offset : offset + t], hidden, **tol(arch))
        offset += t


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_capturable_forward_of_experts_matches_transformers(arch):
    """The form a CUDA graph captures (``compute(capturable=True)``: dense experts), run eagerly on a CPU."""
    model, lm = models(arch)
    cache = lm.new_cache(2, 32)
    rows = [[5, 17, 3, 44, 9, 21, 60], [8, 2, 71]]
    for slot, row in enumerate(rows):  # the blocks a forward reserves before it lays out its grid
        cache.reserve(slot, len(row))
    grid, cells = lm.grid(ForwardBatch.from_rows(rows, [0, 0], [0, 1], CPU), cache)
    logits = lm.head(lm.compute(grid, cache, capturable=True)[0])[cells]
    torch.testing.assert_close(logits, torch.cat([reference_chain(model, row)[0] for row in rows]), **TOL)


@pytest.mark.parametrize("router", ["qwen3_moe", "mixtral"])
def test_dense_experts_equal_routed_experts(router):
    """The capturable form (every expert on every token, exact zeros for the unchosen) gives the
    routed form's result, with tokens that share experts and experts that no token chose."""
    torch.manual_seed(0)
    experts, hidden, inner = 6, 16, 12
    h = torch.randn(3, 5, hidden, dtype=torch.float64) + 3.0
    router_weight = torch.randn(experts, hidden, dtype=torch.float64) / 4
    router_weight[5] = -1.0  # expert 5: chosen by no token (every token's inputs are near +3)
    gate_up = torch.randn(experts, 2 * inner, hidden, dtype=torch.float64)
    down = torch.randn(experts, hidden, inner, dtype=torch.float64)
    args = (h, router_weight, gate_up, down, 2, router == "mixtral", router == "mixtral", "silu")
    routed = routed_experts(*args)
    torch.testing.assert_close(dense_experts(*args), routed, rtol=1e-12, atol=1e-12)
    # Reference: each token alone, its two experts in ascending order.
    flat = h.reshape(-1, hidden)
    probs = torch.softmax(flat @ router_weight.T, -1, dtype=torch.float32)
    weights, chosen = probs.topk(2, -1)
    assert 5 not in chosen
    if router == "mixtral":
        weights = weights / weights.sum(-1, keepdim=True)
    for n in range(flat.shape[0]):
        total = torch.zeros(hidden, dtype=torch.float64)
        for w, e in sorted(zip(weights[n], chosen[n].tolist()), key=lambda item: item[1]):
            gate, up = (gate_up[e] @ flat[n]).chunk(2)
            total = total + (down[e] @ (torch.nn.functional.silu(gate) * up)) * w.to(torch.float64)
        torch.testing.assert_close(routed.reshape(-1, hidden)[n], total, rtol=1e-12, atol=1e-12)


def test_unsupported_reason_names_what_is_missing():
    shape = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}
    assert unsupported_reason(Qwen2Config(use_sliding_window=True, sliding_window=8, **shape)) is None
    assert "gpt2" in unsupported_reason(build_model("gpt2", seed=0, layers=1).config)
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 64}
    reason = unsupported_reason(Phi3Config(rope_parameters=longrope, max_position_embeddings=128, **shape))
    assert "longrope" in reason and "sequence length" in reason
    same = {**longrope, "long_factor": [1.0] * 4}
    assert unsupported_reason(Phi3Config(rope_parameters=same, max_position_embeddings=128, **shape)) is None
    dynamic = Qwen2Config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, **shape)
    assert "dynamic" in unsupported_reason(dynamic)
    assert "bidirectional" in unsupported_reason(Gemma3TextConfig(use_bidirectional_attention=True, **shape))
    assert "activation 'relu'" in unsupported_reason(Qwen2Config(hidden_act="relu", **shape))
    chunked = Gemma3TextConfig(layer_types=["chunked_attention", "full_attention"], **shape)
    assert "chunked_attention" in unsupported_reason(chunked)


def test_layer_windows_follow_the_config():
    """Mistral slides on every layer; Qwen2 from ``max_window_layers`` on; Gemma on its sliding layer types."""
    assert decoder_spec(build_model("mistral", seed=0).config).windows == (WINDOW,) * 3
    assert decoder_spec(build_model("qwen2-window", seed=0).config).windows == (None, WINDOW, WINDOW)
    assert decoder_spec(build_model("gemma2", seed=0).config).windows == (WINDOW, None, WINDOW)
    assert decoder_spec(build_model("qwen3", seed=0).config).windows == (None,) * 3
