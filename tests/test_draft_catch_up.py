"""A draft model's catch-up folded into its proposal's forward (:meth:`DraftModelDrafter._folds`): where the rows
that draft are a few positions behind (the steps they sat out), the proposal's first forward feeds the whole
backlog and no catch-up forward runs; the drafts are the ones a catch-up forward of its own gives (float64)."""

import pytest

from specdec import LLM, SamplingParams
from specdec.drafters import draft_model

PROMPTS = [[(5 * i) % 50 + 3 for i in range(6)], [(7 * i) % 40 + 5 for i in range(9)]]


def drafting_after_sitting_out(model_dirs, steps: int) -> tuple[list[int], list[list[int]], int, list[int]]:
    """Two greedy rows sit out ``steps`` steps and then draft 4 positions: ``(their backlogs before the drafting
    step, the drafts, the draft model's forwards in the drafting step's catch-up, the backlogs after)``."""
    dirs = model_dirs["llama"]
    config = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 4}
    llm = LLM(dirs["target"], dtype="float64", speculative_config=config)
    for prompt in PROMPTS:
        llm.submit({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine, drafter = llm.engine, llm.engine.drafter
    engine.policy.choose = lambda seqs, limits, *_: [0] * len(seqs)
    for _ in range(steps):
        llm.step()
    seqs = list(llm.scheduler.running)
    assert len(seqs) == 2
    before = drafter.backlog(seqs)
    engine.policy.choose = lambda seqs, limits, *_: [min(4, limit) for limit in limits]
    forwards, drafts = [], []
    model_forward, catch_up, propose = drafter.model.forward, drafter.catch_up, drafter.propose

    def counted(*args, **kwargs):
        forwards[-1] += 1
        return model_forward(*args, **kwargs)

    def counted_catch_up(seqs, ks):
        forwards.append(0)
        drafter.model.forward = counted
        try:
            catch_up(seqs, ks)
        finally:
            drafter.model.forward = model_forward

    def proposed(seqs, ks, sampling):
        batch = propose(seqs, ks, sampling)
        drafts.extend(batch.tokens[b, :k].tolist() for b, k in enumerate(batch.num_draft))
        return batch

    drafter.catch_up, drafter.propose = counted_catch_up, proposed
    llm.step()
    return before, drafts, forwards[0], drafter.backlog(seqs)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_small_catch_up_is_fed_by_the_proposal(model_dirs, monkeypatch, steps):
    """Rows 6 and 9 prompt tokens long that sat out ``steps`` steps draft with no catch-up forward (their backlogs,
    ragged, fed by the proposal's first forward), and draft what they draft after a catch-up forward of their own
    (the fold turned off); either way the proposal leaves them caught up."""
    before, folded, forwards, after = drafting_after_sitting_out(model_dirs, steps)
    assert before == [len(p) + steps for p in PROMPTS] and forwards == 0
    assert all(n <= 2 for n in after)
    monkeypatch.setattr(draft_model, "FOLD_CELLS", 0)
    before_apart, apart, forwards_apart, after_apart = drafting_after_sitting_out(model_dirs, steps)
    assert before_apart == before and forwards_apart == 1 and after_apart == after
    assert folded == apart and all(len(d) == 4 for d in folded)


def test_the_fold_is_bounded_by_width_and_cells(model_dirs, monkeypatch):
    """A backlog wider than ``FOLD_WIDTH``, or more grid cells than ``FOLD_CELLS`` beyond the two-token forward,
    gets its catch-up forward (the 9-token prompt after 3 steps: 12 positions, 2 x 10 cells beyond two)."""
    monkeypatch.setattr(draft_model, "FOLD_WIDTH", 11)
    assert drafting_after_sitting_out(model_dirs, 3)[2] == 1
    monkeypatch.setattr(draft_model, "FOLD_WIDTH", 12)
    assert drafting_after_sitting_out(model_dirs, 3)[2] == 0
    monkeypatch.setattr(draft_model, "FOLD_CELLS", 19)
    assert drafting_after_sitting_out(model_dirs, 3)[2] == 1
