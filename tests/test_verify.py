"""Unit tests of the verifier on synthetic distributions (no models)."""

import torch

from specdec.verify import residual_distribution, verify_greedy, verify_stochastic


def one_hot(tokens, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).double()


def test_greedy_all_accepted_gives_bonus():
    logits = one_hot([[1, 2, 3, 4]])
    output, n = verify_greedy(torch.tensor([[1, 2, 3]]), logits)
    assert n.tolist() == [3]
    assert output.tolist() == [[1, 2, 3, 4]]


def test_greedy_first_rejected_gives_target_token():
    output, n = verify_greedy(torch.tensor([[0, 2, 3]]), one_hot([[1, 2, 3, 4]]))
    assert n.tolist() == [0]
    assert output.tolist() == [[1, -1, -1, -1]]


def test_greedy_batched_mixed():
    logits = torch.stack([one_hot([1, 2, 3]), one_hot([4, 4, 0])])
    output, n = verify_greedy(torch.tensor([[1, 0], [4, 4]]), logits)
    assert n.tolist() == [1, 2]
    assert output.tolist() == [[1, 2, -1], [4, 4, 0]]


def test_stochastic_identical_distributions_accept_everything():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 4, 5, dtype=torch.float64), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 5), 1).view(4, 3)
    _, n = verify_stochastic(drafts, p[:, :3], p, torch.Generator().manual_seed(1))
    assert n.tolist() == [3, 3, 3, 3]


def test_stochastic_zero_target_probability_always_rejects_and_recovers_elsewhere():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        output, n = verify_stochastic(torch.tensor([[0]]), q, p, gen)
        assert n.item() == 0
        assert output[0, 0].item() in (1, 2)


def test_stochastic_bonus_comes_from_last_target_row():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=torch.float64)
    output, n = verify_stochastic(torch.tensor([[1]]), q, p, torch.Generator().manual_seed(0))
    assert n.item() == 1
    assert output.tolist() == [[1, 2]]


def test_deterministic_draft_uses_one_hot_q():
    # p(d) = 0.25: accepted a quarter of the time; on rejection the draft token is excluded.
    p = torch.tensor([[[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    trials = 4000
    for _ in range(trials):
        output, n = verify_stochastic(torch.tensor([[0]]), None, p, gen)
        if n.item():
            accepted += 1
            assert output.tolist() == [[0, 0]]
        else:
            assert output[0, 0].item() == 1
    assert abs(accepted / trials - 0.25) < 0.03


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(residual_distribution(p, p), p)
