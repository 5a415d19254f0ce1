"""A constraint after the thinking (``reasoning_parser``): the thinking runs free, the answer after ``</think>`` holds
the constraint; with the tags as single tokens (as DeepSeek-R1's and Qwen3's tokenizers hold them, added or special)
and spelled in several tokens. Speculation stays exact across the boundary: greedy outputs equal plain greedy
decoding's, and sampled ones follow the target's distribution under the grammar (drafts cross ``</think>`` within
a step)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue
from test_structured_limits import NO_TEXT_REGEX
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from specdec import LLM, SamplingParams, SpecDecError, StructuredOutputsParams
from specdec.reasoning import PARSERS, output_thinking, thinking_closed
from specdec.structured.grammar import GrammarCache

TAGS = ("token", "special", "text")  # how the tokenizer holds <think> and </think>


def tokenizer_with(tokenizer_dir, tags: str) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    if tags == "token":
        tokenizer.add_tokens(["<think>", "</think>"])
    elif tags == "special":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tokenizer


def walk(grammars: GrammarCache, constraint: StructuredOutputsParams, tokenizer, text: str, parser: str) -> str:
    """``"refused"`` if the grammar refuses a token of ``text``, else ``"complete"`` (end-of-sequence may follow) or
    ``"partial"``."""
    matcher, _ = grammars.matcher(constraint, PARSERS[parser])
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return "refused"
    return "complete" if matcher.is_accepting() else "partial"


DIGITS = StructuredOutputsParams(regex="[0-9]+")
CASES = {  # text: what the grammar makes of it, per parser
    "deepseek_r1": {"plan it": "complete", "<think>plan": "complete", "plan</think>12": "complete",
                    "</think>7": "complete", "plan</think>": "partial", "plan</think>x": "refused",
                    "plan</think> 12": "refused", "plan</think>12</think>": "refused"},
    "qwen3": {"12": "complete", "plan": "refused", "<think>plan": "complete", "<think>plan</think>12": "complete",
              "<think>plan</think>": "partial", " <think>x": "refused", "<think>a</think>b": "refused",
              "<think>a</think>1</think>": "refused"},
}


@pytest.mark.parametrize("tags", TAGS)
@pytest.mark.parametrize("parser", sorted(CASES))
def test_the_thinking_is_free_and_the_answer_holds_the_constraint(tokenizer_dir, tags, parser):
    tokenizer = tokenizer_with(tokenizer_dir, tags)
    grammars = GrammarCache(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    if tags != "text":
        assert len(tokenizer.encode("a</think>1", add_special_tokens=False)) == 3
    for text, expected in CASES[parser].items():
        assert walk(grammars, DIGITS, tokenizer, text, parser) == expected, (text, tags)


@pytest.mark.parametrize("constraint, answer, wrong", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}, '{"a": 3}', '{"b": 3}'),
    ({"json_object": True}, "{}", "[]"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'start: "f(" NUM ")"\nNUM: /[0-9]+/'}, "f(12)", "f(x)"),
    ({"grammar": 'root ::= "f(" [0-9]+ ")"'}, "f(12)", "f()"),
    ({"regex": "[a-c]{2}"}, "ab", "ad"),
])
def test_every_kind_of_constraint_follows_the_thinking(tokenizer_dir, constraint, answer, wrong):
    tokenizer = tokenizer_with(tokenizer_dir, "token")
    grammars = GrammarCache(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    params = StructuredOutputsParams(**constraint)
    assert walk(grammars, params, tokenizer, "hm, let me see</think>" + answer, "deepseek_r1") == "complete"
    assert walk(grammars, params, tokenizer, "hm, let me see</think>" + wrong, "deepseek_r1") != "complete"


def test_a_constraint_that_matches_no_text_is_still_refused(tokenizer_dir):
    """The answer's grammar alone is probed: free thinking before it does not hide that it matches nothing."""
    tokenizer = tokenizer_with(tokenizer_dir, "token")
    grammars = GrammarCache(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    with pytest.raises(SpecDecError, match="the regex in structured_outputs matches no text"):
        grammars.compile(StructuredOutputsParams(regex=NO_TEXT_REGEX), True)


def test_an_unknown_parser_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(SpecDecError, match="unknown reasoning parser 'r2': specdec has deepseek_r1, qwen3"):
        LLM(tmp_path / "no-model-here", reasoning_parser="r2")


def test_a_prompt_that_closes_the_thinking_leaves_the_output_all_answer():
    """A template with the thinking off (Qwen3's enable_thinking false, DeepSeek's non-thinking mode) closes it in the
    prompt: vLLM reads the prompt so, and so does specdec."""
    for prompt, closed in [("<|user|>q<|assistant|><think>\n\n</think>\n\n", True), ("q</think>", True),
                           ("q<|assistant|><think>\n", False), ("q", False), ("a</think>b<think>", False)]:
        assert thinking_closed(prompt) is closed, prompt
        assert output_thinking("deepseek_r1", prompt) is (None if closed else True)
        assert output_thinking("qwen3", prompt) is (None if closed else False)
    assert output_thinking(None, "q") is None


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_after_a_closed_thinking_the_constraint_holds_from_the_first_token(think_model_dirs, parser):
    """Strong biases on both tags: after a prompt that closed the thinking the output may use neither, it is the
    answer alone; after one that did not, the same request thinks."""
    target = think_model_dirs["target"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    tags = {tokenizer.convert_tokens_to_ids(t): 5.0 for t in ("<think>", "</think>")}
    llm = LLM(target, dtype="float64", reasoning_parser=parser)
    params = SamplingParams(temperature=0, max_tokens=12, logit_bias=tags, structured_outputs={"regex": "[0-9]{2,4}"})
    closed = llm.generate(["q<think>\n\n</think>\n\n"], params)[0].outputs[0]
    assert re.fullmatch("[0-9]{2,4}", closed.text) and closed.finish_reason == "stop", closed.text
    opened = llm.generate(["q<think>\n"], params)[0].outputs[0].text
    assert "</think>" in opened or opened.startswith("<think>"), opened


# ------------------------------------------------------------------------------------------------ the engine
PROMPTS = ["def f(x):", "return x", "for i in", "x = 1\n"]
BIASES = (0.02, 0.06, 0.1)  # on </think>: a random model closes its thinking after some tokens, or never
QWEN3_BIASES = (0.1, 0.15, 0.2)
ANSWERS = [
    ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"regex": "[0-9]{2,8}"}, lambda text: re.fullmatch("[0-9]{2,8}", text) is not None),
    ({"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
     lambda text: isinstance(json.loads(text)["n"], int)),
]
SPECS = {
    "draft_model": lambda dirs: {"method": "draft_model", "model": str(dirs["draft"]), "num_speculative_tokens": 3},
    "ngram": lambda dirs: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
}


def requests(tokenizer, parser: str) -> tuple[list[str], list[SamplingParams]]:
    """Each prompt with each bias and constraint; with qwen3, a bias on <think> opens the thinking in most."""
    close, opening = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.convert_tokens_to_ids("<think>")
    prompts, params = [], []
    for prompt in PROMPTS:
        for bias in (BIASES if parser == "deepseek_r1" else QWEN3_BIASES):
            for constraint, _ in ANSWERS:
                prompts.append(prompt)
                params.append(SamplingParams(temperature=0, max_tokens=28, structured_outputs=constraint,
                                             logit_bias={close: bias, **({opening: 0.1} if parser == "qwen3" else {})}))
    return prompts, params


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_greedy_speculation_equals_plain_decoding_across_the_thinking(think_model_dirs, parser):
    target = think_model_dirs["target"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    prompts, params = requests(tokenizer, parser)
    plain = LLM(target, dtype="float64", max_num_seqs=8, reasoning_parser=parser).generate(prompts, params)
    answered = 0
    for out, (_, valid) in zip(plain, ANSWERS * (len(plain) // len(ANSWERS))):
        text, finish = out.outputs[0].text, out.outputs[0].finish_reason
        if parser == "qwen3" and not text.startswith("<think>"):  # no thinking: all answer
            assert finish == "length" or valid(text), text
            continue
        thinking, closed, answer = text.removeprefix("<think>").partition("</think>")
        assert "</think>" not in answer and (finish == "length" or closed), text
        if closed and finish == "stop":
            assert valid(answer), text
            answered += thinking != ""
    assert answered >= 3, "the test needs outputs that think, close their thinking and answer"
    assert_speculation_equals(plain, think_model_dirs, parser, prompts, params)


def assert_speculation_equals(plain, think_model_dirs, parser: str, prompts, params) -> None:
    """Greedy outputs of every method of :data:`SPECS` equal ``plain``'s, with drafts accepted."""
    for method, spec in SPECS.items():
        llm = LLM(think_model_dirs["target"], dtype="float64", max_num_seqs=8, reasoning_parser=parser,
                  speculative_config=spec(think_model_dirs))
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain], method
        assert llm.batch_metrics.num_accepted_tokens > 0, method


# A distribution over two tokens that crosses the boundary: biases put most of the mass on a and b (thinking) and on
# </think>, after which the grammar allows the answer's first token only (the answer is [cd]+).
SAMPLES, PER_CALL = 1200, 16


def exact_joint(model, grammars: GrammarCache, constraint: StructuredOutputsParams | None, prompt_ids: list[int],
                biases: dict[int, float], budget: int | None = None) -> np.ndarray:
    """P(t1, t2) of plain sampling at temperature 1 with ``biases``, under the grammar (its masks from llguidance;
    ``budget``: a thinking budget's)."""
    vocab = model.config.vocab_size

    def probs(context: list[int], matcher) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([context])).logits[0, -1].clone()
        for token, bias in biases.items():
            logits[token] += bias
        allowed = torch.tensor(list(matcher.compute_logit_bias())[:vocab]) > 0
        return torch.softmax(logits.masked_fill(~allowed, -torch.inf), -1)

    root, _ = grammars.matcher(constraint, True, budget)
    first = probs(prompt_ids, root)
    joint = np.zeros((vocab, vocab))
    for t1 in first.nonzero().flatten().tolist():
        state = root.deep_copy()
        assert state.consume_token(t1)
        joint[t1] = first[t1].item() * probs(prompt_ids + [t1], state).numpy()
    return joint


def sampled_and_exact(think_model_dirs, constraint: StructuredOutputsParams | None, budget: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, int, LLM]:
    """The first two tokens of :data:`SAMPLES` draft_model (k=2) outputs at temperature 1, with biases toward a, b and
    </think> (and none toward the end), counted by pair; their exact joint distribution; </think>'s id; the LLM."""
    target = think_model_dirs["target"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    close, eos = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.eos_token_id
    biases = {tokenizer.convert_tokens_to_ids("a"): 6.0, tokenizer.convert_tokens_to_ids("b"): 6.0, close: 6.0,
              eos: -100.0}
    prompt_ids = tokenizer("abcab")["input_ids"]
    llm = LLM(target, dtype="float64", max_num_seqs=PER_CALL, reasoning_parser="deepseek_r1",
              speculative_config={"method": "draft_model", "model": str(think_model_dirs["draft"]),
                                  "num_speculative_tokens": 2})
    counts = np.zeros((model.config.vocab_size,) * 2)
    for call in range(SAMPLES // PER_CALL):
        params = [SamplingParams(max_tokens=2, seed=(call * PER_CALL + j) * 7919 + 5, ignore_eos=True,
                                 temperature=1.0, logit_bias=biases, structured_outputs=constraint,
                                 thinking_token_budget=budget)
                  for j in range(PER_CALL)]
        for out in llm.generate([{"prompt_token_ids": prompt_ids}] * PER_CALL, params):
            first, second = out.outputs[0].token_ids
            counts[first, second] += 1
    grammars = GrammarCache(tokenizer, model.config.vocab_size, frozenset({eos}))
    return counts, exact_joint(model, grammars, constraint, prompt_ids, biases, budget), close, llm


def test_sampled_speculation_follows_the_target_across_the_thinking(think_model_dirs):
    counts, expected, close, llm = sampled_and_exact(think_model_dirs, StructuredOutputsParams(regex="[cd]+"))
    assert counts[close].sum() > 100 and counts.sum() - counts[close].sum() > 100, "both sides of the boundary"
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > 1e-3, f"samples deviate from the target under the grammar (p={pvalue:.2e})"
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the test needs accepted and rejected drafts"
