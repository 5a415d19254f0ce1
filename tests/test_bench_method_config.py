"""``specdec bench --method-config NAME=JSON``: per-method speculative_config fields, and further
configurations of a method under their own label, validated where every speculative_config is."""

import json

import pytest
from test_bench import _bench, _write_jsonl

from specdec.errors import SpecDecError


def test_method_config_overrides_a_method_and_adds_labelled_configurations(text_model_dirs, tmp_path):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x = 1\nx = 1\nx = 1\n"}, {"prompt": "def f(x):\n"}])
    out = tmp_path / "out"
    rc = _bench(["--model", str(text_model_dirs["target"]), "--methods", "plain,suffix,layer_skip", "--k", "2", "3",
                 "--method-config", 'suffix={"suffix_factor": 2.5, "suffix_min_prob": 0.3, "num_candidates": 2}',
                 "--method-config", 'exit1={"method": "layer_skip", "skip_layers": [1]}',
                 "--workload", "jsonl", "--data", str(data), "--max-tokens", "8", "--dtype", "float64",
                 "--warmup", "0", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    configs = {m["label"]: m["speculative_config"] for m in report["methods"]}
    assert list(configs) == ["plain", "suffix k=2", "suffix k=3", "layer_skip k=2", "layer_skip k=3",
                             "exit1 k=2", "exit1 k=3"]
    for k in (2, 3):
        suffix = configs[f"suffix k={k}"]
        assert (suffix["suffix_factor"], suffix["suffix_min_prob"], suffix["num_candidates"]) == (2.5, 0.3, 2)
        assert configs[f"exit1 k={k}"]["method"] == "layer_skip" and configs[f"exit1 k={k}"]["skip_layers"] == [1]
        assert configs[f"layer_skip k={k}"]["skip_layers"] is None
        assert configs[f"exit1 k={k}"]["num_speculative_tokens"] == k
    overall = {r["label"] for r in report["summary"] if r["category"] == "overall"}
    assert {"exit1 k=2", "suffix k=3"} <= overall
    assert all(m["matches_reference"] for m in report["measurements"] if m["method"] != "plain")


def test_a_method_config_with_its_own_k_runs_once_at_it(text_model_dirs, tmp_path):
    """``num_speculative_tokens`` in a configuration fixes its k: it runs once, labelled with that k (it used
    to run once per --k, every run with the configuration's own k under another k's label)."""
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x = 1\nx = 1\nx = 1\n"}])
    out = tmp_path / "out"
    rc = _bench(["--model", str(text_model_dirs["target"]), "--methods", "plain,ngram", "--k", "2", "auto",
                 "--method-config", 'wide={"method": "ngram", "num_speculative_tokens": "auto", '
                                    '"max_num_speculative_tokens": 12}',
                 "--workload", "jsonl", "--data", str(data), "--max-tokens", "8", "--dtype", "float64",
                 "--warmup", "0", "--out", str(out)])
    assert rc == 0
    configs = {m["label"]: m["speculative_config"] for m in json.loads((out / "bench.json").read_text())["methods"]}
    assert list(configs) == ["plain", "ngram k=2", "ngram k=auto", "wide k=auto"]
    assert configs["wide k=auto"]["max_num_speculative_tokens"] == 12
    assert configs["ngram k=auto"]["max_num_speculative_tokens"] == 8


@pytest.mark.parametrize("value,message", [
    ("suffix", "NAME=JSON"),
    ("suffix={bad", "not valid JSON"),
    ("suffix=[1]", "must be an object"),
    ('ngram={"prompt_lookup_max": 2}', "not a speculative method of --methods"),
    ('other={"suffix_factor": 2}', "needs a 'method'"),
    ('other={"method": "hf_assisted"}', "needs a 'method'"),
    ('suffix={"method": "ngram"}', "must be 'suffix'"),
    ('suffix={"suffix_factor": 0}', "suffix_factor must be"),
    ('suffix={"no_such_field": 1}', "unknown speculative_config keys"),
])
def test_bad_method_configs(text_model_dirs, tmp_path, value, message):
    data = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x = 1\n"}])
    with pytest.raises(SpecDecError, match=message):
        _bench(["--model", str(text_model_dirs["target"]), "--methods", "plain,suffix", "--method-config", value,
                "--workload", "jsonl", "--data", str(data), "--max-tokens", "2", "--out", str(tmp_path / "out")])


def test_a_method_config_given_twice_is_refused(text_model_dirs):
    with pytest.raises(SpecDecError, match="given twice"):
        _bench(["--model", str(text_model_dirs["target"]), "--methods", "plain,suffix",
                "--method-config", 'suffix={"suffix_factor": 2}', "--method-config", 'suffix={"suffix_factor": 3}'])
