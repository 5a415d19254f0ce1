"""Prepacked weights on a CPU (``specdec.models.cpu_linear``): the fast backend packs its decoder layers'
weights in float32 and (where oneDNN supports it) bfloat16, every layer product then runs on the packed
weights, and the logits and greedy tokens are the plain weights' (within the dtype's rounding); the shared
embeddings and output head stay plain tensors for the head drafters, draft vocabularies and row subsets
that read them, and the output head's own product reads a packed copy of it. A drafter's own small
modules and its draft vocabulary's head rows run their products packed too, with their greedy output
unchanged."""

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model

from specdec.models import cpu_linear, layers
from specdec.models.base import ForwardBatch
from specdec.models.bf16_product import is_blocked
from specdec.models.cpu_linear import PackedLinear, is_packed, linear, pack, pack_linears, packs
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.loader import load_causal_lm

CPU = torch.device("cpu")
PACKED = [pytest.param(torch.float32, id="float32"),
          pytest.param(torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
              not packs(CPU, torch.bfloat16), reason="this CPU's oneDNN has no bfloat16"))]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # the dtype's rounding of a product's output


def _layer_weights(lm: FastLlamaLM) -> list[torch.Tensor]:
    """Each dense layer's q/k/v, o, gate/up and down matrices (``LayerWeights.attention`` holds the arguments of
    ``attention_inputs``, ``LayerWeights.output`` those of ``attention_output_and_mlp``)."""
    return [w for layer in lm.layers for w in (layer.attention[1], layer.output[0], layer.output[4],
                                                 layer.output[6])]


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("rows", [1, 2, 5, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_is_the_plain_product(rows, bias, dtype):
    torch.manual_seed(rows)
    weight = (torch.randn(96, 64) * 0.1).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    x = torch.randn(rows, 64).to(dtype)
    packed = pack(weight)
    assert is_packed(packed) and packed.shape == weight.shape and packed.dtype == dtype
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    out = linear(x, packed, b)
    assert out.dtype == dtype and out.shape == (rows, 96)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=tolerance)
    # [R, T, in] inputs and a non-contiguous one (a transposed attention output) give the same rows.
    wide = torch.randn(2, rows, 128).to(dtype)[..., ::2]
    torch.testing.assert_close(linear(wide, packed, b), linear(wide.contiguous().view(-1, 64), packed, b).view(
        2, rows, 96), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_stay_plain(dtype):
    weight = torch.randn(8, 4, dtype=dtype)
    assert not packs(CPU, dtype)
    assert pack(weight) is weight
    lm = load_causal_lm(build_model("llama", seed=1), dtype=dtype, device=CPU, backend="fast")
    assert not any(is_packed(w) for w in _layer_weights(lm)) and lm.packed_head is None


@pytest.mark.parametrize("dtype", PACKED)
def test_layers_are_packed_and_shared_weights_are_not(monkeypatch, dtype):
    lm = load_causal_lm(build_model("llama", seed=1), dtype=dtype, device=CPU, backend="fast")
    assert all(is_packed(w) for w in _layer_weights(lm))
    for shared in (lm.embed, lm.lm_head):  # read by heads, draft vocabularies, row subsets: plain tensors
        assert not is_packed(shared) and shared.is_contiguous()
    assert is_packed(lm.packed_head) and lm.packed_head.shape == lm.lm_head.shape  # the head's own copy
    plain = FastLlamaLM(build_model("llama", seed=1).to(dtype), "plain", pack_weights=False)
    assert not any(is_packed(w) for w in _layer_weights(plain)) and plain.packed_head is None
    # A head larger than COPY_BYTES is not copied: the model keeps one head.
    monkeypatch.setattr(cpu_linear, "COPY_BYTES", lm.lm_head.numel() * lm.lm_head.element_size() - 1)
    assert FastLlamaLM(build_model("llama", seed=1).to(dtype), "large head").packed_head is None


def _pair(arch: str, seed: int, dtype: torch.dtype, scale: float = 1.0) -> tuple[FastLlamaLM, FastLlamaLM]:
    model = build_model(arch, seed=seed, scale=scale).to(dtype)
    return FastLlamaLM(model, "packed"), FastLlamaLM(model, "plain", pack_weights=False)


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_packed_forwards_give_the_plain_logits(monkeypatch, arch, dtype):
    packed, plain = _pair(arch, seed=5, dtype=dtype)
    tolerance = TOLERANCE[dtype]
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
        torch.testing.assert_close(logits[packed], logits[plain], atol=tolerance, rtol=tolerance)
    # Layer subsets and a subset of the output head's rows (self-speculation, draft vocabularies).
    rows = plain.lm_head[:40]
    subset = {lm: lm.forward(ForwardBatch(torch.tensor([3]), torch.tensor([11]), [0], [0, 1], layers=(0,),
                                          output_head=rows), caches[lm]).logits for lm in (packed, plain)}
    assert subset[packed].shape == (1, 40)
    torch.testing.assert_close(subset[packed], subset[plain], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_greedy_tokens_are_the_plain_ones(dtype):
    packed, plain = _pair("llama", seed=7, dtype=dtype)
    outputs = []
    for lm in (packed, plain):
        cache = lm.new_cache(2, 96)
        lm.forward(ForwardBatch.from_rows([[1, 2, 3], [9, 8]], [0, 0], [0, 1], CPU, logits="none"), cache)
        outputs.append(lm.greedy_chain(torch.tensor([4, 5]), [0, 1], cache, steps=40))  # batch of 2
        outputs.append(lm.greedy_chain(torch.tensor([6]), [0], cache, steps=40))  # one row
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
    assert len(set(outputs[1][0].tolist())) > 3  # a sequence, not one token repeated


def test_an_eagle_layer_reads_its_targets_packed_head():
    """The EAGLE layer scores with the target's head: it reads the target's packed copy, not one of its own."""
    from specdec import LLM
    from specdec.assets import default_pair

    llm = LLM(default_pair()[0], speculative_config={"method": "eagle"}, dtype="float32", max_num_seqs=1)
    target, layer = llm.engine.target, llm.engine.drafter.layer
    assert is_packed(target.packed_head) and layer.packed_head is target.packed_head


@pytest.mark.parametrize("dtype", PACKED)
def test_pack_linears_packs_a_modules_linears_but_the_skipped(dtype):
    torch.manual_seed(3)
    module = torch.nn.Module()
    module.body = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(),
                                      torch.nn.Sequential(torch.nn.Linear(96, 32, bias=False)))
    module.keep = torch.nn.Linear(32, 8)
    module = module.to(dtype)
    x = torch.randn(5, 64).to(dtype)
    expected = module.keep(module.body(x))
    assert pack_linears(module, skip=("keep",)) is module
    body = module.body
    assert isinstance(body[0], PackedLinear) and is_packed(body[0].weight) and body[0].bias is not None
    assert isinstance(body[2][0], PackedLinear) and body[2][0].bias is None  # nested modules too
    assert type(module.keep) is torch.nn.Linear and not is_packed(module.keep.weight)  # skipped: plain
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(module.keep(body(x)), expected, atol=tolerance, rtol=tolerance)
    plain = pack_linears(torch.nn.Sequential(torch.nn.Linear(4, 4).double()))  # float64: plain weights
    assert isinstance(plain[0], PackedLinear) and not is_packed(plain[0].weight)


@pytest.mark.parametrize(("method", "extra"), [("eagle", {}), ("medusa", {}), ("mtp", {}),
                                               ("layer_skip", {"early_exit": True})])
def test_drafter_modules_and_draft_vocabularies_run_packed(method, extra):
    """The embedded pair's trained drafters in float32: their own linears (an EAGLE layer's fc, Medusa's blocks,
    MTP's depths, the early exit's adapter) and their draft vocabulary's head rows are read packed, the EAGLE
    layer's decoder stays the fast backend's to pack, and greedy output is plain decoding's."""
    from specdec import LLM, SamplingParams
    from specdec.assets import default_pair

    target = default_pair()[0]
    llm = LLM(target, speculative_config={"method": method, "num_speculative_tokens": 3, **extra},
              dtype="float32", max_num_seqs=2)
    drafter = llm.engine.drafter
    module = drafter.adapter if method == "layer_skip" else drafter.module
    linears = [m for m in module.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    if method == "eagle":
        assert {type(m) for m in module.decoder.modules()} & {PackedLinear} == set()
        linears = [m for m in linears if not any(m is d for d in module.decoder.modules())]
    assert linears and all(isinstance(m, PackedLinear) and is_packed(m.weight) for m in linears)
    assert is_packed(drafter.vocab.scorer) and not is_packed(drafter.vocab.head)
    scorer = drafter.vocab.scorer  # oneDNN's [V', H], or bfloat16-stored [V' / 16, H, 16] (bf16_product)
    shape = (scorer.shape[0] * scorer.shape[2], scorer.shape[1]) if is_blocked(scorer) else scorer.shape
    assert tuple(shape) == tuple(drafter.vocab.head.shape)
    prompts = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32", max_num_seqs=2).generate(prompts, params)
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.metrics.num_accepted_tokens > 0
