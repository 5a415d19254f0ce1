"""vLLM's ``prompt_logprobs``: the target's raw logprobs of every prompt token but the first, equal to a naive
reference (transformers' forward, float64), however the prompt is fed (whole, in chunks, beside running
sequences, with a drafter that reads hidden states) and whatever the prefix cache holds."""

import pytest
import torch
from test_heads import make_heads

import specdec.prompt_feed
from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5, 9, 14, 2, 8, 8, 1, 40, 41, 42, 43, 44, 45], [42, 1, 17, 29, 8, 64, 2],
           [90, 91, 90, 91, 90, 91, 90, 91, 90, 91, 90, 91, 90, 91, 90, 91, 90, 91, 5]]
TOP = 3


@pytest.fixture(scope="module")
def reference(model_dirs):
    """Per prompt: ``[L - 1]`` lists of (logprob, rank, top ids, top logprobs) of prompt tokens 1..L-1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], -1)
            rows = []
            for position, token in enumerate(prompt[1:]):
                row = logprobs[position]
                top = row.topk(TOP)
                rows.append((row[token].item(), int((row >= row[token]).sum()), top.indices.tolist(),
                             top.values.tolist()))
            out.append(rows)
    return out


def check(outputs, reference) -> None:
    for output, expected in zip(outputs, reference):
        entries = output.prompt_logprobs
        assert entries[0] is None and len(entries) == len(output.prompt_token_ids)
        for entry, token, (logprob, rank, top_ids, top_values) in zip(entries[1:], output.prompt_token_ids[1:],
                                                                      expected):
            assert abs(entry[token].logprob - logprob) < 1e-9 and entry[token].rank == rank
            tops = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= TOP), key=lambda item: item[1].rank)
            assert [t for t, _ in tops][:TOP] == top_ids
            assert all(abs(lp.logprob - v) < 1e-9 for (_, lp), v in zip(tops, top_values))


SETTINGS = {
    "whole": lambda dirs, tmp: {"enable_chunked_prefill": False},  # fed in SCORED_TOKENS pieces: 4 here
    "chunks beside running rows": lambda dirs, tmp: {"max_num_batched_tokens": 8},
    "draft model": lambda dirs, tmp: {"max_num_batched_tokens": 8, "speculative_config": {
        "method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 3}},
    "eagle (hidden states)": lambda dirs, tmp: {"max_num_batched_tokens": 8, "speculative_config": {
        "method": "eagle", "model": str(tmp), "num_speculative_tokens": 3}},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prompt_logprobs_equal_the_reference(model_dirs, reference, tmp_path, monkeypatch, setting):
    """The prompts go in a batch with a request that does not score its prompt and shares one (its blocks are in
    the prefix cache first), so scored prompts are fed beside running rows and past cached blocks; greedy outputs
    stay those of requests that do not ask."""
    dirs = model_dirs["llama"]
    if setting == "whole":
        monkeypatch.setattr(specdec.prompt_feed, "SCORED_TOKENS", 4)
    if setting.startswith("eagle"):
        from transformers import AutoModelForCausalLM

        make_heads(AutoModelForCausalLM.from_pretrained(dirs["target"], dtype=torch.float64), "eagle", tmp_path,
                   seed=3)
    llm = LLM(dirs["target"], dtype="float64", max_num_seqs=4, **SETTINGS[setting](dirs, tmp_path))
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
    warm = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=20,
                                                                          ignore_eos=True))[0]
    outputs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[0]]], [scored] * 3 + [plain])
    check(outputs[:3], reference)
    assert outputs[3].prompt_logprobs is None and outputs[3].num_cached_tokens > 0, "the cache held the prompt"
    assert outputs[0].num_cached_tokens == 0, "a scored prompt reads nothing from the prefix cache"
    assert outputs[0].outputs[0].token_ids == outputs[3].outputs[0].token_ids == warm.outputs[0].token_ids[:6]


def test_n_streams_and_checks(model_dirs, reference):
    """With ``n`` the prompt is scored once (the first choice); a stream's first output carries them; a value
    outside 0..20 is refused by name."""
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=4)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=4, n=3, prompt_logprobs=TOP)
    assert [c.prompt_logprobs for c in params.choices()] == [TOP, None, None]
    output = llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0]
    check([output], reference[1:2])
    assert len(output.outputs) == 3
    stream = list(llm.stream({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=4, prompt_logprobs=TOP)))
    assert stream[0].prompt_logprobs is not None and all(out.prompt_logprobs is None for out in stream[1:])
    check([type("Output", (), {"prompt_logprobs": stream[0].prompt_logprobs, "prompt_token_ids": PROMPTS[1]})],
          reference[1:2])
    for value in (21, -1, 2.0):
        with pytest.raises(SpecDecError, match="prompt_logprobs must be None or an integer in 0..20"):
            SamplingParams(prompt_logprobs=value)
