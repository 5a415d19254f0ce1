"""A thinking budget (``SamplingParams.thinking_token_budget``, vLLM's name): a reasoning model thinks at most that
many tokens, then ``</think>`` follows; below the budget nothing changes (an output that closes earlier, or a budget
it never reaches, equals the output without one); speculation stays exact (greedy outputs equal plain decoding's,
sampled ones follow the target under the budget's grammar); the server takes it on chat and as Anthropic's
``thinking.budget_tokens``."""

from __future__ import annotations

import httpx
import pytest
from helpers import chi_square_pvalue
from test_server import TEMPLATE, Served
from test_thinking_constraint import PROMPTS, assert_speculation_equals, sampled_and_exact
from transformers import PreTrainedTokenizerFast

from specdec import LLM, SamplingParams, SpecDecError
from specdec.server import create_app
from specdec.structured.grammar import GrammarCache

BUDGETS = (0, 1, 3, 8, None, 1000)


def closes_at(token_ids, close: int) -> int | None:
    return list(token_ids).index(close) if close in token_ids else None


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_thinking_closes_at_the_budget_and_speculation_equals_plain(think_model_dirs, parser):
    """A random model never closes its thinking by itself: with a budget it closes after exactly that many tokens;
    with a bias on </think> that closes it after a few tokens, a larger budget changes nothing; greedy draft_model
    and ngram outputs equal plain decoding's for every budget."""
    target = think_model_dirs["target"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    close, opening = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.convert_tokens_to_ids("<think>")
    opens = {opening: 3.0} if parser == "qwen3" else {}  # qwen3 thinks only where the output opens with <think>
    prompts, params = [], []
    for budget in BUDGETS:
        for bias in (0.0, 0.1 if parser == "deepseek_r1" else 0.2):
            prompts += PROMPTS
            params += [SamplingParams(temperature=0, max_tokens=24, thinking_token_budget=budget,
                                      logit_bias={close: bias, **opens})] * len(PROMPTS)
    plain = LLM(target, dtype="float64", max_num_seqs=8, reasoning_parser=parser).generate(prompts, params)
    unbudgeted = {(p, sp.logit_bias[close]): o.outputs[0].token_ids
                  for p, sp, o in zip(prompts, params, plain) if sp.thinking_token_budget is None}
    shift = 1 if parser == "qwen3" else 0  # qwen3's output opens with <think>
    thought = opened = 0
    for prompt, sp, out in zip(prompts, params, plain):
        ids, budget = out.outputs[0].token_ids, sp.thinking_token_budget
        free = unbudgeted[prompt, sp.logit_bias[close]]
        natural = closes_at(free, close)
        if parser == "qwen3" and ids[0] != opening:  # this output does not think: the budget has nothing to bound
            assert ids == free and free[0] != opening
            continue
        opened += 1
        if budget is None or natural is not None and natural - shift <= budget or budget >= 24:
            assert ids == free, (prompt, budget)  # the budget is not reached: nothing changes
            thought += natural is not None and natural - shift > 0
        else:
            assert closes_at(ids, close) == budget + shift and ids[:budget + shift] == free[:budget + shift]
    assert opened >= len(plain) // 2, "the test needs outputs that think"
    if parser == "deepseek_r1":  # (qwen3's, biased to open with <think>, keep writing it: the walk below closes)
        assert thought >= 3, "the test needs outputs that close their thinking before the budget"
    assert_speculation_equals(plain, think_model_dirs, parser, prompts, params)


def allowed(matcher) -> set[int]:
    return {i for i, b in enumerate(matcher.compute_logit_bias()) if b}


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_budgets_grammar_step_by_step(think_model_dirs, parser):
    """The grammar of a free answer after a budget of 3 (qwen3: after the <think> the output opens with, or with
    no thinking at all): any token while under it (thinking, </think>, the end), </think> alone at it, then any
    token (the answer, or the end)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(think_model_dirs["target"])
    close, opening, eos = (tokenizer.convert_tokens_to_ids(t) for t in ("</think>", "<think>", tokenizer.eos_token))
    vocab = len(tokenizer)
    everything = set(range(vocab))
    grammars = GrammarCache(tokenizer, vocab, frozenset({eos}))
    for early in (None, 0, 2):  # never close (the budget does), close at once, close after two tokens
        matcher, _ = grammars.matcher(None, parser == "deepseek_r1", 3)
        if parser == "qwen3":
            assert allowed(matcher) == everything  # no thinking yet: the answer may start, or <think>
            assert matcher.consume_token(opening)
        for step in range(3 if early is None else early):
            assert allowed(matcher) == everything  # a thinking token, </think> or the end
            assert matcher.consume_token(7 + step)
        if early is None:
            assert allowed(matcher) == {close}, "at the budget only </think>"
        assert matcher.consume_token(close)
        assert allowed(matcher) == everything, "then a free answer"


def test_a_budget_holds_before_a_constrained_answer(think_model_dirs):
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=4, reasoning_parser="deepseek_r1")
    params = SamplingParams(temperature=0, max_tokens=30, thinking_token_budget=4,
                            structured_outputs={"choice": ["yes", "no"]})
    for out in llm.generate(PROMPTS, params):
        ids = out.outputs[0].token_ids
        assert closes_at(ids, llm.tokenizer.convert_tokens_to_ids("</think>")) == 4
        assert out.outputs[0].text.partition("</think>")[2] in ("yes", "no"), out.outputs[0].text


def test_a_budget_the_output_cannot_reach_is_no_budget(think_model_dirs):
    """A budget of at least the output's length (``max_tokens``, 10^30: a number the grammar compiler cannot
    parse as a repetition count) never binds: the output equals the one without a budget, with a free answer and a
    constrained one."""
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=4, reasoning_parser="deepseek_r1")
    for constraint in (None, {"choice": ["yes", "no"]}):
        free = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=12, structured_outputs=constraint))]
        for budget in (12, 10**30):
            params = SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=budget,
                                    structured_outputs=constraint)
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == free, (constraint, budget)


def test_sampled_speculation_follows_the_target_under_the_budget(think_model_dirs):
    """Budget 1, the first two tokens: a thinking token then the forced </think>, or </think> then a free answer
    token; draft_model k=2 samples follow plain sampling under the budget's grammar (chi-square)."""
    counts, expected, close, llm = sampled_and_exact(think_model_dirs, None, budget=1)
    assert counts[close].sum() > 100 and counts.sum() - counts[close].sum() > 100, "both orders of the two tokens"
    assert counts[:, close].sum() - counts[close, close] == counts.sum() - counts[close].sum(), "forced </think>"
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > 1e-3, f"samples deviate from the target under the budget (p={pvalue:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"


def test_bad_budgets_are_refused(think_model_dirs, text_model_dirs):
    for value in (-1, 1.5, "3", True):
        with pytest.raises(SpecDecError, match="thinking_token_budget must be None or an integer >= 0"):
            SamplingParams(thinking_token_budget=value)
    with pytest.raises(SpecDecError, match="min_tokens cannot be combined with thinking_token_budget"):
        SamplingParams(thinking_token_budget=3, min_tokens=2)
    with pytest.raises(SpecDecError, match="needs a reasoning model's parser"):
        LLM(think_model_dirs["target"], dtype="float64").generate(["x"], SamplingParams(thinking_token_budget=3))
    no_tags = LLM(text_model_dirs["target"], dtype="float64", reasoning_parser="deepseek_r1")  # </think> is text
    with pytest.raises(SpecDecError, match="needs </think> to be one token"):
        no_tags.generate(["x"], SamplingParams(thinking_token_budget=3))


def test_the_server_takes_a_budget_on_chat_and_as_anthropics_budget_tokens(think_model_dirs):
    llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=2, reasoning_parser="deepseek_r1")
    served = Served(create_app(llm, served_model_name="tiny", api_key="", chat_template=TEMPLATE))
    tokenizer = llm.tokenizer
    try:  # the server's reasoning is the offline output's first three tokens, then </think>
        ask = [{"role": "user", "content": "def f(x):"}]
        answer = httpx.post(f"{served.root}/v1/chat/completions", timeout=60, json={
            "messages": ask, "max_tokens": 12, "temperature": 0, "thinking_token_budget": 3}).json()
        message = answer["choices"][0]["message"]
        (offline,) = llm.chat(ask, SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=3),
                              chat_template=TEMPLATE)
        ids = offline.outputs[0].token_ids
        assert closes_at(ids, tokenizer.convert_tokens_to_ids("</think>")) == 3
        assert message["reasoning_content"] == tokenizer.decode(ids[:3])
        assert message["content"], answer  # the answer follows the forced </think>
        anthropic = httpx.post(f"{served.root}/v1/messages", timeout=60, json={
            "messages": ask, "max_tokens": 12, "temperature": 0, "thinking": {"type": "enabled",
                                                                               "budget_tokens": 3}}).json()
        assert [b["type"] for b in anthropic["content"]] == ["thinking", "text"], anthropic
        assert anthropic["content"][0]["thinking"] == message["reasoning_content"]
        refused = httpx.post(f"{served.root}/v1/chat/completions", timeout=60, json={
            "messages": ask, "max_tokens": 2, "thinking_token_budget": -1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    finally:
        served.stop()
