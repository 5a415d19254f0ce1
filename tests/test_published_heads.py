"""Published heads: EAGLE-3 (vLLM/SGLang ``LlamaForCausalLMEagle3``), EAGLE-1/2 and Medusa (FasterDecoding's
and vLLM's layouts), built here in exactly those layouts (tensor names, shapes, config fields, safetensors)
for tiny float64 targets. Each head's drafts equal an independent reference forward written below from the
published semantics; greedy output equals plain decoding (chains and trees, both backends); sampled output
follows the target's distribution; malformed folders are clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import build_model, record_drafts
from safetensors.torch import save_file
from test_greedy_equality import PROMPTS, check_outputs, run_batch
from test_heads import llama, references  # noqa: F401 - module fixtures
from test_sampling_exactness import BATCH, PROMPT, VOCAB, assert_matches_target

from specdec import LLM, SamplingParams
from specdec.drafters.heads.published import aux_layer_ids
from specdec.errors import SpecDecError

INTER = 48


def _rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale / shape[-1] ** 0.5


def _norm(gen, n):
    return 1.0 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


def layer_tensors(gen, prefix: str, hidden: int, qkv_in: int, heads: int, kv: int, scale: float) -> dict:
    """One Llama decoder layer's tensors under ``prefix`` (q/k/v reading ``qkv_in`` features)."""
    hd = hidden // heads
    return {f"{prefix}.self_attn.q_proj.weight": _rand(gen, heads * hd, qkv_in, scale=scale),
            f"{prefix}.self_attn.k_proj.weight": _rand(gen, kv * hd, qkv_in, scale=scale),
            f"{prefix}.self_attn.v_proj.weight": _rand(gen, kv * hd, qkv_in, scale=scale),
            f"{prefix}.self_attn.o_proj.weight": _rand(gen, hidden, heads * hd, scale=scale),
            f"{prefix}.mlp.gate_proj.weight": _rand(gen, INTER, hidden, scale=scale),
            f"{prefix}.mlp.up_proj.weight": _rand(gen, INTER, hidden, scale=scale),
            f"{prefix}.mlp.down_proj.weight": _rand(gen, hidden, INTER, scale=scale),
            f"{prefix}.post_attention_layernorm.weight": _norm(gen, hidden)}


def llama_config(target, **extra) -> dict:
    c = target.config
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": INTER,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "num_hidden_layers": 1, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float64", **extra}


def save(folder, config: dict, tensors: dict, name: str = "model.safetensors") -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return tensors


def make_eagle3(target, folder, seed: int, draft_vocab: int | None = None, scale: float = 1.0,
                layer: str = "midlayer", embed: bool = False, **config) -> dict:
    """An EAGLE-3 head for ``target`` as SafeAILab/SpecForge publish it (``midlayer.*``, ``d2t``/``t2d``)."""
    gen = torch.Generator().manual_seed(seed)
    c = target.config
    hidden, vocab = c.hidden_size, c.vocab_size
    draft_vocab = draft_vocab or vocab
    tensors = layer_tensors(gen, layer, hidden, 2 * hidden, c.num_attention_heads, c.num_key_value_heads, scale)
    tensors.update({"fc.weight": _rand(gen, hidden, 3 * hidden, scale=scale),
                    f"{layer}.input_layernorm.weight": _norm(gen, hidden),
                    f"{layer}.hidden_norm.weight": _norm(gen, hidden),
                    "norm.weight": _norm(gen, hidden),
                    "lm_head.weight": _rand(gen, draft_vocab, hidden, scale=3.0 * scale)})
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if embed:
        tensors["embed_tokens.weight"] = _rand(gen, vocab, hidden, scale=hidden**0.5)
    return save(folder, llama_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                                     **config), tensors)


def make_eagle1(target, folder, seed: int, scale: float = 1.0) -> dict:
    """An EAGLE-1/2 head as SafeAILab publishes it (``fc`` with a bias, ``layers.0`` without an input norm)."""
    gen = torch.Generator().manual_seed(seed)
    c = target.config
    hidden = c.hidden_size
    tensors = layer_tensors(gen, "layers.0", hidden, hidden, c.num_attention_heads, c.num_key_value_heads, scale)
    tensors.update({"fc.weight": _rand(gen, hidden, 2 * hidden, scale=scale),
                    "fc.bias": 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)})
    return save(folder, llama_config(target, architectures=["LlamaForCausalLM"]), tensors,
                name="pytorch_model.safetensors")


def make_medusa(target, folder, seed: int, layout: str, num_heads: int = 3, num_layers: int = 2,
                scale: float = 1.0) -> dict:
    """Medusa heads in FasterDecoding's layout (``medusa_head.{i}.{j}.linear``, ``medusa_head.{i}.{n}``) or
    vLLM's (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            name = f"medusa_head.{i}.{j}.linear" if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}"
            tensors[f"{name}.weight"] = _rand(gen, hidden, hidden, scale=scale)
            tensors[f"{name}.bias"] = 0.1 * torch.randn(hidden, generator=gen, dtype=torch.float64)
        head = f"medusa_head.{i}.{num_layers}.weight" if layout == "fasterdecoding" else f"lm_heads.{i}.weight"
        tensors[head] = _rand(gen, vocab, hidden, scale=3.0 * scale)
    if layout == "fasterdecoding":
        config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                  "base_model_name_or_path": "test-target"}
    else:
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": hidden,
                  "vocab_size": vocab, "num_heads": num_heads, "num_hidden_layers": num_layers}
    return save(folder, config, tensors)


# The reference forwards: written from the published semantics, whole sequences, no cache.

def rms(x, w, eps=1e-5):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, theta=10000.0):
    """Rotary embedding of ``x`` ``[heads, T, d]`` at positions ``0..T-1`` (halves rotated)."""
    d = x.shape[-1]
    freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * freq
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    lo, hi = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-hi, lo], -1) * sin


def decoder(t, p, attn_in, residual, heads, kv):
    """A Llama decoder layer (prefix ``p``) whose q/k/v read ``attn_in`` ``[T, D]``, residual ``[T, H]``."""
    n = attn_in.shape[0]
    q = (attn_in @ t[f"{p}.self_attn.q_proj.weight"].T).view(n, heads, -1).transpose(0, 1)
    k = (attn_in @ t[f"{p}.self_attn.k_proj.weight"].T).view(n, kv, -1).transpose(0, 1)
    v = (attn_in @ t[f"{p}.self_attn.v_proj.weight"].T).view(n, kv, -1).transpose(0, 1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
    h = residual + attn @ t[f"{p}.self_attn.o_proj.weight"].T
    m = rms(h, t[f"{p}.post_attention_layernorm.weight"])
    gate, up = m @ t[f"{p}.mlp.gate_proj.weight"].T, m @ t[f"{p}.mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ t[f"{p}.mlp.down_proj.weight"].T


def eagle3_step(t, target, features, tokens, layer="midlayer"):
    """EAGLE-3 over pairs (``features`` ``[T, H]``, ``tokens`` ``[T]``): the layer's outputs before its norm and
    the target-vocabulary logits of the last one."""
    c = target.config
    embed = t.get("embed_tokens.weight", target.get_input_embeddings().weight)[tokens]
    attn_in = torch.cat([rms(embed, t[f"{layer}.input_layernorm.weight"]),
                         rms(features, t[f"{layer}.hidden_norm.weight"])], -1)
    out = decoder(t, layer, attn_in, features, c.num_attention_heads, c.num_key_value_heads)
    draft = rms(out[-1], t["norm.weight"]) @ t["lm_head.weight"].T
    logits = torch.full((c.vocab_size,), float("-inf"), dtype=torch.float64)
    logits[torch.arange(draft.shape[0]) + t["d2t"]] = draft
    return out, logits


def eagle1_step(t, target, features, tokens):
    c = target.config
    x = torch.cat([target.get_input_embeddings().weight[tokens], features], -1) @ t["fc.weight"].T + t["fc.bias"]
    out = decoder(t, "layers.0", x, x, c.num_attention_heads, c.num_key_value_heads)
    return out, out[-1] @ target.get_output_embeddings().weight.T


def reference_eagle_drafts(step, target_features, context, n):
    """``n`` greedy drafts after ``context``: pairs ``(f_j, t_{j+1})`` for the committed tokens, then the layer's
    own outputs with its drafts."""
    features, tokens = target_features[: len(context) - 1], torch.tensor(context[1:])
    drafts = []
    for _ in range(n):
        out, logits = step(features, tokens)
        token = int(logits.argmax())
        drafts.append(token)
        features, tokens = torch.cat([features, out[-1:]]), torch.cat([tokens, torch.tensor([token])])
    return drafts


def states(target, ids):
    with torch.no_grad():
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize(("method", "layer", "embed", "pickled"), [
    ("eagle3", "midlayer", False, False), ("eagle", "layers.0", True, False), ("eagle3", "midlayer", False, True)])
def test_eagle3_drafts_equal_the_reference_forward(model_dirs, llama, tmp_path, method, layer, embed,  # noqa: F811
                                                   pickled):
    """Each draft of an EAGLE-3 head (a 64-token draft vocabulary through d2t) equals the reference: ``fc``
    over the target's hidden states 0, 1, 2 (vLLM's default (2, L//2, L-3) for 3 layers, in layer order),
    the layer over ``[input_layernorm(e); hidden_norm(f)]`` with ``f`` as residual, its norm and head. Named
    ``midlayer.*`` or ``layers.0.*``, with or without its own embedding, as safetensors or as the
    ``pytorch_model.bin`` SafeAILab publishes."""
    t = make_eagle3(llama, tmp_path / "e3", seed=1, draft_vocab=64, scale=2.0, layer=layer, embed=embed)
    if pickled:
        torch.save(t, tmp_path / "e3" / "pytorch_model.bin")
        (tmp_path / "e3" / "model.safetensors").unlink()
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4,
              speculative_config={"method": method, "model": str(tmp_path / "e3"), "num_speculative_tokens": 3})
    assert llm.engine.hidden_layers == (0, 1, 2)
    t = {k.replace("layers.0", "midlayer"): v for k, v in t.items()}
    for context, drafts in record_drafts(llm, PROMPTS[:4]):
        if drafts:
            hs = states(llama, context)
            fused = torch.cat([hs[0][0], hs[1][0], hs[2][0]], -1) @ t["fc.weight"].T
            expected = reference_eagle_drafts(lambda f, tok: eagle3_step(t, llama, f, tok), fused, context,
                                              len(drafts))
            assert drafts == expected, f"context {context}"


def test_eagle1_drafts_equal_the_reference_forward(model_dirs, llama, tmp_path):  # noqa: F811
    t = make_eagle1(llama, tmp_path / "e1", seed=2, scale=2.0)
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4,
              speculative_config={"method": "eagle", "model": str(tmp_path / "e1"), "num_speculative_tokens": 3})
    assert llm.engine.hidden_layers == (-1,)
    for context, drafts in record_drafts(llm, PROMPTS[:4]):
        if drafts:
            expected = reference_eagle_drafts(lambda f, tok: eagle1_step(t, llama, f, tok),
                                              states(llama, context)[-1][0], context, len(drafts))
            assert drafts == expected, f"context {context}"


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa"])
def test_published_heads_run_packed_in_float32(model_dirs, llama, tmp_path, monkeypatch, kind):  # noqa: F811
    """In float32 on a CPU an inference head's matrices (EAGLE-1's use of the target's head included) are read
    packed: its drafts are those of the same head with every weight plain, and greedy output is the target's."""
    from specdec.models import cpu_linear
    from specdec.models.cpu_linear import PackedLinear, is_packed

    folder, method = tmp_path / kind, "eagle" if kind == "eagle1" else kind
    {"eagle3": lambda: make_eagle3(llama, folder, seed=1, draft_vocab=64, scale=2.0),
     "eagle1": lambda: make_eagle1(llama, folder, seed=2, scale=2.0),
     "medusa": lambda: make_medusa(llama, folder, seed=3, layout="vllm", scale=2.0)}[kind]()
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": 3}

    def matrices(drafter) -> list[torch.Tensor]:
        if kind == "medusa":
            blocks = [m for m in drafter.module.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
            assert blocks and all(isinstance(m, PackedLinear) for m in blocks)
            return [m.weight for m in blocks] + drafter.module.heads
        return [*drafter.layer.module.matrices.values(), drafter.layer.target_head]

    def run(packs: bool):
        if not packs:
            monkeypatch.setattr(cpu_linear, "packs", lambda device, dtype: False)
        llm = LLM(model_dirs["llama"]["target"], dtype="float32", max_num_seqs=4, speculative_config=spec)
        assert {is_packed(w) for w in matrices(llm.engine.drafter)} == {packs}
        return record_drafts(llm, PROMPTS[:4]), llm

    packed, llm = run(True)
    plain, _ = run(False)
    assert packed == plain
    monkeypatch.undo()
    reference = LLM(model_dirs["llama"]["target"], dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=20)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in reference.generate(prompts, params)])


@pytest.mark.parametrize("layout", ["fasterdecoding", "vllm"])
def test_medusa_drafts_equal_the_reference_forward(model_dirs, llama, tmp_path, layout):  # noqa: F811
    """Head ``i`` drafts the argmax of its own output head over its residual blocks on the feature of the token
    before the pending one."""
    t = make_medusa(llama, tmp_path / "m", seed=3, layout=layout)
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4,
              speculative_config={"method": "medusa", "model": str(tmp_path / "m"), "num_speculative_tokens": 3})
    t = {k.removeprefix("medusa_head."): v for k, v in t.items()}
    for context, drafts in record_drafts(llm, PROMPTS[:4]):
        if drafts:
            f = states(llama, context)[-1][0, -2]
            expected = []
            for i in range(len(drafts)):
                x = f
                for j in range(2):
                    name = f"{i}.{j}.linear" if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}"
                    x = x + F.silu(x @ t[f"{name}.weight"].T + t[f"{name}.bias"])
                head = t[f"{i}.2.weight"] if layout == "fasterdecoding" else t[f"lm_heads.{i}.weight"]
                expected.append(int((x @ head.T).argmax()))
            assert drafts == expected, f"context {context}"


HEADS = {"eagle3": lambda m, f: make_eagle3(m, f, seed=5, draft_vocab=m.config.vocab_size * 2 // 3),
         "eagle": lambda m, f: make_eagle1(m, f, seed=6),
         "medusa": lambda m, f: make_medusa(m, f, seed=7, layout="fasterdecoding")}


@pytest.mark.parametrize(("method", "candidates", "backend"), [
    ("eagle3", 1, "auto"), ("eagle3", 2, "auto"), ("eagle3", 1, "hf"),
    ("eagle", 1, "auto"), ("eagle", 2, "auto"), ("medusa", 1, "auto"), ("medusa", 2, "auto")])
def test_published_heads_batched_greedy_matches_transformers(model_dirs, llama, references, tmp_path,  # noqa: F811
                                                             method, candidates, backend):
    HEADS[method](llama, tmp_path / method)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 4 * candidates,
            "num_candidates": candidates}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", backend=backend,
              max_num_seqs=BATCH)
    check_outputs(run_batch(llm), references)
    assert llm.batch_metrics.num_draft_tokens > 50
    assert not llm.engine.drafter.features, "features of finished sequences must be released"


@pytest.fixture(scope="module")
def sharp_three_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("published_exact")
    target = build_model("llama", seed=11, vocab=VOCAB, layers=3, scale=3.0)
    target.save_pretrained(root / "target")
    return target, root


@pytest.mark.parametrize("method", ["eagle3", "eagle", "medusa"])
def test_published_heads_sampling_matches_target(sharp_three_layers, method):
    target, root = sharp_three_layers
    if method == "eagle3":
        make_eagle3(target, root / method, seed=8, draft_vocab=8, scale=3.0)
    elif method == "eagle":
        make_eagle1(target, root / method, seed=9, scale=3.0)
    else:
        make_medusa(target, root / method, seed=10, layout="vllm", num_heads=2, scale=3.0)
    spec = {"method": method, "model": str(root / method), "num_speculative_tokens": 2}
    llm = LLM(root / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, f"published {method}")


def test_aux_layer_ids_follow_vllm_and_sglang(tmp_path):
    """vLLM's top-level ids index layer inputs; SGLang's ``eagle_config`` ids are layer outputs (one more)."""
    assert aux_layer_ids({}, 32, tmp_path) == [2, 16, 29]
    assert aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [29, 2, 16]}, 32, tmp_path) == [2, 16, 29]
    sglang = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert aux_layer_ids(sglang, 32, tmp_path) == [2, 16, 29]
    with pytest.raises(SpecDecError, match="not three distinct layers of a target with 4 layers"):
        aux_layer_ids({}, 4, tmp_path)
    with pytest.raises(SpecDecError, match="must be a list of three layer ids"):
        aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [1, 2]}, 32, tmp_path)
    both = {**sglang, "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}  # the same layers for both servers
    assert aux_layer_ids(both, 32, tmp_path) == [2, 16, 29]
    with pytest.raises(SpecDecError, match=r"names its target layers twice, differently: eagle_config\.eagle_aux_"
                                           r"hidden_state_layer_ids \[1, 15, 28\] .* hidden states \[2, 16, 29\]\) "
                                           r"and eagle_aux_hidden_state_layer_ids \[1, 15, 28\]"):
        aux_layer_ids({**sglang, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}, 32, tmp_path)


def _edit(folder, drop=None, reshape=None, extra=None, **config):
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    if extra:
        tensors[extra] = torch.zeros(3)
    save_file(tensors, str(path))
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(("method", "edit", "message"), [
    ("eagle3", {"drop": "midlayer.hidden_norm.weight"}, "lack the tensor 'layers.0.hidden_norm.weight'"),
    ("eagle3", {"drop": "fc.weight"}, "lack the tensor 'fc.weight'"),
    ("eagle3", {"reshape": "fc.weight"}, r"tensor 'fc.weight' has shape \(31, 96\), expected \(32, 96\)"),
    ("eagle3", {"reshape": "d2t"}, r"tensor 'd2t' has shape"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}, "not three distinct layers of a target with 3"),
    ("eagle3", {"vocab_size": 128}, "vocabulary of 128 tokens; the target"),
    ("eagle3", {"target_hidden_size": 48}, "hidden size 48; the target"),
    ("eagle3", {"num_hidden_layers": 2}, "has 2 layers; published EAGLE heads have one"),
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, "sets use_aux_hidden_state false"),
    ("eagle3", {"transformer_layer_config": {}, "architectures": ["Eagle3Speculator"]}, "speculators format"),
    ("medusa", {"drop": "medusa_head.1.2.weight"}, "lack the tensor '1.2.weight'"),
    ("medusa", {"medusa_num_heads": 4}, "lack the tensor '3.0.linear.weight'"),
    ("medusa", {"extra": "medusa_head.0.0.linear.scale"}, r"tensors this layout does not have: \['0.0.linear.scale'\]"),
])
def test_malformed_published_heads_are_refused(model_dirs, llama, tmp_path, method, edit, message):  # noqa: F811
    if method == "eagle3":
        make_eagle3(llama, tmp_path / "h", seed=11)
    else:
        make_medusa(llama, tmp_path / "h", seed=12, layout="fasterdecoding")
    _edit(tmp_path / "h", **edit)
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], dtype="float64", speculative_config={"method": method,
                                                                              "model": str(tmp_path / "h")})


def test_heads_for_another_target_width_or_vocabulary_are_refused(model_dirs, tmp_path):
    wide = build_model("llama", seed=3, vocab=80, layers=3)
    wide.config.hidden_size = 48  # only the head's shapes are read
    make_eagle3(wide, tmp_path / "e3", seed=13)
    with pytest.raises(SpecDecError, match="vocabulary of 80 tokens"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "eagle3", "model": str(tmp_path / "e3")})
    make_medusa(build_model("llama", seed=3, vocab=80, layers=3), tmp_path / "m", seed=14, layout="vllm")
    with pytest.raises(SpecDecError, match="vocabulary of 80 tokens"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "medusa", "model": str(tmp_path / "m")})


def test_eagle3_method_needs_an_eagle3_head(model_dirs, llama, tmp_path):  # noqa: F811
    make_eagle1(llama, tmp_path / "e1", seed=15)
    with pytest.raises(SpecDecError, match="is not an EAGLE-3 head"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "eagle3", "model": str(tmp_path / "e1")})
    with pytest.raises(SpecDecError, match="'eagle3' needs a 'model'"):
        LLM(model_dirs["llama"]["target"], dtype="float64", speculative_config={"method": "eagle3"})
    make_medusa(llama, tmp_path / "m", seed=16, layout="vllm")
    with pytest.raises(SpecDecError, match="draft_vocab_size applies to heads trained by specdec"):
        LLM(model_dirs["llama"]["target"], dtype="float64",
            speculative_config={"method": "medusa", "model": str(tmp_path / "m"), "draft_vocab_size": 10})


def test_a_head_trained_in_the_eagle3_format_round_trips(model_dirs, llama, tmp_path):  # noqa: F811
    """A head of ``specdec train eagle --format eagle3`` (random weights here) written by ``save_eagle3`` loads
    as a published EAGLE-3 head whose drafts equal the in-memory module's; its tensors and config fields are
    the published layout's (the names :func:`make_eagle3` writes)."""
    from safetensors.torch import load_file

    from specdec.drafters.heads.common import spec_for
    from specdec.train.eagle3_format import Eagle3Training, save_eagle3

    embed, lm_head = llama.get_input_embeddings().weight.detach(), llama.get_output_embeddings().weight.detach()
    spec = spec_for("eagle", "test target", lm_head, llama.config, intermediate_size=INTER, feature_layers=[0, 1, 2])
    torch.manual_seed(17)
    module = Eagle3Training(spec, embed, lm_head)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * (0.1 if param.ndim == 1 else 2.0 / param.shape[-1] ** 0.5))
    save_eagle3(module, tmp_path / "trained", torch.float64)
    make_eagle3(llama, tmp_path / "published", seed=1)
    published = load_file(str(tmp_path / "published" / "model.safetensors"))
    saved = load_file(str(tmp_path / "trained" / "model.safetensors"))
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in published.items()}
    config = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == config["vocab_size"] == llama.config.vocab_size
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and "eagle_config" not in config

    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": str(tmp_path / "trained"), "num_speculative_tokens": 3})

    def step(features, tokens):
        out = module(features[None], tokens[None])
        return out[0], module.logits(out)[0, -1]

    with torch.no_grad():
        for context, drafts in record_drafts(llm, PROMPTS[:4]):
            if drafts:
                hs = states(llama, context)
                fused = module.fused(torch.cat([hs[0], hs[1], hs[2]], -1))[0]
                assert drafts == reference_eagle_drafts(step, fused, context, len(drafts)), f"context {context}"


def test_train_eagle_format_eagle3(text_model_dirs, tmp_path):
    """``specdec train eagle --format eagle3`` writes a published EAGLE-3 folder that the eagle3 method loads and
    decodes with; the option is refused for other methods and with eagle-only regression options."""
    from test_train import tiny_head_training

    from specdec.train.cli import main

    out = tmp_path / "eagle3"
    common = tiny_head_training(tmp_path, text_model_dirs["target"])
    assert main(["eagle", "--out", str(out), "--format", "eagle3", *common]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "target_fingerprint" not in config
    assert json.loads((out / "train_summary.json").read_text())["heldout_tau"] >= 1.0
    llm = LLM(text_model_dirs["target"], speculative_config={"method": "eagle3", "model": str(out)}, dtype="float64")
    assert llm.engine.hidden_layers == tuple(config["eagle_aux_hidden_state_layer_ids"])
    assert len(llm.generate("def f(", SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids) == 5
    assert main(["eagle", "--out", str(tmp_path / "bad"), "--format", "eagle3", "--feature-weight", "0.5",
                 *common]) == 2


def test_the_method_is_inferred_from_the_model_as_vllm_does(tmp_path, model_dirs):
    """A ``speculative_config`` with a ``model`` and no ``method``: a specdec head folder names its method, a
    published EAGLE-3 or Medusa config is eagle3 or medusa, anything else a draft model; the inferred config
    runs (the embedded eagle heads on the embedded target)."""
    from specdec.assets import default_pair
    from specdec.drafters import SpeculativeConfig
    from specdec.drafters.heads.common import HEADS_DIR

    def method(model):
        return SpeculativeConfig.from_dict({"model": model, "num_speculative_tokens": 2}).method

    assert method(str(HEADS_DIR / "eagle")) == "eagle" and method(HEADS_DIR / "medusa") == "medusa"
    assert method(str(HEADS_DIR / "early_exit")) == "layer_skip"  # the trained form of layer_skip
    assert method(str(model_dirs["llama"]["truncated"])) == "draft_model"
    assert method("some-org/some-draft") == "draft_model" and method(build_model("llama", seed=3)) == "draft_model"
    for name, config in (("e3", {"architectures": ["LlamaForCausalLMEagle3"]}), ("m", {"medusa_num_heads": 3})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert method(str(tmp_path / "e3")) == "eagle3" and method(str(tmp_path / "m")) == "medusa"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(SpecDecError, match="cannot read .*config.json"):
        method(str(tmp_path / "bad"))
    with pytest.raises(SpecDecError, match=r"needs a 'method' \(or a 'model' to infer it from\)"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2})
    target = default_pair()[0]
    inferred = LLM(target, speculative_config={"model": str(HEADS_DIR / "eagle"), "num_speculative_tokens": 2})
    named = LLM(target, speculative_config={"method": "eagle", "model": str(HEADS_DIR / "eagle"),
                                            "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0, max_tokens=12)
    assert inferred.speculative_config.method == "eagle"
    assert inferred.generate("def add(a, b):", params)[0].outputs[0].token_ids == named.generate(
        "def add(a, b):", params)[0].outputs[0].token_ids


@pytest.mark.parametrize("heads, method", [("eagle", "eagle"), ("medusa", "medusa"), ("early_exit", "layer_skip")])
def test_the_cli_infers_the_method_of_a_speculative_model_folder(heads, method, capsys):
    """``--speculative-model`` without ``--speculative-method`` runs the method its folder means, as a
    ``speculative_config`` without a method does (it was handed to draft_model, which could not load it)."""
    from specdec.cli import main
    from specdec.drafters.heads.common import HEADS_DIR

    assert main(["generate", "def f(x):", "--speculative-model", str(HEADS_DIR / heads), "--max-tokens", "4",
                 "--temperature", "0", "--warmup", "0"]) == 0
    assert f"({method}, k=4)" in capsys.readouterr().err
