"""``min_tokens``: no stop token before that many output tokens, and no stop string ending in their text.

Greedy: plain decoding with ``min_tokens`` equals a naive reference (transformers' forward, the stop tokens'
logits at -inf below the floor, argmax), and every method's speculative output equals plain decoding's, chains
and trees. Sampling: the first two tokens of a sampled request with ``min_tokens=2`` follow the target's
distribution without its stop tokens at both positions (chi-square), for a chain and a tree method; banning
the stop tokens at the pending token's column only (the drafts' columns unmasked) fails the same test.
"""

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue
from test_sampling_exactness import VOCAB, pair  # noqa: F401 - pair: a sharp target and a different draft

import specdec.engine
import specdec.min_tokens
from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.sampling import logits_to_probs
from specdec.text import TextTracker

GREEDY_PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [90, 91, 90, 91, 90]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def greedy_case(model_dirs):
    """The llama target, and as stop tokens the first two tokens plain greedy decoding emits for each prompt
    (so that without min_tokens each output would end at once)."""
    target_dir = model_dirs["llama"]["target"]
    plain = LLM(target_dir, dtype="float64", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    firsts = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS],
                                                             params)]
    stops = sorted({t for first in firsts for t in first})
    return target_dir, stops


def reference(model, prompt: list[int], stops: list[int], min_tokens: int) -> list[int]:
    """Plain greedy decoding one token at a time with the stop tokens banned below ``min_tokens``."""
    out = []
    with torch.no_grad():
        while len(out) < MAX_TOKENS:
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            if len(out) < min_tokens:
                logits[stops] = -torch.inf
            out.append(int(logits.argmax()))
            if out[-1] in stops:
                break
    return out


def greedy_params(stops: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=stops, ignore_eos=True,
                           min_tokens=m) for m in (0, 5, 12)]


@pytest.fixture(scope="module")
def plain_outputs(greedy_case):
    from transformers import AutoModelForCausalLM

    target_dir, stops = greedy_case
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    llm = LLM(target_dir, dtype="float64", max_num_seqs=9)
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS for _ in range(3)]
    params = [p for _ in GREEDY_PROMPTS for p in greedy_params(stops)]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for prompt, p, out in zip(prompts, params, outputs):
        assert out == reference(model, prompt["prompt_token_ids"], stops, p.min_tokens)
        assert not set(out[: p.min_tokens]) & set(stops)
    assert any(len(out) < MAX_TOKENS for out in outputs), "some output must end on a stop token"
    assert sum(len(out) for out in outputs[2::3]) > sum(len(out) for out in outputs[::3]), "min_tokens changed none"
    return prompts, params, outputs


METHODS = {
    "draft_model": lambda dirs: {"method": "draft_model", "model": str(dirs["truncated"]),
                                 "num_speculative_tokens": 3},
    "ngram": lambda dirs: {"method": "ngram", "num_speculative_tokens": 3},
    "ngram-tree": lambda dirs: {"method": "ngram", "num_speculative_tokens": 6, "num_candidates": 3},
    "suffix": lambda dirs: {"method": "suffix", "num_speculative_tokens": 3},
    "lookahead": lambda dirs: {"method": "lookahead", "num_speculative_tokens": 4},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_with_min_tokens(model_dirs, greedy_case, plain_outputs, method):
    target_dir, _ = greedy_case
    prompts, params, plain = plain_outputs
    llm = LLM(target_dir, dtype="float64", max_num_seqs=9, speculative_config=METHODS[method](model_dirs["llama"]))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.batch_metrics.num_accepted_tokens > 0


# ---------------------------------------------------------------------------------------------- sampling
PROMPT = [5, 1, 4, 5, 2, 1, 4, 7, 3, 1, 4]  # "1 4" and "4" occurred before: ngram drafts trees from them
SAMPLES = 1600
PER_CALL = 16


@pytest.fixture(scope="module")
def sampled_pair(pair):  # noqa: F811
    target, root = pair
    with torch.no_grad():  # the stop tokens: the two likeliest first tokens
        stops = target(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    return target, root, stops


def masked_joint(target, stops: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of plain sampling with the stop tokens banned at both positions, ``[V, V]``."""
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1].index_fill(0, torch.tensor(stops),
                                                                                       -torch.inf), params)
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = logits_to_probs(target(contexts).logits[:, -1].index_fill(1, torch.tensor(stops), -torch.inf),
                                 params)
    return (first[:, None] * second).numpy()


def sampled_pvalue(sampled_pair, spec: dict) -> tuple[float, LLM]:
    target, root, stops = sampled_pair
    llm = LLM(root / "target", dtype="float64", max_num_seqs=PER_CALL, speculative_config=spec)
    counts = np.zeros((VOCAB, VOCAB))
    for call in range(SAMPLES // PER_CALL):
        params = [SamplingParams(temperature=1.0, max_tokens=5, min_tokens=2, stop_token_ids=stops, ignore_eos=True,
                                 seed=(call * PER_CALL + j) * 7919 + 5) for j in range(PER_CALL)]
        for out in llm.generate([{"prompt_token_ids": PROMPT}] * PER_CALL, params):
            tokens = out.outputs[0].token_ids
            counts[tokens[0], tokens[1]] += 1
    return chi_square_pvalue(counts, masked_joint(target, stops, SamplingParams(temperature=1.0))), llm


SPECS = {
    "chain": lambda root: {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 2},
    "tree": lambda root: {"method": "ngram", "num_speculative_tokens": 4, "num_candidates": 3,
                          "prompt_lookup_max": 2},
}


@pytest.mark.parametrize("case", list(SPECS))
def test_sampled_output_follows_the_target_without_its_stop_tokens(sampled_pair, case):
    p, llm = sampled_pvalue(sampled_pair, SPECS[case](sampled_pair[1]))
    assert p > 1e-3, f"{case}: samples deviate from the target without its stop tokens (p={p:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"


def pending_column_only(logits, seqs, depth=None):
    """The drafts' columns keep their stop tokens: a drafted stop token at the second position may be accepted."""
    banned = specdec.min_tokens.ban_early_stops(logits, seqs, depth)
    if logits.dim() == 3:
        banned[:, 1:] = logits[:, 1:]
    return banned


def columns_as_depths(logits, seqs, depth=None):
    """A tree's columns taken for depths: the nodes past the first, at depth 1, keep their stop tokens."""
    return specdec.min_tokens.ban_early_stops(logits, seqs)


@pytest.mark.parametrize("case, wrong", [("chain", pending_column_only), ("tree", columns_as_depths)])
def test_a_wrong_ban_fails_the_test(sampled_pair, monkeypatch, case, wrong):
    monkeypatch.setattr(specdec.engine, "ban_early_stops", wrong)
    p, _ = sampled_pvalue(sampled_pair, SPECS[case](sampled_pair[1]))
    assert p < 1e-3


# ---------------------------------------------------------------------------------------------- checks, text
@pytest.mark.parametrize("kwargs, words", [
    ({"min_tokens": -1}, "min_tokens must be an integer in 0..max_tokens (16), got -1"),
    ({"min_tokens": 17}, "min_tokens must be an integer in 0..max_tokens (16), got 17"),
    ({"min_tokens": 2.0}, "min_tokens must be an integer"),
    ({"min_tokens": True}, "min_tokens must be an integer"),
    ({"min_tokens": 1, "structured_outputs": {"regex": "a+"}}, "min_tokens cannot be combined with structured"),
])
def test_bad_min_tokens_are_refused(kwargs, words):
    with pytest.raises(SpecDecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs)


class Letters:
    """A tokenizer whose token ``i`` is the letter ``"abcdefghijklmnopqrstuvwxyz"[i]``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_a_stop_string_in_the_first_min_tokens_does_not_stop():
    """"ab" completes at token 2 (within min_tokens 3: it does not count, later either) and again at token 6."""
    tokens = [0, 1, 2, 3, 0, 1, 4]  # a b c d a b e
    plain = TextTracker(Letters(), ("ab",), streaming=False)
    assert plain.add(tokens) == 2 and plain.text == ""
    late = TextTracker(Letters(), ("ab",), streaming=False, min_tokens=3)
    assert late.add(tokens) == 6 and late.text == "abcd"
    across = TextTracker(Letters(), ("bc",), streaming=False, min_tokens=2)  # "bc" ends at token 3
    assert across.add(tokens) == 3 and across.text == "a"
    # A longer stop string holds back more text: the search window after the floor still starts past it for "ab".
    wide = TextTracker(Letters(), ("ab", "zzzzzz"), streaming=False, min_tokens=3)
    assert wide.add(tokens[:4]) == 4 and wide.add(tokens[4:]) == 2 and wide.text == "abcd"
    assert TextTracker(Letters(), ("ab", "zzzzzz"), streaming=False, min_tokens=3).add([0, 1, 2, 3, 4]) == 5
