"""The tie-aware greedy check: equal, rounding tie (the target's two logits within the dtype's rounding)
or real mismatch, each with its position and logit gap; the bench fails only on real mismatches."""

import pytest
import torch
from helpers import build_model
from test_bench import QUESTIONS, ScriptedPrompts, ScriptedRunner

from specdec import LLM, SamplingParams
from specdec.bench.harness import BenchSettings, reference_judge, run_benchmark
from specdec.bench.methods import MethodSpec, RunOutput
from specdec.bench.report import mismatch_warning, tie_notice, to_markdown
from specdec.bench.runners import SpecDecRunner
from specdec.bench.workloads import Question
from specdec.greedy_check import GreedyVerdict, check_greedy, first_difference, rounding_tolerance

PROMPT = [3, 5, 7, 11, 13]


@pytest.fixture(scope="module")
def tied():
    """A float64 Llama whose output head has a twin of the row of its first greedy token, so that token
    and its twin have exactly equal logits everywhere; plus the plain greedy output and the twin's id."""
    model = build_model("llama", seed=31)
    first = model(torch.tensor([PROMPT])).logits[0, -1].argmax().item()
    twin = (first + 1) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[first]
    llm = LLM(model, dtype="float64")
    expected = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=8))[0]
    return llm, expected.outputs[0].token_ids, twin, model


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_rounding_tolerance_is_two_units_in_the_last_place():
    assert rounding_tolerance(4.6562, torch.bfloat16) == pytest.approx(2 * 2**-7 * 4)  # bf16 ulp at 4..8: 1/32
    assert rounding_tolerance(4.6562, torch.float32) == pytest.approx(2 * 2**-23 * 4)
    assert rounding_tolerance(0.0, torch.bfloat16) > 0


def test_equal_outputs_run_nothing(tied):
    llm, expected, _, _ = tied
    verdict = check_greedy(llm.target, PROMPT, expected, list(expected))
    assert verdict == GreedyVerdict("equal") and verdict.ok and verdict.describe() == "identical"


def test_an_exact_tie_is_a_rounding_tie_with_its_position_and_gap(tied):
    llm, expected, twin, _ = tied
    assert expected[0] != twin
    verdict = check_greedy(llm.target, PROMPT, expected, [twin, *expected[1:]])
    assert verdict.kind == "tie" and verdict.ok
    assert verdict.position == 0 and verdict.tokens == (expected[0], twin)
    assert verdict.gap == 0.0 and verdict.top2_gap == 0.0
    assert "rounding tie at token 0" in verdict.describe()


def test_a_real_mismatch_names_the_position_and_the_gap(tied):
    llm, expected, twin, model = tied
    logits = model(torch.tensor([PROMPT + expected[:3]])).logits[0, -1]
    wrong = next(t for t in range(llm.target.vocab_size) if t not in (expected[3], twin))
    verdict = check_greedy(llm.target, PROMPT, expected, [*expected[:3], wrong, *expected[4:]])
    assert verdict.kind == "mismatch" and not verdict.ok
    assert verdict.position == 3 and verdict.tokens == (expected[3], wrong)
    assert verdict.gap > verdict.tolerance and verdict.top2_gap >= 0
    assert verdict.gap == pytest.approx((logits[expected[3]] - logits[wrong]).abs().item())
    assert "mismatch at token 3" in verdict.describe()
    shorter = check_greedy(llm.target, PROMPT, expected, expected[:5])
    assert shorter.kind == "mismatch" and shorter.position == 5 and shorter.tokens is None


def test_the_bench_judges_with_the_reference_target(tied):
    llm, expected, twin, _ = tied
    judge = reference_judge([SpecDecRunner(MethodSpec("plain"), llm)])
    assert judge(PROMPT, expected, [twin, *expected[1:]]).kind == "tie"


class Fixed(ScriptedRunner):
    """A scripted runner that outputs ``tokens`` for every prompt, its ``llm`` the one its mode judges with."""

    def __init__(self, spec: MethodSpec, tokens: list[int], llm: LLM) -> None:
        super().__init__(spec)
        self.tokens, self.llm = tokens, llm

    def run(self, prompts, max_tokens, temperature, seed):
        out = super().run(prompts, max_tokens, temperature, seed)
        return RunOutput([list(self.tokens) for _ in prompts], out.seconds, out.metrics)


class OnePrompt(ScriptedPrompts):
    def build(self, turns, answers):
        return list(PROMPT)


def test_both_modes_judge_a_tie_as_a_tie_by_default_and_as_a_mismatch_when_deterministic(tied):
    llm, expected, twin, model = tied
    deterministic = LLM(model, dtype="float64", deterministic=True)
    swapped = [twin, *expected[1:]]  # a tie of the target's logits at the first token
    runners = [Fixed(MethodSpec("plain"), expected, llm), Fixed(MethodSpec("ngram", 2), swapped, llm)]
    runners += [Fixed(MethodSpec("plain", deterministic=True), expected, deterministic),
                Fixed(MethodSpec("ngram", 2, deterministic=True), swapped, deterministic)]
    settings = BenchSettings(max_tokens=len(expected), warmup=0)
    result = run_benchmark(runners, [Question("1", "one", ("abc",), "one")], OnePrompt(), settings, progress=False)
    assert result.ties == {"ngram k=2": 1} and result.mismatches == {"ngram k=2 det": 1}


def test_bench_counts_ties_apart_and_fails_only_on_mismatches():
    runners = [ScriptedRunner(MethodSpec("plain")), ScriptedRunner(MethodSpec("ngram", 2), corrupt=True)]

    def judge(prompt_ids, expected, actual):
        position = first_difference(expected, actual)
        return GreedyVerdict("tie", position, (expected[position], actual[position]), 0.0, 0.0, 0.0625)

    settings = BenchSettings(max_tokens=8, warmup=0)
    result = run_benchmark(runners, QUESTIONS, ScriptedPrompts(), settings, progress=False, judge=judge)
    assert result.mismatches == {} and result.ties == {"ngram k=2": 3}
    assert mismatch_warning(result) is None
    assert "ngram k=2: 3/3" in tie_notice(result) and tie_notice(result) in to_markdown(result)
    assert "0/3 (3 ties)" in to_markdown(result)
    bad = [m for m in result.measurements if m.method == "ngram k=2"]
    assert all(m.verdict.kind == "tie" and m.first_mismatch == 7 and m.prompt_ids for m in bad)
    assert all(m.to_dict()["greedy_check"]["kind"] == "tie" for m in bad)
