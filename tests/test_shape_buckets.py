"""Wide forwards (prefills) on a CPU are padded to a few shapes, and stay exact.

oneDNN keeps state for every half-precision shape it sees, so the fast backend pads chain
forwards of more than ``WIDE_TOKENS`` tokens per row to :func:`wide_bucket` widths and attends
to a bucketed cache length. These tests check the bound on shapes and that padding changes
no output: long prompts, alone and batched, against transformers' greedy ``generate``.
"""

import random

import pytest
import torch
from helpers import CONTEXT, VOCAB
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.models.fast_llama import FastLlamaLM
from specdec.models.grid import WIDE_TOKENS, wide_bucket


def test_wide_bucket_is_a_few_widths_covering_every_length():
    widths = {wide_bucket(n) for n in range(1, 4097)}
    assert sorted(widths)[:8] == [16, 24, 32, 48, 64, 96, 128, 192]
    assert len(widths) == 17  # two per octave from 16 to 4096
    for n in range(1, 4097):
        assert n <= wide_bucket(n) <= max(WIDE_TOKENS, 3 * n // 2 + 1)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_long_prompts_alone_and_batched_match_transformers(model_dirs, arch):
    lengths = [17, 18, 30, 45, 77, 130]
    prompts = _prompts(lengths)
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch]["target"], dtype=torch.float64)
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        references.append(out[0, len(prompt):].tolist())
    params = SamplingParams(temperature=0, max_tokens=12)
    for config in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(model_dirs[arch]["target"], dtype="float64", speculative_config=config, max_num_seqs=4)
        batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in batched] == references
        for prompt, reference in zip(prompts, references):
            alone = llm.generate({"prompt_token_ids": prompt}, params)[0]
            assert alone.outputs[0].token_ids == reference


def test_prompts_of_every_length_use_few_shapes(model_dirs, monkeypatch):
    """200 prompt lengths give at most a dozen (width, cache length) shapes of wide forwards."""
    seen = set()
    compute = FastLlamaLM.compute

    def recording(self, g, cache, *args, **kwargs):
        if g.width > WIDE_TOKENS:
            seen.add((g.rows, g.width, g.key_len))
        return compute(self, g, cache, *args, **kwargs)

    monkeypatch.setattr(FastLlamaLM, "compute", recording)
    # whole prompts (chunked prefill would cut the longer ones into chunks of at most its budget)
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=1, enable_chunked_prefill=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    lengths = range(WIDE_TOKENS + 2, CONTEXT - 1)
    for prompt in _prompts(lengths, seed=1):
        llm.generate({"prompt_token_ids": prompt}, params)
    widths = {w for _, w, _ in seen}
    assert len(lengths) > 150
    assert widths == {wide_bucket(n - 1) for n in lengths}
    assert len(seen) <= 10
