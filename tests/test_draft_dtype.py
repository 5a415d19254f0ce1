"""The draft model's dtype: explicit, inherited, or float32 on a CPU under a float16 target, or under a
bfloat16 target where the draft runs on transformers' forward (the fast backend pairs single bfloat16 queries)."""

import torch

from specdec import LLM
from specdec.drafters.draft_model import resolve_draft_dtype
from specdec.models.loader import runs_on_fast_backend

CPU = torch.device("cpu")


def test_resolve_draft_dtype_rules():
    assert resolve_draft_dtype(None, torch.bfloat16, CPU, fast_backend=True) == torch.bfloat16
    assert resolve_draft_dtype(None, torch.bfloat16, CPU, fast_backend=False) == torch.float32
    assert resolve_draft_dtype(None, torch.float16, CPU, fast_backend=True) == torch.float32
    assert resolve_draft_dtype(None, torch.float64, CPU, fast_backend=False) == torch.float64
    assert resolve_draft_dtype("auto", torch.float32, CPU, fast_backend=True) == torch.float32
    assert resolve_draft_dtype("bfloat16", torch.float32, CPU, fast_backend=False) == torch.bfloat16
    assert resolve_draft_dtype(None, torch.bfloat16, torch.device("cuda"), fast_backend=False) == torch.bfloat16


def test_llm_runs_draft_in_its_own_dtype(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["same"]), "num_speculative_tokens": 2, "dtype": "float32"}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64")
    assert llm.target.dtype == torch.float64
    assert llm.engine.drafter.model.dtype == torch.float32
    # A bfloat16 target: the draft inherits it on the fast backend, runs in float32 on transformers' forward.
    bf16 = LLM(dirs["target"], speculative_config={**spec, "dtype": None}, dtype="bfloat16")
    assert bf16.target.dtype == torch.bfloat16 and bf16.engine.drafter.model.dtype == torch.bfloat16
    assert bf16.engine.drafter.model.pair_single_queries
    hf = LLM(dirs["target"], speculative_config={**spec, "dtype": None}, dtype="bfloat16", backend="hf")
    assert hf.engine.drafter.model.dtype == torch.float32
    gpt2 = model_dirs["gpt2"]
    other = LLM(gpt2["target"], speculative_config={**spec, "model": str(gpt2["same"]), "dtype": None},
                dtype="bfloat16")
    assert other.engine.drafter.model.dtype == torch.float32  # gpt2 runs on transformers' forward


def test_runs_on_fast_backend_reads_the_config(model_dirs):
    assert runs_on_fast_backend(model_dirs["llama"]["target"], "auto")
    assert runs_on_fast_backend(str(model_dirs["qwen2"]["target"]), "auto")
    assert not runs_on_fast_backend(model_dirs["gpt2"]["target"], "auto")
    assert not runs_on_fast_backend(model_dirs["llama"]["target"], "hf")
    assert runs_on_fast_backend(model_dirs["llama"]["target"], "fast")


def test_auto_dtype_on_cpu(monkeypatch):
    from types import SimpleNamespace

    import specdec.models.loader as loader

    bf16_config, fp32_config = SimpleNamespace(dtype=torch.bfloat16), SimpleNamespace(dtype="float32")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert loader.resolve_dtype("auto", bf16_config, CPU) == torch.bfloat16
    assert loader.resolve_dtype("auto", fp32_config, CPU) == torch.float32
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert loader.resolve_dtype("auto", bf16_config, CPU) == torch.float32
    assert loader.resolve_dtype("auto", bf16_config, torch.device("cuda")) == torch.bfloat16
