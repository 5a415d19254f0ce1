"""After ragged rejections across the rows of a batch, every slot of the KV pool (the target's
and the draft model's) gives the logits of a fresh prefill of its sequence's committed tokens."""

import pytest
import torch
from helpers import make_sequence
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.models.base import ForwardBatch

COMBOS = [("llama", "fast"), ("llama", "hf"), ("qwen2", "fast"), ("gpt2", "hf")]
PROMPTS = [[5, 9, 2, 33, 7], [1], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [8, 8, 3]]
TOL = {"rtol": 1e-9, "atol": 1e-9}


def fresh_last_logits(lm, tokens):
    """The last-token logits of ``tokens`` prefilled into a new pool of the same backend."""
    cache = lm.new_cache(1, len(tokens) + 1)
    return lm.forward(ForwardBatch.from_rows([tokens], [0], [0], lm.device, logits="last"), cache).logits[0]


@pytest.mark.parametrize("arch,backend", COMBOS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_pool_rollback_after_ragged_rejections(model_dirs, arch, backend, temperature):
    dirs = model_dirs[arch]
    # Drafts that rows accept in different numbers (a random draft is never accepted under greedy
    # Llama/Qwen2 targets; the truncated one sometimes is).
    draft = "truncated" if temperature == 0 and arch != "gpt2" else "random"
    spec = {"method": "draft_model", "model": str(dirs[draft]), "num_speculative_tokens": 4}
    # Five slots for four sequences: slot 4 stays free.
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", backend=backend, max_num_seqs=5)
    seqs = [make_sequence(str(i), p, SamplingParams(temperature=temperature, max_tokens=100), seed=i)
            for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        llm.scheduler.add(seq)

    ragged_steps, rejected = 0, set()
    for _ in range(6):
        outputs = llm.scheduler.step()
        assert [o.request_id for o in outputs] == ["0", "1", "2", "3"]
        accepted = [o.num_accepted for o in outputs]
        assert all(o.num_drafted == 4 and len(o.token_ids) == o.num_accepted + 1 for o in outputs)
        if len(set(accepted)) > 1 and min(accepted) < 4:
            ragged_steps += 1
        rejected |= {o.request_id for o in outputs if o.num_accepted < o.num_drafted}
    assert ragged_steps >= 2, "the test needs steps whose rows accept different numbers of drafts"
    assert len(rejected) >= 3, "the test needs rejections in most rows"

    engine = llm.engine
    target, drafter = engine.target, engine.drafter
    assert sorted(s.slot for s in seqs) == [0, 1, 2, 3]
    for seq in seqs:
        assert engine.cache.lengths[seq.slot] == len(seq.token_ids) - 1
        assert drafter.cache.lengths[seq.slot] <= len(seq.token_ids) - 1
    assert engine.cache.lengths[4] == 0 and drafter.cache.lengths[4] == 0

    # One batched forward of every row's pending token over the rolled-back pool...
    slots = [s.slot for s in seqs]
    batch = ForwardBatch.from_rows([s.token_ids[-1:] for s in seqs], [len(s.token_ids) - 1 for s in seqs], slots,
                                   target.device)
    rolled_back = target.forward(batch, engine.cache).logits
    # ... and the draft's uncached committed tokens over its own pool.
    draft_lm = drafter.model
    draft_batch = ForwardBatch.from_rows([s.token_ids[drafter.cache.lengths[s.slot]:] for s in seqs],
                                         [drafter.cache.lengths[s.slot] for s in seqs], slots, draft_lm.device,
                                         logits="last")
    draft_rolled_back = draft_lm.forward(draft_batch, drafter.cache).logits

    reference = AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float64)
    draft_reference = AutoModelForCausalLM.from_pretrained(dirs[draft], dtype=torch.float64)
    for row, seq in enumerate(seqs):
        context = torch.tensor([seq.token_ids])
        torch.testing.assert_close(rolled_back[row], fresh_last_logits(target, seq.token_ids), **TOL)
        with torch.no_grad():
            torch.testing.assert_close(rolled_back[row], reference(context).logits[0, -1], **TOL)
            torch.testing.assert_close(draft_rolled_back[row], draft_reference(context).logits[0, -1], **TOL)


def test_finished_rows_leave_the_pool_empty(model_dirs):
    """Rows finishing at different steps release their slots (target and draft) and the rows that
    go on keep their invariant."""
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["random"]), "num_speculative_tokens": 3}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=3)
    budgets = [2, 7, 30]
    seqs = [make_sequence(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=n), seed=i)
            for i, n in enumerate(budgets)]
    for seq in seqs:
        llm.scheduler.add(seq)
    while llm.scheduler.has_work:
        llm.scheduler.step()
        for seq in seqs:
            if seq.finished:
                assert seq.slot == -1
            else:
                assert llm.engine.cache.lengths[seq.slot] == len(seq.token_ids) - 1
        running = {s.slot for s in llm.scheduler.running}
        for slot in range(3):
            if slot not in running:
                assert llm.engine.cache.lengths[slot] == 0 and llm.engine.drafter.cache.lengths[slot] == 0
    assert [s.num_generated for s in seqs] == budgets
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert llm.engine.cache.lengths == [0, 0, 0]
