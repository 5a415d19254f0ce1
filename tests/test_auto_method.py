"""``{"method": "auto", "candidates": [...]}``: the bandit on synthetic timings, the composite's choice
from an injected clock, bad configs, and losslessness (batched greedy equality, sampling exactness)
with candidates mixed inside one step."""

import json
import random

import pytest
import torch
from test_sampling_exactness import BATCH, NGRAM_PROMPT, assert_matches_target, pair  # noqa: F401  (pair: a fixture)
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.drafters.auto import ThroughputBandit, merge_drafts
from specdec.drafters.base import DraftBatch
from specdec.errors import SpecDecError
from specdec.verify import common_prefix

PROMPTS = [
    [3, 5, 7, 3, 5, 7, 11, 3, 5],
    [42, 1, 17, 29, 8, 64, 2],
    [7],
    [90, 91, 90, 91, 90],
    [33, 3, 33, 3, 33, 3],
    [55, 44, 33, 22, 11, 0, 12, 23, 34, 45, 56, 67, 78],
]
MAX_TOKENS = [30, 24, 31, 17, 35, 9]


def run_bandit(bandit: ThroughputBandit, keys: list[str], figures: dict[str, list[tuple[float, float]]],
               steps: int) -> dict[str, list[int]]:
    """Steps of every request: choose, then report the synthetic (tokens, seconds) of the chosen arm."""
    picks = {key: [0] * bandit.num_arms for key in keys}
    for _ in range(steps):
        for key in keys:
            arm = bandit.choose(key)
            picks[key][arm] += 1
            bandit.update(key, arm, *figures[key][arm])
    return picks


@pytest.mark.parametrize("fast", [0, 1, 2])
def test_bandit_picks_the_fastest_candidate(fast):
    # Arm `fast` emits fewer tokens per step but takes far less time: the most tokens per second.
    figures = [(3.0, 1.0)] * 3
    figures[fast] = (2.0, 0.25)
    bandit = ThroughputBandit(3, rng=random.Random(1))
    picks = run_bandit(bandit, ["a"], {"a": figures}, 200)["a"]
    assert picks[fast] > 0.9 * 200, picks
    assert all(p > 0 for p in picks), f"every candidate must be measured: {picks}"


def test_bandit_learns_per_request():
    # Request "x" is fastest with arm 0, request "y" with arm 1 (e.g. repetitive text suits n-grams).
    figures = {"x": [(4.0, 1.0), (1.0, 1.0)], "y": [(1.0, 1.0), (4.0, 1.0)]}
    bandit = ThroughputBandit(2, rng=random.Random(2))
    picks = run_bandit(bandit, ["x", "y"], figures, 200)
    assert picks["x"][0] > 0.85 * 200 and picks["y"][1] > 0.85 * 200, picks
    bandit.release("x")
    assert "x" not in bandit.requests


def test_bandit_without_exploration_sticks_to_the_measured_best():
    bandit = ThroughputBandit(2, exploration=0.0)
    picks = run_bandit(bandit, ["a"], {"a": [(1.0, 1.0), (1.5, 1.0)]}, 50)["a"]
    assert picks == [1, 49]  # arm 0 tried once (unmeasured arms first), then the better arm 1 only


def test_bandit_keeps_the_current_candidate_unless_another_is_clearly_faster():
    """A switch costs a catch-up step: a request stays on its candidate unless another one's estimate
    beats it by ``SWITCH_MARGIN``; without a current candidate the best estimate wins."""
    bandit = ThroughputBandit(2, exploration=0.0)
    for arm, tokens in ((0, 1.0), (1, 1.03)):
        bandit.update("a", arm, tokens, 1.0)
    assert bandit.choose("a", current=0) == 0 and bandit.choose("a") == 1 and bandit.choose("a", current=1) == 1
    bandit.update("a", 1, 1.6, 1.0)  # arm 1 now clearly faster
    assert bandit.choose("a", current=0) == 1


def test_merge_gives_deterministic_rows_one_hot_probs():
    device = torch.device("cpu")
    sampled = DraftBatch(torch.tensor([[4, 2, 1]]), [3], torch.full((1, 3, 6), 1 / 6, dtype=torch.float64))
    lookup = DraftBatch(torch.tensor([[5, 3], [1, 0]]), [2, 1])
    merged = merge_drafts([([1], sampled), ([0, 2], lookup)], 3, device)
    assert merged.tokens.tolist() == [[5, 3, 0], [4, 2, 1], [1, 0, 0]]
    assert merged.num_draft == [2, 3, 1]
    assert merged.probs.dtype == torch.float64 and merged.probs.shape == (3, 3, 6)
    assert torch.equal(merged.probs[1], sampled.probs[0])
    assert merged.probs[0, 0, 5] == 1 and merged.probs[0, 1, 3] == 1 and merged.probs[2, 0, 1] == 1
    assert merged.probs[0, :2].sum() == 2 and merged.probs[0, 2].sum() == 0  # padding column: never read
    alone = merge_drafts([([0, 1], lookup)], 2, device)
    assert alone is lookup


BAD = [
    ({"method": "auto"}, "needs 'candidates'"),
    ({"method": "auto", "candidates": []}, "needs 'candidates'"),
    ({"method": "auto", "candidates": {"method": "ngram"}}, "must be a list"),
    ({"method": "auto", "candidates": [{"method": "auto", "candidates": [{"method": "ngram"}]}]}, "composite"),
    ({"method": "auto", "candidates": [{"method": "ngram", "lookup": 3}]}, "candidate 0: unknown speculative_config"),
    ({"method": "auto", "candidates": [{"method": "ngram"}, {"method": "nope"}]}, "candidate 1: unknown speculative"),
    ({"method": "auto", "candidates": [{"method": "layer_skip"}]}, "target's own layers"),
    ({"method": "auto", "candidates": [{"method": "medusa", "num_candidates": 4}]}, "trees"),
    ({"method": "auto", "candidates": [{"method": "ngram", "num_speculative_tokens": "auto"}]}, "fixed k"),
    ({"method": "auto", "model": "x", "candidates": [{"method": "ngram"}]}, "no 'model'"),
    ({"method": "ngram", "candidates": [{"method": "ngram"}]}, "takes no 'candidates'"),
]


@pytest.mark.parametrize("config,message", BAD, ids=[m for _, m in BAD])
def test_bad_auto_configs(model_dirs, config, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], speculative_config=config, dtype="float64")


@pytest.fixture(scope="module")
def references(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    refs = []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(prompt):].tolist())
    return refs


def candidates(dirs):
    return [{"method": "ngram", "num_speculative_tokens": 3},
            {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 4},
            {"method": "suffix", "num_speculative_tokens": 2}]


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_equality_with_auto_method(model_dirs, references, k):
    """Batched greedy output equals transformers' greedy output while rows switch candidates."""
    dirs = model_dirs["llama"]
    spec = {"method": "auto", "num_speculative_tokens": k, "candidates": candidates(dirs)}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    llm.engine.drafter.bandit.exploration = 0.5  # every candidate drafts, often several in one step
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for output, reference in zip(outputs, references, strict=True):
        assert output.outputs[0].token_ids == reference
    batch = llm.batch_metrics
    assert set(batch.drafter_choices) == {"ngram", "draft_model", "suffix"}, batch.drafter_choices
    total = {}
    for output in outputs:
        for label, count in output.metrics.drafter_choices.items():
            total[label] = total.get(label, 0) + count
    assert total == batch.drafter_choices


class SyntheticClock:
    """A StageClock stand-in: every stage named in ``seconds`` lasts that long."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.names = seconds, []

    def start(self) -> None:
        self.names = []

    def lap(self, name: str) -> None:
        self.names.append(name)

    def read(self) -> dict[str, float]:
        return {name: self.seconds[name] for name in self.names}


def test_auto_method_prefers_the_cheaper_candidate_on_injected_timings(model_dirs):
    """Two identical n-gram candidates; the injected clock says candidate 1 drafts 100x faster."""
    dirs = model_dirs["llama"]
    spec = {"method": "auto", "num_speculative_tokens": 3,
            "candidates": [{"method": "ngram"}, {"method": "ngram"}]}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    llm.engine.drafter.clock = SyntheticClock({"draft0": 1.0, "draft1": 0.01, "shadow0": 1.0, "shadow1": 0.01,
                                               "target": 0.1})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    choices = llm.batch_metrics.drafter_choices
    assert choices["ngram#1"] > 5 * choices.get("ngram#0", 0), choices
    assert all(o.metrics.drafter_choices["ngram#1"] > 0 for o in outputs)


@pytest.mark.parametrize("k,max_tokens", [(2, (3, 2))])
def test_sampling_matches_target_with_mixed_candidates(pair, k, max_tokens):  # noqa: F811  (pair: the fixture)
    """A sampling drafter (q returned) and a deterministic one (one-hot q) share steps."""
    target, root = pair
    spec = {"method": "auto", "num_speculative_tokens": k, "candidates": [
        {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": k},
        {"method": "ngram", "num_speculative_tokens": k}]}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    llm.engine.drafter.bandit.exploration = 0.5
    assert_matches_target(target, llm, NGRAM_PROMPT, "speculative", max_tokens)
    batch = llm.batch_metrics
    assert min(batch.drafter_choices.values()) > 1000, batch.drafter_choices


def test_generate_cli_takes_an_auto_speculative_config(text_model_dirs, capsys):
    """``specdec generate --speculative-config JSON``: the auto method from the command line, greedy output
    equal to plain decoding, the choices in the JSON metrics, and a bad config exits 2 with one line."""
    from specdec.cli import main

    common = ["generate", "def f(x):", "--model", str(text_model_dirs["target"]), "--max-tokens", "16",
              "--ignore-eos", "--dtype", "float64", "--temperature", "0", "--json"]
    assert main([*common, "--speculative-method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = {"method": "auto", "num_speculative_tokens": 3, "candidates": [
        {"method": "draft_model", "model": str(text_model_dirs["draft"])}, {"method": "ngram"}]}
    assert main([*common, "--speculative-config", json.dumps(spec)]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["token_ids"] == plain["token_ids"]
    assert record["method"] == "auto" and record["num_speculative_tokens"] == 3
    assert sum(record["metrics"]["drafter_choices"].values()) > 0
    bad = json.dumps({"method": "auto", "candidates": [{"method": "auto"}]})
    assert main([*common, "--speculative-config", bad]) == 2
    assert "candidate 0" in capsys.readouterr().err
    assert main([*common, "--speculative-config", json.dumps(spec), "--speculative-method", "ngram"]) == 2


def test_a_switch_is_held_one_step_and_not_measured(model_dirs):
    """After switching candidate a row stays one more step; the switch step (catch-up) is not measured."""
    dirs = model_dirs["llama"]
    spec = {"method": "auto", "num_speculative_tokens": 2, "candidates": [{"method": "ngram"}, {"method": "suffix"}]}
    drafter = LLM(dirs["target"], speculative_config=spec, dtype="float64").engine.drafter
    choices = iter([0, 1, 0])
    drafter.bandit.choose = lambda key, current=None: next(choices)
    assert [drafter._choose("r") for _ in range(4)] == [0, 1, 1, 0]
    assert "r" in drafter.switched  # the last step switched back: the next one is held again


@pytest.mark.parametrize(("draft", "emitted", "expected"), [
    ([4, 5, 6], [4, 5, 9], 2),  # rejected at the third token
    ([4, 5, 6], [7], 0),
    ([4, 5], [4, 5, 6], 2),  # the whole draft kept, and the bonus token
    ([4, 5, 6, 7], [4, 5], 2),  # cut at the emitted tokens: at least 2
    ([], [3], 0),
])
def test_a_shadow_draft_keeps_its_common_prefix_with_the_emitted_tokens(draft, emitted, expected):
    assert common_prefix(draft, emitted) == expected


def test_lookup_candidates_are_measured_on_the_rows_others_draft(model_dirs):
    """Two identical n-gram candidates, every row forced onto the first: the second is measured on every
    step through its shadow drafts, with the very tokens the first was credited (its draft is the same, so
    its common prefix with the emitted tokens is the accepted count), never drafting itself."""
    dirs = model_dirs["llama"]
    spec = {"method": "auto", "num_speculative_tokens": 3, "candidates": [{"method": "ngram"}, {"method": "ngram"}]}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    drafter = llm.engine.drafter
    drafter.bandit.choose = lambda key, current=None: 0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    assert "ngram#1" not in llm.batch_metrics.drafter_choices
    drafted, shadowed = drafter.bandit.pool
    assert drafted.count > 10 and shadowed.count == pytest.approx(drafted.count)
    assert shadowed.tokens == pytest.approx(drafted.tokens)
