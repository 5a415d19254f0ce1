"""Unit tests of the batched chain verifier on synthetic distributions (no models).

The verifier is pure: the uniforms and the exponential noise are inputs, so every case
here is exact, and ragged rows (fewer drafts than K, or none) are checked alongside full ones.
"""

import torch

from specdec.verify import greedy_accepted, residual_distribution, verify_stochastic


def one_hot(tokens, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).double()


def ones_noise(batch, vocab=5):
    return torch.ones(batch, vocab, dtype=torch.float64)


def test_greedy_all_accepted_gives_bonus():
    assert greedy_accepted([1, 2, 3, 4], [1, 2, 3], 3) == 3  # emits 1 2 3 and the bonus 4


def test_greedy_first_rejected_gives_target_token():
    assert greedy_accepted([1, 2, 3, 4], [0, 2, 3], 3) == 0  # emits the target's 1


def test_greedy_ragged_rows():
    """Row 0 drafts 2 of K=3 (its third column is padding that happens to match the target and
    must not be accepted); row 1 drafts nothing; row 2 is rejected at its second draft; row 3
    accepts all 3."""
    targets = [[1, 2, 3, 4], [3, 3, 3, 3], [4, 4, 0, 1], [2, 2, 2, 1]]
    drafts = [[1, 2, 3], [0, 0, 0], [4, 0, 4], [2, 2, 2]]
    counts = [greedy_accepted(t, d, n) for t, d, n in zip(targets, drafts, [2, 0, 3, 3])]
    assert counts == [2, 0, 1, 3]


def test_greedy_without_drafts():
    assert greedy_accepted([3], [], 0) == 0


def test_greedy_matching_equals_a_greedy_stochastic_call():
    """Random ragged batches: the host matching accepts what the tensor verifier accepts for greedy rows."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch, width, vocab = 4, 5, 3
        drafts = torch.randint(0, vocab, (batch, width), generator=gen)
        num_draft = torch.randint(0, width + 1, (batch,), generator=gen)
        target = torch.randint(0, vocab, (batch, width + 1), generator=gen)
        probs = torch.nn.functional.one_hot(target, vocab).double()
        output, n = verify_stochastic(drafts, num_draft, None, probs, torch.zeros(batch, width, dtype=torch.float64),
                                      ones_noise(batch, vocab))
        host = [greedy_accepted(t, d, k) for t, d, k in zip(target.tolist(), drafts.tolist(), num_draft.tolist())]
        assert host == n.tolist()
        for b, k in enumerate(host):
            assert output[b, : k + 1].tolist() == target[b, : k + 1].tolist()


def test_stochastic_identical_distributions_accept_everything():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 4, 5, dtype=torch.float64), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 5), 1).view(4, 3)
    uniforms = torch.rand(4, 3, dtype=torch.float64)
    noise = torch.empty(4, 5, dtype=torch.float64).exponential_()
    output, n = verify_stochastic(drafts, torch.tensor([3, 3, 3, 3]), p[:, :3], p, uniforms, noise)
    assert n.tolist() == [3, 3, 3, 3]
    assert output[:, :3].tolist() == drafts.tolist()
    # The bonus is the exponential race over the last target row.
    assert output[:, 3].tolist() == (p[:, 3] / noise).argmax(-1).tolist()


def test_stochastic_ragged_rows_stop_at_their_own_draft_count():
    """q == p accepts every real draft; a row with n < K emits its bonus from column n, and a
    row with no drafts samples from column 0."""
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(3, 4, 5, dtype=torch.float64), -1)
    drafts = torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]])
    noise = torch.empty(3, 5, dtype=torch.float64).exponential_()
    output, n = verify_stochastic(drafts, torch.tensor([3, 1, 0]), p[:, :3], p, torch.zeros(3, 3,
                                  dtype=torch.float64), noise)
    assert n.tolist() == [3, 1, 0]
    bonus = [(p[b, c] / noise[b]).argmax().item() for b, c in enumerate([3, 1, 0])]
    assert output.tolist() == [[1, 2, 3, bonus[0]], [4, bonus[1], -1, -1], [bonus[2], -1, -1, -1]]


def test_stochastic_acceptance_threshold_is_p_over_q():
    """d is accepted exactly when u * q(d) < p(d)."""
    p = torch.tensor([[[0.3, 0.7, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64).expand(4, 2, 3)
    q = torch.tensor([[[0.6, 0.4, 0.0]]], dtype=torch.float64).expand(4, 1, 3)
    uniforms = torch.tensor([[0.0], [0.49], [0.51], [0.99]], dtype=torch.float64)
    output, n = verify_stochastic(torch.zeros(4, 1, dtype=torch.long), torch.tensor([1] * 4), q, p, uniforms,
                                  torch.ones(4, 3, dtype=torch.float64))
    assert n.tolist() == [1, 1, 0, 0]  # p/q = 0.5
    # Accepted rows get the bonus from p[1] (token 2); rejected rows the residual max(p - q, 0) = token 1.
    assert output.tolist() == [[0, 2], [0, 2], [1, -1], [1, -1]]


def test_stochastic_zero_target_probability_always_rejects_and_recovers_elsewhere():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(20):
        uniforms = torch.rand(1, 1, generator=gen, dtype=torch.float64)
        noise = torch.empty(1, 5, dtype=torch.float64).exponential_(generator=gen)
        output, n = verify_stochastic(torch.tensor([[0]]), torch.tensor([1]), q, p, uniforms, noise)
        assert n.item() == 0
        seen.add(output[0, 0].item())
    assert seen == {1, 2}


def test_stochastic_bonus_comes_from_last_target_row():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=torch.float64)
    output, n = verify_stochastic(torch.tensor([[1]]), torch.tensor([1]), q, p, torch.tensor([[0.9]],
                                  dtype=torch.float64), ones_noise(1, 3))
    assert n.item() == 1
    assert output.tolist() == [[1, 2]]


def test_deterministic_draft_uses_one_hot_q():
    # p(d) = 0.25: accepted a quarter of the time; on rejection the draft token is excluded.
    p = torch.tensor([[[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    trials = 4000
    gen = torch.Generator().manual_seed(0)
    uniforms = torch.rand(trials, 1, generator=gen, dtype=torch.float64)
    noise = torch.empty(trials, 3, dtype=torch.float64).exponential_(generator=gen)
    output, n = verify_stochastic(torch.zeros(trials, 1, dtype=torch.long), torch.tensor([1] * trials), None,
                                  p.expand(trials, 2, 3), uniforms, noise)
    accepted = n.bool()
    assert (output[accepted] == torch.tensor([0, 0])).all()
    assert (output[~accepted] == torch.tensor([1, -1])).all()
    assert abs(accepted.double().mean().item() - 0.25) < 0.03


def test_greedy_rows_in_a_stochastic_call():
    """A greedy row (one-hot p and q, u = 0, noise 1) keeps exactly the drafts equal to the argmax."""
    p = one_hot([[2, 3, 1]], vocab=4)
    drafts = torch.tensor([[2, 0]])
    q = one_hot([[2, 0]], vocab=4)
    output, n = verify_stochastic(drafts, torch.tensor([2]), q, p, torch.zeros(1, 2, dtype=torch.float64),
                                  ones_noise(1, 4))
    assert n.tolist() == [1]
    assert output.tolist() == [[2, 3, -1]]


def test_rows_are_independent():
    """A row's result depends on its own inputs only: verifying rows together or one at a time agrees."""
    torch.manual_seed(2)
    b, k, v = 6, 3, 7
    p = torch.softmax(torch.randn(b, k + 1, v, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(b, k, v, dtype=torch.float64) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, v), 1).view(b, k)
    num_draft = torch.tensor([3, 0, 2, 1, 3, 2])
    uniforms = torch.rand(b, k, dtype=torch.float64)
    noise = torch.empty(b, v, dtype=torch.float64).exponential_()
    together = verify_stochastic(drafts, num_draft, q, p, uniforms, noise)
    for row in range(b):
        s = slice(row, row + 1)
        alone = verify_stochastic(drafts[s], num_draft[s], q[s], p[s], uniforms[s], noise[s])
        assert together[0][row].tolist() == alone[0][0].tolist()
        assert together[1][row].item() == alone[1].item()


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(residual_distribution(p, p), p)
