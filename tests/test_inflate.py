"""Function-preserving inflation (specdec.inflate): same logits, same greedy outputs and τ, heads that
load on the inflated target, ``specdec inflate`` and ``bench --shape`` at the tiny shape, bad inputs."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdec.assets import DEFAULT_PAIR_DIR
from specdec.cli import main
from specdec.drafters.heads.common import HeadSpec
from specdec.drafters.heads.eagle import eagle_config
from specdec.drafters.heads.modules import EagleLayer, EarlyExitAdapter, MedusaHeads, MTPModules
from specdec.errors import SpecDecError
from specdec.inflate.checkpoint import inflate_checkpoint
from specdec.inflate.heads import inflate_head_state, inflate_spec
from specdec.inflate.layout import Dims, Layout
from specdec.inflate.model import inflate_model, layout_for
from specdec.inflate.pair import cached_pair, inflate_pair
from specdec.llm import LLM
from specdec.sampling import SamplingParams
from specdec.shapes import SHAPES, Shape

ARCHS = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}


def _source(arch: str, tied: bool, dtype: torch.dtype, heads: int = 2, kv_heads: int = 1) -> torch.nn.Module:
    """A random 3-layer model with 16-wide heads, random norm weights and (Qwen2) random qkv biases."""
    cls, config_cls = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                        tie_word_embeddings=tied, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "bias" in name:
                param.normal_(0.0, 0.5)
    return model


def _max_relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inflated_logits_equal_the_source(arch, tied, dtype):
    model = _source(arch, tied, dtype)
    big = inflate_model(model, SHAPES["test"], "test")
    assert big.config.hidden_size == 64 and big.config.num_hidden_layers == 4 and big.dtype == dtype
    assert big.config.num_attention_heads == 4 and big.config.num_key_value_heads == 2
    assert big.config.rms_norm_eps == pytest.approx(model.config.rms_norm_eps / 2)
    assert big.config.vocab_size == 96 and big.config.tie_word_embeddings == tied
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        small_logits, big_logits = model(ids).logits, big(ids).logits
    # transformers' RMSNorm computes in float32 even for float64 models: float32 rounding either way
    assert _max_relative_gap(small_logits, big_logits) < 1e-5
    assert torch.equal(small_logits.argmax(-1), big_logits.argmax(-1))
    # a wrong construction fails: without the eps scaling the norms differ
    wrong = inflate_model(model, SHAPES["test"], "test")
    wrong.config.rms_norm_eps = model.config.rms_norm_eps
    for module in wrong.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.1
    with torch.no_grad():
        assert _max_relative_gap(small_logits, wrong(ids).logits) > 1e-3


def test_grouped_query_heads_are_copied_when_groups_shrink():
    model = _source("llama", True, torch.float64, heads=4, kv_heads=1)  # one group of 4 query heads
    shape = Shape(64, 4, 4, 2, 64, 96, 64, 10000.0, "groups of 2", head_dim=16)
    layout = layout_for(model.config, shape, "groups")
    assert layout.copies == 2  # the KV head is copied into both groups of 2
    big = inflate_model(model, shape, "groups")
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _max_relative_gap(model(ids).logits, big(ids).logits) < 1e-5


def test_layers_are_spread_and_hidden_states_mapped():
    layout = Layout(Dims(512, 6, 8, 8, 64, 1024), Dims(2048, 22, 32, 8, 64, 5632))
    assert layout.layer_at == (2, 6, 10, 13, 17, 21)  # the last source layer is the last layer
    assert [layout.hidden_index(i) for i in (0, 1, 3, 6, -1)] == [0, 3, 11, 22, 22]
    model = _source("llama", False, torch.float64)
    big = inflate_model(model, SHAPES["test"], "test")
    big_layout = layout_for(model.config, SHAPES["test"], "test")
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        small = model(ids, output_hidden_states=True).hidden_states
        large = big(ids, output_hidden_states=True).hidden_states
    for i, h in enumerate(small):
        mapped = large[big_layout.hidden_index(i)]
        assert torch.allclose(mapped[..., :32], h, atol=1e-5) and not mapped[..., 32:].any()


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _spec(method: str, **kw) -> HeadSpec:
    layer = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}
    return HeadSpec(method, "small", "0", 32, 96, num_heads=2, intermediate_size=24, layer=layer, **kw)


def _random(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(4)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(1.0 if param.ndim == 1 else 0.0, 0.3)
    return module.double().eval()


def _inflated(module_cls, spec: HeadSpec, small: torch.nn.Module, layout: Layout, args) -> torch.nn.Module:
    new_spec = inflate_spec(spec, layout, torch.zeros(96, layout.dst.hidden), "big")
    big = module_cls(*args(new_spec)).double().eval()
    state = inflate_head_state(spec, small.state_dict(), layout)
    big.load_state_dict(state)
    return big


def test_every_head_kind_reads_inflated_features_exactly():
    layout = layout_for(_source("llama", True, torch.float64).config, SHAPES["test"], "test")
    f, e = torch.randn(5, 32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64)
    medusa_spec = _spec("medusa")
    medusa = _random(MedusaHeads(32, 2))
    big = _inflated(MedusaHeads, medusa_spec, medusa, layout, lambda s: (s.hidden_size, s.num_heads))
    assert torch.allclose(big(_padded(f, 64)), _padded(medusa(f), 64), atol=1e-12)
    mtp_spec = _spec("mtp")
    mtp = _random(MTPModules(32, 24, 2, 1e-6))
    big = _inflated(MTPModules, mtp_spec, mtp, layout,
                    lambda s: (s.hidden_size, s.intermediate_size, s.num_heads, s.rms_norm_eps))
    for k in range(2):
        expected = _padded(mtp.depth(k)(f, e), 64)
        assert torch.allclose(big.depth(k)(_padded(f, 64), _padded(e, 64)), expected, atol=1e-10)
    exit_spec = _spec("early_exit", exit_layer=2)
    adapter = _random(EarlyExitAdapter(32, 24, 1e-6))
    big = _inflated(EarlyExitAdapter, exit_spec, adapter, layout,
                    lambda s: (s.hidden_size, s.intermediate_size, s.rms_norm_eps))
    assert torch.allclose(big(_padded(f, 64)), _padded(adapter(f), 64), atol=1e-12)
    assert inflate_spec(exit_spec, layout, torch.zeros(96, 64), "big").exit_layer == layout.hidden_index(2)


def test_eagle_with_fused_feature_layers_is_inflated_exactly():
    layout = layout_for(_source("llama", True, torch.float64).config, SHAPES["test"], "test")
    spec = _spec("eagle", feature_layers=[1, 2, 3])
    embed, head = torch.randn(96, 32, dtype=torch.float64), torch.randn(96, 32, dtype=torch.float64)
    small = EagleLayer(eagle_config(spec), embed, head, num_fused=3)
    _random(small)
    new_spec = inflate_spec(spec, layout, _padded(head, 64), "big")
    assert new_spec.feature_layers == [layout.hidden_index(i) for i in (1, 2, 3)] and new_spec.layer["head_dim"] == 16
    big = EagleLayer(eagle_config(new_spec), _padded(embed, 64), _padded(head, 64), num_fused=3).double().eval()
    missing = big.load_state_dict(inflate_head_state(spec, small.trained_state(), layout), strict=False).missing_keys
    assert set(missing) == {"decoder.model.embed_tokens.weight", "decoder.lm_head.weight"}
    hidden = torch.randn(1, 6, 3 * 32, dtype=torch.float64)
    fused_big = big.fused(torch.cat([_padded(h, 64) for h in hidden.split(32, -1)], -1))
    assert torch.allclose(fused_big, _padded(small.fused(hidden), 64), atol=1e-12)
    tokens = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        out_small = small(small.fused(hidden), tokens)
        out_big = big(fused_big, tokens)
    assert _max_relative_gap(out_small, out_big[..., :32]) < 1e-5 and not out_big[..., 32:].any()


# ---------------------------------------------------------------- the embedded pair at the tiny shape
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inflate") / "tiny"
    pair = inflate_pair(DEFAULT_PAIR_DIR, root, "tiny")
    assert pair.target_parameters == 33_924_480 and pair.draft_parameters == 6_064_320
    return root


PROMPTS = ["def quicksort(arr):\n", "class Stack:\n    def __init__(self):"]


def _run(folder: Path, spec: dict | None) -> tuple[list[list[int]], list[float]]:
    llm = LLM(folder / "target", speculative_config=spec, dtype="float32", max_num_seqs=2)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    return [o.outputs[0].token_ids for o in outs], [o.metrics.mean_acceptance_length for o in outs]


@pytest.mark.parametrize("method", [None, "draft_model", "eagle", "medusa", "mtp", "early_exit"])
def test_inflated_pair_gives_the_same_tokens_and_tau(tiny_pair, method):
    def spec(root: Path) -> dict | None:
        if method is None:
            return None
        if method == "draft_model":
            return {"method": "draft_model", "model": str(root / "draft"), "num_speculative_tokens": 4}
        if method == "early_exit":
            return {"method": "layer_skip", "early_exit": True, "num_speculative_tokens": 4}
        return {"method": method, "num_speculative_tokens": 3}

    tokens, tau = _run(DEFAULT_PAIR_DIR, spec(DEFAULT_PAIR_DIR))
    assert _run(tiny_pair, spec(tiny_pair)) == (tokens, tau)  # the heads were found beside the inflated target
    if method is not None:
        assert max(tau) > 1.0


def test_cached_pair_is_built_once(tmp_path, capsys):
    first = cached_pair("tiny", tmp_path)
    stamp = (first.root / "pair.json").stat().st_mtime_ns
    again = cached_pair("tiny", tmp_path)
    assert again.root == first.root and (again.root / "pair.json").stat().st_mtime_ns == stamp
    assert capsys.readouterr().err.count("inflating") == 1
    assert [p.name for p in tmp_path.iterdir()] == [first.root.name]
    spec = HeadSpec.load(first.heads / "eagle")
    assert spec.hidden_size == 640 and spec.layer["num_attention_heads"] == 10


def test_bench_shape_tiny_smoke(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "--shape", "tiny", "--shape-cache", str(tmp_path / "cache"), "--methods",
                 "plain,draft_model", "--k", "2", "--num-prompts", "1", "--max-tokens", "8", "--warmup", "0",
                 "--out", str(out)])
    assert code == 0
    info = json.loads((out / "bench.json").read_text())["info"]
    assert info["shape"].startswith("tiny, the embedded pair inflated") and "tiny" in info["target"]
    assert "inflated" in (out / "bench.md").read_text().split("## Overall")[0]
    assert info["measured read bandwidth GB/s"] > 0 and info["bandwidth GB/s"] == info["measured read bandwidth GB/s"]
    assert info["bytes read per step"] > info["KV bytes per step"] > 0
    summary = json.loads((out / "bench.json").read_text())["summary"]
    assert all(r["roofline"] > 0 for r in summary if r["label"] == "plain")


def test_inflate_cli_writes_a_pair_and_a_checkpoint(tmp_path, capsys):
    mask = os.umask(0o022)
    try:
        assert main(["inflate", "default", str(tmp_path / "pair"), "--shape", "tiny"]) == 0
        assert main(["inflate", str(DEFAULT_PAIR_DIR / "draft"), str(tmp_path / "draft"), "--shape", "tiny-draft"]) == 0
    finally:
        os.umask(mask)
    # readable by others, as any file under umask 022 (safetensors alone writes 0600)
    weights = sorted(tmp_path.rglob("*.safetensors"))
    assert len(weights) >= 6 and {stat.S_IMODE(f.stat().st_mode) for f in weights} == {0o644}
    printed = capsys.readouterr().out
    assert "33,924,480 parameters" in printed and "6,064,320 parameters" in printed
    assert (tmp_path / "pair" / "heads" / "mtp" / "config.json").is_file()
    note = json.loads((tmp_path / "draft" / "inflated.json").read_text())
    assert note["shape"] == "tiny-draft" and (tmp_path / "draft" / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).save_pretrained(folder)
    return folder


def test_bad_inputs_are_spec_dec_errors(tmp_path, gpt2_dir):
    with pytest.raises(SpecDecError, match="unknown shape"):
        inflate_checkpoint(DEFAULT_PAIR_DIR / "target", tmp_path / "a", "2b")
    with pytest.raises(SpecDecError, match="smaller than the source"):
        inflate_checkpoint(DEFAULT_PAIR_DIR / "target", tmp_path / "b", "tiny-draft")
    with pytest.raises(SpecDecError, match="model types"):
        inflate_checkpoint(gpt2_dir, tmp_path / "c", "tiny")
    with pytest.raises(SpecDecError, match="not a target shape"):
        inflate_pair(DEFAULT_PAIR_DIR, tmp_path / "d", "tiny-draft")


@pytest.mark.parametrize("argv", [
    ["inflate", "default", "{tmp}/x", "--shape", "2b"],
    ["inflate", "default", "{tmp}/x", "--shape", "tiny-draft"],
    ["inflate", "{gpt2}", "{tmp}/x", "--shape", "tiny"],
    ["inflate", "{tmp}", "{tmp}/x", "--shape", "tiny"],
    ["inflate", "default", "{gpt2}", "--shape", "tiny"],
    ["bench", "--shape", "tiny", "--model", "x"],
    ["bench", "--shape-cache", "{tmp}", "--methods", "plain"],
])
def test_bad_cli_inputs_exit_2(tmp_path, gpt2_dir, argv, capsys):
    (tmp_path / "stray").write_text("")
    args = [a.format(tmp=tmp_path, gpt2=gpt2_dir) for a in argv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(args))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("specdec ") and "Traceback" not in "".join(err)


def test_every_target_shape_holds_the_embedded_pair():
    from transformers import AutoConfig

    from specdec.shapes import TARGET_SHAPES

    target, draft = (AutoConfig.from_pretrained(DEFAULT_PAIR_DIR / name) for name in ("target", "draft"))
    assert set(TARGET_SHAPES) == {"1b", "3b", "8b", "tiny"}
    for name in TARGET_SHAPES:
        layout = layout_for(target, SHAPES[name], name)
        draft_layout = layout_for(draft, SHAPES[SHAPES[name].draft], SHAPES[name].draft)
        assert layout.layer_at[-1] == layout.dst.layers - 1 and draft_layout.dst.head_dim == 64
    eight = layout_for(target, SHAPES["8b"], "8b").dst
    assert (eight.heads, eight.kv_heads, eight.kv_heads * eight.head_dim) == (64, 16, 1024)  # the real KV width


def test_the_shape_table_script_runs_configurations_the_bench_accepts():
    """scripts/shape_table.py's method list and configurations expand as the bench expands them: every
    labelled configuration runs (a label listed in --methods, or cascade left out of it, is refused)."""
    import importlib.util

    from specdec.bench.methods import expand_methods

    path = Path(__file__).resolve().parents[1] / "scripts" / "shape_table.py"
    spec = importlib.util.spec_from_file_location("shape_table", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    configs = {name: json.loads(text) for name, text in (c.split("=", 1) for c in script.method_configs())}
    specs = expand_methods(script.METHODS.split(","), [4, "auto"], configs)
    labels = {s.label for s in specs}
    for name in configs:
        assert {f"{name} k=4", f"{name} k=auto"} <= labels, name
