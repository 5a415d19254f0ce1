"""``SamplingParams(logprobs=N)``: the values are the target's raw log-softmax at every output position, equal
to plain decoding's under every method family (draft model, n-gram, heads, trees, self-speculation), greedy
and sampled, on float64 tiny models; the top lists are sorted and rank the chosen token; under a constraint
they are the target's distribution restricted to the grammar and renormalised."""

from __future__ import annotations

import math

import llguidance
import llguidance.hf
import pytest
import torch
from helpers import build_model
from test_heads import make_heads
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import LLM, Logprob, SamplingParams, SpecDecError, StructuredOutputsParams

PROMPTS = ["def f(x):\n    return x", "for i in range(10):\n    print(i)\nfor i in range(10):\n", "x = 1\n"]
TOL = 1e-9


@pytest.fixture(scope="module")
def models(text_model_dirs, tmp_path_factory):
    """The text target (transformers, float64), its folder, and a folder of drafts and heads."""
    target_dir = text_model_dirs["target"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    root = tmp_path_factory.mktemp("logprobs")
    build_model("llama", seed=31, vocab=target.config.vocab_size, layers=1).save_pretrained(root / "draft")
    make_heads(target, "eagle", root / "eagle", seed=4)
    make_heads(target, "medusa", root / "medusa", seed=5)
    return target, target_dir, root, text_model_dirs


METHODS = {
    "plain": lambda root, dirs: None,
    "draft_model-same": lambda root, dirs: {"method": "draft_model", "model": str(dirs["draft"]),
                                            "num_speculative_tokens": 3},
    "draft_model": lambda root, dirs: {"method": "draft_model", "model": str(root / "draft"),
                                       "num_speculative_tokens": 3},
    "ngram": lambda root, dirs: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "ngram-tree": lambda root, dirs: {"method": "ngram", "num_speculative_tokens": 6, "num_candidates": 3,
                                      "prompt_lookup_min": 1},
    "eagle": lambda root, dirs: {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 3},
    "eagle-tree": lambda root, dirs: {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 6,
                                      "num_candidates": 2},
    "medusa-tree": lambda root, dirs: {"method": "medusa", "model": str(root / "medusa"),
                                       "num_speculative_tokens": 6, "num_candidates": 2},
    "layer_skip": lambda root, dirs: {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [1]},
}


def make_llm(models, method: str) -> LLM:
    _, target_dir, root, dirs = models
    return LLM(target_dir, speculative_config=METHODS[method](root, dirs), dtype="float64", max_num_seqs=4)


def reference_logprobs(target, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The target's raw log-softmax at every output position, one teacher-forced transformers forward:
    ``[len(output_ids), V]``."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids + output_ids])).logits[0]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)


def check_against_reference(target, request, num_top: int) -> None:
    """Every position: the chosen token's value and rank, and the top ``num_top`` list, equal the reference."""
    out = request.outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) > 0
    reference = reference_logprobs(target, request.prompt_token_ids, out.token_ids)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[position]
        chosen = entry[token]
        assert next(iter(entry)) == token  # the chosen token comes first, as in vLLM
        assert abs(chosen.logprob - row[token].item()) < TOL
        assert chosen.rank == int((row >= row[token]).sum())
        top = sorted((lp for t, lp in entry.items() if t != token or lp.rank <= num_top), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, num_top + 1))
        values = [lp.logprob for lp in top]
        assert values == sorted(values, reverse=True)
        expected = row.topk(num_top).values.tolist() if num_top else []
        assert all(abs(a - b) < TOL for a, b in zip(values, expected))
        assert len(entry) == num_top + (chosen.rank > num_top)
        if chosen.rank <= num_top:  # the chosen token sits at its rank in the top list
            assert top[chosen.rank - 1].logprob == chosen.logprob
    assert abs(out.cumulative_logprob - sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids))) < TOL


@pytest.fixture(scope="module")
def plain_greedy(models):
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=n, ignore_eos=True) for n in (5, 0, None)]
    return make_llm(models, "plain").generate(PROMPTS, params)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "plain"])
def test_greedy_logprobs_equal_plain_decoding(models, plain_greedy, method):
    target = models[0]
    llm = make_llm(models, method)
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=n, ignore_eos=True) for n in (5, 0, None)]
    outputs = llm.generate(PROMPTS, params)
    for got, plain, p in zip(outputs, plain_greedy, params):
        assert got.outputs[0].token_ids == plain.outputs[0].token_ids
        if p.logprobs is None:
            assert got.outputs[0].logprobs is None and got.outputs[0].cumulative_logprob is None
            continue
        for mine, theirs in zip(got.outputs[0].logprobs, plain.outputs[0].logprobs):
            assert list(mine) == list(theirs)
            assert all(abs(mine[t].logprob - theirs[t].logprob) < TOL and mine[t].rank == theirs[t].rank
                       for t in mine)
        check_against_reference(target, got, p.logprobs)
    assert llm.speculative_config is None or llm.batch_metrics.num_draft_tokens > 0


@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_logprobs_are_the_raw_target_distribution(models, method):
    """Seeded sampling under temperature and top-k: the values ignore both (raw logprobs), at every emitted
    token, whether it was an accepted draft, a recovered or a bonus token."""
    target = models[0]
    llm = make_llm(models, method)
    params = SamplingParams(temperature=0.7, top_k=12, max_tokens=20, logprobs=3, seed=11, ignore_eos=True)
    for request in llm.generate(PROMPTS, params):
        check_against_reference(target, request, 3)
    if method == "draft_model-same":
        assert llm.batch_metrics.num_accepted_tokens > 10  # accepted drafts were reported too


def test_greedy_chosen_token_is_rank_one_and_the_values_are_text(models, plain_greedy):
    """Ranks, token texts (vLLM's decoded_token) and the exact bytes of byte-level tokens: the output's bytes,
    token by token (the random model emits partial UTF-8 characters, whose decoded_token is U+FFFD)."""
    llm = make_llm(models, "plain")
    out = plain_greedy[0].outputs[0]
    assert all(e[t].rank == 1 and next(iter(e.values())) is e[t] for e, t in zip(out.logprobs, out.token_ids))
    assert all(isinstance(lp, Logprob) and lp.decoded_token == llm.tokenizer.decode([t]) for e in out.logprobs
               for t, lp in e.items())
    raw = bytes(b for t in out.token_ids for b in llm.token_texts.bytes(t))
    assert raw.decode("utf-8", errors="replace") == llm.tokenizer.decode(out.token_ids)
    assert "\ufffd" in out.text and llm.token_texts.bytes(out.token_ids[0]) != list("\ufffd".encode())


def test_stream_and_stop_strings_trim_the_logprobs(models):
    llm = make_llm(models, "draft_model-same")
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True)
    full = llm.generate(PROMPTS[0], params)[0].outputs[0]
    streamed = [lp for piece in llm.stream(PROMPTS[0], params) for lp in piece.logprobs]
    assert [{t: lp.logprob for t, lp in e.items()} for e in streamed] == \
           [{t: lp.logprob for t, lp in e.items()} for e in full.logprobs]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]
    assert len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)


REGEX = r"(ab|cd)+x[0-9]{2,4}"


def masked_reference(target, tokenizer, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The reference under the regex: the target's raw logits with the grammar's forbidden tokens removed,
    log-softmax (renormalised over the allowed tokens), at every output position."""
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=target.config.vocab_size)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("regex", REGEX))
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1]
    rows = []
    for row, token in zip(logits, output_ids):
        bitmask = matcher.compute_bitmask()
        allowed = torch.tensor([bool(bitmask[t // 8] >> (t % 8) & 1) for t in range(row.shape[0])])
        rows.append(torch.log_softmax(row.masked_fill(~allowed, float("-inf")), dim=-1))
        if not matcher.is_stopped():
            assert matcher.consume_token(token)
    return torch.stack(rows)


@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram-tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_logprobs_are_the_grammar_restricted_target(models, method, temperature):
    target, target_dir = models[0], models[1]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    llm = make_llm(models, method)
    params = SamplingParams(temperature=temperature, max_tokens=12, logprobs=20, seed=3,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    for request in llm.generate(PROMPTS, params):
        out = request.outputs[0]
        masked = masked_reference(target, tokenizer, request.prompt_token_ids, out.token_ids)
        raw = reference_logprobs(target, request.prompt_token_ids, out.token_ids)
        for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            allowed = int(torch.isfinite(masked[position]).sum())
            assert abs(entry[token].logprob - masked[position, token].item()) < TOL
            assert masked[position, token] > raw[position, token]  # renormalised: not the unconstrained value
            assert len(entry) == min(20, allowed)  # forbidden tokens are never listed
            assert all(math.isfinite(lp.logprob) for lp in entry.values())
            assert abs(sum(math.exp(lp.logprob) for lp in entry.values()) - 1.0) < 1e-6 or allowed > 20


@pytest.mark.parametrize("value", [-1, 21, True, 1.5, "3"])
def test_bad_logprobs_value(value):
    with pytest.raises(SpecDecError, match="logprobs must be None or an integer in 0..20"):
        SamplingParams(logprobs=value)
