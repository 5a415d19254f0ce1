"""The generated pages match the code and the results files; README figures trace to results rows."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_generated_from_the_code():
    reference = _script("docs_config_reference")
    text = reference.render()
    assert (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8") == text, (
        "docs/configuration.md is stale: run PYTHONPATH=src python3 scripts/docs_config_reference.py")
    from specdec.drafters import DRAFTERS

    for method in DRAFTERS:  # the reference cannot miss a method or a command flag
        assert f"| `{method}` |" in text
    assert "`--speculative-config`" in text and "`--draft-model`" in text


def test_results_page_and_readme_table_are_generated_from_the_results_files():
    results = _script("docs_results")
    files = results.load()
    assert (ROOT / "docs" / "results.md").read_text(encoding="utf-8") == results.render_page(files), (
        "docs/results.md is stale: run PYTHONPATH=src python3 scripts/docs_results.py")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme == results.readme_with_table(readme, results.render_readme_table(files), files), (
        "the README's results are stale: run PYTHONPATH=src python3 scripts/docs_results.py")
    for _, bench in files:  # every results file says how it was made
        assert bench["info"].get("command", "").startswith("specdec bench")


def test_every_readme_speedup_links_to_a_results_row():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    results = _script("docs_results")
    head, rest = readme.split(results.START, 1)
    prose = head + rest.split(results.END, 1)[1]  # the generated table is checked against its files above
    for figure in re.findall(r"\d+\.\d+x", prose):
        assert re.search(re.escape(figure) + r"\]\(docs/results\.md#([a-z0-9-]+)\)", prose), (
            f"README figure {figure} does not link to a results row")
    for target in re.findall(r"\(docs/results\.md#([a-z0-9-]+)\)", readme):
        assert f'id="{target}"' in page, f"README links to a missing results row {target}"


def test_results_grouping_by_shape():
    results = _script("docs_results")
    assert results.group_of({"info": {"shape": "1b", "target": "x"}}) == "1b"
    # what `specdec bench --shape 1b` records
    shape = "1b, the embedded pair inflated with zero padding (same logits): target 1.01B, draft 82M parameters"
    assert results.group_of({"info": {"shape": shape, "target": "x"}}) == "1b"
    two = {"settings": {"batch_sizes": [4, 16]}}
    assert results.row_label({"label": "plain", "batch_size": 16}, two) == "plain, batch 16"
    assert results.row_label({"label": "plain", "batch_size": 1}, {"settings": {"batch_sizes": [1]}}) == "plain"
    assert results.group_of({"info": {"target": "/p/specdec/assets/default_pair/target"}}) == "embedded"
    assert results.anchor("embedded-pair-cpu", "draft_model k=4") == "embedded-pair-cpu-draft-model-k-4"
    assert results.group_of({"info": {"target": "inflated"}}, "1b-h100") == "1b"
    assert results.group_of({"info": {"target": "elsewhere"}}, "llama") == "other"


def test_a_1b_results_file_fills_its_row_group():
    results = _script("docs_results")
    row = {"label": "draft_model k=4", "category": "overall", "batch_size": 1, "tokens_per_second": 120.0,
           "speedup": 1.5, "tau": 3.0, "alpha": 0.6, "cost_ratio": 0.1, "mismatches": 0, "checked": 4, "ties": 1}
    bench = {"info": {"shape": "1b", "command": "specdec bench --shape 1b", "dtype": "bfloat16",
                      "device name": "GPU"},
             "settings": {"max_tokens": 8, "temperature": 0.0, "batch_sizes": [1], "seeds": [0], "repeats": 1,
                          "warmup": 1},
             "summary": [{**row, "label": "plain", "speedup": 1.0}, row]}
    table = results.render_readme_table([("1b-gpu", bench)])
    assert "| method | batch 1, greedy |" in table
    assert "| plain decoding | [120.0 tok/s](docs/results.md#1b-gpu-plain) |" in table
    assert "| draft_model k=4 | [1.50x](docs/results.md#1b-gpu-draft-model-k-4) |" in table
    assert "embedded pair" in table and "not measured yet" in table  # the other group says it has no file
    page = results.render_page([("1b-gpu", bench)])
    assert 'id="1b-gpu-draft-model-k-4"' in page and "3/4 equal, 1 ties" in page


def test_the_readme_table_has_a_column_per_batch_and_temperature():
    results = _script("docs_results")

    def made(temperature: float, batches: list[int], label: str, speedup: float) -> dict:
        rows = [{"label": name, "category": "overall", "batch_size": b, "tokens_per_second": 10.0 * b,
                 "speedup": s, "tau": 1.0} for b in batches for name, s in (("plain", 1.0), (label, speedup))]
        return {"info": {"shape": "1b", "dtype": "bfloat16", "cpu threads": 2},
                "settings": {"temperature": temperature, "batch_sizes": batches}, "summary": rows}

    table = results.render_readme_table([("a", made(0.0, [1], "eagle k=auto", 3.0)),
                                         ("b", made(0.7, [1], "eagle k=auto", 2.5)),
                                         ("c", made(0.0, [4, 16], "ngram k=auto", 1.1))])
    assert "| method | batch 1, greedy | batch 4, greedy | batch 16, greedy | batch 1, T = 0.7 |" in table
    eagle = "| eagle | [3.00x](docs/results.md#a-eagle-k-auto) | – | – | [2.50x](docs/results.md#b-eagle-k-auto) |"
    assert eagle in table
    assert "| ngram | – | [1.10x](docs/results.md#c-ngram-k-auto-batch-4) |" in table


def test_a_both_modes_results_file_gets_a_det_cost_column():
    results = _script("docs_results")
    base = {"category": "overall", "batch_size": 1, "tau": None, "alpha": None, "cost_ratio": None,
            "mismatches": None, "checked": 0, "ties": None}
    rows = [{**base, "label": "plain", "method": "plain", "tokens_per_second": 100.0, "speedup": 1.0},
            {**base, "label": "plain det", "method": "plain", "deterministic": True, "tokens_per_second": 80.0,
             "speedup": 1.0, "deterministic_cost": 1.25},
            {**base, "label": "eagle k=auto det", "method": "eagle", "deterministic": True, "tokens_per_second": 160.0,
             "speedup": 2.0, "deterministic_cost": 1.1, "mismatches": 0, "checked": 4, "ties": 0}]
    bench = {"info": {"target": "/p/specdec/assets/default_pair/target", "command": "specdec bench",
                      "dtype": "bfloat16", "cpu threads": 2},
             "settings": {"max_tokens": 8, "temperature": 0.0, "batch_sizes": [1], "seeds": [0], "repeats": 1,
                          "warmup": 1},
             "summary": rows}
    page = results.render_page([("det", bench)])
    assert "| speedup vs plain | det. cost | per-prompt median" in page
    assert "eagle k=auto det | 1 | 160.0 | 2.00x | 1.10x | – |" in page and "plain | 1 | 100.0 | 1.00x | – |" in page
    table = results.render_readme_table([("det", bench)])
    assert "| plain decoding, deterministic | [80.0 tok/s](docs/results.md#det-plain-det) |" in table
    assert "| eagle det | [2.00x](docs/results.md#det-eagle-k-auto-det) |" in table
    assert "| speedup vs plain | per-prompt" in results.render_page([("default", {**bench, "summary": rows[:1]})])
