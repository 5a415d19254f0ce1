"""The bfloat16-weight product (:mod:`specdec.models.bf16_product`): a float32 model whose weights hold bfloat16
values keeps them in bfloat16 on a CPU with AVX2 and computes the same float32 products. Its values are within
float32 rounding of a float64 reference; a row's bits are the same alone, among others and in any order (so a
verification of k + 1 rows gives each row plain decoding's bits, and greedy speculation equals greedy plain
decoding in float32); only weights of bfloat16 values whose outputs are a multiple of 16 are stored so; without
the kernel (no compiler, or switched off) weights stay float32."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import build_model

from specdec.models import bf16_product, cpu_linear
from specdec.models.base import ForwardBatch
from specdec.models.bf16_product import BLOCK, blocked, is_blocked, unblocked
from specdec.models.cpu_linear import linear, pack, packed_copy
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not bf16_product.available(),
                                reason="the bfloat16-weight product needs an x86 CPU with AVX2 and a C++ compiler")


def bf16_valued(*shape: int, seed: int = 0) -> torch.Tensor:
    """float32 values that are bfloat16 values."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 0.1).bfloat16().float()


@pytest.mark.parametrize(("out", "width"), [(16, 1), (32, 7), (48, 300), (64, 513), (160, 40), (528, 260)])
def test_products_are_float32_products_and_rows_are_independent(out, width):
    """Against float64: within float32's rounding of each sum (``width`` ulps of the sum of absolute products);
    each row of 1..20 rows has the bits it has alone, with a bias and for ``[R, T, in]`` inputs too. The shapes
    of 10 and 33 blocks give the passes of 1 or 2 rows groups of blocks and blocks left over."""
    weight, bias = bf16_valued(out, width), torch.randn(out)
    stored = blocked(weight)
    assert stored is not None and is_blocked(stored) and stored.shape == (out // BLOCK, width, BLOCK)
    for rows in (1, 2, 3, 5, 6, 7, 9, 13, 20):
        x = torch.randn(rows, width)
        y = linear(x, stored, bias)
        exact = x.double() @ weight.double().T + bias.double()
        bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * (width + 1) * 2**-24 + 1e-30
        assert y.dtype == torch.float32 and y.shape == (rows, out)
        assert ((y.double() - exact).abs() <= bound).all(), rows
        alone = torch.stack([linear(x[i : i + 1], stored, bias)[0] for i in range(rows)])
        assert torch.equal(alone, y), rows
        order = torch.randperm(rows)
        assert torch.equal(linear(x[order], stored, bias), y[order])
    grid = torch.randn(2, 3, width)
    assert torch.equal(linear(grid, stored), linear(grid.reshape(6, width), stored).view(2, 3, out))


def test_only_float32_weights_of_bfloat16_values_are_stored():
    """Random float32 values, a non-multiple of 16 outputs, float64 and bfloat16 weights stay as they were;
    a weight whose first row is bfloat16 but not the rest too (nothing is rounded); :func:`pack` stores the
    eligible ones (oneDNN's float32 packing where asked), :func:`packed_copy` copies a head so."""
    values = bf16_valued(48, 32)
    assert blocked(torch.randn(48, 32)) is None
    assert blocked(bf16_valued(40, 32)) is None
    assert blocked(values.double()) is None and blocked(values.bfloat16()) is None
    almost = values.clone()
    almost[-1, -1] += 1e-4
    assert blocked(almost) is None
    assert is_blocked(pack(values)) and pack(values, bfloat16_storage=False).is_mkldnn
    copy = packed_copy(values)
    assert copy is not None and is_blocked(copy)
    assert torch.equal(unblocked(copy), values)  # the same values, block by block


def test_without_the_kernel_weights_stay_float32(monkeypatch, caplog):
    """A build that fails (no compiler) is one logged line and float32 packing; ``SPECDEC_BF16_PRODUCT=0`` is no
    build at all."""
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension: g++ not found\nmore lines")

    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda *a, **k: "/nonexistent")
    with caplog.at_level(logging.WARNING, logger="specdec"):
        assert bf16_product._build() is None
    assert [r.getMessage() for r in caplog.records][-1].endswith("could not be built: Error building extension: "
                                                                  "g++ not found)")
    monkeypatch.setenv(bf16_product.ENV, "0")
    assert bf16_product._build() is None
    monkeypatch.setattr(bf16_product, "_kernel", None)
    values = bf16_valued(32, 16)
    assert blocked(values) is None and pack(values).is_mkldnn


def _bf16_valued_model(seed: int = 1):
    model = build_model("llama", seed=seed).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def test_a_float32_model_of_bfloat16_weights_runs_stored():
    """The fast backend stores every layer matrix and the head's copy in bfloat16 (half the bytes a step reads),
    and its logits are the float32 backend's within float32 rounding."""
    lm = load_causal_lm(_bf16_valued_model(), dtype=torch.float32, device=CPU, backend="fast")
    weights = [w for layer in lm.layers for w in (layer.attention[1], layer.output[0], layer.output[4],
                                                    layer.output[6])]
    assert all(is_blocked(w) for w in weights) and is_blocked(lm.packed_head)
    reference = FastLlamaLM(_bf16_valued_model(), "float32", pack_weights=False)
    assert lm.step_weight_bytes() < 0.6 * reference.step_weight_bytes()
    tokens = torch.randint(0, lm.vocab_size, (12,)).tolist()
    outputs = [model.forward(ForwardBatch.from_rows([tokens], [0], [0], CPU), model.new_cache(1, 64)).logits
               for model in (lm, reference)]
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)


def test_greedy_speculation_equals_plain_decoding_in_float32():
    """The embedded pair in float32 (bfloat16 values): draft_model and eagle, greedy, equal plain decoding token
    for token, the layers stored in bfloat16."""
    from specdec import LLM, SamplingParams
    from specdec.assets import default_pair

    target, draft = default_pair()
    prompts = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(target, dtype="float32", max_num_seqs=3)
    assert is_blocked(plain.target.layers[0].attention[1])
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for spec in ({"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
                 {"method": "eagle", "num_speculative_tokens": 4}):
        out = LLM(target, dtype="float32", max_num_seqs=3, speculative_config=spec).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == expected, spec["method"]


def test_cpu_linear_reads_the_stored_form():
    weight = bf16_valued(32, 24)
    stored = cpu_linear.pack(weight)
    assert cpu_linear.is_packed(stored) and cpu_linear.row_invariant(stored)
    assert not cpu_linear.pads_few_rows(stored)
    x = torch.randn(3, 24)
    torch.testing.assert_close(cpu_linear.linear(x, stored), x @ weight.T, atol=1e-5, rtol=1e-5)
