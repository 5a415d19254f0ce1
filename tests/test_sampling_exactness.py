"""Sampled speculative output follows the target's distribution exactly, with per-row sampling
parameters inside one batch.

Every ``generate`` call holds 32 requests: four sampled settings (different temperature,
top-k, top-p and min-p), six requests of each, plus eight greedy rows (the larger batch halves the steps
a test takes; a tiny model's step costs little more for 32 rows than for 16). For each setting the
exact joint distribution of the first two generated tokens is enumerated from the target,
and 2000 seeded samples are compared to it with a chi-square test; the greedy rows must give
the greedy tokens every time. A deliberately broken verifier (the recovered token drawn
from ``p`` instead of the residual ``norm(max(p - q, 0))``) fails the same test.
"""

import numpy as np
import pytest
import torch
from helpers import build_model
from scipy.stats import chisquare

import specdec.verify
from specdec import LLM, SamplingParams, keyed_noise
from specdec.sampling import logits_to_probs

VOCAB = 12
PROMPT = [3, 1, 4]
NGRAM_PROMPT = [3, 1, 4, 3, 3, 1, 4]  # [3, 1, 4] occurred before: ngram drafts 3 3 (3 is the likeliest token)
SAMPLES = 2000
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_k": 6},
    {"temperature": 1.3, "top_p": 0.8, "min_p": 0.02},
    {"temperature": 0.6, "top_k": 9, "min_p": 0.1},
]
PER_SETTING = 6  # requests of each setting per generate call
GREEDY_ROWS = 8  # greedy requests per generate call
BATCH = PER_SETTING * len(SETTINGS) + GREEDY_ROWS  # requests per generate call: the max_num_seqs of the LLMs tested
CALLS = -(-SAMPLES // PER_SETTING)


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


def exact_joint(target, prompt, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of plain sampling from the target, ``[V, V]``."""
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1], params)
        contexts = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second = logits_to_probs(target(contexts).logits[:, -1], params)
    return (first[:, None] * second).numpy()


def greedy_tokens(target, prompt, n):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def empirical_joints(llm: LLM, prompt, max_tokens: tuple[int, ...], greedy: list[int]) -> list[np.ndarray]:
    """Counts of the first two tokens per setting, from ``CALLS`` mixed batches of 32 requests.

    The requests of a setting alternate their ``max_tokens`` over ``max_tokens`` (so with k=2 some
    rows draft 2 tokens and others 1 in the same step: ragged drafts under sampling)."""
    counts = [np.zeros((VOCAB, VOCAB)) for _ in SETTINGS]
    request = {"prompt_token_ids": prompt}
    for call in range(CALLS):
        params, which = [], []
        for j in range(PER_SETTING * len(SETTINGS)):
            setting = j % len(SETTINGS)
            seed = (call * PER_SETTING * len(SETTINGS) + j) * 7919 + 1
            budget = max_tokens[(j // len(SETTINGS)) % len(max_tokens)]
            params.append(SamplingParams(max_tokens=budget, seed=seed, ignore_eos=True, **SETTINGS[setting]))
            which.append(setting)
        for j in range(GREEDY_ROWS):
            params.insert(3 * j + 1, SamplingParams(temperature=0, max_tokens=max_tokens[j % len(max_tokens)]))
            which.insert(3 * j + 1, None)
        outputs = llm.generate([request] * len(params), params)
        for setting, output, p in zip(which, outputs, params, strict=True):
            tokens = output.outputs[0].token_ids
            assert len(tokens) == p.max_tokens
            if setting is None:
                assert tokens == greedy[: p.max_tokens], "a greedy row in a sampled batch left the greedy path"
            else:
                counts[setting][tokens[0], tokens[1]] += 1
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


def pvalues(target, llm, prompt, max_tokens):
    counts = empirical_joints(llm, prompt, max_tokens, greedy_tokens(target, prompt, max(max_tokens)))
    return [chi_square_pvalue(c, exact_joint(target, prompt, SamplingParams(**s))) for c, s in zip(counts, SETTINGS)]


def assert_matches_target(target, llm, prompt, what: str, max_tokens=(3, 2)) -> None:
    """The chi-square test of ``llm``'s first sampled tokens after ``prompt`` against ``target``'s exact
    distribution under every row of SETTINGS (:func:`pvalues`), and the guard that the run both
    accepted and rejected drafts (else it tested nothing). ``what`` names the samples in messages."""
    for settings, pvalue in zip(SETTINGS, pvalues(target, llm, prompt, max_tokens)):
        assert pvalue > 1e-3, f"{settings}: {what} samples deviate from the target distribution (p={pvalue:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"


CASES = [
    # k=1, two tokens: rejection/residual at the first token, bonus at the second.
    ("draft_model", 1, (2,)),
    # k=2: rows of 3 tokens draft 2 (the second token can also come from a residual after an
    # acceptance), rows of 2 tokens draft 1, in the same steps.
    ("draft_model", 2, (3, 2)),
    # A deterministic drafter: verified against a one-hot q.
    ("ngram", 2, (3, 2)),
    # A deterministic drafter whose drafts also come from earlier requests' (sampled) outputs.
    ("suffix", 2, (3, 2)),
    # The target's first layer and head draft (q returned); verification resumes after that layer.
    ("layer_skip", 2, (3, 2)),
]


@pytest.mark.parametrize("method,k,max_tokens", CASES, ids=[f"{m}-k{k}" for m, k, _ in CASES])
def test_mixed_batch_sampling_matches_target(pair, method, k, max_tokens):
    target, root = pair
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(root / "draft")
    prompt = NGRAM_PROMPT if method in ("ngram", "suffix") else PROMPT
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, prompt, "speculative", max_tokens)
    assert llm.batch_metrics.mean_batch_size > 8, "the requests must have run batched"


def test_broken_residual_is_caught(pair, monkeypatch):
    """Recovering from p instead of norm(max(p - q, 0)) biases the output; the test must see it."""
    target, root = pair
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 1}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    results = pvalues(target, llm, PROMPT, (2,))
    for settings, pvalue in zip(SETTINGS, results):
        assert pvalue < 1e-6, f"{settings}: a wrong residual went unnoticed (p={pvalue:.2e})"


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


KEYED_CASES = [("draft_model", 2, (3, 2)), ("suffix", 2, (3, 2))]


@pytest.mark.parametrize("method,k,max_tokens", KEYED_CASES, ids=[f"{m}-k{k}" for m, k, _ in KEYED_CASES])
def test_keyed_sampling_matches_target(pair, method, k, max_tokens):
    """The deterministic mode's keyed sampling (:mod:`specdec.keyed_noise`: the race's noise a function of
    seed and token index, drafts kept when equal to the target's sample) is exact too."""
    target, root = pair
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(root / "draft")
    prompt = NGRAM_PROMPT if method in ("ngram", "suffix") else PROMPT
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH, deterministic=True)
    assert_matches_target(target, llm, prompt, "keyed speculative", max_tokens)


def test_broken_keyed_race_is_caught(pair, monkeypatch):
    """A race over uniform noise instead of exponential noise is biased; the keyed test must see it."""
    target, root = pair
    exponential = keyed_noise.keyed_noise

    def uniform_noise(keys, indices, vocab, dtype, device):
        out = exponential(keys, indices, vocab, dtype, device)
        return torch.where(out == 1.0, out, (1 - torch.exp(-out)).clamp_min(1e-30))  # Exp(1) -> U(0, 1)

    monkeypatch.setattr(keyed_noise, "keyed_noise", uniform_noise)
    spec = {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 1}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH, deterministic=True)
    results = pvalues(target, llm, PROMPT, (2,))
    assert any(pvalue < 1e-6 for pvalue in results), f"a wrong race went unnoticed ({results})"
