"""``{"method": "cascade", "stages": [small, mid]}``: batched greedy equality with three tiny float64 models,
sampling exactness (and a wrong outer q caught), the per-stage metrics, and bad configs."""

import json
import shutil

import pytest
import test_sampling_exactness
import torch
from helpers import build_model, truncated_copy
from test_auto_method import MAX_TOKENS, PROMPTS
from test_sampling_exactness import BATCH, PROMPT, SETTINGS, VOCAB, assert_matches_target, pair, pvalues  # noqa: F401  (pair: a fixture)
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import specdec.drafters.cascade
from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError


@pytest.fixture(scope="module")
def three(model_dirs, tmp_path_factory):
    """Per architecture: the target (3 layers), a middle draft (its first 2 layers), a small one (its first)."""
    root = tmp_path_factory.mktemp("cascade")
    dirs = {}
    for arch in ("llama", "gpt2"):
        target = AutoModelForCausalLM.from_pretrained(model_dirs[arch]["target"], dtype=torch.float64)
        truncated_copy(target, 2).save_pretrained(root / arch / "mid")
        dirs[arch] = {"target": model_dirs[arch]["target"], "mid": root / arch / "mid",
                      "small": model_dirs[arch]["truncated"], "model": target}
    return dirs


def cascade(small, mid, k, inner_k=2):
    return {"method": "cascade", "num_speculative_tokens": k, "stages": [
        {"method": "draft_model", "model": str(small), "num_speculative_tokens": inner_k},
        {"method": "draft_model", "model": str(mid)}]}


def reference(model, prompt, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,k", [("llama", 4), ("llama", "auto"), ("gpt2", 3)])
def test_greedy_equality_batched(three, arch, k):
    """Batched greedy output equals transformers' greedy output of the target (fast and hf backends)."""
    dirs = three[arch]
    llm = LLM(dirs["target"], speculative_config=cascade(dirs["small"], dirs["mid"], k), dtype="float64",
              max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for output, prompt, n in zip(outputs, PROMPTS, MAX_TOKENS, strict=True):
        assert output.outputs[0].token_ids == reference(dirs["model"], prompt, n)
    batch = llm.batch_metrics
    assert 0 < batch.num_accepted_tokens < batch.num_draft_tokens, "the target must accept some drafts, not all"
    assert 0 < batch.inner_accepted_tokens < batch.inner_draft_tokens, "the middle model must reject some drafts"
    assert batch.inner_steps > 0
    for name in ("inner_steps", "inner_draft_tokens", "inner_accepted_tokens"):
        assert sum(getattr(o.metrics, name) for o in outputs) == getattr(batch, name), name
    record = outputs[0].metrics.to_dict()
    assert record["inner_acceptance_rate"] == record["inner_accepted_tokens"] / record["inner_draft_tokens"]


def test_each_step_drafts_exactly_k_middle_tokens(three):
    """The middle model produces k tokens per row per step: the target sees chains of k (fewer only at the end)."""
    dirs = three["llama"]
    llm = LLM(dirs["target"], speculative_config=cascade(dirs["small"], dirs["mid"], 5, inner_k=3), dtype="float64")
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=40))[0]
    drafted = out.metrics.drafted_per_position
    assert len(drafted) == 5 and drafted[4] == out.metrics.num_drafts - 1  # the last step drafts what remains
    # Each middle forward after a small draft of n tokens emits at most n + 1 tokens; at least ceil(k/(inner+1)).
    assert out.metrics.inner_steps >= out.metrics.num_drafts * 2 - 1


@pytest.fixture(scope="module")
def small_dir(pair, tmp_path_factory):  # noqa: F811  (pair: the fixture)
    """A third model for the sampling tests, unlike both the target and the middle model (``pair``'s draft)."""
    path = tmp_path_factory.mktemp("small") / "small"
    build_model("llama", seed=13, vocab=VOCAB, layers=1, scale=3.0).save_pretrained(path)
    return path


CALLS = 60  # generate calls of 32 requests per test: 360 samples per setting (the wrong q below fails at this size)


def test_sampling_matches_target(pair, small_dir, monkeypatch):  # noqa: F811  (pair: the fixture)
    """Chi-square: the first two sampled tokens of mixed batches follow the target's exact distribution."""
    monkeypatch.setattr(test_sampling_exactness, "CALLS", CALLS)
    target, root = pair
    llm = LLM(root / "target", speculative_config=cascade(small_dir, root / "draft", 2, inner_k=1),
              dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, "cascade")
    batch = llm.batch_metrics
    assert 0 < batch.inner_accepted_tokens < batch.inner_draft_tokens


def test_the_small_models_q_at_the_outer_stage_is_caught(pair, small_dir, monkeypatch):  # noqa: F811
    """Verifying the middle model's tokens against the small model's q (where it drafted) biases the output."""
    target, root = pair
    monkeypatch.setattr(test_sampling_exactness, "CALLS", CALLS)
    exact = specdec.drafters.cascade.verify_sampled

    def small_q(draft_tokens, num_draft, draft_probs, parents, target_probs, sampling):
        result = exact(draft_tokens, num_draft, draft_probs, parents, target_probs, sampling)
        if draft_probs is not None:  # the distributions handed to the target now hold the small model's q
            target_probs[:, : draft_probs.shape[1]] = draft_probs
        return result

    monkeypatch.setattr(specdec.drafters.cascade, "verify_sampled", small_q)
    llm = LLM(root / "target", speculative_config=cascade(small_dir, root / "draft", 2, inner_k=1),
              dtype="float64", max_num_seqs=BATCH)
    results = pvalues(target, llm, PROMPT, (3,))
    for settings, pvalue in zip(SETTINGS, results):
        assert pvalue < 1e-6, f"{settings}: a wrong outer q went unnoticed (p={pvalue:.2e})"


BAD = [
    ({"method": "cascade"}, "needs 'stages'"),
    ({"method": "cascade", "stages": []}, "needs 'stages'"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x"}]}, "needs 'stages'"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x"}] * 3}, "needs 'stages'"),
    ({"method": "cascade", "stages": {"method": "draft_model"}}, "must be a list"),
    ({"method": "cascade", "stages": [{"method": "ngram"}, {"method": "draft_model", "model": "x"}]},
     "stage 0 is 'ngram'"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x"}, {"method": "nope"}]},
     "cascade stage 1: unknown speculative method"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x", "lookup": 1},
                                      {"method": "draft_model", "model": "x"}]}, "stage 0: unknown speculative_config"),
    ({"method": "cascade", "stages": [{"method": "draft_model"}, {"method": "draft_model", "model": "x"}]},
     "stage 0: speculative method 'draft_model' needs a draft 'model'"),
    ({"method": "cascade", "stages": [{"method": "cascade", "stages": []}, {"method": "draft_model", "model": "x"}]},
     "stage 0: speculative method 'cascade' needs 'stages'"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x", "num_speculative_tokens": "auto"},
                                      {"method": "draft_model", "model": "x"}]}, "fixed num_speculative_tokens"),
    ({"method": "cascade", "stages": [{"method": "draft_model", "model": "x"},
                                      {"method": "draft_model", "model": "x", "draft_confidence_threshold": 0.5}]},
     "middle model\\) takes no draft_confidence_threshold"),
    ({"method": "cascade", "model": "x", "stages": [{"method": "draft_model", "model": "x"}] * 2}, "no 'model'"),
    ({"method": "draft_model", "model": "x", "stages": [{"method": "draft_model", "model": "x"}] * 2},
     "takes no 'stages'"),
    ({"method": "auto", "stages": [{"method": "draft_model", "model": "x"}] * 2}, "takes no 'stages'"),
]


@pytest.mark.parametrize("config,message", BAD, ids=[m for _, m in BAD])
def test_bad_cascade_configs(model_dirs, config, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], speculative_config=config, dtype="float64")


def test_a_stage_with_another_tokenizer_is_refused(text_model_dirs, tmp_path):
    """Same vocabulary size, other token ids: a cascade stage must share the target's tokenizer."""
    other = tmp_path / "other"
    shutil.copytree(text_model_dirs["draft"], other)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(text_model_dirs["draft"])
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    size = len(spec["model"]["vocab"])
    spec["model"]["vocab"] = {token: (size - i) % size for token, i in spec["model"]["vocab"].items()}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                            eos_token=tokenizer.eos_token).save_pretrained(other)
    same = text_model_dirs["draft"]
    for stages, index in (([same, other], 1), ([other, same], 0)):
        with pytest.raises(SpecDecError, match=f"cascade stage {index} .* tokenizer different"):
            LLM(text_model_dirs["target"], speculative_config=cascade(*stages, 3), dtype="float64")


def test_bench_runs_a_cascade_from_a_method_config(text_model_dirs, tmp_path):
    """``specdec bench --method-config LABEL={"method": "cascade", ...}``: the middle stage without a model is the
    run's draft; the report has the inner stage's α and the auto-k policy's choices."""
    from test_bench import _bench, _write_jsonl

    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "def f(x):\n"}, {"prompt": "for i in"}])
    out = tmp_path / "out"
    stages = [{"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 2},
              {"method": "draft_model"}]
    rc = _bench(["--model", str(text_model_dirs["target"]), "--draft-model", str(text_model_dirs["draft"]),
                 "--methods", "plain,draft_model", "--k", "3", "auto",
                 "--method-config", json.dumps({"method": "cascade", "stages": stages}).join(["cas=", ""]),
                 "--workload", "jsonl", "--data", str(data), "--max-tokens", "8", "--dtype", "float64",
                 "--warmup", "0", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    configs = {m["label"]: m["speculative_config"] for m in report["methods"]}
    assert configs["cas k=3"]["stages"][1]["model"] == configs["draft_model k=3"]["model"]  # the run's draft
    rows = {r["label"]: r for r in report["summary"] if r["category"] == "overall"}
    assert rows["cas k=3"]["inner_alpha"] == 1.0  # every stage is the target itself
    assert rows["draft_model k=3"]["inner_alpha"] is None
    assert sum(rows["draft_model k=auto"]["k_choices"].values()) > 0 and rows["cas k=3"]["k_choices"] is None
    assert all(m["matches_reference"] for m in report["measurements"] if m["method"] != "plain")
    table = (out / "bench.md").read_text()
    assert "inner α" in table and "auto k" in table
