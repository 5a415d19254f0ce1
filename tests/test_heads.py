"""The head drafters (medusa, eagle, mtp) on the target's features: lossless greedy and sampled
output with random head weights, the head folder's target check, eagle's draft bookkeeping, and a
tiny training run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model, record_drafts, run_graph_bodies_eagerly
from test_greedy_equality import MAX_TOKENS, PROMPTS, check_outputs, run_batch
from test_sampling_exactness import BATCH, PROMPT, VOCAB, assert_matches_target
from test_train import MODULES
from test_train import _module_source as module_source

from specdec import LLM, SamplingParams
from specdec.drafters.heads.common import save_heads, spec_for
from specdec.drafters.heads.modules import EagleLayer
from specdec.errors import SpecDecError
from specdec.train.heads import build_module

METHODS = ["medusa", "eagle", "mtp"]


def make_heads(model, method: str, folder, seed: int, scale: float = 1.0, num_heads: int = 3):
    """Random ``method`` heads for the transformers ``model``, saved in float64 to ``folder``."""
    lm_head, embed = model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    spec = spec_for(method, "test target", lm_head, model.config, num_heads=num_heads, intermediate_size=48)
    return randomize_and_save(build_module(method, spec, embed, lm_head), spec, folder, seed, scale)


def randomize_and_save(module, spec, folder, seed: int, scale: float):
    """``module``'s trainable weights drawn at random (matrices ~ N(0, scale^2 / fan-in), vectors ~ 1 +
    N(0, 0.01)), saved with ``spec`` in float64 to ``folder``; returns the module."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.requires_grad:
                param.normal_(0.0, scale / param.shape[-1] ** 0.5 if param.ndim > 1 else 0.1).add_(
                    1.0 if param.ndim == 1 else 0.0)
    save_heads(module, spec, folder, torch.float64)
    return module


@pytest.fixture(scope="module")
def llama(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)


@pytest.fixture(scope="module")
def references(llama):
    refs = []
    for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
        ids = torch.tensor([prompt])
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(prompt):].tolist())
    return refs


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_heads_batched_greedy_matches_transformers(model_dirs, llama, references, tmp_path, method, k):
    make_heads(llama, method, tmp_path / method, seed=1)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": k}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64",
              max_num_seqs=4 if k == 1 else 16)
    check_outputs(run_batch(llm), references)
    assert llm.batch_metrics.num_draft_tokens > 50
    assert max(llm.engine.cache.lengths) == 0 and not llm.scheduler.has_work
    assert not llm.engine.drafter.features, "features of finished sequences must be released"


def test_heads_on_the_transformers_backend(model_dirs, llama, references, tmp_path):
    make_heads(llama, "eagle", tmp_path / "eagle", seed=2)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", backend="hf", max_num_seqs=5)
    check_outputs(run_batch(llm), references)


def check_eagle_drafts_from_scratch(llm, module, features) -> None:
    """Greedy-decode four prompts with an eagle ``llm`` (``max_num_seqs`` 4, k 3) recording every
    proposal, then check each against the one computed from scratch: ``module`` teacher-forced over
    ``features(ids)`` (the drafter's input features of the whole context, ``[1, T, H]``), then on
    its own predictions."""
    records = record_drafts(llm, PROMPTS[:4])
    with torch.no_grad():
        for context, drafts in records:
            if not drafts:
                continue
            ids = torch.tensor([context])
            expected, inputs, tokens = [], features(ids)[:, :-1], ids[:, 1:]
            for _ in drafts:
                pred = module(inputs, tokens)[:, -1:]
                token = F.linear(pred, module.decoder.lm_head.weight).argmax(-1)
                expected.append(int(token))
                inputs, tokens = torch.cat([inputs, pred], dim=1), torch.cat([tokens, token], dim=1)
            assert drafts == expected, f"context {context}"


def test_eagle_drafts_equal_a_fresh_computation(model_dirs, llama, tmp_path):
    """After steps with rejections, each eagle draft equals the one computed from scratch: the layer
    teacher-forced over the target's features of the whole context, then on its own predictions."""
    module = make_heads(llama, "eagle", tmp_path / "eagle", seed=3, scale=3.0)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    check_eagle_drafts_from_scratch(llm, module, lambda ids: llama(ids, output_hidden_states=True).hidden_states[-1])


def test_eagle_drafts_through_the_captured_bodies(model_dirs, llama, references, tmp_path, monkeypatch):
    """What a GPU runs for eagle, on a CPU: the layer marked as capturing, each graph's body run once in place of
    a capture and replay. The catch-up forward fed the target's features and the whole greedy draft chain
    (rows of different k in one chain, each keeping its own first k tokens) give the drafts computed from
    scratch, and a batch's output equals transformers' greedy output."""
    run_graph_bodies_eagerly(monkeypatch)
    module = make_heads(llama, "eagle", tmp_path / "eagle", seed=3, scale=3.0)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}
    ragged = []
    for check in ("drafts", "outputs"):
        llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64",
                  max_num_seqs=4 if check == "drafts" else 16)
        drafter = llm.engine.drafter
        drafter.layer.use_cuda_graphs = True
        chains = drafter._chains

        def spy(seqs, active, ks, rows, width, chains=chains):
            taken = chains(seqs, active, ks, rows, width)
            ragged.append(taken and len({ks[b] for b in active}) > 1)
            return taken

        drafter._chains = spy
        if check == "drafts":
            check_eagle_drafts_from_scratch(
                llm, module, lambda ids: llama(ids, output_hidden_states=True).hidden_states[-1])
        else:
            check_outputs(run_batch(llm), references)
        kinds = {key[0] for key in drafter.cache.graphs.graphs}
        assert kinds == {"forward", "greedy_chain"}, kinds
    assert any(ragged) and not all(ragged)


@pytest.fixture(scope="module")
def sharp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads_exact")
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    target.save_pretrained(root / "target")
    return target, root


@pytest.mark.parametrize("method", METHODS)
def test_heads_sampling_matches_target(sharp_pair, method):
    target, root = sharp_pair
    make_heads(target, method, root / method, seed=4, scale=3.0, num_heads=2)
    spec = {"method": method, "model": str(root / method), "num_speculative_tokens": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, method)


def test_heads_for_another_target_are_refused(model_dirs, llama, tmp_path):
    make_heads(llama, "medusa", tmp_path / "medusa", seed=5)
    other = build_model("llama", seed=999)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SpecDecError, match="trained for the target 'test target'"):
        LLM(tmp_path / "other", speculative_config={"method": "medusa", "model": str(tmp_path / "medusa")},
            dtype="float64")
    with pytest.raises(SpecDecError, match="holds 'medusa' heads, not 'eagle'"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "eagle", "model": str(tmp_path / "medusa")},
            dtype="float64")
    with pytest.raises(SpecDecError, match="needs a 'model'"):
        LLM(tmp_path / "other", speculative_config={"method": "mtp"}, dtype="float64")
    with pytest.raises(SpecDecError, match="not a folder of heads"):
        LLM(tmp_path / "other", speculative_config={"method": "mtp", "model": str(tmp_path)}, dtype="float64")


def test_eagle_layer_keeps_the_targets_tensors_out_of_its_weights(llama):
    lm_head, embed = llama.get_output_embeddings().weight.detach(), llama.get_input_embeddings().weight.detach()
    spec = spec_for("eagle", "t", lm_head, llama.config, intermediate_size=48)
    module = build_module("eagle", spec, embed, lm_head)
    assert isinstance(module, EagleLayer)
    assert module.decoder.lm_head.weight.data_ptr() == lm_head.data_ptr()
    assert not any("embed_tokens" in k or "lm_head" in k for k in module.trained_state())


def test_train_heads_smoke(text_model_dirs, tmp_path):
    """A tiny training run writes loadable heads, a log and a summary with held-out acceptance."""
    from specdec.train.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in MODULES:  # a corpus with held-out modules (test_train's)
        (corpus / f"{name}.py").write_text(module_source(name))
    out = tmp_path / "mtp"
    argv = ["mtp", "--target", str(text_model_dirs["target"]), "--out", str(out), "--corpus", str(corpus),
            "--preset", "tiny", "--max-steps", "3", "--batch-size", "2", "--eval-blocks", "2", "--warmup-steps", "1",
            "--acceptance-prompts", "2", "--acceptance-tokens", "6", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["heldout_tau"] >= 1.0
    assert len(summary["heldout_acceptance_per_position"]) == 4
    assert (out / "training_log.jsonl").is_file()
    llm = LLM(text_model_dirs["target"], speculative_config={"method": "mtp", "model": str(out)}, dtype="float64")
    assert len(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    assert (out / "token_counts.safetensors").is_file()  # the training split's counts: a draft vocabulary works
    llm = LLM(text_model_dirs["target"], dtype="float64",
              speculative_config={"method": "mtp", "model": str(out), "draft_vocab_size": 16})
    assert len(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    assert main([*argv[:-2], "--resume", "--max-steps", "4"]) == 0
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("method", METHODS)
def test_embedded_heads_serve_the_embedded_target_with_no_model(method, capsys):
    """``speculative_config={"method": m}`` and ``specdec generate --speculative-method m`` with no model
    use the shipped heads on the embedded target; greedy output equals plain decoding's."""
    from specdec.assets import default_pair
    from specdec.cli import main
    from specdec.drafters.heads.common import HEADS_DIR

    assert (HEADS_DIR / method / "model.safetensors").stat().st_size < 12 * 2**20
    target = default_pair()[0]
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["def quicksort(arr):\n", "class Stack:\n"]
    spec = LLM(target, speculative_config={"method": method}, dtype="float32", max_num_seqs=2)
    plain = LLM(target, dtype="float32", max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert spec.batch_metrics.num_draft_tokens > 0
    assert main(["generate", "def f(x):", "--speculative-method", method, "--max-tokens", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["method"] == method and record["speculative_model"] is None
