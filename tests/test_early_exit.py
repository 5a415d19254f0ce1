"""layer_skip's trained early-exit form: the target's first ``L`` layers, an adapter, the target's
final norm and head. Lossless greedy (batched, beside sampled rows) and sampled output with random
adapters, the target's pool after rejections equals a fresh prefill, the adapter folder's checks, a
tiny ``specdec train early-exit`` run, and the adapter shipped for the embedded target."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_model
from test_heads import llama, randomize_and_save  # noqa: F401 - llama: a module fixture
from test_layer_skip import MAX_TOKENS, PROMPTS, assert_pool_is_a_fresh_prefill, reference, run_ragged_steps
from test_sampling_exactness import BATCH, PROMPT, VOCAB, assert_matches_target
from test_train import MODULES
from test_train import _module_source as module_source

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.heads.common import HEADS_DIR, save_heads, spec_for
from specdec.train.heads import build_module


def make_adapter(model, folder, exit_layer: int, seed: int, scale: float = 1.0):
    """A random early-exit adapter for the transformers ``model``, saved in float64 to ``folder``."""
    lm_head, embed = model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    spec = spec_for("early_exit", "test target", lm_head, model.config, intermediate_size=24, exit_layer=exit_layer)
    return randomize_and_save(build_module("early_exit", spec, embed, lm_head), spec, folder, seed, scale)


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_early_exit_greedy_matches_transformers(model_dirs, llama, tmp_path, exit_layer):  # noqa: F811
    """Greedy rows (a queue of 5 prompts on 3 slots, beside a sampled row) give transformers' greedy
    output; the draft runs layers 0..L-1 and the adapter, verification only layers L.."""
    make_adapter(llama, tmp_path / "ee", exit_layer, seed=3)
    spec = {"method": "layer_skip", "model": str(tmp_path / "ee"), "num_speculative_tokens": 3}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=3)
    target, calls = llm.engine.target, []
    forward = target.forward

    def recording(batch, cache):
        calls.append((batch.layers, batch.exit_adapter is not None, batch.input_hidden is not None))
        return forward(batch, cache)

    target.forward = recording
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    sampled = SamplingParams(temperature=0.8, max_tokens=10, seed=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, [9, 9]]], [*params, sampled])
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outputs):
        assert out.outputs[0].token_ids == reference(llama, prompt, n)
    assert len(outputs[-1].outputs[0].token_ids) == 10
    assert 0 < llm.batch_metrics.num_accepted_tokens < llm.batch_metrics.num_draft_tokens
    drafts = {c for c in calls if c[1]}
    verifies = {c for c in calls if c[2]}
    assert drafts == {(tuple(range(exit_layer)), True, False)}
    assert verifies == {(tuple(range(exit_layer, 3)), False, True)}
    assert max(llm.engine.cache.lengths) == 0


def test_the_adapter_changes_the_drafts(model_dirs, llama, tmp_path):  # noqa: F811
    """Guard: the adapter is applied (a different adapter gives different acceptance), and an
    untrained (zero ``down``) adapter drafts exactly what the plain early exit ``skip_layers=[1, 2]`` drafts."""
    target = model_dirs["llama"]["target"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]

    def accepted(spec):
        llm = LLM(target, speculative_config={"num_speculative_tokens": 3, **spec}, dtype="float64", max_num_seqs=5)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return llm.batch_metrics.num_accepted_tokens, llm.batch_metrics.num_draft_tokens

    results = []
    for seed, scale in ((3, 1.0), (4, 3.0)):
        make_adapter(llama, tmp_path / str(seed), 1, seed=seed, scale=scale)
        results.append(accepted({"method": "layer_skip", "model": str(tmp_path / str(seed))}))
    assert results[0] != results[1]
    zero = make_adapter(llama, tmp_path / "zero", 1, seed=5)
    lm_head = llama.get_output_embeddings().weight.detach()
    spec = spec_for("early_exit", "test target", lm_head, llama.config, intermediate_size=24, exit_layer=1)
    torch.nn.init.zeros_(zero.down.weight)
    save_heads(zero, spec, tmp_path / "zero", torch.float64)
    assert accepted({"method": "layer_skip", "model": str(tmp_path / "zero")}) == \
        accepted({"method": "layer_skip", "skip_layers": [1, 2]})


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_early_exit_leaves_the_pool_a_fresh_prefill(model_dirs, llama, tmp_path, exit_layer):  # noqa: F811
    """Greedy and sampled rows with rejections: the entries the draft wrote for layers 0..L-1 are the
    target's own, and verification wrote the rest."""
    make_adapter(llama, tmp_path / "ee", exit_layer, seed=6, scale=2.0)
    llm = LLM(model_dirs["llama"]["target"], speculative_config={
        "method": "layer_skip", "model": str(tmp_path / "ee"), "num_speculative_tokens": 4}, dtype="float64",
        max_num_seqs=5)
    seqs = run_ragged_steps(llm)
    assert_pool_is_a_fresh_prefill(llm, seqs)


def test_early_exit_sampling_matches_target(tmp_path):
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    target.save_pretrained(tmp_path / "target")
    make_adapter(target, tmp_path / "ee", 1, seed=4, scale=3.0)
    spec = {"method": "layer_skip", "model": str(tmp_path / "ee"), "num_speculative_tokens": 2}
    llm = LLM(tmp_path / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, "early-exit")


def test_bad_early_exit_configs(model_dirs, llama, tmp_path):  # noqa: F811
    target = model_dirs["llama"]["target"]
    make_adapter(llama, tmp_path / "ee", 1, seed=7)
    other = build_model("llama", seed=999)
    other.save_pretrained(tmp_path / "other")
    cases = [
        (tmp_path / "other", {"model": str(tmp_path / "ee")}, "trained for the target 'test target'"),
        (tmp_path / "other", {"early_exit": True}, "layer_skip's early exit needs a 'model'"),
        (target, {"model": str(tmp_path)}, "not a folder of heads"),
        (target, {"model": str(tmp_path / "ee"), "skip_layers": [2]}, "takes no skip_layers"),
        (target, {"early_exit": 1}, "early_exit must be true or false"),
        (target, {"model": llama}, "a folder with an early-exit adapter"),
        (model_dirs["gpt2"]["target"], {"early_exit": True}, "fast backend"),
    ]
    for path, extra, message in cases:
        with pytest.raises(SpecDecError, match=message):
            LLM(path, speculative_config={"method": "layer_skip", **extra}, dtype="float64")
    config = json.loads((tmp_path / "ee" / "config.json").read_text())
    for exit_layer in (0, 3):
        (tmp_path / "ee" / "config.json").write_text(json.dumps({**config, "exit_layer": exit_layer}))
        with pytest.raises(SpecDecError, match="outside 1..2"):
            LLM(target, speculative_config={"method": "layer_skip", "model": str(tmp_path / "ee")}, dtype="float64")
    (tmp_path / "ee" / "config.json").write_text(json.dumps({**config, "method": "medusa"}))
    with pytest.raises(SpecDecError, match="holds 'medusa' heads, not 'early_exit'"):
        LLM(target, speculative_config={"method": "layer_skip", "model": str(tmp_path / "ee")}, dtype="float64")


def test_train_early_exit_smoke(text_model_dirs, tmp_path, capsys):
    """A tiny ``specdec train early-exit`` run writes a loadable adapter (``generate --speculative-model``
    takes it), a log and a summary with held-out acceptance; ``--resume`` continues it; a bad exit layer
    is refused."""
    from specdec.cli import main as cli
    from specdec.train.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in MODULES:
        (corpus / f"{name}.py").write_text(module_source(name))
    out = tmp_path / "ee"
    argv = ["early-exit", "--target", str(text_model_dirs["target"]), "--out", str(out), "--corpus", str(corpus),
            "--exit-layer", "2", "--intermediate-size", "8", "--preset", "tiny", "--batch-size", "2",
            "--eval-blocks", "2", "--warmup-steps", "1", "--acceptance-prompts", "2", "--acceptance-tokens", "6",
            "--cache-dir", str(tmp_path / "cache"), "--max-steps", "3"]
    assert main(argv) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["heldout_tau"] >= 1.0 and summary["role"] == "early_exit"
    assert json.loads((out / "config.json").read_text())["exit_layer"] == 2
    llm = LLM(text_model_dirs["target"], speculative_config={"method": "layer_skip", "model": str(out)},
              dtype="float64")
    assert llm.engine.drafter.remaining == (2,)
    assert len(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    capsys.readouterr()
    assert cli(["generate", "def f(", "--model", str(text_model_dirs["target"]), "--speculative-method", "layer_skip",
                "--speculative-model", str(out), "--max-tokens", "4", "--dtype", "float64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["method"] == "layer_skip" and record["speculative_model"] == str(out)
    assert main([*argv[:-2], "--resume", "--max-steps", "4"]) == 0
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 4
    assert main([*argv[:-2], "--exit-layer", "3", "--max-steps", "1"]) == 2


def test_embedded_adapter_serves_the_embedded_target(capsys):
    """``{"method": "layer_skip", "early_exit": true}`` with no model uses the adapter shipped for the
    embedded target (small); greedy output equals plain decoding's; the CLI takes it too."""
    from specdec.assets import default_pair
    from specdec.cli import main

    assert (HEADS_DIR / "early_exit" / "model.safetensors").stat().st_size < 1 << 20
    target = default_pair()[0]
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["def quicksort(arr):\n", "class Stack:\n"]
    spec = LLM(target, speculative_config={"method": "layer_skip", "early_exit": True}, dtype="float32",
               max_num_seqs=2)
    assert spec.engine.drafter.adapter is not None
    plain = LLM(target, dtype="float32", max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert spec.batch_metrics.num_accepted_tokens > 0
    config = json.dumps({"method": "layer_skip", "early_exit": True})
    assert main(["generate", "def f(x):", "--speculative-config", config, "--max-tokens", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["method"] == "layer_skip"
