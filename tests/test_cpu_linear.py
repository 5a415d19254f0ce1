"""Prepacked bfloat16 weights on a CPU (``specdec.models.cpu_linear``): the fast backend packs its
decoder layers' weights in bfloat16 only, every layer product then runs on the packed weights, and the
logits and greedy tokens are the plain weights' (within bfloat16 rounding); the shared embeddings and
output head stay plain tensors for the head drafters, draft vocabularies and row subsets that read them."""

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model

from specdec.models import layers
from specdec.models.base import ForwardBatch
from specdec.models.cpu_linear import is_packed, linear, pack, packs
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packs(CPU, torch.bfloat16), reason="this CPU's oneDNN has no bfloat16")


def _layer_weights(lm: FastLlamaLM) -> list[torch.Tensor]:
    """Each dense layer's q/k/v, o, gate/up and down matrices (``_Layer.attention`` holds the arguments of
    ``attention_inputs``, ``_Layer.output`` those of ``attention_output_and_mlp``)."""
    return [w for layer in lm.layers for w in (layer.attention[1], layer.output[0], layer.output[4],
                                                 layer.output[6])]


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_is_the_plain_product(rows, bias):
    torch.manual_seed(rows)
    weight = (torch.randn(96, 64) * 0.1).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    x = torch.randn(rows, 64).bfloat16()
    packed = pack(weight)
    assert is_packed(packed) and packed.shape == weight.shape and packed.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    out = linear(x, packed, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=1e-2)  # bfloat16 rounding of the output
    # [R, T, in] inputs and a non-contiguous one (a transposed attention output) give the same rows.
    wide = torch.randn(2, rows, 128).bfloat16()[..., ::2]
    torch.testing.assert_close(linear(wide, packed, b), linear(wide.contiguous().view(-1, 64), packed, b).view(
        2, rows, 96), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_other_dtypes_stay_plain(dtype):
    weight = torch.randn(8, 4, dtype=dtype)
    assert not packs(CPU, dtype)
    assert pack(weight) is weight
    lm = load_causal_lm(build_model("llama", seed=1), dtype=dtype, device=CPU, backend="fast")
    assert not any(is_packed(w) for w in _layer_weights(lm))


def test_bfloat16_layers_are_packed_and_shared_weights_are_not():
    lm = load_causal_lm(build_model("llama", seed=1), dtype=torch.bfloat16, device=CPU, backend="fast")
    assert all(is_packed(w) for w in _layer_weights(lm))
    for shared in (lm.embed, lm.lm_head):  # read by heads, draft vocabularies, row subsets: plain tensors
        assert not is_packed(shared) and shared.is_contiguous()
    plain = FastLlamaLM(build_model("llama", seed=1).to(torch.bfloat16), "plain", pack_weights=False)
    assert not any(is_packed(w) for w in _layer_weights(plain))


def _pair(arch: str, seed: int, scale: float = 1.0) -> tuple[FastLlamaLM, FastLlamaLM]:
    model = build_model(arch, seed=seed, scale=scale).to(torch.bfloat16)
    return FastLlamaLM(model, "packed"), FastLlamaLM(model, "plain", pack_weights=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_packed_forwards_give_the_plain_logits(monkeypatch, arch):
    packed, plain = _pair(arch, seed=5)
    seen = []

    def spy(x, weight, bias=None):
        seen.append(is_packed(weight))
        return linear(x, weight, bias)

    monkeypatch.setattr(layers, "linear", spy)
    caches = {lm: lm.new_cache(3, 64) for lm in (packed, plain)}
    prompts = [[5, 9, 14, 3, 3], [2] * 11, [7, 1, 3, 8, 30, 31, 32]]
    batches = [
        ForwardBatch.from_rows(prompts, [0, 0, 0], [0, 1, 2], CPU),  # a ragged prefill
        ForwardBatch.from_rows([[4]], [5], [0], CPU),  # a plain decoding step
        ForwardBatch.from_rows([[4, 6, 8, 10, 12]], [6], [0], CPU),  # verifying k = 4 drafts
        ForwardBatch.from_rows([[4], [6], [8, 9, 10]], [11, 11, 7], [0, 1, 2], CPU),  # a batch
    ]
    for batch in batches:
        seen.clear()
        logits = {lm: lm.forward(batch, caches[lm]).logits for lm in (packed, plain)}
        assert seen == [True] * 4 * packed.num_layers + [False] * 4 * plain.num_layers
        torch.testing.assert_close(logits[packed], logits[plain], atol=3e-2, rtol=3e-2)
    # Layer subsets and a subset of the output head's rows (self-speculation, draft vocabularies).
    rows = plain.lm_head[:40]
    subset = {lm: lm.forward(ForwardBatch(torch.tensor([3]), torch.tensor([11]), [0], [0, 1], layers=(0,),
                                          output_head=rows), caches[lm]).logits for lm in (packed, plain)}
    assert subset[packed].shape == (1, 40)
    torch.testing.assert_close(subset[packed], subset[plain], atol=3e-2, rtol=3e-2)


def test_packed_greedy_tokens_are_the_plain_ones():
    packed, plain = _pair("llama", seed=7)
    outputs = []
    for lm in (packed, plain):
        cache = lm.new_cache(2, 96)
        lm.forward(ForwardBatch.from_rows([[1, 2, 3], [9, 8]], [0, 0], [0, 1], CPU, logits="none"), cache)
        outputs.append(lm.greedy_chain(torch.tensor([4, 5]), [0, 1], cache, steps=40))  # batch of 2
        outputs.append(lm.greedy_chain(torch.tensor([6]), [0], cache, steps=40))  # one row
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
    assert len(set(outputs[1][0].tolist())) > 3  # a sequence, not one token repeated
