"""vLLM's logit adjustments (``allowed_token_ids``, ``logit_bias``, the repetition, frequency and presence penalties)
and offline ``n``: exact under speculation.

Greedy: plain decoding with each adjustment equals a naive reference (transformers' forward, vLLM's formulas applied
to the last position's logits, argmax), the adjustments change the outputs, and every method's speculative output
equals plain decoding's, chains and trees. Sampling: the first two tokens of a penalized request follow the
adjusted target distribution (chi-square), for a chain and a tree method; leaving the drafts on a column's path out
of its counts fails the same test.
"""

import re

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue
from test_min_tokens import METHODS, PER_CALL, PROMPT, SAMPLES, SPECS  # chains and trees, greedy and sampled
from test_sampling_exactness import VOCAB, pair  # noqa: F401 - pair: a sharp target and a different draft

import specdec.engine
import specdec.penalties
import specdec.sampling
from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.sampling import logits_to_probs

GREEDY_PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [90, 91, 90, 91, 90]]
MAX_TOKENS = 20


def vllm_adjusted(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's adjustments of one position's logits ``[V]``, written out plainly."""
    logits = logits.clone()
    if p.allowed_token_ids is not None:
        banned = torch.ones_like(logits, dtype=torch.bool)
        banned[list(p.allowed_token_ids)] = False
        logits[banned] = -torch.inf
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        if logits[token] > 0:
            logits[token] /= p.repetition_penalty
        else:
            logits[token] *= p.repetition_penalty
    for token in set(output):
        logits[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return logits


GREEDY_SETTINGS = [
    {},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"frequency_penalty": -0.7},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.7},
    {"logit_bias": {7: 3.0, 11: -100.0, 0: 0.5}},
    {"allowed_token_ids": list(range(0, 96, 5)), "repetition_penalty": 1.3},
]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **s) for s in GREEDY_SETTINGS]


@pytest.fixture(scope="module")
def plain_outputs(model_dirs):
    from transformers import AutoModelForCausalLM

    target_dir = model_dirs["llama"]["target"]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    llm = LLM(target_dir, dtype="float64", max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS for _ in GREEDY_SETTINGS]
    params = [p for _ in GREEDY_PROMPTS for p in greedy_params()]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with torch.no_grad():
        for prompt, p, out in zip(prompts, params, outputs):
            ids, expected = prompt["prompt_token_ids"], []
            while len(expected) < MAX_TOKENS:
                logits = model(torch.tensor([ids + expected])).logits[0, -1]
                expected.append(int(vllm_adjusted(logits, ids, expected, p).argmax()))
            assert out == expected, p
    width = len(GREEDY_SETTINGS)
    for i in range(1, width):
        assert any(outputs[j * width + i] != outputs[j * width] for j in range(len(GREEDY_PROMPTS))), \
            f"{GREEDY_SETTINGS[i]} changed no output"
    return target_dir, prompts, params, outputs


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculation_equals_plain_with_adjustments(model_dirs, plain_outputs, method):
    target_dir, prompts, params, plain = plain_outputs
    llm = LLM(target_dir, dtype="float64", max_num_seqs=8, speculative_config=METHODS[method](model_dirs["llama"]))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.batch_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["medusa", "eagle", "mtp", "layer_skip"])
def test_heads_and_layer_skip_draft_adjusted_and_stay_exact(model_dirs, plain_outputs, tmp_path, method):
    """The drafters that draw position by position from their own logits (adjusted there): greedy outputs equal
    plain decoding's; sampled rows with adjustments run to their budget."""
    from test_heads import make_heads
    from transformers import AutoModelForCausalLM

    target_dir, prompts, params, plain = plain_outputs
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "layer_skip":
        spec["skip_layers"] = [1]
    else:
        make_heads(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64), method, tmp_path, seed=1)
        spec["model"] = str(tmp_path)
    llm = LLM(target_dir, dtype="float64", max_num_seqs=8, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.batch_metrics.num_accepted_tokens > 0
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True, **setting)
               for i, setting in enumerate(GREEDY_SETTINGS)]
    outputs = llm.generate([prompts[0]] * len(sampled), sampled)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12] * len(sampled)


# ---------------------------------------------------------------------------------------------- sampling
PENALIZED = {"presence_penalty": -1.5, "frequency_penalty": -1.0, "repetition_penalty": 1.5, "logit_bias": {3: 1.0}}
"""Negative presence and frequency penalties make a repeat likelier: a column's path counted wrong shows in
P(t2 = t1)."""


def adjusted_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of plain sampling from the adjusted target, ``[V, V]``."""
    with torch.no_grad():
        first = logits_to_probs(vllm_adjusted(target(torch.tensor([PROMPT])).logits[0, -1], PROMPT, [], params),
                                params)
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        seconds = target(contexts).logits[:, -1]
        second = torch.stack([logits_to_probs(vllm_adjusted(seconds[t], PROMPT, [t], params), params)
                              for t in range(VOCAB)])
    return (first[:, None] * second).numpy()


def sampled_pvalue(pair, spec: dict) -> tuple[float, LLM]:  # noqa: F811
    target, root = pair
    llm = LLM(root / "target", dtype="float64", max_num_seqs=PER_CALL, speculative_config=spec)
    counts = np.zeros((VOCAB, VOCAB))
    for call in range(SAMPLES // PER_CALL):
        params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=(call * PER_CALL + j) * 7919 + 3,
                                 **PENALIZED) for j in range(PER_CALL)]
        for out in llm.generate([{"prompt_token_ids": PROMPT}] * PER_CALL, params):
            tokens = out.outputs[0].token_ids
            counts[tokens[0], tokens[1]] += 1
    return chi_square_pvalue(counts, adjusted_joint(target, SamplingParams(temperature=1.0, **PENALIZED))), llm


@pytest.mark.parametrize("case", list(SPECS))
def test_sampled_output_follows_the_adjusted_target(pair, case):  # noqa: F811
    p, llm = sampled_pvalue(pair, SPECS[case](pair[1]))
    assert p > 1e-3, f"{case}: samples deviate from the adjusted target (p={p:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"


def output_counts_only(logits, seqs, rows, drafts=None, num_draft=None, ancestors=None):
    """Every column counted as the pending token's: the drafts on a column's path are not penalized."""
    return specdec.penalties.adjust(logits, seqs, rows)


def tree_as_chain(logits, seqs, rows, drafts=None, num_draft=None, ancestors=None):
    """A tree's nodes counted as if they were a chain: a column's path is every node before it."""
    return specdec.penalties.adjust(logits, seqs, rows, drafts, num_draft)


@pytest.mark.parametrize("case, wrong", [("chain", output_counts_only), ("tree", tree_as_chain)])
def test_wrong_counts_fail_the_test(pair, monkeypatch, case, wrong):  # noqa: F811
    monkeypatch.setattr(specdec.engine, "adjust", wrong)
    p, _ = sampled_pvalue(pair, SPECS[case](pair[1]))
    assert p < 1e-3


# ---------------------------------------------------------------------------------------------- drafting
@pytest.mark.parametrize("drafts_adjusted", [True, False])
def test_a_draft_model_drafts_from_adjusted_logits(model_dirs, monkeypatch, drafts_adjusted):
    """The target's own weights as the draft model: drawing its drafts from logits adjusted as the target's will
    be (for the output and the drafts before), it proposes what the adjusted target samples, and every draft is
    accepted, greedy and sampled; drawn from its plain logits, some are rejected."""
    if not drafts_adjusted:
        monkeypatch.setattr(specdec.sampling.SamplingBatch, "adjust_draft", lambda self, logits: logits)
    dirs = model_dirs["llama"]
    llm = LLM(dirs["target"], dtype="float64", max_num_seqs=8, speculative_config={
        "method": "draft_model", "model": str(dirs["same"]), "num_speculative_tokens": 3})
    settings = [{"presence_penalty": 1.0, "frequency_penalty": 0.5}, {"repetition_penalty": 1.5},
                {"logit_bias": {3: 2.0, 7: -3.0}, "allowed_token_ids": list(range(0, 96, 3))}, {}]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=24, ignore_eos=True, **setting)
              for i, (t, setting) in enumerate((t, s) for t in (0, 1.0) for s in settings)]
    llm.generate([{"prompt_token_ids": GREEDY_PROMPTS[i % 3]} for i in range(len(params))], params)
    batch = llm.batch_metrics
    assert batch.num_draft_tokens > 100
    rate = batch.num_accepted_tokens / batch.num_draft_tokens
    assert (rate == 1.0) == drafts_adjusted, rate


# ---------------------------------------------------------------------------------------------- bad words
TEXT_PROMPTS = ["def f(x):", "hello world", "for i in range(10):"]


@pytest.fixture(scope="module")
def bad_words_case(text_model_dirs):
    """Bad words taken from plain greedy outputs (a word and a pair of words' text, so that multi-token sequences
    are banned too), the sequences they ban, and the plain greedy outputs with them."""
    from transformers import AutoModelForCausalLM

    target_dir = text_model_dirs["target"]
    llm = LLM(target_dir, dtype="float64", max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = [o.outputs[0] for o in llm.generate(TEXT_PROMPTS, greedy)]
    tokenizer = llm.tokenizer

    def printable(ids: list[int]) -> str | None:
        text = tokenizer.decode(ids).strip()
        return text if text and text.isascii() and text.isprintable() and " " not in text else None

    singles = [w for o in free for t in o.token_ids[:8] if (w := printable([t]))]
    pairs = [w for o in free for a, b in zip(o.token_ids, o.token_ids[1:]) if (w := printable([a, b]))
             and len(tokenizer.encode(w, add_special_tokens=False)) > 1]
    words = sorted(set(singles[:2] + pairs[:2]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words)
    banned = specdec.penalties.bad_word_ids(llm.tokenizer, params.bad_words, llm.target.vocab_size)
    assert any(len(ids) > 1 for ids in banned), "the test needs a bad word of more than one token"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    outputs = [o.outputs[0].token_ids for o in llm.generate(TEXT_PROMPTS, params)]
    with torch.no_grad():
        for prompt, out in zip(TEXT_PROMPTS, outputs):
            ids, expected = llm.tokenizer.encode(prompt), []
            while len(expected) < MAX_TOKENS:
                logits = model(torch.tensor([ids + expected])).logits[0, -1]
                for word in banned:
                    if len(word) - 1 <= len(expected) and expected[len(expected) - len(word) + 1:] == list(word[:-1]):
                        logits[word[-1]] = -torch.inf
                expected.append(int(logits.argmax()))
            assert out == expected
    assert outputs != [o.token_ids for o in free], "the bad words changed no output"
    return target_dir, params, outputs


@pytest.mark.parametrize("method", ["draft_model", "ngram", "ngram-tree", "suffix"])
def test_greedy_speculation_equals_plain_with_bad_words(text_model_dirs, bad_words_case, method):
    target_dir, params, plain = bad_words_case
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3} if (
        method == "draft_model") else METHODS[method](None)
    llm = LLM(target_dir, dtype="float64", max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(TEXT_PROMPTS, params)] == plain
    assert llm.batch_metrics.num_accepted_tokens > 0


def drafts_without_bans(monkeypatch) -> None:
    """Drafters that draw from adjusted logits no longer ban one-token bad words (as n-gram drafters never do)."""
    init = specdec.penalties.DraftAdjuster.__init__

    def without_bans(self, seqs):
        init(self, seqs)
        self.banned = [[] for _ in seqs]

    monkeypatch.setattr(specdec.penalties.DraftAdjuster, "__init__", without_bans)


@pytest.mark.parametrize("drafts_banned", [True, False])
def test_a_draft_model_drafts_without_one_token_bad_words(text_model_dirs, bad_words_case, monkeypatch,
                                                          drafts_banned):
    """The identical draft model with one-token bad words: banned in its drafts too, it proposes what the target
    samples and every draft is accepted; not banned there, it proposes banned tokens, which the target rejects."""
    if not drafts_banned:
        drafts_without_bans(monkeypatch)
    target_dir, params, _ = bad_words_case
    llm = LLM(target_dir, dtype="float64", max_num_seqs=4, speculative_config={
        "method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3})
    singles = [w for w in params.bad_words if len(llm.tokenizer.encode(w, add_special_tokens=False)) == 1]
    assert singles, "the test needs one-token bad words"
    one_token = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=singles)
    llm.generate(TEXT_PROMPTS, one_token)
    batch = llm.batch_metrics
    assert (batch.num_accepted_tokens == batch.num_draft_tokens) == drafts_banned, (
        batch.num_accepted_tokens, batch.num_draft_tokens)


def test_bad_words_at_the_pending_column_only_fail(text_model_dirs, bad_words_case, monkeypatch):
    """The bans left off the target's draft columns: the identical draft model, its own bans off too (as an n-gram
    drafter has none), proposes a banned continuation, the target accepts it, and the output is no longer plain
    decoding's."""
    drafts_without_bans(monkeypatch)
    ban = specdec.penalties._ban_bad_words
    monkeypatch.setattr(specdec.penalties, "_ban_bad_words",
                        lambda work, seqs, drafts, num_draft, ancestors: ban(work, seqs, None, None, None))
    target_dir, params, plain = bad_words_case
    llm = LLM(target_dir, dtype="float64", max_num_seqs=4, speculative_config={
        "method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(TEXT_PROMPTS, params)] != plain


def test_adjustments_under_a_constraint_stay_exact(text_model_dirs):
    """A regex constraint with penalties, a bias and a bad word: the grammar's mask, the drafter's adjusted and
    masked drafts and the target's adjusted columns together; speculative greedy outputs equal plain ones, match
    the pattern and differ from the unadjusted ones."""
    target_dir = text_model_dirs["target"]
    pattern = "[a-z]+( [a-z]+)*"
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "structured_outputs": {"regex": pattern}}
    adjusted = SamplingParams(presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3,
                              logit_bias={65: 2.0}, bad_words=["ab"], **kwargs)
    plain = LLM(target_dir, dtype="float64", max_num_seqs=4)
    expected = [o.outputs[0] for o in plain.generate(TEXT_PROMPTS, adjusted)]
    free = [o.outputs[0].token_ids for o in plain.generate(TEXT_PROMPTS, SamplingParams(**kwargs))]
    assert [o.token_ids for o in expected] != free
    assert all(re.fullmatch(pattern, o.text) or o.finish_reason == "length" for o in expected)
    for spec in ({"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 3},
                 METHODS["ngram-tree"](None)):
        llm = LLM(target_dir, dtype="float64", max_num_seqs=4, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(TEXT_PROMPTS, adjusted)] == [o.token_ids
                                                                                        for o in expected]


def test_bad_words_encode_as_vllm_does(text_model_dirs):
    """A word alone and, where a space before it makes another first token in as many tokens, inside a text."""
    tokenizer = LLM(text_model_dirs["target"], dtype="float64").tokenizer
    alone, inside = (tuple(tokenizer.encode(t, add_special_tokens=False)) for t in ("range", " range"))
    expected = (alone, inside) if inside[0] != alone[0] and len(inside) == len(alone) else (alone,)
    assert specdec.penalties.bad_word_ids(tokenizer, ("  range",), 10**6) == expected
    with pytest.raises(SpecDecError, match="bad_words needs a tokenizer"):
        specdec.penalties.bad_word_ids(None, ("x",), 100)


# ---------------------------------------------------------------------------------------------- offline n
def test_n_outputs_per_prompt(model_dirs):
    """``n`` choices per prompt, batched: a seeded request's choice 0 is its ``n=1`` output, choice ``i`` the
    output of seed + i; the metrics add the choices' tokens and count the prompt once."""
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS[:2]]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=40, n=3, presence_penalty=0.5)
    outputs = llm.generate(prompts, params)
    assert [[c.index for c in o.outputs] for o in outputs] == [[0, 1, 2]] * 2
    for prompt, output in zip(prompts, outputs):
        singles = [llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=40 + i,
                                                       presence_penalty=0.5))[0].outputs[0] for i in range(3)]
        assert [c.token_ids for c in output.outputs] == [s.token_ids for s in singles]
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1, "the choices must differ"
        assert output.metrics.num_generated_tokens == 36
        assert output.metrics.num_prompt_tokens == len(prompt["prompt_token_ids"])
    unseeded = llm.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=4))[0]
    assert len(unseeded.outputs) == 4 and len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    chat_like = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6, n=2))[0].outputs
    assert chat_like[0].token_ids == chat_like[1].token_ids  # greedy choices agree
    with pytest.raises(SpecDecError, match="n is 2, but a stream is one output"):
        llm.stream(prompts[0], SamplingParams(n=2))
    with pytest.raises(SpecDecError, match="n is 2, but a stream is one output"):
        llm.submit(prompts[0], SamplingParams(n=2))


# ---------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("kwargs, words", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2], got nan"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a number in [-2, 2], got '1'"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number above 0 (1 is none), got 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number above 0"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias must be a dict of token ids (integers >= 0) to numbers"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias must be a dict of token ids (integers >= 0) to numbers"),
    ({"logit_bias": [1, 2]}, "logit_bias must be a dict of token ids"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias values must be finite numbers, got {3: inf}"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list of token ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be None or a non-empty list of token ids"),
    ({"allowed_token_ids": [1], "structured_outputs": {"regex": "a"}}, "allowed_token_ids cannot be combined"),
    ({"bad_words": [" "]}, "bad_words must be words (not blank) of at most 256 characters, got ' '"),
    ({"bad_words": ["a" * 257]}, "bad_words must be words (not blank) of at most 256 characters"),
    ({"bad_words": ["a"] * 1025}, "bad_words has 1025 words; at most 1024 are allowed"),
    ({"bad_words": [3]}, "bad_words must be a list of strings"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"n": 2.0}, "n must be an integer >= 1, got 2.0"),
    ({"n": 2, "seed": 2**64 - 1}, "seed + n - 1 must be at most 2**64-1"),
])
def test_bad_adjustments_are_refused(kwargs, words):
    with pytest.raises(SpecDecError, match=re.escape(words)):
        SamplingParams(**kwargs)


def test_token_ids_are_checked_against_the_vocabulary(model_dirs):
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=2)
    for kwargs, words in [({"logit_bias": {96: 1.0}}, "logit_bias [96] are outside the vocabulary (0..95)"),
                          ({"allowed_token_ids": [5, 200]}, "allowed_token_ids [200] are outside the vocabulary"),
                          ({"allowed_token_ids": [4], "stop_token_ids": [4], "min_tokens": 2},
                           "allowed_token_ids [4] are all stop tokens (or bad_words), which min_tokens (2) bans"),
                          ({"bad_words": ["x"]}, "bad_words needs a tokenizer")]:
        with pytest.raises(SpecDecError, match=re.escape(words)):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(**kwargs))
    only = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=8, allowed_token_ids=[4, 9],
                                                                     ignore_eos=True))[0].outputs[0].token_ids
    assert len(only) == 8 and set(only) <= {4, 9}
    # a bias of -inf in effect (vLLM's way to ban a token): -100 on the greedy choice moves it elsewhere
    first = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0, max_tokens=1))[0]
    token = first.outputs[0].token_ids[0]
    banned = llm.generate({"prompt_token_ids": [1, 2]},
                          SamplingParams(temperature=0, max_tokens=1, logit_bias={token: -100}))[0]
    assert banned.outputs[0].token_ids[0] != token
