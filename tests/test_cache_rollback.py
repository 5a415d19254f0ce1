"""After steps with rejections, the rolled-back caches give the logits of a fresh prefill."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import LLM, RequestMetrics, SamplingParams

COMBOS = [("llama", "fast"), ("llama", "hf"), ("qwen2", "fast"), ("gpt2", "hf")]


@pytest.mark.parametrize("arch,backend", COMBOS)
@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_rolled_back_cache_equals_fresh_prefill(model_dirs, arch, backend, temperature):
    dirs = model_dirs[arch]
    spec = {"method": "draft_model", "model": str(dirs["random"]), "num_speculative_tokens": 4}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", backend=backend)
    params = SamplingParams(temperature=temperature, max_tokens=120, seed=3)
    prompt = [5, 9, 2, 33, 7]
    context = list(prompt)
    rejections = 0
    steps = llm.engine.generate(prompt, params, torch.Generator().manual_seed(3), RequestMetrics())
    for step in steps:
        context.extend(step.token_ids)
        rejections += step.num_accepted < step.num_drafted
        if rejections >= 3:
            break
    assert rejections > 0, "the test needs at least one rejected draft"

    target, draft = llm.engine.target, llm.engine.drafter.model
    assert target.length == len(context) - 1
    assert draft.length <= len(context) - 1
    reference = AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float64)
    with torch.no_grad():
        expected = reference(torch.tensor([context])).logits[0, -1]
    rolled_back = target.forward(torch.tensor([context[-1:]]))[0, -1]
    torch.testing.assert_close(rolled_back, expected, rtol=1e-9, atol=1e-9)

    draft_reference = AutoModelForCausalLM.from_pretrained(dirs["random"], dtype=torch.float64)
    with torch.no_grad():
        expected_draft = draft_reference(torch.tensor([context])).logits[0, -1]
    draft_logits = draft.forward(torch.tensor([context[draft.length:]]), num_logits=1)[0, -1]
    torch.testing.assert_close(draft_logits, expected_draft, rtol=1e-9, atol=1e-9)
