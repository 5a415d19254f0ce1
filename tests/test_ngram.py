"""The n-gram (prompt lookup) drafter proposes what followed an earlier match."""

import torch

from specdec.drafters.ngram import NgramDrafter
from specdec.sampling import SamplingParams


def make(context, max_n=3, min_n=1):
    drafter = NgramDrafter(max_n, min_n, torch.device("cpu"))
    drafter.begin(context, SamplingParams(), torch.Generator())
    return drafter


def test_longest_match_wins():
    context = [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurred at 0, followed by 9 9 2.
    assert make(context).propose(context, 3).tokens.tolist() == [[9, 9, 2]]


def test_falls_back_to_shorter_ngram():
    context = [5, 6, 7, 8, 4, 6]
    assert make(context).propose(context, 2).tokens.tolist() == [[7, 8]]


def test_prefers_latest_occurrence_with_enough_continuation():
    context = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert make(context, max_n=2, min_n=2).propose(context, 2).tokens.tolist() == [[20, 21]]


def test_no_match_proposes_nothing():
    context = [1, 2, 3, 4]
    assert make(context, min_n=2).propose(context, 4).num_tokens == 0


def test_index_grows_with_the_context():
    context = [1, 2, 3]
    drafter = make(context, max_n=1, min_n=1)
    assert drafter.propose(context, 2).num_tokens == 0
    context += [4, 3]
    drafter.observe(context, 0)
    assert drafter.propose(context, 2).tokens.tolist() == [[4, 3]]
