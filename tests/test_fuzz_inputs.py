"""Fuzzing the API's inputs: every failure of SamplingParams, speculative_config and prompts is a
SpecDecError with a message, never another exception type; what is accepted generates."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters import LoadOptions, SpeculativeConfig, create_drafter

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.sampled_from(["\ud800", "€", 0, 1, 2, 64, 65, 1e-45, 2**64, -1, 0.5]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=2), SCALARS, max_size=2))


def _check_failure(exc: BaseException) -> None:
    assert isinstance(exc, SpecDecError), f"{type(exc).__name__}: {exc}"
    assert str(exc).strip() and "\n" not in str(exc)


@pytest.fixture(scope="module")
def llm(text_model_dirs):
    return LLM(text_model_dirs["target"], dtype="float64", max_num_seqs=4, max_model_len=64)


SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
                   "seed"]


@FUZZ
@given(kwargs=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), VALUES, max_size=4))
@example(kwargs={"top_k": 2**64})  # found by this test: a top_k past int64 once overflowed in the sampler
def test_fuzz_sampling_params(llm, kwargs):
    try:
        params = SamplingParams(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the point: whatever is raised must be a SpecDecError
        _check_failure(exc)
        return
    short = dataclasses.replace(params, max_tokens=min(params.max_tokens or 3, 3), min_tokens=min(params.min_tokens, 3))
    try:
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, short)[0]
    except Exception as exc:  # noqa: BLE001
        _check_failure(exc)  # e.g. stop_token_ids outside the vocabulary
        return
    assert 1 <= len(out.outputs[0].token_ids) <= 3
    assert math.isfinite(out.metrics.tokens_per_second)


SPEC_FIELDS = {
    "method": st.one_of(st.sampled_from(["ngram", "draft_model", "suffix", "lookahead", "layer_skip", "eagle",
                                         "cascade", "auto"]), VALUES),
    "num_speculative_tokens": VALUES,
    "model": st.one_of(VALUES, st.sampled_from(["DRAFT", "/no/such/folder", "./nope"])),
    "dtype": st.one_of(VALUES, st.sampled_from(["float64", "float32", "float8", "auto"])),
    "prompt_lookup_max": VALUES,
    "prompt_lookup_min": VALUES,
    "draft_vocab_size": VALUES,
    "num_candidates": VALUES,
    "early_exit": VALUES,
    "skip_layers": VALUES,
    "lookahead_window": VALUES,
    "stages": VALUES,
    "candidates": VALUES,
    "no_such_key": VALUES,
}


@FUZZ
@given(config=st.fixed_dictionaries({}, optional=SPEC_FIELDS))
def test_fuzz_speculative_config(llm, text_model_dirs, config):
    """A ``speculative_config`` dict as ``LLM`` takes it, built into a drafter over the shared target."""
    config = {key: str(text_model_dirs["draft"]) if value == "DRAFT" else value for key, value in config.items()}
    if isinstance(config.get("model"), str) and not config["model"].startswith(("/", ".")):
        config["model"] = "./" + config["model"]  # a bare name would be looked up on the hub
    options = LoadOptions(device=torch.device("cpu"), backend="auto", num_slots=2, max_model_len=64,
                          target_tokenizer=llm.tokenizer)
    try:
        create_drafter(SpeculativeConfig.from_dict(config), llm.target, options)
    except Exception as exc:  # noqa: BLE001
        _check_failure(exc)


PROMPTS = st.one_of(
    VALUES,
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udcffb", "", "x" * 200, "def f(x):"]),
    st.fixed_dictionaries({"prompt_token_ids": VALUES}, optional={"prompt": VALUES}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-5, 200), max_size=70)}),
)


@FUZZ
@given(prompts=st.one_of(PROMPTS, st.lists(PROMPTS, max_size=3)))
def test_fuzz_prompts(llm, prompts):
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
    except Exception as exc:  # noqa: BLE001
        _check_failure(exc)
        assert not llm.scheduler.has_work
        return
    assert all(1 <= len(o.outputs[0].token_ids) <= 2 for o in outputs)
