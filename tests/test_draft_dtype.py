"""The draft model's dtype: explicit, inherited, or float32 on a CPU under a float16 target."""

import torch

from specdec import LLM
from specdec.drafters.draft_lm import resolve_draft_dtype

CPU = torch.device("cpu")


def test_resolve_draft_dtype_rules():
    assert resolve_draft_dtype(None, torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_draft_dtype(None, torch.float16, CPU) == torch.float32
    assert resolve_draft_dtype(None, torch.float64, CPU) == torch.float64
    assert resolve_draft_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_draft_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert resolve_draft_dtype(None, torch.float16, torch.device("cuda")) == torch.float16


def test_llm_runs_draft_in_its_own_dtype(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["same"]), "num_speculative_tokens": 2, "dtype": "float32"}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64")
    assert llm.target.dtype == torch.float64
    assert llm.engine.drafter.model.dtype == torch.float32
    bf16 = LLM(dirs["target"], speculative_config={**spec, "dtype": None}, dtype="bfloat16")
    assert bf16.target.dtype == torch.bfloat16 and bf16.engine.drafter.model.dtype == torch.bfloat16
    assert bf16.engine.drafter.model.pair_single_queries  # its one-token steps attend query pairs
    fp16 = LLM(dirs["target"], speculative_config={**spec, "dtype": None}, dtype="float16")
    assert fp16.engine.drafter.model.dtype == torch.float32


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
