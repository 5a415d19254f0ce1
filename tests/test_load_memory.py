"""Loading a model for the fast backend peaks near one copy of its weights: a model loaded from a folder
(``load_causal_lm``) is consumed layer by layer as the backend reads it (``FastLlamaLM(consume=True)``),
each transformers layer dropped once its fused and packed copies exist. The consumed backend computes what
a backend over an untouched copy of the model computes, in every family (the tensors it reads as they are,
norms, biases and experts, stay alive), and a model the caller passed in is never consumed."""

import copy

import pytest
import torch
from helpers import FAMILY_ARCHS, build_model

from specdec.models import loader
from specdec.models.base import ForwardBatch
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
BATCHES = [
    ForwardBatch.from_rows([[5, 9, 14, 3, 3], [2] * 11, [7, 1, 3, 8, 30, 31]], [0, 0, 0], [0, 1, 2], CPU),
    ForwardBatch.from_rows([[4], [6], [8, 9, 10]], [5, 11, 6], [0, 1, 2], CPU),
]


def _logits(lm: FastLlamaLM) -> list[torch.Tensor]:
    cache = lm.new_cache(3, 64)
    return [lm.forward(batch, cache).logits for batch in BATCHES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the layers' weights are packed copies
@pytest.mark.parametrize("arch", ["llama", "qwen2", *FAMILY_ARCHS])
def test_a_consumed_model_gives_the_logits_of_an_untouched_one(arch, dtype):
    model = build_model(arch, seed=3).to(dtype)
    untouched = FastLlamaLM(copy.deepcopy(model), "untouched")
    consumed = FastLlamaLM(model, "consumed", consume=True)
    assert all(isinstance(layer, torch.nn.Identity) for layer in model.model.layers)
    for got, want in zip(_logits(consumed), _logits(untouched), strict=True):
        assert torch.equal(got, want), arch


def test_only_a_model_loaded_from_a_folder_is_consumed(tmp_path, monkeypatch):
    model = build_model("llama", seed=4).to(torch.float32)
    model.save_pretrained(tmp_path)
    consumed = []
    real = FastLlamaLM

    def spy(*args, consume: bool = False, **kwargs):
        consumed.append(consume)
        return real(*args, consume=consume, **kwargs)

    monkeypatch.setattr(loader, "FastLlamaLM", spy)
    from_folder = load_causal_lm(tmp_path, device="cpu")
    from_object = load_causal_lm(model, device="cpu")
    assert consumed == [True, False]
    assert all(not isinstance(layer, torch.nn.Identity) for layer in model.model.layers)  # the caller's, untouched
    for got, want in zip(_logits(from_folder), _logits(from_object), strict=True):
        assert torch.equal(got, want)
