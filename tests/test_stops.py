"""Stop tokens, EOS, stop strings and max_tokens end generation exactly, also inside an accepted run."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams

PROMPT = [3, 5, 7, 3, 5, 7, 11, 3, 5]


@pytest.fixture(scope="module")
def reference(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def first_new_token_after(tokens, start):
    """An index >= start whose token does not occur earlier (so it is the first stop)."""
    for index in range(start, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index
    raise AssertionError("reference has no fresh token")


@pytest.fixture(scope="module")
def spec_llm(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["same"]), "num_speculative_tokens": 8}
    return LLM(dirs["target"], speculative_config=spec, dtype="float64")


def test_stop_token_inside_accepted_run(spec_llm, reference):
    stop_at = first_new_token_after(reference, 3)
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference[stop_at]])
    out = spec_llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert out.outputs[0].token_ids == reference[: stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"
    # The stop fell inside a run of 9 tokens (8 accepted + bonus): nothing past it was emitted.
    assert out.metrics.num_steps == 1 + stop_at // 9


def test_eos_from_config_inside_accepted_run(model_dirs, reference, tmp_path):
    stop_at = first_new_token_after(reference, 4)
    target_dir = tmp_path / "target"
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]["target"], dtype=torch.float64)
    model.config.eos_token_id = reference[stop_at]
    model.generation_config.eos_token_id = reference[stop_at]
    model.save_pretrained(target_dir)
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["same"]), "num_speculative_tokens": 8}
    llm = LLM(target_dir, speculative_config=spec, dtype="float64")
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.outputs[0].token_ids == reference[: stop_at + 1]
    assert out.outputs[0].finish_reason == "stop"
    ignored = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert ignored[0].outputs[0].token_ids == reference


@pytest.mark.parametrize("max_tokens", [1, 5, 13])
def test_max_tokens_mid_run(spec_llm, reference, max_tokens):
    out = spec_llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    assert out.outputs[0].token_ids == reference[:max_tokens]
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.num_generated_tokens == max_tokens


def test_context_window_ends_generation(spec_llm, model_dirs):
    config = json.loads((model_dirs["llama"]["target"] / "config.json").read_text())
    window = config["max_position_embeddings"]
    prompt = [1 + i % 50 for i in range(window - 4)]
    out = spec_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].finish_reason == "length"


def test_stop_string_cuts_text_and_tokens(text_model_dirs):
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 8}
    llm = LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64")
    prompt = "def f(x):\n"
    reference = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    ref_text = reference.outputs[0].text
    assert len(ref_text) > 12
    stop = ref_text[8:11]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params)[0]
    cut = ref_text.index(stop)
    assert out.outputs[0].text == ref_text[:cut]
    assert out.outputs[0].finish_reason == "stop"
    ids = out.outputs[0].token_ids
    assert ids == reference.outputs[0].token_ids[: len(ids)]
    assert stop in llm.tokenizer.decode(ids) and stop not in llm.tokenizer.decode(ids[:-1])

    streamed = list(llm.stream(prompt, params))
    assert "".join(piece.text for piece in streamed) == ref_text[:cut]
    assert [t for piece in streamed for t in piece.token_ids] == ids
    assert streamed[-1].finished and streamed[-1].finish_reason == "stop"


def test_stops_per_row_in_one_batch(spec_llm, reference):
    """Rows of one batch stop at their own stop token or budget, inside accepted runs, and the
    other rows go on unaffected."""
    first, second = first_new_token_after(reference, 3), first_new_token_after(reference, 8)
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference[first]]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[reference[second]]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=30),
    ]
    outputs = spec_llm.generate([{"prompt_token_ids": PROMPT}] * 4, params)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]
    assert got == [
        (reference[: first + 1], "stop"),
        (reference[: second + 1], "stop"),
        (reference[:7], "length"),
        (reference, "length"),
    ]


def test_stop_strings_per_row_in_one_batch(text_model_dirs):
    """A stop string ends its own row only (the engine is told to drop it); streams and
    generate agree."""
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 4}
    llm = LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    prompts = ["def f(x):\n", "for i in range(10):\n"]
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    refs = [llm.generate(p, free)[0].outputs[0] for p in prompts]
    stop = refs[0].text[6:9]
    assert stop not in refs[0].text[:6]
    stopped = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    outputs = llm.generate([prompts[0], prompts[1], prompts[0]], [stopped, free, free])
    assert outputs[0].outputs[0].text == refs[0].text[: refs[0].text.index(stop)]
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert outputs[1].outputs[0].token_ids == refs[1].token_ids
    assert outputs[2].outputs[0].token_ids == refs[0].token_ids
    assert not llm.scheduler.has_work and llm.engine.cache.lengths == [0, 0]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("stop", ["€", "1 €", "€ y", "→"])
def test_multibyte_stop_string_split_across_tokens(tokenizer_dir, stop, streaming):
    """A stop string whose characters span several byte-level tokens (the tokenizer never saw them) is
    found when the token completing its last character arrives, and the text is cut before it."""
    from transformers import AutoTokenizer

    from specdec.text import TextTracker

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "x = 1 € y → z"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split())  # the multi-byte characters are several tokens each
    tracker = TextTracker(tokenizer, (stop,), streaming=streaming)
    kept = 0
    for token in ids:
        kept += tracker.add([token])
        assert stop not in tracker.delta(final=tracker.stopped)
        if tracker.stopped:
            break
    assert tracker.stopped
    assert tracker.text == text[: text.index(stop)]
    assert stop in tokenizer.decode(ids[:kept]) and stop not in tokenizer.decode(ids[: kept - 1])
