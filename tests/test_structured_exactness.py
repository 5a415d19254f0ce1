"""Speculation under a structured-output constraint is exact with respect to the constrained target (its
distribution with the tokens the grammar forbids removed and renormalised, at every position).

Greedy: plain constrained decoding equals a naive reference (transformers' forward, llguidance's mask, argmax,
one token at a time), and every method's speculative output equals plain constrained output, in batches that
mix JSON schemas, JSON objects, regexes, choices, grammars and unconstrained rows. Sampling: the first two
tokens under a regex follow the constrained target's exact distribution (chi-square) for a chain method whose
drafter masks its q as it drafts and for a tree method whose deterministic trees hold invalid nodes; a drafter
that samples from the masked q but hands verification the unmasked q fails the same test.
"""

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from helpers import build_model, chi_square_pvalue
from test_heads import make_heads
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdec.drafters.draft_model
from specdec import LLM, SamplingParams, StructuredOutputsParams
from specdec.drafters.base import draw_column
from specdec.sampling import logits_to_probs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"(ab|cd)+x[0-9]{2,4}"),
    StructuredOutputsParams(choice=["return x", "print(i)", "range"]),
    StructuredOutputsParams(grammar='root ::= "def " [a-z]+ "(" [a-z]* "):"'),
    None,
]
PROMPTS = ['{"name":"ab","n":12} {"name":"ab', "abcdabx12 abcd", "def f(x):\n    return x", "for i in range(10):"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def models(text_model_dirs, tmp_path_factory):
    """The text target (float64, with its tokenizer), a different random draft, eagle and medusa heads."""
    target_dir = text_model_dirs["target"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    root = tmp_path_factory.mktemp("structured")
    build_model("llama", seed=21, vocab=target.config.vocab_size, layers=1).save_pretrained(root / "draft")
    build_model("llama", seed=22, vocab=target.config.vocab_size, layers=2).save_pretrained(root / "mid")
    make_heads(target, "eagle", root / "eagle", seed=4)
    make_heads(target, "medusa", root / "medusa", seed=5)
    return target, tokenizer, target_dir, root


def reference(target, tokenizer, prompt: str, constraint: StructuredOutputsParams | None) -> list[int]:
    """Plain constrained greedy decoding, one token at a time, without specdec."""
    ids = tokenizer(prompt)["input_ids"]
    eos = tokenizer.eos_token_id
    matcher = None
    if constraint is not None:
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=target.config.vocab_size)
        kind, text, compact = constraint.key
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": not compact})
        else:
            grammar = llguidance.grammar_from({"regex": "regex", "choice": "choice", "grammar": "gbnf"}[kind], text)
        matcher = llguidance.LLMatcher(lltok, grammar)
    out = []
    with torch.no_grad():
        while len(out) < MAX_TOKENS:
            logits = target(torch.tensor([ids + out])).logits[0, -1]
            if matcher is not None:
                bitmask = matcher.compute_bitmask()  # little-endian 32-bit words: token t is bit t % 8 of byte t // 8
                allowed = torch.tensor([bool(bitmask[t // 8] >> (t % 8) & 1) for t in range(logits.shape[0])])
                logits = logits.masked_fill(~allowed, float("-inf"))
            token = int(logits.argmax())
            out.append(token)
            if token == eos:
                break
            if matcher is not None and not matcher.is_stopped():
                assert matcher.consume_token(token)
    return out


def greedy_batch() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i, constraint in enumerate(CONSTRAINTS):
        for j in range(2):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=constraint))
    return prompts, params


@pytest.fixture(scope="module")
def plain_outputs(models):
    target, tokenizer, target_dir, _ = models
    prompts, params = greedy_batch()
    outputs = [o.outputs[0] for o in LLM(target_dir, dtype="float64", max_num_seqs=8).generate(prompts, params)]
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.token_ids == reference(target, tokenizer, prompt, p.structured_outputs), (prompt, p)
    return outputs


GREEDY_METHODS = {
    "draft_model": lambda root: {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 3},
    "ngram": lambda root: {"method": "ngram", "num_speculative_tokens": 3},
    "ngram-tree": lambda root: {"method": "ngram", "num_speculative_tokens": 6, "num_candidates": 3},
    "eagle": lambda root: {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 3},
    "eagle-tree": lambda root: {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 6,
                                "num_candidates": 2},
    "medusa-tree": lambda root: {"method": "medusa", "model": str(root / "medusa"), "num_speculative_tokens": 6,
                                 "num_candidates": 2},
    "layer_skip": lambda root: {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [1, 2]},
    "suffix": lambda root: {"method": "suffix", "num_speculative_tokens": 3},
    "lookahead": lambda root: {"method": "lookahead", "num_speculative_tokens": 6},
    "cascade": lambda root: {"method": "cascade", "num_speculative_tokens": 3, "stages": [
        {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 2},
        {"method": "draft_model", "model": str(root / "mid"), "num_speculative_tokens": 3}]},
    "auto": lambda root: {"method": "auto", "num_speculative_tokens": 3, "candidates": [
        {"method": "draft_model", "model": str(root / "draft")}, {"method": "ngram"}]},
}


@pytest.mark.parametrize("method", list(GREEDY_METHODS))
def test_greedy_speculative_equals_plain_constrained(models, plain_outputs, method):
    _, _, target_dir, root = models
    llm = LLM(target_dir, dtype="float64", max_num_seqs=8, speculative_config=GREEDY_METHODS[method](root))
    prompts, params = greedy_batch()
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for p, out, plain in zip(params, outputs, plain_outputs):
        assert out.token_ids == plain.token_ids, (method, p.structured_outputs)
        assert out.finish_reason == plain.finish_reason
    assert llm.batch_metrics.num_draft_tokens > 0
    assert sum(p.structured_outputs is not None and o.finish_reason == "stop" for p, o in zip(params, outputs)) >= 4


# ---------------------------------------------------------------------------------------------- sampling
REGEX = "[a-f]{2,3}"  # the tiny tokenizer has one token per byte: 6 valid tokens at each of the first two
LETTERS = "abcdef"
SAMPLES = 1600
SETTINGS = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}]
PER_CALL = 16  # sampled requests per generate call


def exact_joint(target, tokenizer, prompt_ids: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2) of plain sampling from the constrained target, ``[V, V]`` (the regex allows the six letters at
    both positions; sampling parameters apply after the mask)."""
    vocab = target.config.vocab_size
    letters = [tokenizer.convert_tokens_to_ids(c) for c in LETTERS]
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[letters] = True
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([prompt_ids])).logits[0, -1].masked_fill(~allowed, -torch.inf),
                                params)
        contexts = torch.tensor([prompt_ids + [t] for t in letters])
        second = logits_to_probs(target(contexts).logits[:, -1].masked_fill(~allowed, -torch.inf), params)
    joint = np.zeros((vocab, vocab))
    for i, t in enumerate(letters):
        joint[t] = first[t].item() * second[i].numpy()
    return joint


def sampled_pvalues(models, spec: dict, prompt: str) -> tuple[list[float], LLM]:
    target, tokenizer, target_dir, _ = models
    llm = LLM(target_dir, dtype="float64", max_num_seqs=PER_CALL, speculative_config=spec)
    prompt_ids = tokenizer(prompt)["input_ids"]
    constraint = StructuredOutputsParams(regex=REGEX)
    vocab = target.config.vocab_size
    counts = [np.zeros((vocab, vocab)) for _ in SETTINGS]
    for call in range(SAMPLES * len(SETTINGS) // PER_CALL):
        params = [SamplingParams(max_tokens=2, seed=(call * PER_CALL + j) * 7919 + 3, ignore_eos=True,
                                 structured_outputs=constraint, **SETTINGS[j % len(SETTINGS)])
                  for j in range(PER_CALL)]
        for j, out in enumerate(llm.generate([{"prompt_token_ids": prompt_ids}] * PER_CALL, params)):
            tokens = out.outputs[0].token_ids
            counts[j % len(SETTINGS)][tokens[0], tokens[1]] += 1
    pvalues = [chi_square_pvalue(c, exact_joint(target, tokenizer, prompt_ids, SamplingParams(**s)))
               for c, s in zip(counts, SETTINGS)]
    return pvalues, llm


CHAIN = lambda root: {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 2}  # noqa: E731
# A prompt whose n-grams continue with letters (valid) and with other bytes (invalid): trees of both.
TREE_PROMPT = "abc_abd_abe_ab"
TREE = {"method": "ngram", "num_speculative_tokens": 4, "num_candidates": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize("case", ["chain", "tree"])
def test_sampled_constrained_output_follows_the_constrained_target(models, case):
    spec, prompt = (CHAIN(models[3]), "abcab") if case == "chain" else (TREE, TREE_PROMPT)
    pvalues, llm = sampled_pvalues(models, spec, prompt)
    for settings, pvalue in zip(SETTINGS, pvalues):
        assert pvalue > 1e-3, f"{case} {settings}: samples deviate from the constrained target (p={pvalue:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"


def test_an_unmasked_q_fails_the_test(models, monkeypatch):
    """The draft samples from its masked distribution but verification is handed the unmasked one."""

    def wrong_draw_column(logits, rows, probs, index, column, tokens):
        token = draw_column(logits, rows, probs, index, column, tokens)
        if probs is not None:
            probs[index, column] = rows.probs(logits)
        return token

    monkeypatch.setattr(specdec.drafters.draft_model, "draw_column", wrong_draw_column)
    pvalues, _ = sampled_pvalues(models, CHAIN(models[3]), "abcab")
    assert min(pvalues) < 1e-3, f"an unmasked q passed the chi-square test (p={pvalues})"
