"""Sampled speculative output follows the target's distribution exactly.

The exact joint distribution of the first two generated tokens is enumerated from the
target under the same SamplingParams; thousands of seeded speculative runs are compared to
it with a chi-square test. A deliberately broken verifier (the recovered token drawn from
``p`` instead of the residual ``norm(max(p - q, 0))``) fails the same test.
"""

import numpy as np
import pytest
import torch
from helpers import build_model
from scipy.stats import chisquare

import specdec.verify
from specdec import LLM, SamplingParams
from specdec.sampling import logits_to_probs

VOCAB = 12
PROMPT = [3, 1, 4]
RUNS = 2000
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_k": 6},
    {"temperature": 1.3, "top_p": 0.8, "min_p": 0.02},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    # Weights x3 give peaked distributions; two different seeds make q differ from p
    # (overlap ~0.5: about half the drafts are rejected and the residual matters).
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    draft = build_model("llama", seed=12, vocab=VOCAB, layers=1, scale=3.0)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return target, root


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of plain sampling from the target, ``[V, V]``."""
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], params)
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = logits_to_probs(target(contexts).logits[:, -1], params)
    return (first[:, None] * second).numpy()


def empirical_joint(llm: LLM, params: dict, max_tokens: int) -> np.ndarray:
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(RUNS):
        sampling = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **params)
        tokens = llm.generate({"prompt_token_ids": PROMPT}, sampling)[0].outputs[0].token_ids
        counts[tokens[0], tokens[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test with cells of expected count < 5 pooled into one."""
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[probs.ravel() == 0].sum() > 0:
        return 0.0  # a token the target can never produce
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


CASES = [(settings, 1, 2) for settings in SETTINGS] + [(SETTINGS[0], 2, 3)]


def case_id(case) -> str:
    settings, k, max_tokens = case
    return ",".join(f"{key}={value}" for key, value in settings.items()) + f",k={k},max_tokens={max_tokens}"


@pytest.mark.parametrize("settings,k,max_tokens", CASES, ids=[case_id(c) for c in CASES])
def test_draft_model_sampling_matches_target(pair, settings, k, max_tokens):
    """k=1, two tokens: rejection/residual at the first token, bonus at the second.
    k=2, three tokens: the first two tokens also go through a residual after an acceptance."""
    target, root = pair
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": k}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64")
    counts = empirical_joint(llm, settings, max_tokens)
    pvalue = chi_square_pvalue(counts, exact_joint(target, SamplingParams(**settings)))
    assert pvalue > 1e-3, f"speculative samples deviate from the target distribution (p={pvalue:.2e})"


def test_broken_residual_is_caught(pair, monkeypatch):
    """Recovering from p instead of norm(max(p - q, 0)) biases the output; the test must see it."""
    target, root = pair
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 1}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64")
    settings = SETTINGS[0]
    counts = empirical_joint(llm, settings, max_tokens=2)
    pvalue = chi_square_pvalue(counts, exact_joint(target, SamplingParams(**settings)))
    assert pvalue < 1e-6, f"a wrong residual went unnoticed (p={pvalue:.2e})"


def test_draft_differs_from_target(pair):
    """Guard: the test is only sharp when many drafts are rejected and the residual differs from p."""
    target, root = pair
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(root / "draft", dtype=torch.float64)
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], params)
        q = logits_to_probs(draft(torch.tensor([PROMPT])).logits[0, -1], params)
    overlap = torch.minimum(p, q).sum().item()
    assert 0.2 < overlap < 0.8, f"acceptance probability {overlap:.2f} makes the test blunt"
    distance = 0.5 * (specdec.verify.residual_distribution(p, q) - p).abs().sum().item()
    assert distance > 0.2, f"the residual is too close to p ({distance:.2f}) to catch a wrong one"
