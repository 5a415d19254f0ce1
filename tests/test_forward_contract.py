"""The model contract (``CausalLM.forward`` over a KV pool) against transformers' own forward, float64.

- A tree of new tokens after a cached prefix (root, two children, a grandchild; positions =
  depth) with ``hidden_layers=(0, 1, -1)``: logits and hidden states equal transformers'
  forward of prefix + nodes with the equivalent 4-D attention mask and
  ``output_hidden_states=True`` (a 4-D mask is passed through ``masking_utils`` as is).
- A ragged chain batch across several slots (in and out of slot order) equals one
  transformers forward per sequence.
- The transformers backend returns the same hidden states and refuses a tree mask.
"""

import functools

import pytest
import torch
from helpers import build_model

from specdec import SpecDecError
from specdec.models.base import ForwardBatch
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
LAYERS = (0, 1, -1)
TOL = {"rtol": 1e-9, "atol": 1e-9}

# Two trees: parents of the new tokens in feeding order (-1: the root, the pending token).
TREE_A = [-1, 0, 0, 1]  # root, two children, a grandchild under the first child
TREE_B = [-1, 0, 1, 0, 0]  # root, a child with a grandchild, two more children


@functools.cache
def models(arch):
    """(arch, transformers model, fast-or-hf backend over the same weights, hf backend)."""
    model = build_model(arch, seed=31)
    backend = "hf" if arch == "gpt2" else "fast"
    lm = load_causal_lm(model, dtype=torch.float64, device=CPU, backend=backend)
    hf = load_causal_lm(model, dtype=torch.float64, device=CPU, backend="hf")
    return arch, model, lm, hf


@pytest.fixture(params=["llama", "qwen2", "gpt2"])
def arch_models(request):
    return models(request.param)


@pytest.fixture(params=["llama", "qwen2"])
def fast_models(request):
    """The architectures the fast backend runs natively (tree masks)."""
    return models(request.param)


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestors_mask(parents) -> torch.Tensor:
    """``[T, T]`` bool: node ``n`` sees node ``j`` when ``j`` is ``n`` or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def reference_tree(model, prefix, nodes, parents):
    """transformers' forward over ``prefix + nodes``: the prefix causal, each node seeing the
    prefix and its ancestors, at position ``len(prefix) + depth``; returns the nodes'
    logits ``[T, V]`` and hidden states ``[T, len(LAYERS), H]``."""
    length, t = len(prefix), len(nodes)
    allowed = torch.zeros(length + t, length + t, dtype=torch.bool)
    allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[length:, :length] = True
    allowed[length:, length:] = ancestors_mask(parents)
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    positions = list(range(length)) + [length + d for d in depths(parents)]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([prefix + nodes]), attention_mask=additive[None, None],
            position_ids=torch.tensor([positions]), output_hidden_states=True, use_cache=False,
        )
    hidden = torch.stack([out.hidden_states[i][0, length:] for i in LAYERS], dim=1)
    return out.logits[0, length:], hidden


def reference_chain(model, tokens):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return out.logits[0], torch.stack([h[0] for h in (out.hidden_states[i] for i in LAYERS)], dim=1)


def forward_matches_chains(lm, model, cache, contexts: dict[int, tuple[list[int], list[int]]], order: list[int],
                           tolerance: dict) -> None:
    """One ragged forward (hidden states of :data:`LAYERS` kept) of each slot's new tokens, slots in ``order``
    (``contexts``: slot -> (its cached prefix, its new tokens)); every row's logits and hidden states equal
    transformers' over the slot's whole context."""
    batch = ForwardBatch.from_rows([contexts[s][1] for s in order], [len(contexts[s][0]) for s in order], order, CPU)
    batch.hidden_layers = LAYERS
    out = lm.forward(batch, cache)
    offset = 0
    for slot in order:
        prefix, new = contexts[slot]
        logits, hidden = reference_chain(model, prefix + new)
        torch.testing.assert_close(out.logits[offset : offset + len(new)], logits[len(prefix) :], **tolerance)
        torch.testing.assert_close(out.hidden[offset : offset + len(new)], hidden[len(prefix) :], **tolerance)
        offset += len(new)
    assert offset == out.logits.shape[0]


def prefill(lm, cache, prefixes: dict[int, list[int]]):
    """Cache each slot's prefix in one ragged forward with no logits."""
    slots = list(prefixes)
    batch = ForwardBatch.from_rows([prefixes[s] for s in slots], [0] * len(slots), slots, CPU, logits="none")
    out = lm.forward(batch, cache)
    assert out.logits.shape[0] == 0
    for s in slots:
        assert cache.lengths[s] == len(prefixes[s])


def tree_batch(rows, slots, cache):
    """A tree ForwardBatch: ``rows`` = [(nodes, parents)], positions = cached length + depth."""
    width = max(len(nodes) for nodes, _ in rows)
    ids, positions, masks, cu = [], [], [], [0]
    for (nodes, parents), slot in zip(rows, slots):
        ids += nodes
        positions += [cache.lengths[slot] + d for d in depths(parents)]
        mask = torch.zeros(len(nodes), width, dtype=torch.bool)
        mask[:, : len(nodes)] = ancestors_mask(parents)
        masks.append(mask)
        cu.append(len(ids))
    return ForwardBatch(torch.tensor(ids), torch.tensor(positions), list(slots), cu,
                        tree_mask=torch.cat(masks), hidden_layers=LAYERS)


@pytest.mark.parametrize("slots", [[1, 2], [3, 0]], ids=["consecutive", "gathered"])
def test_tree_mask_and_hidden_states_match_transformers(fast_models, slots):
    _, model, lm, _ = fast_models
    assert lm.supports_tree_mask
    cache = lm.new_cache(4, 64)
    prefixes = {slots[0]: [5, 17, 3, 44, 9, 21, 60], slots[1]: [8, 2, 71]}
    prefill(lm, cache, prefixes)
    trees = [([12, 33, 7, 90], TREE_A), ([4, 50, 61, 19, 2], TREE_B)]
    out = lm.forward(tree_batch(trees, slots, cache), cache)

    assert out.logits.shape == (9, lm.vocab_size)
    assert out.hidden.shape == (9, len(LAYERS), model.config.hidden_size)
    offset = 0
    for (nodes, parents), slot in zip(trees, slots):
        logits, hidden = reference_tree(model, prefixes[slot], nodes, parents)
        torch.testing.assert_close(out.logits[offset : offset + len(nodes)], logits, **TOL)
        torch.testing.assert_close(out.hidden[offset : offset + len(nodes)], hidden, **TOL)
        assert cache.lengths[slot] == len(prefixes[slot]) + len(nodes)
        offset += len(nodes)

    # Sharpness: read as a causal chain, the second child (which must not see its sibling) differs.
    chain_logits, _ = reference_chain(model, prefixes[slots[0]] + trees[0][0])
    assert not torch.allclose(chain_logits[len(prefixes[slots[0]]) + 2], out.logits[2], atol=1e-6)


def test_tree_logits_rows_select_nodes(fast_models):
    _, model, lm, _ = fast_models
    cache = lm.new_cache(2, 32)
    prefix = [9, 8, 7, 6]
    prefill(lm, cache, {1: prefix})
    nodes = [12, 33, 7, 90]
    batch = tree_batch([(nodes, TREE_A)], [1], cache)
    batch.logits_rows = torch.tensor([3, 1])
    out = lm.forward(batch, cache)
    logits, hidden = reference_tree(model, prefix, nodes, TREE_A)
    torch.testing.assert_close(out.logits, logits[[3, 1]], **TOL)
    torch.testing.assert_close(out.hidden, hidden[[3, 1]], **TOL)


def test_gathered_reads_share_one_scratch_across_forwards_of_any_shape(fast_models):
    """Rows on non-consecutive slots are read into the pool's scratch, reused by every layer and
    forward and grown only when a read needs more: keys and values never share a buffer, and each
    forward (more rows or a longer context after a smaller one, or the other way round) reads its
    own cache."""
    _, model, lm, _ = fast_models
    cache = lm.new_cache(5, 40)
    contexts = {4: [3, 9, 27, 81, 5], 1: [2, 4, 8, 16, 32, 64, 7, 14, 28, 56, 11, 22], 3: [6, 12, 24]}
    prefill(lm, cache, contexts)
    scratches = []
    for slots, new in (([4, 1], [[7], [19]]), ([3, 1, 4], [[44, 45], [46], [47, 48, 49]]), ([3, 4], [[50], [51]])):
        batch = ForwardBatch.from_rows(new, [cache.lengths[s] for s in slots], slots, CPU)
        out = lm.forward(batch, cache)
        scratches.append(cache.gather_scratch)
        offset = 0
        for slot, tokens in zip(slots, new):
            expected, _ = reference_chain(model, contexts[slot] + tokens)
            torch.testing.assert_close(out.logits[offset : offset + len(tokens)], expected[-len(tokens) :], **TOL)
            contexts[slot] = contexts[slot] + tokens
            offset += len(tokens)
    first, grown, reused = scratches
    assert first is not None and grown is not first and reused is grown  # grown once, for the larger read
    assert grown.shape[1] <= cache.keys[0].numel()


@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=["consecutive", "gathered"])
def test_ragged_chain_batch_matches_per_sequence_forward(arch_models, slots):
    """Rows of 1, 4 and 2 new tokens after cached prefixes of 6, 1 and 11 tokens (and one row with
    nothing cached), logits and hidden states of every new token."""
    arch, model, lm, _ = arch_models
    cache = lm.new_cache(4, 48)
    contexts = {
        slots[0]: ([4, 8, 15, 16, 23, 42], [7]),
        slots[1]: ([1], [2, 3, 5, 8]),
        slots[2]: ([11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47], [53, 59]),
    }
    prefill(lm, cache, {s: prefix for s, (prefix, _) in contexts.items()})
    # A fourth row in the free slot with nothing cached yet: a prefill with logits.
    free = ({0, 1, 2, 3} - set(slots)).pop()
    contexts[free] = ([], [6, 28, 49])
    order = [*slots, free]
    forward_matches_chains(lm, model, cache, contexts, order, TOL)
    for slot in order:
        assert cache.lengths[slot] == len(contexts[slot][0]) + len(contexts[slot][1])

    # logits="last": one row per sequence, the same values.
    for slot in order:
        cache.set_length(slot, len(contexts[slot][0]))
    last = ForwardBatch.from_rows([contexts[s][1] for s in order], [len(contexts[s][0]) for s in order], order, CPU,
                                  logits="last")
    out_last = lm.forward(last, cache).logits
    expected = torch.stack([reference_chain(model, contexts[s][0] + contexts[s][1])[0][-1] for s in order])
    torch.testing.assert_close(out_last, expected, **TOL)


def test_rollback_then_forward_matches_fresh_context(arch_models):
    """set_length forgets the entries past it: writing other tokens there gives the new context's logits."""
    _, model, lm, _ = arch_models
    cache = lm.new_cache(2, 32)
    prefill(lm, cache, {0: [3, 1, 4, 1, 5, 9, 2, 6], 1: [2, 7, 1, 8]})
    cache.set_length(0, 3)
    out = lm.forward(ForwardBatch.from_rows([[50, 51], [60]], [3, 4], [0, 1], CPU), cache).logits
    torch.testing.assert_close(out[:2], reference_chain(model, [3, 1, 4, 50, 51])[0][3:], **TOL)
    torch.testing.assert_close(out[2], reference_chain(model, [2, 7, 1, 8, 60])[0][-1], **TOL)
    with pytest.raises(ValueError, match="cannot roll slot 0"):
        cache.set_length(0, 6)


@pytest.mark.parametrize("slots", [[1], [0, 1]])
def test_greedy_chain_matches_greedy_decoding(arch_models, slots):
    """``greedy_chain`` (one row: the fast backend's own loop; two rows: one forward per step) returns
    each slot's greedy continuation, grows each slot by ``steps`` and leaves entries a forward reads."""
    _, model, lm, _ = arch_models
    contexts = {0: [3, 1, 4, 1, 5], 1: [2, 7, 1, 8, 2, 8, 1]}
    cache = lm.new_cache(2, 32)
    prefill(lm, cache, {s: contexts[s][:-1] for s in slots})
    chain = lm.greedy_chain(torch.tensor([contexts[s][-1] for s in slots]), slots, cache, 4)
    for row, s in zip(chain.tolist(), slots):
        tokens = list(contexts[s])
        for _ in range(4):
            tokens.append(int(reference_chain(model, tokens)[0][-1].argmax()))
        assert row == tokens[len(contexts[s]):]
        assert cache.lengths[s] == len(contexts[s]) + 3
        fed = lm.forward(ForwardBatch.from_rows([[row[-1]]], [cache.lengths[s]], [s], CPU), cache).logits
        torch.testing.assert_close(fed[0], reference_chain(model, tokens)[0][-1], **TOL)


def test_hf_backend_hidden_states_match(arch_models):
    """The transformers path (any architecture) returns the same hidden states for a ragged chain."""
    _, model, _, hf = arch_models
    cache = hf.new_cache(3, 32)
    prefill(hf, cache, {2: [9, 3, 27, 81], 0: [5, 5]})
    batch = ForwardBatch.from_rows([[1, 2, 3], [77]], [4, 2], [2, 0], CPU)
    batch.hidden_layers = LAYERS
    batch.logits_rows = torch.tensor([0, 2, 3])
    out = hf.forward(batch, cache)
    logits_a, hidden_a = reference_chain(model, [9, 3, 27, 81, 1, 2, 3])
    logits_b, hidden_b = reference_chain(model, [5, 5, 77])
    torch.testing.assert_close(out.logits, torch.stack([logits_a[4], logits_a[6], logits_b[2]]), **TOL)
    torch.testing.assert_close(out.hidden, torch.stack([hidden_a[4], hidden_a[6], hidden_b[2]]), **TOL)


def test_hf_backend_refuses_tree_mask(arch_models):
    _, _, _, hf = arch_models
    assert not hf.supports_tree_mask
    cache = hf.new_cache(1, 16)
    prefill(hf, cache, {0: [1, 2, 3]})
    with pytest.raises(SpecDecError, match="tree attention masks need the fast backend"):
        hf.forward(tree_batch([([4, 5, 6, 7], TREE_A)], [0], cache), cache)
    assert cache.lengths[0] == 3
