"""Bad arguments to ``LLM`` and prompts of the wrong shape are a SpecDecError naming the problem, and drafting
flags a command would drop are an error (exit 2, one line) rather than ignored."""

import json
import re

import pytest
from helpers import build_model

from specdec import LLM, SpecDecError
from specdec.assets import default_pair
from specdec.cli import main
from specdec.drafters import SpeculativeConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    build_model("llama", seed=0).save_pretrained(path)
    return path


@pytest.mark.parametrize("model,message", [(None, "model must be a folder, a hub id or a loaded PreTrainedModel, "
                                                   "got NoneType"),
                                          (5, "got int")])
def test_a_model_of_the_wrong_type(model, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model)


@pytest.mark.parametrize("kwargs,message", [
    ({"tokenizer": 5}, "tokenizer must be a folder or a hub id, got int"),
    ({"device": "meta"}, "device 'meta' is not supported"),
    ({"seed": -1}, r"seed must be an integer in 0..2\*\*64-1 or None, got -1"),
    ({"seed": 2**70}, "seed must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": "x"}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"enforce_eager": "no"}, "enforce_eager must be True or False, got 'no'"),
    ({"deterministic": 1}, "deterministic must be True or False, got 1"),
])
def test_bad_llm_arguments(folder, kwargs, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(folder, dtype="float64", **kwargs)


@pytest.fixture(scope="module")
def embedded():
    pair = default_pair()
    if pair is None:
        pytest.skip("the embedded default pair is not shipped")
    return LLM(pair[0], dtype="float32")


def test_a_text_prompt_dict_is_its_text(embedded):
    from specdec import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0)
    as_dict = embedded.generate({"prompt": "def add(a, b):"}, params)[0]
    as_text = embedded.generate("def add(a, b):", params)[0]
    assert as_dict.prompt == "def add(a, b):" and as_dict.prompt_token_ids == as_text.prompt_token_ids
    assert as_dict.outputs[0].token_ids == as_text.outputs[0].token_ids


@pytest.mark.parametrize("prompt,message", [
    ({"prompt": "a", "max_tokens": 3}, "unknown key 'max_tokens' in a prompt"),
    ({"text": "a"}, "unknown key 'text' in a prompt"),
    ({"prompt": 5}, "a prompt dict needs 'prompt' \\(a string\\) or 'prompt_token_ids'"),
    ({}, "a prompt dict needs 'prompt'"),
    ([5], "a prompt is a string or a dict with 'prompt' or 'prompt_token_ids', got int"),
])
def test_prompts_of_the_wrong_shape(embedded, prompt, message):
    with pytest.raises(SpecDecError, match=message):
        embedded.generate(prompt)
    assert not embedded.scheduler.has_work


def test_max_num_speculative_tokens_needs_auto():
    with pytest.raises(SpecDecError, match="max_num_speculative_tokens is the largest k"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 8, "max_num_speculative_tokens": 2})
    auto = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "auto",
                                        "max_num_speculative_tokens": 2})
    assert auto.max_k == 2


@pytest.mark.skipif(default_pair() is None, reason="the embedded default pair is not shipped")
@pytest.mark.parametrize("flags,message", [
    (["--speculative-config", '{"method": "ngram"}', "--k", "3"],
     "--k does not combine with --speculative-config: give its field in the JSON"),
    (["--speculative-config", '{"method": "ngram"}', "--prompt-lookup-max", "2"], "--prompt-lookup-max does not"),
    (["--speculative-method", "none", "--num-speculative-tokens", "3"],
     "--num-speculative-tokens sets drafting, and this runs plain decoding"),
    (["--speculative-method", "none", "--max-step-time-ratio", "1.2"], "--max-step-time-ratio sets drafting"),
    (["--max-num-speculative-tokens", "2"], "max_num_speculative_tokens is the largest k"),
    (["--speculative-method", "ngram", "--draft-dtype", "float16"],
     "--draft-dtype applies to draft_model, and this runs ngram"),
    (["--speculative-method", "draft_model", "--prompt-lookup-max", "5"],
     "--prompt-lookup-max applies to ngram, and this runs draft_model"),
])
def test_drafting_flags_a_command_would_drop_are_an_error(capsys, flags, message):
    assert main(["generate", "def f():", "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("config, words", [
    ({"method": "draft_model", "model": "x", "early_exit": True}, "'draft_model' takes no 'early_exit' (it is read by "
                                                                  "layer_skip)"),
    ({"method": "ngram", "dtype": "float16"}, "'ngram' takes no 'dtype' (it is read by draft_model)"),
    ({"method": "eagle", "lookahead_window": 5}, "'eagle' takes no 'lookahead_window' (it is read by lookahead)"),
    ({"method": "suffix", "prompt_lookup_max": 5}, "'suffix' takes no 'prompt_lookup_max' (it is read by ngram)"),
    ({"method": "auto", "candidates": [{"method": "ngram", "suffix_factor": 2.0}]},
     "auto candidate 0: speculative method 'ngram' takes no 'suffix_factor' (it is read by suffix)"),
])
def test_a_method_refuses_the_fields_only_other_methods_read(config, words):
    """A field set for a method that does not read it would change nothing: refused by name, with its readers."""
    with pytest.raises(SpecDecError, match=re.escape(words)):
        SpeculativeConfig.from_dict(config)
    if "candidates" not in config:  # at their defaults, every method takes them (the CLI passes them so)
        defaults = {k: v for k, v in config.items() if k in ("method", "model")}
        assert SpeculativeConfig.from_dict({**defaults, "prompt_lookup_max": 3, "dtype": None}).method == config[
            "method"]


def test_a_prompts_file_line_with_both_text_and_ids(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", "prompt_token_ids": [1]}) + "\n")
    assert main(["generate", "--prompts-file", str(path), "--speculative-method", "none"]) == 2
    assert "prompts.jsonl:1: give 'prompt' or 'prompt_token_ids', not both" in capsys.readouterr().err
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "max_tokens": 3}) + "\n")
    assert main(["generate", "--prompts-file", str(path), "--speculative-method", "none"]) == 2
    assert "prompts.jsonl:2: unknown key 'max_tokens': a line takes 'prompt'" in capsys.readouterr().err


def test_a_config_declaring_more_layers_than_its_weights_hold(folder, tmp_path):
    """transformers initialises missing tensors at random (and says so in a log the CLI hides): refused by name."""
    import shutil

    copy = tmp_path / "more-layers"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecError, match=r"lack \d+ tensors its config.json declares \(model.layers.3.*a config "
                                           r"that does not match its checkpoint"):
        LLM(copy, dtype="float64")
    assert LLM(folder, dtype="float64").target.name  # the checkpoint itself loads


def test_a_config_whose_shapes_differ_from_its_weights(folder, tmp_path):
    import shutil

    copy = tmp_path / "fewer-kv-heads"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    assert config["num_key_value_heads"] > 1
    config["num_key_value_heads"] = 1
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecError, match=r"do not match its config.json in \d+ tensors \(model.layers.0.self_attn"
                                           r".k_proj.weight \[\d+, \d+\] where config.json makes \[\d+, \d+\]"):
        LLM(copy, dtype="float64")


def test_an_error_that_quotes_a_multi_line_message_is_one_line(monkeypatch, capsys):
    """A library's message quoted in a SpecDecError (transformers' tokenizer and config errors span lines)."""
    import specdec.generate_cli

    def run(args):
        raise SpecDecError("could not load a tokenizer from 'x': Couldn't instantiate the backend tokenizer from:\n"
                           "(1) a `tokenizers` file,\n(2) a slow tokenizer\n\nYou need sentencepiece")

    monkeypatch.setattr(specdec.generate_cli, "run", run)
    assert main(["generate", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "from: (1) a `tokenizers` file, (2) a slow tokenizer You need sentencepiece" in err
