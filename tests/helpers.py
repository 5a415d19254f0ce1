"""Tiny random models for the tests, built in memory (float64, see conftest)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from scipy.stats import chisquare
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from specdec import SamplingParams

VOCAB = 96
CONTEXT = 192

ARCHS = {
    "llama": lambda vocab, layers: LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
    "qwen2": lambda vocab, layers: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
    "gpt2": lambda vocab, layers: GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=CONTEXT,
        eos_token_id=None, bos_token_id=None)),
}


WINDOW = 6
"""The sliding window of the windowed families below: prompts and generations of the tests cross it."""

_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": CONTEXT, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def _gemma_types(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


FAMILY_ARCHS = {
    "qwen3": lambda vocab, layers: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, num_hidden_layers=layers, head_dim=8, **_SHAPE)),
    "mistral": lambda vocab, layers: MistralForCausalLM(MistralConfig(
        vocab_size=vocab, num_hidden_layers=layers, sliding_window=WINDOW, **_SHAPE)),
    "qwen2-window": lambda vocab, layers: Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, num_hidden_layers=layers, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, **_SHAPE)),
    "phi3": lambda vocab, layers: Phi3ForCausalLM(Phi3Config(
        vocab_size=vocab, num_hidden_layers=layers, sliding_window=WINDOW + 3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **_SHAPE)),
    "gemma2": lambda vocab, layers: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=vocab, num_hidden_layers=layers, head_dim=8, query_pre_attn_scalar=12, sliding_window=WINDOW,
        layer_types=_gemma_types(layers), attn_logit_softcapping=1.5, final_logit_softcapping=4.0, **_SHAPE)),
    "gemma3_text": lambda vocab, layers: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=vocab, num_hidden_layers=layers, head_dim=8, query_pre_attn_scalar=12, sliding_window=WINDOW,
        layer_types=_gemma_types(layers), **_SHAPE)),
    "qwen3_moe": lambda vocab, layers: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, num_hidden_layers=layers, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1], **_SHAPE)),
    "mixtral": lambda vocab, layers: MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab, num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2, **_SHAPE)),
}
"""Tiny models of the fast backend's further families (their own tests: the suites over ``ARCHS`` stay as
they were). The windowed ones (mistral, qwen2-window, phi3, gemma2, gemma3_text) slide over a window
of a few tokens."""


def build_model(arch: str, seed: int, vocab: int = VOCAB, layers: int = 3, scale: float = 1.0):
    """A float64 random model; ``scale`` multiplies every weight (sharper distributions)."""
    torch.manual_seed(seed)
    model = {**ARCHS, **FAMILY_ARCHS}[arch](vocab, layers).to(torch.float64).eval()
    if scale != 1.0:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(scale)
    return model


def truncated_copy(model, keep_layers: int):
    """The target with its last layers dropped: agrees with it on some tokens."""
    small = copy.deepcopy(model)
    base = small.model if hasattr(small, "model") else small.transformer
    if hasattr(base, "layers"):
        base.layers = base.layers[:keep_layers]
    else:
        base.h = base.h[:keep_layers]
    small.config.num_hidden_layers = keep_layers
    if hasattr(small.config, "layer_types") and small.config.layer_types:
        small.config.layer_types = small.config.layer_types[:keep_layers]
    return small


def make_sequence(request_id: str, prompt: list[int], params, seed: int = 0, max_new_tokens: int | None = None,
                  stop_ids: frozenset[int] = frozenset()):
    """A :class:`~specdec.sequence.Sequence` to hand to ``llm.scheduler.add`` directly."""
    from specdec.sequence import Sequence

    return Sequence(
        request_id=request_id, prompt_ids=list(prompt), params=params,
        generator=torch.Generator().manual_seed(seed),
        max_new_tokens=params.max_tokens if max_new_tokens is None else max_new_tokens, stop_ids=stop_ids,
    )


def record_drafts(llm, prompts: list[list[int]], max_tokens: int = 20) -> list[tuple[list[int], list[int]]]:
    """Greedy-decode ``prompts`` with ``llm`` (k 3) recording each row's context and chain draft at every
    step: ``[(context token ids, draft token ids), ...]``."""
    drafter, records = llm.engine.drafter, []
    propose = drafter.propose

    def recording(seqs, ks, sampling):
        draft = propose(seqs, ks, sampling)
        for b, s in enumerate(seqs):
            records.append((list(s.token_ids), draft.tokens[b, : draft.num_draft[b]].tolist()))
        return draft

    drafter.propose = recording
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    assert len(records) > 20 and any(len(d) == 3 for _, d in records)
    return records


class _BodyRan:
    """Stands for a captured graph whose body already ran: replaying it does nothing."""

    def replay(self) -> None:
        pass


def run_graph_bodies_eagerly(monkeypatch) -> None:
    """Make :mod:`specdec.models.cuda_graphs` run a graph's body once where it would capture (or look up) the
    graph and replay it: what a replay computes, on a CPU. Each key asked for is recorded in the pool's
    ``graphs.graphs`` (value None)."""
    from specdec.models import cuda_graphs

    def body_once(graphs, key, body, refill):
        graphs.graphs[key] = None
        return _BodyRan(), body()

    monkeypatch.setattr(cuda_graphs, "_captured", body_once)


def spy(obj, name: str) -> list:
    """Replace ``obj.name`` by a wrapper that records each call's arguments; returns the record."""
    calls, method = [], getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test with cells of expected count < 5 pooled; 0.0 when a forbidden pair was drawn."""
    expected, observed = probs.ravel() * counts.sum(), counts.ravel()
    if observed[probs.ravel() == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
