"""The n-gram (prompt lookup) drafter proposes what followed an earlier match, per sequence."""

import torch

from specdec.drafters.ngram import NgramDrafter, _Index
from specdec.sampling import SamplingBatch, SamplingParams
from specdec.sequence import Sequence

CPU = torch.device("cpu")


def lookup(context, k, max_n=3, min_n=1):
    return _Index(min_n, max_n).lookup(context, k)


def make_seq(request_id, prompt, slot):
    seq = Sequence(request_id, list(prompt), SamplingParams(temperature=0), torch.Generator(), 100, frozenset())
    seq.slot = slot
    return seq


def sampling(seqs):
    return SamplingBatch([s.params for s in seqs], [s.generator for s in seqs], CPU)


def test_longest_match_wins():
    context = [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurred at 0, followed by 9 9 2 (the 2-gram [2, 3] would give 7 8 1).
    assert lookup(context, 3) == [9, 9, 2]


def test_falls_back_to_shorter_ngram():
    assert lookup([5, 6, 7, 8, 4, 6], 2) == [7, 8]


def test_follows_the_latest_occurrence():
    context = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert lookup(context, 2, max_n=2, min_n=2) == [20, 21]


def test_a_continuation_reaching_the_end_repeats_the_lookup():
    # [7, 8] last occurred at 5, followed only by the suffix itself: the pattern repeats.
    context = [7, 8, 1, 2, 3, 7, 8, 7, 8]
    assert lookup(context, 5, max_n=2, min_n=2) == [7, 8, 7, 8, 7]
    # The repeated lookup matches the context extended by the draft: [4, 5] again after the proposed 6 4 5.
    assert lookup([4, 5, 6, 4, 5], 4, max_n=2, min_n=2) == [6, 4, 5, 6]
    assert lookup([3, 1, 9, 5, 6, 1, 9, 5, 6], 6, max_n=2, min_n=1) == [1, 9, 5, 6, 1, 9]


def test_a_shorter_draft_is_the_start_of_a_longer_one():
    """The draft for k does not depend on k beyond its length (what the auto k policy's per-position
    acceptance assumes)."""
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        context = torch.randint(0, 4, (40,), generator=rng).tolist()
        longest = lookup(context, 16)
        assert len(longest) == 16  # four tokens: every suffix recurs
        for k in range(1, 16):
            assert lookup(context, k) == longest[:k]


def test_no_match_proposes_nothing():
    assert lookup([1, 2, 3, 4], 4, min_n=2) == []


def test_index_grows_with_the_context():
    index = _Index(1, 1)
    context = [1, 2, 3]
    assert index.lookup(context, 2) == []
    context += [4, 3]
    assert index.lookup(context, 2) == [4, 3]
    assert index.indexed_until == len(context)


def test_drafter_keeps_one_index_per_sequence():
    """Two sequences with contradicting histories in one batch each get their own continuation;
    ragged ks (0 for one row) and a row with no match give ragged drafts."""
    drafter = NgramDrafter(3, 1, CPU)
    a = make_seq("a", [1, 2, 3, 4, 1, 2], slot=0)
    b = make_seq("b", [1, 2, 9, 9, 1, 2], slot=1)
    c = make_seq("c", [5, 6, 7], slot=2)
    d = make_seq("d", [1, 2, 3, 1, 2], slot=3)
    seqs = [a, b, c, d]
    drafter.add(seqs)
    draft = drafter.propose(seqs, [3, 2, 3, 0], sampling(seqs))
    assert draft.num_draft == [3, 2, 0, 0]
    assert draft.probs is None
    assert draft.tokens.shape == (4, 3)
    assert draft.tokens[0].tolist() == [3, 4, 1]
    assert draft.tokens[1, :2].tolist() == [9, 9]

    # Sequence a commits tokens; b is untouched by it.
    a.commit([3, 4, 1])
    drafter.observe([a, b], [2, 0])
    draft = drafter.propose([a, b], [2, 2], sampling([a, b]))
    # a: [3, 4, 1] first seen at 2, followed by 2 3; b still matches its own [1, 2] -> 9 9.
    assert draft.tokens.tolist() == [[2, 3], [9, 9]]


def test_release_forgets_the_sequence():
    drafter = NgramDrafter(2, 1, CPU)
    a = make_seq("a", [1, 2, 1], slot=0)
    drafter.add([a])
    assert drafter.propose([a], [1], sampling([a])).tokens.tolist() == [[2]]
    drafter.release(a)
    assert "a" not in drafter._indexes
    # A new request reusing the id starts from a fresh index (its own prompt only).
    b = make_seq("a", [7, 8, 9], slot=0)
    drafter.add([b])
    assert drafter.propose([b], [2], sampling([b])).num_draft == [0]


def test_candidates_are_distinct_continuations_best_first():
    # [1, 2] is followed by 10 11 (at 0), 20 21 (at 4) and again 10 11 (at 8); 2 alone also by 30.
    context = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2, 10, 11, 2, 30, 1, 2]
    index = _Index(1, 2)
    assert index.candidates(context, 2, 1) == [lookup(context, 2, max_n=2)]
    assert index.candidates(context, 2, 3) == [[10, 11], [20, 21], [30, 1]]
    # The first is the repeated lookup's; the start of a candidate found already is no new candidate.
    context = [5, 1, 2, 3, 9, 1, 2, 3, 1, 2]
    assert _Index(1, 2).candidates(context, 4, 3) == [[3, 1, 2, 3], [3, 9, 1, 2]]


def test_candidate_tree_is_a_trie_within_the_budget():
    from specdec.drafters.ngram import candidate_tree

    tokens, parents = candidate_tree([[5, 6, 7, 8], [5, 9, 9], [4, 4]], budget=6)
    # Limits: the others 6 // 6 = 1 token each, the first 4; [5] is shared with the first.
    assert (tokens, parents) == ([5, 6, 7, 8, 4], [-1, 0, 1, 2, -1])
    tokens, parents = candidate_tree([[5, 6, 7, 8], [5, 9, 9]], budget=8)
    assert (tokens, parents) == ([5, 6, 7, 8, 9], [-1, 0, 1, 2, 0]) and len(tokens) <= 8
    assert candidate_tree([[1, 2], [3]], budget=1) == ([1], [-1])
    assert candidate_tree([], budget=4) == ([], [])
