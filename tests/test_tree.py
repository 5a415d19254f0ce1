"""Tree utilities (specdec.tree) and tree verification (specdec.verify) against brute force.

- Random ragged trees: the ancestor mask, depths, root-to-leaf paths and compaction moves equal
  a plain walk up the parent pointers; PagedKVPool.compact moves exactly those entries (through the
  block tables).
- Static trees from paths and EAGLE-2-style expand/prune keep a valid tree with the right nodes.
- Greedy tree verification keeps the longest path of target-argmax matches (brute force).
- Stochastic tree verification is exact: the first two emitted tokens of many independent
  verifications (each with its own drafts, uniforms and noise) match the target's enumerated
  joint distribution (chi-square), for two siblings both drawn from a q that carries
  probability (i.i.d. and without replacement) and for deterministic siblings; a wrong sibling
  residual (the next sibling tried against the unchanged distribution) fails the same test.
"""

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdec.verify
from specdec import SpecDecError
from specdec.models.kv_pool import PagedKVPool
from specdec.tree import (
    DynamicTree,
    StaticTree,
    ancestor_mask,
    chain_parents,
    compaction_moves,
    depths,
    expand,
    prune,
    root_to_leaf_paths,
)
from specdec.verify import verify_tree_greedy, verify_tree_stochastic


def random_tree(rng: random.Random, size: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(size)]


def brute_ancestors(parents: list[int], i: int) -> list[int]:
    """Fed indices of node ``i`` (fed ``i+1``) and its ancestors, root (0) first."""
    out, node = [], i
    while node >= 0:
        out.append(node + 1)
        node = parents[node]
    return [0, *out[::-1]]


def random_batch(rng: random.Random, rows: int, width: int):
    trees = [random_tree(rng, rng.randint(0, width)) for _ in range(rows)]
    k = max(len(t) for t in trees)
    padded = torch.tensor([t + [rng.randrange(-1, 5)] * (k - len(t)) for t in trees], dtype=torch.long)
    return trees, padded.reshape(rows, k), torch.tensor([len(t) for t in trees])


def test_mask_and_depths_match_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        trees, parents, num_draft = random_batch(rng, 5, 12)
        k = parents.shape[1]
        mask = ancestor_mask(parents, num_draft)
        depth = depths(mask)
        assert mask.shape == (5, k + 1, k + 1)
        for b, tree in enumerate(trees):
            expected = torch.zeros(k + 1, k + 1, dtype=torch.bool)
            expected[0, 0] = True
            for i in range(len(tree)):
                expected[i + 1, brute_ancestors(tree, i)] = True
            for pad in range(len(tree) + 1, k + 1):
                expected[pad, pad] = True  # padding sees only itself
            assert torch.equal(mask[b], expected)
            for i in range(len(tree)):
                assert depth[b, i + 1] == len(brute_ancestors(tree, i)) - 1
            assert depth[b, 0] == 0


def test_chain_is_a_causal_mask():
    parents = torch.tensor([chain_parents(5)])
    mask = ancestor_mask(parents, torch.tensor([5]))
    assert torch.equal(mask[0], torch.ones(6, 6, dtype=torch.bool).tril())
    assert depths(mask)[0].tolist() == [0, 1, 2, 3, 4, 5]


def test_root_to_leaf_paths_match_brute_force():
    rng = random.Random(1)
    for _ in range(50):
        tree = random_tree(rng, rng.randint(0, 10))
        paths = root_to_leaf_paths(tree)
        leaves = [i for i in range(len(tree)) if i not in tree]
        assert [p[-1] for p in paths] == leaves
        for path in paths:
            assert path == [a - 1 for a in brute_ancestors(tree, path[-1])[1:]]
    with pytest.raises(SpecDecError, match="parent"):
        root_to_leaf_paths([-1, 1])


def test_compaction_moves_make_the_path_contiguous():
    """A list model of each slot: after the moves, the accepted path's entries sit at start+1.. in order."""
    rng = random.Random(2)
    pool = PagedKVPool(4, 40, 4, 40, keys=[torch.randn(161, 2, 3, dtype=torch.float64) for _ in range(2)],
                       values=[torch.randn(161, 2, 3, dtype=torch.float64) for _ in range(2)])
    for length in range(1, 41):  # the slots grow in turn: their blocks interleave
        for slot in range(4):
            pool.reserve(slot, length)

    def entries(tensor, slot, start, count):
        return tensor[pool.rows_of(slot, start, count)]

    for _ in range(20):
        slots = rng.sample(range(4), 3)
        starts = [rng.randint(0, 10) for _ in slots]
        paths, model = [], {}
        for slot, start in zip(slots, starts):
            tree = random_tree(rng, rng.randint(0, 12))
            end = rng.randrange(-1, len(tree)) if tree else -1  # the accepted path ends at a random node
            path = [a - 1 for a in brute_ancestors(tree, end)[1:]] if end >= 0 else []
            paths.append(path)
            model[slot] = [(slot, start + 1 + node) for node in path]  # (slot, index) each entry must come from
        before = [t.clone() for t in pool.keys + pool.values]
        pool.compact(*compaction_moves(slots, starts, paths))
        for tensor, old in zip(pool.keys + pool.values, before):
            for slot, start in zip(slots, starts):
                for t, (src_slot, src) in enumerate(model[slot]):
                    assert torch.equal(entries(tensor, slot, start + 1 + t, 1), entries(old, src_slot, src, 1))
                assert torch.equal(entries(tensor, slot, 0, start + 1), entries(old, slot, 0, start + 1))
            for s in range(4):
                if s not in slots:
                    assert torch.equal(entries(tensor, s, 0, 40), entries(old, s, 0, 40))


def test_static_tree_from_paths():
    tree = StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]])
    assert tree.depth == (1, 1, 1, 2, 2, 2, 3)
    assert tree.rank == (0, 1, 2, 0, 1, 0, 0)
    assert tree.parents == (-1, -1, -1, 0, 0, 1, 3)
    topk = torch.arange(2 * 3 * 3).view(2, 3, 3)  # [B, depth, rank]
    tokens = tree.tokens(topk)
    assert tokens[1].tolist() == [9, 10, 11, 12, 13, 12, 15]
    assert tree.parents_tensor(2, torch.device("cpu")).shape == (2, 7)
    for bad, message in [([[0], [0, 1, 0]], "no parent path"), ([[0], [0]], "twice"), ([[-1]], "ranks")]:
        with pytest.raises(SpecDecError, match=message):
            StaticTree.from_paths(bad)


def test_dynamic_tree_keeps_the_best_nodes_as_a_tree():
    torch.manual_seed(3)
    batch, vocab, top_k = 3, 11, 3
    tree = DynamicTree.empty(batch, torch.device("cpu"), torch.float64)
    frontier = torch.full((batch, 1), -1)
    for _ in range(3):
        logprobs = torch.log_softmax(torch.randn(batch, frontier.shape[1], vocab, dtype=torch.float64) * 2, -1)
        tree, frontier = expand(tree, frontier, logprobs, top_k, width=top_k)
    budgets = [8, 5, 12]
    tokens, parents, num_draft = prune(tree, budgets)
    assert num_draft == budgets and tokens.shape == (3, 12)
    for b, n in enumerate(budgets):
        # Brute force: the n best pool nodes by score (ties to the earlier), in pool order.
        scores = tree.scores[b].tolist()
        best = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:n])
        assert tokens[b, :n].tolist() == [tree.tokens[b, i].item() for i in best]
        for new, old in enumerate(best):
            old_parent = tree.parents[b, old].item()
            assert parents[b, new].item() == (best.index(old_parent) if old_parent >= 0 else -1)
            assert parents[b, new] < new
        # A node's score is its parent's plus a log-probability.
        for i in range(tree.tokens.shape[1]):
            parent = tree.parents[b, i].item()
            assert scores[i] <= (scores[parent] if parent >= 0 else 0.0)


def brute_greedy(tokens: list[int], tree: list[int], argmax: list[int]) -> list[int]:
    """The deepest (then earliest) node whose whole path matches; its path as node indices."""
    best: list[int] = []
    for i in range(len(tree)):
        path = [a - 1 for a in brute_ancestors(tree, i)[1:]]
        if all(tokens[n] == argmax[tree[n] + 1] for n in path) and len(path) > len(best):
            best = path
    return best


def test_greedy_tree_verification_matches_brute_force():
    rng = random.Random(4)
    vocab = 4  # small: many matches and duplicate siblings
    for _ in range(40):
        trees, parents, num_draft = random_batch(rng, 6, 10)
        k = parents.shape[1]
        tokens = torch.randint(0, vocab, (6, k), generator=torch.Generator().manual_seed(rng.randrange(1000)))
        logits = torch.randn(6, k + 1, vocab, generator=torch.Generator().manual_seed(rng.randrange(1000)))
        output, num_accepted, path = verify_tree_greedy(tokens, parents, num_draft, logits)
        argmax = logits.argmax(-1)
        for b, tree in enumerate(trees):
            expected = brute_greedy(tokens[b].tolist(), tree, argmax[b].tolist())
            n = len(expected)
            assert num_accepted[b] == n
            assert path[b, :n].tolist() == expected and (path[b, n:] == -1).all()
            last = expected[-1] + 1 if expected else 0
            assert output[b, : n + 1].tolist() == [tokens[b, i].item() for i in expected] + [argmax[b, last].item()]
            assert (output[b, n + 1 :] == -1).all()


# ---------------------------------------------------------------------- stochastic exactness
VOCAB = 5
# Fed frame: root, two children of the root (siblings), a grandchild under each.
TREE = [-1, -1, 0, 1]
SAMPLES = 40000
ROOT_P = torch.tensor([0.30, 0.25, 0.05, 0.25, 0.15], dtype=torch.float64)
Q = torch.tensor([0.10, 0.40, 0.30, 0.15, 0.05], dtype=torch.float64)  # the siblings' draft distribution


def next_p(token: int) -> torch.Tensor:
    """The target's distribution after the root's child ``token``."""
    g = torch.Generator().manual_seed(100 + token)
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, -1)


def exact_joint() -> np.ndarray:
    return (ROOT_P[:, None] * torch.stack([next_p(t) for t in range(VOCAB)])).numpy()


def draw_trees(mode: str, gen: torch.Generator):
    """``SAMPLES`` trees: tokens [S, 4] and probs [S, 4, V] (or None)."""
    first = torch.multinomial(Q.expand(SAMPLES, VOCAB), 1, generator=gen)[:, 0]
    if mode == "iid":
        second = torch.multinomial(Q.expand(SAMPLES, VOCAB), 1, generator=gen)[:, 0]
        q_second = Q.expand(SAMPLES, VOCAB)
    elif mode == "without_replacement":
        q_second = Q.expand(SAMPLES, VOCAB).scatter(1, first[:, None], 0.0)
        q_second = q_second / q_second.sum(-1, keepdim=True)
        second = torch.multinomial(q_second, 1, generator=gen)[:, 0]
    else:  # deterministic: two fixed siblings, then fixed grandchildren
        first, second = torch.full((SAMPLES,), 1), torch.full((SAMPLES,), 3)
    grand = torch.multinomial(Q.expand(SAMPLES * 2, VOCAB), 1, generator=gen)[:, 0].view(SAMPLES, 2)
    tokens = torch.stack([first, second, grand[:, 0], grand[:, 1]], dim=1)
    if mode == "deterministic":
        return tokens, None
    probs = torch.stack([Q.expand(SAMPLES, VOCAB), q_second, Q.expand(SAMPLES, VOCAB), Q.expand(SAMPLES, VOCAB)], 1)
    return tokens, probs


def sampled_joint(mode: str, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    tokens, probs = draw_trees(mode, gen)
    target = torch.zeros(SAMPLES, 5, VOCAB, dtype=torch.float64)
    target[:, 0] = ROOT_P
    table = torch.stack([next_p(t) for t in range(VOCAB)])
    target[:, 1], target[:, 2] = table[tokens[:, 0]], table[tokens[:, 1]]
    # After a grandchild: the target's distribution two tokens in (not needed for the first two tokens).
    target[:, 3:] = 1.0 / VOCAB
    uniforms = torch.rand(SAMPLES, 4, generator=gen, dtype=torch.float64)
    noise = torch.empty(SAMPLES, VOCAB, dtype=torch.float64).exponential_(generator=gen)
    parents = torch.tensor(TREE).expand(SAMPLES, 4)
    output, num_accepted, _ = verify_tree_stochastic(tokens, parents, torch.full((SAMPLES,), 4), probs, target,
                                                     uniforms, noise)
    # Rows that emitted a single token get their second from the target (as the next step would).
    counts = np.zeros((VOCAB, VOCAB))
    first = output[:, 0]
    second = output[:, 1].clone()
    single = num_accepted == 0
    if single.any():
        second[single] = torch.multinomial(table[first[single]], 1, generator=gen)[:, 0]
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    stats = (num_accepted > 0).double().mean().item(), (output[:, 0] == tokens[:, 1]).double().mean().item()
    return counts, stats


def pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() * counts.sum()
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0
    return float(chisquare(counts.ravel()[keep], expected[keep]).pvalue)


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_stochastic_tree_verification_is_exact(mode):
    counts, (accepted, second_sibling) = sampled_joint(mode, seed=5)
    p = pvalue(counts, exact_joint())
    assert p > 1e-3, f"{mode}: tree verification deviates from the target (p={p:.2e})"
    # Sharpness: drafts are accepted and rejected, and the second sibling is emitted often.
    assert 0.2 < accepted < 0.9 and second_sibling > 0.05


def test_wrong_sibling_residual_is_caught(monkeypatch):
    """Trying the second sibling against the unchanged distribution (forgetting the first's rejection)
    biases the output."""
    monkeypatch.setattr(specdec.verify, "sibling_residual", lambda r, q: r)
    for mode in ("iid", "deterministic"):
        counts, _ = sampled_joint(mode, seed=5)
        p = pvalue(counts, exact_joint())
        assert p < 1e-6, f"{mode}: a wrong sibling residual went unnoticed (p={p:.2e})"


def test_single_chain_tree_equals_chain_verification():
    """A tree that is a chain verifies exactly as the chain verifier, random numbers included."""
    gen = torch.Generator().manual_seed(6)
    batch, k = 64, 4
    tokens = torch.randint(0, VOCAB, (batch, k), generator=gen)
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    probs = torch.softmax(torch.randn(batch, k, VOCAB, generator=gen, dtype=torch.float64), -1)
    target = torch.softmax(torch.randn(batch, k + 1, VOCAB, generator=gen, dtype=torch.float64), -1)
    uniforms = torch.rand(batch, k, generator=gen, dtype=torch.float64)
    noise = torch.empty(batch, VOCAB, dtype=torch.float64).exponential_(generator=gen)
    parents = torch.tensor(chain_parents(k)).expand(batch, k)
    chain = specdec.verify.verify_stochastic(tokens, num_draft, probs, target, uniforms, noise)
    tree = verify_tree_stochastic(tokens, parents, num_draft, probs, target, uniforms, noise)
    assert torch.equal(chain[0], tree[0]) and torch.equal(chain[1], tree[1])
