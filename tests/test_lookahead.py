"""Lookahead decoding (``method="lookahead"``): the Jacobi window, the n-gram pool and the tree one
step proposes (pure helpers), then end to end on float64 tiny models.

- Greedy: batches of prompts of different lengths equal transformers' greedy ``generate``, for a
  few (k, W, N, G); two ``LLM``s of different methods (lookahead and ngram) over one target,
  their streams consumed interleaved in one process, each equal transformers.
- The engine's argmax hand-over: after every step, the argmax after the pending token is the token
  greedy decoding committed there, and the argmax after every window node whose path was right is
  the next committed token (rows, columns and the fed frame line up).
- Sampling: the first two sampled tokens follow the target's distribution (the chi-square test of
  test_sampling_exactness); a tree verifier that forgets to remove a rejected deterministic
  sibling from the residual fails the same test.
- Bad config: W, N, G out of range or of the wrong type, a model, a backend without tree masks,
  lookahead as a candidate of ``auto``.
"""

import pytest
from test_greedy_equality import MAX_TOKENS, PROMPTS
from test_sampling_exactness import BATCH, NGRAM_PROMPT, assert_matches_target, pair, pvalues  # noqa: F401  (pair: a fixture)
from test_tree_engine import greedy_refs, run_batch  # noqa: F401  (greedy_refs: a fixture)

import specdec.verify
from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.jacobi import JacobiWindow, NgramPool, lookahead_tree
from specdec.tree import check_parents


# ---------------------------------------------------------------------- the pool
def test_pool_keeps_the_most_recent_continuations_per_key():
    pool = NgramPool(3, per_key=2)
    for gram in ([1, 2, 3], [1, 4, 5], [7, 8, 9], [1, 6, 6]):
        pool.add(gram)
    assert pool.candidates(1, 5) == [(6, 6), (4, 5)]  # (2, 3) fell off: two per key
    assert pool.candidates(7, 5) == [(8, 9)]
    assert pool.candidates(1, 1) == [(6, 6)]
    assert pool.candidates(42, 3) == []
    pool.add([1, 4, 5])  # already there: moves to the front, no duplicate
    assert pool.candidates(1, 5) == [(4, 5), (6, 6)]


def test_pool_takes_the_context_ngrams_from_an_index_on():
    pool = NgramPool(3, per_key=4)
    tokens = [5, 6, 7, 5, 6, 8]
    pool.add_context(tokens[:4])
    assert pool.table == {5: [(6, 7)], 6: [(7, 5)]}
    pool.add_context(tokens, first_end=4)  # the n-grams ending at the two new tokens
    assert pool.candidates(5, 4) == [(6, 8), (6, 7)]
    assert pool.candidates(7, 4) == [(5, 6)]
    assert sum(len(v) for v in pool.table.values()) == len(tokens) - 2


# ---------------------------------------------------------------------- the window
def test_window_starts_from_context_tokens_and_is_seeded():
    context = [11, 12, 13, 14]
    a, b = JacobiWindow(5, 2, context, seed=3), JacobiWindow(5, 2, context, seed=3)
    assert a.window == b.window and len(a.window) == 5 and set(a.window) <= set(context)
    assert a.start == len(context) and a.levels == [a.window]


def test_jacobi_update_collects_the_trajectory_diagonals():
    """N = 3: two levels; the n-gram at offset j is (older[j], newer[j+1], out[j+2])."""
    window = JacobiWindow(4, 2, [0], seed=0)
    window.levels = [[10, 11, 12, 13]]
    assert window.update([20, 21, 22, 23, 24]) == []  # one level only: no diagonal of 3 yet
    assert window.levels == [[10, 11, 12, 13], [20, 21, 22, 23, 24]]
    grams = window.update([30, 31, 32, 33, 34])  # [20..24] was the window fed
    assert grams == [[10, 21, 32], [11, 22, 33], [12, 23, 34]]
    assert window.levels == [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]  # the oldest level left


def test_update_of_a_partly_fed_window_keeps_the_unfed_guesses():
    window = JacobiWindow(5, 1, [0], seed=0)  # N = 2: bigrams (guess, argmax after it)
    window.levels = [[1, 2, 3, 4, 5]]
    assert window.update([7, 8, 9]) == [[1, 8], [2, 9]]  # two window tokens were fed
    assert window.levels == [[7, 8, 9, 4, 5]]


def test_advance_shifts_every_level_and_refills_the_window():
    context = [50, 51, 52]
    window = JacobiWindow(4, 2, context, seed=1)
    window.levels = [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
    window.advance(context + [60, 61])  # two tokens committed
    assert window.start == 5
    assert window.levels[0] == [3, 4]
    assert window.levels[1][:3] == [7, 8, 9] and len(window.levels[1]) == 4
    assert window.levels[1][3] in context + [60, 61]
    assert window.window == window.levels[1]


# ---------------------------------------------------------------------- the tree
def test_tree_merges_candidates_then_adds_the_window_chain():
    tokens, parents, window_nodes = lookahead_tree([(1, 2), (1, 3), (4, 5)], [7, 8, 9], budget=16)
    assert tokens == [1, 2, 3, 4, 5, 7, 8, 9]
    assert parents == [-1, 0, 0, -1, 3, -1, 5, 6]
    assert window_nodes == [5, 6, 7]
    check_parents(parents)


@pytest.mark.parametrize("budget", range(0, 10))
def test_tree_stays_in_budget_and_keeps_half_for_the_window(budget):
    candidates, window = [(1, 2, 3), (4, 5, 6), (7, 8, 9)], [20, 21, 22, 23, 24]
    tokens, parents, window_nodes = lookahead_tree(candidates, window, budget)
    assert len(tokens) == len(parents) == min(budget, 14)
    check_parents(parents)
    assert len(window_nodes) == min(len(window), max(-(-budget // 2), budget - 9))
    assert [tokens[n] for n in window_nodes] == window[: len(window_nodes)]
    assert [parents[n] for n in window_nodes] == [-1, *window_nodes][: len(window_nodes)]


def test_tree_gives_the_window_what_the_candidates_leave():
    tokens, _, window_nodes = lookahead_tree([(1, 2)], [20, 21, 22, 23, 24], budget=6)
    assert tokens == [1, 2, 20, 21, 22, 23] and window_nodes == [2, 3, 4, 5]
    assert lookahead_tree([], [20, 21], budget=6)[2] == [0, 1]


# ---------------------------------------------------------------------- end to end, greedy
SETTINGS_GREEDY = [
    {"num_speculative_tokens": 8},  # the defaults W=2, N=4, G=2
    {"num_speculative_tokens": 16, "lookahead_window": 6, "lookahead_ngram": 4, "lookahead_guesses": 3},
    {"num_speculative_tokens": 3, "lookahead_window": 5, "lookahead_ngram": 2, "lookahead_guesses": 1},
]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("spec", SETTINGS_GREEDY, ids=["defaults", "wide", "tight"])
def test_greedy_matches_transformers(model_dirs, greedy_refs, arch, spec):  # noqa: F811
    llm = LLM(model_dirs[arch]["target"], dtype="float64", speculative_config={"method": "lookahead", **spec},
              max_num_seqs=4)
    assert run_batch(llm) == greedy_refs[arch][1]
    metrics = llm.batch_metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    assert not llm.engine.drafter._states and max(llm.engine.cache.lengths) == 0


def test_argmax_hand_over_lines_up_with_the_committed_tokens(model_dirs, greedy_refs):  # noqa: F811
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4,
              speculative_config={"method": "lookahead", "num_speculative_tokens": 10, "lookahead_window": 5})
    drafter = llm.engine.drafter
    seen = {"steps": 0, "window_nodes_checked": 0}
    original = drafter.observe

    def checked_observe(seqs, num_accepted):
        for s in seqs:
            state = drafter._states[s.request_id]
            if state.out is None:
                continue
            start = state.window.start
            committed = s.token_ids[start:]
            assert state.out[0] == committed[0], "the argmax after the pending token is the committed token"
            window = state.window.window
            for i in range(1, len(state.out)):
                if i >= len(committed) or window[: i] != committed[: i]:
                    break
                assert state.out[i] == committed[i], "the argmax after a right window prefix is the next token"
                seen["window_nodes_checked"] += 1
            seen["steps"] += 1
        original(seqs, num_accepted)

    drafter.observe = checked_observe
    assert run_batch(llm) == greedy_refs["llama"][1]
    assert seen["steps"] > 50 and seen["window_nodes_checked"] > 0


def test_interleaved_with_another_method_in_one_process(model_dirs, greedy_refs):  # noqa: F811
    """A lookahead LLM and an ngram LLM over the same target: their streams are consumed in turns
    (so their steps interleave), and every output equals transformers' greedy output."""
    target = model_dirs["llama"]["target"]
    llms = [LLM(target, dtype="float64", max_num_seqs=3, speculative_config=spec) for spec in (
        {"method": "lookahead", "num_speculative_tokens": 8},
        {"method": "ngram", "num_speculative_tokens": 4, "num_candidates": 2})]
    streams, outputs = [], []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        streams.append(llms[i % 2].stream({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n)))
        outputs.append([])
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            piece = next(streams[i], None)
            if piece is None:
                live.discard(i)
            else:
                outputs[i].extend(piece.token_ids)
    assert outputs == greedy_refs["llama"][1]
    assert llms[0].batch_metrics.num_accepted_tokens > 0


# ---------------------------------------------------------------------- sampling
LOOKAHEAD_SAMPLING = {"method": "lookahead", "num_speculative_tokens": 4, "lookahead_window": 2,
                      "lookahead_ngram": 3, "lookahead_guesses": 2}


def test_sampling_matches_target(pair):  # noqa: F811
    """Two-token candidates from the prompt ([4] was followed by 3 3) beside a two-token window."""
    target, root = pair
    llm = LLM(root / "target", speculative_config=LOOKAHEAD_SAMPLING, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, NGRAM_PROMPT, "lookahead")
    batch = llm.batch_metrics
    assert batch.mean_batch_size > 8


def test_residual_that_keeps_a_rejected_sibling_is_caught(pair, monkeypatch):  # noqa: F811
    """A rejected deterministic node must leave the residual; keeping it biases the output."""
    target, root = pair
    monkeypatch.setattr(specdec.verify, "sibling_residual", lambda r, q: r)
    llm = LLM(root / "target", speculative_config=LOOKAHEAD_SAMPLING, dtype="float64", max_num_seqs=BATCH)
    assert min(pvalues(target, llm, NGRAM_PROMPT, (3, 2))) < 1e-6


# ---------------------------------------------------------------------- bad config
@pytest.mark.parametrize("field,value", [
    ("lookahead_window", 0), ("lookahead_window", 65), ("lookahead_window", True), ("lookahead_window", 2.0),
    ("lookahead_ngram", 1), ("lookahead_ngram", 17), ("lookahead_ngram", "3"),
    ("lookahead_guesses", -1), ("lookahead_guesses", 17), ("lookahead_guesses", None),
])
def test_bad_lookahead_config(model_dirs, field, value):
    with pytest.raises(SpecDecError, match=f"{field} must be an integer in"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "lookahead", field: value})


def test_lookahead_refuses_a_model_a_slow_backend_and_auto(model_dirs):
    target = model_dirs["llama"]["target"]
    with pytest.raises(SpecDecError, match="takes no 'model'"):
        LLM(target, speculative_config={"method": "lookahead", "model": str(target)})
    with pytest.raises(SpecDecError, match="need the fast backend"):
        LLM(model_dirs["gpt2"]["target"], speculative_config={"method": "lookahead"})
    with pytest.raises(SpecDecError, match="auto candidate 0 \\(lookahead\\)"):
        LLM(target, speculative_config={"method": "auto", "candidates": [{"method": "lookahead"}]})
