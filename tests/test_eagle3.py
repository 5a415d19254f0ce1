"""EAGLE-3 feature fusion: an eagle folder with ``feature_layers`` reads those hidden states of the target
and fuses them into its input feature. Lossless greedy (batched, chains and trees, both backends) and
sampled output with random fused weights; its drafts equal a fresh computation from transformers'
``hidden_states``; bad configurations are clear errors; ``specdec train eagle --feature-layers`` trains
one; folders without the field keep working."""

from __future__ import annotations

import json

import pytest
import torch
from test_greedy_equality import check_outputs, run_batch
from test_heads import (  # noqa: F401 - llama, references, sharp_pair: module fixtures
    check_eagle_drafts_from_scratch,
    llama,
    randomize_and_save,
    references,
    sharp_pair,
)
from test_sampling_exactness import BATCH, PROMPT, assert_matches_target
from test_train import tiny_head_training

from specdec import LLM, SamplingParams
from specdec.drafters.heads.common import CONFIG_FILE, spec_for
from specdec.drafters.heads.eagle import check_feature_layers
from specdec.errors import SpecDecError
from specdec.train.heads import build_module


def make_fused(model, folder, layers: list[int], seed: int, scale: float = 1.0):
    """A random eagle layer fusing ``layers`` of the transformers ``model``, saved in float64 to ``folder``."""
    lm_head, embed = model.get_output_embeddings().weight.detach(), model.get_input_embeddings().weight.detach()
    layers = check_feature_layers(layers, model.config.num_hidden_layers)
    spec = spec_for("eagle", "test target", lm_head, model.config, intermediate_size=48, feature_layers=layers)
    module = build_module("eagle", spec, embed, lm_head)
    assert module.fuse is not None and module.fuse.in_features == len(layers) * spec.hidden_size
    return randomize_and_save(module, spec, folder, seed, scale)


@pytest.mark.parametrize(("k", "candidates", "backend"), [(4, 1, "auto"), (6, 2, "auto"), (3, 1, "hf")])
def test_fused_eagle_batched_greedy_matches_transformers(model_dirs, llama, references, tmp_path,  # noqa: F811
                                                         k, candidates, backend):
    make_fused(llama, tmp_path / "eagle3", [1, 2, -1], seed=1)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": k,
            "num_candidates": candidates}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", backend=backend,
              max_num_seqs=BATCH)
    assert llm.engine.hidden_layers == (1, 2, 3), "the engine must hand over the fused layers"
    check_outputs(run_batch(llm), references)
    assert llm.batch_metrics.num_draft_tokens > 50 and llm.batch_metrics.num_accepted_tokens > 0
    assert not llm.engine.drafter.features, "features of finished sequences must be released"


def test_fused_eagle_drafts_equal_a_fresh_computation(model_dirs, llama, tmp_path):  # noqa: F811
    """Each draft equals the one computed from scratch: the layer over the fusion of transformers'
    ``hidden_states[1]`` and ``[2]`` for the whole context, then on its own predictions. A drafter
    reading other layers than the fused ones (or fusing them in another order) fails this."""
    module = make_fused(llama, tmp_path / "eagle3", [2, 1], seed=3, scale=3.0)
    spec = {"method": "eagle", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)

    def features(ids):
        states = llama(ids, output_hidden_states=True).hidden_states
        return module.fused(torch.cat([states[2], states[1]], dim=-1))

    check_eagle_drafts_from_scratch(llm, module, features)


def test_fused_eagle_sampling_matches_target(sharp_pair):  # noqa: F811
    target, root = sharp_pair
    make_fused(target, root / "eagle3", [0, 1, 2], seed=4, scale=3.0)
    spec = {"method": "eagle", "model": str(root / "eagle3"), "num_speculative_tokens": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, "fused eagle")


def _edit_config(folder, **fields):
    path = folder / CONFIG_FILE
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("layers", "message"), [
    ([1, 9], r"out of range for a target with 3 layers"),
    ([1, 1], "name a layer twice"),
    ([-1], "distinct non-negative"),
    ("1,2", "must be a list of integers"),
    ([1.5], "must be a list of integers"),
])
def test_bad_feature_layers_in_a_folder_are_refused(model_dirs, llama, tmp_path, layers, message):  # noqa: F811
    make_fused(llama, tmp_path / "eagle3", [1, 3], seed=5)
    _edit_config(tmp_path / "eagle3", feature_layers=layers)
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "eagle", "model": str(tmp_path / "eagle3")})


def test_feature_layers_are_eagle_only_and_must_match_the_weights(model_dirs, llama, tmp_path):  # noqa: F811
    from test_heads import make_heads

    make_heads(llama, "medusa", tmp_path / "medusa", seed=6)
    _edit_config(tmp_path / "medusa", feature_layers=[1, 3])
    with pytest.raises(SpecDecError, match="sets feature_layers, which medusa heads do not take"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "medusa", "model": str(tmp_path / "medusa")})
    make_fused(llama, tmp_path / "eagle3", [1, 3], seed=7)
    _edit_config(tmp_path / "eagle3", feature_layers=[0, 1, 3])  # three layers, weights for two
    with pytest.raises(SpecDecError, match="do not match its config.json"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "eagle", "model": str(tmp_path / "eagle3")})


def test_a_folder_without_feature_layers_reads_the_final_feature(model_dirs, llama, references, tmp_path):  # noqa: F811
    """Folders written before the field existed (no ``feature_layers`` key) load as plain eagle."""
    from test_heads import make_heads

    make_heads(llama, "eagle", tmp_path / "eagle", seed=8)
    path = tmp_path / "eagle" / CONFIG_FILE
    data = json.loads(path.read_text())
    del data["feature_layers"]
    path.write_text(json.dumps(data))
    llm = LLM(model_dirs["llama"]["target"], dtype="float64",
              speculative_config={"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3})
    assert llm.engine.hidden_layers == (-1,) and llm.engine.drafter.module.fuse is None
    check_outputs(run_batch(llm), references)


def test_train_eagle_with_feature_layers(text_model_dirs, tmp_path, capsys):
    """``specdec train eagle --feature-layers`` writes a fused folder that loads and decodes; the flags are
    refused for other methods and out-of-range layers are a one-line error."""
    from specdec.train.cli import main

    out = tmp_path / "eagle3"
    common = tiny_head_training(tmp_path, text_model_dirs["target"])
    assert main(["eagle", "--out", str(out), "--feature-layers", "1,-1", "--feature-weight", "0.5", *common]) == 0
    config = json.loads((out / CONFIG_FILE).read_text())
    layers = config["feature_layers"]
    assert layers[0] == 1 and layers[1] > 1 and len(layers) == 2, "negative layers are stored resolved"
    assert json.loads((out / "train_summary.json").read_text())["heldout_tau"] >= 1.0
    llm = LLM(text_model_dirs["target"], speculative_config={"method": "eagle", "model": str(out)}, dtype="float64")
    assert llm.engine.hidden_layers == tuple(layers)
    assert len(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    capsys.readouterr()
    assert main(["eagle", "--out", str(tmp_path / "bad"), "--feature-layers", "1,99", *common]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # mtp has no such flag
        main(["mtp", "--out", str(tmp_path / "bad"), "--feature-layers", "1", *common])
    with pytest.raises(SystemExit):
        main(["eagle", "--out", str(tmp_path / "bad"), "--feature-layers", "one,two", *common])


def test_train_heads_refuses_eagle_options_for_other_methods(tmp_path):
    from specdec.train.heads import HEAD_PRESETS, train_heads
    from specdec.train.loop import TrainSettings

    for extra in ({"feature_layers": [1]}, {"feature_weight": 0.5}):
        with pytest.raises(SpecDecError, match="eagle options, not mtp ones"):
            train_heads("mtp", tmp_path, HEAD_PRESETS["tiny"], TrainSettings(out_dir=tmp_path / "out"), **extra)
    with pytest.raises(SpecDecError, match="feature weight must be a non-negative number"):
        train_heads("eagle", tmp_path, HEAD_PRESETS["tiny"], TrainSettings(out_dir=tmp_path / "out"),
                    feature_weight=float("nan"))
