"""Stop tokens, EOS, stop strings and max_tokens end generation exactly, also inside an accepted run."""

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
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


def test_stop_token_text_is_left_out_unless_included(text_model_dirs):
    """As in vLLM v1: the text of the stop token (a ``stop_token_ids`` token; end-of-sequence decodes to nothing)
    that ended an output is not in its text, and is among its token ids; ``include_stop_str_in_output`` keeps it
    in the text, and keeps a stop string too. Streamed or not, speculative or not."""
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 8}
    llm = LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64")
    decode = llm.tokenizer.decode
    prompt = "def f(x):\n"
    reference = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    ids = reference.token_ids
    stop_at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and decode([ids[i]]).strip())
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[stop_at]],
                                include_stop_str_in_output=include)
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.token_ids == ids[: stop_at + 1] and (out.finish_reason, out.stop_reason) == ("stop", ids[stop_at])
        expected = decode(ids[: stop_at + 1] if include else ids[:stop_at])
        assert out.text == expected
        streamed = list(llm.stream(prompt, params))
        assert "".join(piece.text for piece in streamed) == expected
        assert [t for piece in streamed for t in piece.token_ids] == out.token_ids
    stop = reference.text[8:11]
    cut = reference.text.index(stop) + len(stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert (out.text, out.stop_reason) == (reference.text[:cut], stop)
    assert "".join(piece.text for piece in llm.stream(prompt, params)) == reference.text[:cut]


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


class ByteChunks:
    """A tokenizer whose tokens are the given byte strings: ``decode`` joins them and decodes UTF-8 with
    U+FFFD for incomplete characters, as byte-level tokenizers do."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


def cut_at_first_stop(decode, ids: list[int], stops: tuple[str, ...], include: bool = False) -> tuple[str, int]:
    """The reference, by brute force: the text of the shortest token prefix whose decoded text holds a
    stop string, cut where the first one starts (``include``: where it ends)."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if found:
            start, stop = min(found)
            return text[: start + len(stop) if include else start], k
    return decode(ids), len(ids)


def run_tracker(tokenizer, ids: list[int], steps: list[int], stops: tuple[str, ...], streaming: bool,
                include: bool = False):
    """Feed ``ids`` in steps of the given sizes; (streamed text, final text, tokens kept). Asserts that
    what was streamed so far is always a prefix of the final text."""
    from specdec.text import TextTracker

    tracker = TextTracker(tokenizer, stops, streaming=streaming, include_stop=include)
    streamed, kept, start = "", 0, 0
    partial = []
    for size in steps:
        group = ids[start : start + size]
        start += size
        if not group:
            break
        kept += tracker.add(group)
        final = tracker.stopped or start >= len(ids)
        piece = tracker.delta(final=final) if streaming else ""
        streamed += piece
        partial.append(streamed)
        if final:
            break
    text = tracker.finish()
    assert all(text.startswith(p) for p in partial), (partial, text)
    return streamed, text, kept


ALPHABET = st.sampled_from(["a", "b", " ", "\n", "é", "ß", "中", "文", "€", "→", "🙂", "👨", "\u200d", "👩", "👧",
                            "𝄞"])
MULTIBYTE_TEXT = st.lists(ALPHABET, min_size=1, max_size=14).map("".join)


@st.composite
def text_splits_and_stops(draw):
    text = draw(MULTIBYTE_TEXT)
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=len(data) - 1))) if len(data) > 1 else []
    bounds = [0, *cuts, len(data)]
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:])]

    def substring():
        i = draw(st.integers(0, len(text) - 1))
        return text[i : i + draw(st.integers(1, 4))]

    stops = tuple(draw(st.lists(st.one_of(st.builds(substring), MULTIBYTE_TEXT.map(lambda s: s[:4])),
                                min_size=1, max_size=3)))
    steps = draw(st.lists(st.integers(1, 4), min_size=len(chunks), max_size=len(chunks)))
    return text, chunks, stops, steps


@settings(max_examples=400, deadline=None)
@given(case=text_splits_and_stops())
@example(case=("a🙂🙂b", [b"a", *[bytes([c]) for c in "🙂🙂".encode()], b"b"], ("🙂🙂",), [1] * 10))
@example(case=("x中文y", [bytes([c]) for c in "x中文y".encode()], ("中文",), [1] * 8))
@example(case=("ab🙂c", [b"a", b"b", *[bytes([c]) for c in "🙂".encode()], b"c"], ("ab🙂",), [1] * 7))
def test_streamed_text_equals_text_cut_at_the_first_stop(case):
    """Random multi-byte texts split into tokens at random bytes (mid-character included), random stop
    strings, random tokens per step: the streamed deltas, the non-streamed text and the brute-force
    reference agree, and the tokens kept end with the one that completed the stop string; with
    ``include_stop`` the text ends with that stop string."""
    text, chunks, stops, steps = case
    tokenizer = ByteChunks(chunks)
    ids = list(range(len(chunks)))
    for include in (False, True):
        expected, expected_kept = cut_at_first_stop(tokenizer.decode, ids, stops, include)
        streamed, final, kept = run_tracker(tokenizer, ids, steps, stops, streaming=True, include=include)
        _, not_streamed, kept_not_streamed = run_tracker(tokenizer, ids, steps, stops, streaming=False,
                                                         include=include)
        assert streamed == final == not_streamed == expected
        assert kept == kept_not_streamed == expected_kept


@settings(max_examples=150, deadline=None)
@given(text=MULTIBYTE_TEXT, data=st.data())
def test_stops_with_a_real_byte_level_tokenizer(tokenizer_dir, text, data):
    """The same property through the test suite's byte-level BPE tokenizer (its own token splits)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(text)["input_ids"]
    i = data.draw(st.integers(0, len(text) - 1))
    stops = (text[i : i + data.draw(st.integers(1, 3))], *data.draw(st.lists(MULTIBYTE_TEXT, max_size=2)))
    steps = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))

    def decode(prefix):
        return tokenizer.decode(prefix, skip_special_tokens=True)

    expected, expected_kept = cut_at_first_stop(decode, ids, stops)
    streamed, final, kept = run_tracker(tokenizer, ids, steps, stops, streaming=True)
    _, not_streamed, _ = run_tracker(tokenizer, ids, steps, stops, streaming=False)
    assert streamed == final == not_streamed == expected
    assert kept == expected_kept

