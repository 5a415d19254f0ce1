"""Every bad input is a clear SpecDecError (a ValueError) in the API and exit code 2 on the CLI."""

import json
import re

import pytest
import torch
from helpers import build_model

from specdec import LLM, SamplingParams, SpecDecError
from specdec.cli import main


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be None or an integer >= 1"),
        ({"top_k": -3}, "top_k must be an integer >= -1"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop has 17 strings; at most 16"),
        ({"stop": "x" * 257}, "stop has a string of 257 characters; at most 256"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(SpecDecError, match=message):
        SamplingParams(**kwargs)
    assert issubclass(SpecDecError, ValueError)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"]["target"], dtype="float64")


def test_empty_prompt(llm):
    with pytest.raises(SpecDecError, match="empty prompt"):
        llm.generate({"prompt_token_ids": []})


def test_bad_stream_prompt_raises_at_the_call_and_queues_nothing(llm):
    with pytest.raises(SpecDecError, match="empty prompt"):
        llm.stream({"prompt_token_ids": []})
    with pytest.raises(SpecDecError, match="outside the vocabulary"):
        llm.stream({"prompt_token_ids": [1, 10**6]})
    assert not llm.scheduler.has_work


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(SpecDecError, match="has no tokenizer"):
        llm.generate("hello")


def test_out_of_vocabulary_prompt(llm):
    with pytest.raises(SpecDecError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10_000]})


def test_prompt_longer_than_context(llm):
    with pytest.raises(SpecDecError, match="too long"):
        llm.generate({"prompt_token_ids": [1] * 500})


def test_vllms_neutral_sampling_fields_are_accepted_and_others_named():
    """Code written for vLLM passes fields specdec does not implement: their neutral values change nothing, any
    other value, an unknown name or too many positional arguments is a SpecDecError naming it (not the
    dataclass's bare TypeError)."""
    neutral = SamplingParams(n=1, best_of=None, presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0,
                             skip_special_tokens=True, logit_bias={}, logits_processors=(), extra_args={},
                             temperature=0.5)
    assert neutral == SamplingParams(temperature=0.5)
    # read back as the values specdec applies, as code written for vLLM reads them; clone() is vLLM's copy
    assert (neutral.n, neutral.best_of, neutral.presence_penalty, neutral.skip_special_tokens) == (1, None, 0, True)
    assert neutral.clone() == neutral and neutral.clone() is not neutral
    with pytest.raises(AttributeError, match="no attribute 'temprature'"):
        _ = neutral.temprature
    for kwargs, words in [({"best_of": 3}, "best_of is not supported by specdec: only None or 1"),
                          ({"logits_processors": [print]}, "logits_processors is not supported"),
                          ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens is not supported"),
                          ({"temprature": 1.0}, "SamplingParams has no field 'temprature'; did you mean 'temperature'"),
                          ({"xyz": 1}, "SamplingParams has no field 'xyz' (its fields: temperature, top_p"),
                          ({"guided_decoding": {"regex": "a"}}, "SamplingParams has no field 'guided_decoding' "
                                                                "(vLLM's earlier name of structured_outputs)")]:
        with pytest.raises(SpecDecError, match=re.escape(words)):
            SamplingParams(**kwargs)
    with pytest.raises(SpecDecError, match="SamplingParams takes keyword arguments only, got 1 positional"):
        SamplingParams(1)  # vLLM's first positional field is n; here it would have been temperature


def test_vllms_neutral_llm_arguments_are_accepted_and_others_named(model_dirs):
    """``LLM(...)`` and ``speculative_config`` take vLLM's arguments that change nothing here at their neutral values
    (``trust_remote_code`` either way: no checkpoint code runs); any other value, a misspelt argument or too many
    positional ones is a SpecDecError naming it (a bare ``TypeError`` before)."""
    target, draft = model_dirs["llama"]["target"], model_dirs["llama"]["same"]
    llm = LLM(target, dtype="float64", tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True,
              swap_space=16, disable_log_stats=True, quantization=None, block_size=16, task="generate",
              limit_mm_per_prompt={"image": 5}, disable_chunked_mm_input=True, max_logprobs=20, served_model_name="m",
              speculative_config={"model": str(draft), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1,
                                  "max_model_len": 4096, "quantization": None, "enforce_eager": True,
                                  "acceptance_method": "rejection_sampler"})
    assert llm.speculative_config.method == "draft_model"
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.reset_prefix_cache() is True
    for kwargs, words in [({"tensor_parallel_size": 2}, "tensor_parallel_size is not supported by specdec: only 1 "
                                                        "is accepted, got 2 (one device per LLM; `specdec serve"),
                          ({"quantization": "awq"}, "quantization is not supported by specdec: only None"),
                          ({"max_num_seq": 8}, "LLM has no argument 'max_num_seq'; did you mean 'max_num_seqs'?"),
                          ({"speculative_config": {"model": str(draft), "draft_tensor_parallel_size": 2}},
                           "speculative_config 'draft_tensor_parallel_size' is not supported by specdec: only None "
                           "or 1"),
                          ({"generation_config": "auto"}, "generation_config is not supported by specdec: only 'vllm'"),
                          ({"speculative_config": {"model": str(draft), "acceptance_method": "typical_acceptance_"
                                                   "sampler"}}, "only 'rejection_sampler' is accepted"),
                          ({"speculative_config": {"method": "suffix", "suffix_decoding_min_token_prob": 0.2}},
                           "(vLLM's 'suffix_decoding_min_token_prob': the closest here is 'suffix_min_prob')")]:
        with pytest.raises(SpecDecError, match=re.escape(words)):
            LLM(target, dtype="float64", **kwargs)
    with pytest.raises(SpecDecError, match="LLM takes at most 19 positional arguments"):
        LLM(*range(20))


def test_max_tokens_none_generates_what_the_context_leaves(llm):
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=None,
                                                                       ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == llm.max_model_len - 3 and out.finish_reason == "length"


def test_generate_takes_vllms_use_tqdm_and_refuses_a_lora_request(llm, capsys):
    outputs = llm.generate([{"prompt_token_ids": [1, 2]}] * 3, SamplingParams(max_tokens=2), use_tqdm=True)
    assert len(outputs) == 3 and "Processed prompts: 100%" in capsys.readouterr().err
    with pytest.raises(SpecDecError, match="lora_request is not supported by specdec"):
        llm.generate({"prompt_token_ids": [1, 2]}, lora_request=object())
    with pytest.raises(SpecDecError, match="use_tqdm must be True, False or a tqdm-like class"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm="yes")
    made = []

    class Bar:  # vLLM's use_tqdm also takes the class to build the bar with
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.n = 0

        def update(self, count):
            self.n += count

        def close(self):
            made.append(self.n)

    assert len(llm.generate([{"prompt_token_ids": [1, 2]}] * 2, SamplingParams(max_tokens=2), use_tqdm=Bar)) == 2
    assert made[0]["total"] == 2 and made[-1] == 2
    made.clear()  # with n > 1 the bar counts prompts, each done when its n outputs are
    assert len(llm.generate([{"prompt_token_ids": [1, 2]}] * 2, SamplingParams(max_tokens=2, n=3), use_tqdm=Bar)) == 2
    assert made[0]["total"] == 2 and made[-1] == 2


def test_sampling_params_count_mismatch(llm):
    with pytest.raises(SpecDecError, match="got 2 sampling_params for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1, 2]}], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("value", [0, -1, 2.5, "4", None, True])
def test_bad_max_num_seqs(model_dirs, value):
    with pytest.raises(SpecDecError, match=re.escape(f"max_num_seqs must be an integer >= 1, got {value!r}")):
        LLM(model_dirs["llama"]["target"], max_num_seqs=value)


@pytest.mark.parametrize("value", [1, 0, 16.0, "32"])
def test_bad_max_model_len(model_dirs, value):
    with pytest.raises(SpecDecError, match="max_model_len must be an integer >= 2"):
        LLM(model_dirs["llama"]["target"], max_model_len=value)


def test_max_model_len_beyond_the_context_window(model_dirs):
    window = json.loads((model_dirs["llama"]["target"] / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(SpecDecError, match=f"max_model_len {window + 1} is larger than the context window of "
                                           f".*target.* \\({window} tokens\\)"):
        LLM(model_dirs["llama"]["target"], max_model_len=window + 1)
    assert LLM(model_dirs["llama"]["target"], max_model_len=window).max_model_len == window


def test_prompt_longer_than_max_model_len(model_dirs):
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_model_len=32)
    with pytest.raises(SpecDecError, match="prompt of 40 tokens is too long: max_model_len is 32"):
        llm.generate({"prompt_token_ids": [1] * 40})
    with pytest.raises(SpecDecError, match="prompt of 32 tokens is too long"):
        llm.generate({"prompt_token_ids": [1] * 32})  # no room left for one output token
    # One token short of the limit: exactly one token comes out, cut by max_model_len.
    out = llm.generate({"prompt_token_ids": [1] * 31}, SamplingParams(temperature=0, max_tokens=10))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    # A bad prompt in a batch fails the whole call before anything is queued.
    with pytest.raises(SpecDecError, match="prompt of 40 tokens is too long"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1] * 40}])
    assert not llm.scheduler.has_work


def test_aborting_an_unknown_request_is_a_no_op(llm):
    assert llm.abort("no-such-request") is None
    assert llm.scheduler.abort("no-such-request") is False
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3
    llm.abort(out.request_id)  # finished: also a no-op
    assert not llm.scheduler.has_work
    running = llm.submit({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(SpecDecError, match="request_id must be a string"):  # was a TypeError while one ran
        llm.abort(["x"])
    llm.abort(running.seq.request_id)
    assert not llm.scheduler.has_work


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_an_integer_past_floats_range_is_a_bad_value(field):
    with pytest.raises(SpecDecError, match=field):  # was an OverflowError
        SamplingParams(**{field: 10**400})


def test_a_folder_without_tokenizer_files_has_no_tokenizer(tmp_path):
    """transformers builds an empty tokenizer from such a folder for GPT-2: "hello" became one unknown token or
    "an empty prompt"; the folder now has no tokenizer, and a text prompt says to pass token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tokenizer is None
    with pytest.raises(SpecDecError, match="has no tokenizer: pass prompts as"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    assert len(llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_more_prompts_than_slots_are_queued(model_dirs):
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompts = [{"prompt_token_ids": [i + 1, i + 2, i + 1]} for i in range(5)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in prompts]
    assert all(len(o.outputs[0].token_ids) == 4 and o.finished for o in outputs)
    assert llm.batch_metrics.mean_batch_size == 1.0


@pytest.mark.parametrize("k", [0, 65, -1])
def test_num_speculative_tokens_out_of_range(model_dirs, k):
    with pytest.raises(SpecDecError, match="num_speculative_tokens must be an integer in 1..64"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "ngram", "num_speculative_tokens": k})


def test_unknown_method(model_dirs):
    with pytest.raises(SpecDecError, match="unknown speculative method 'medusa-ish'"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "medusa-ish"})


def test_unknown_config_key(model_dirs):
    with pytest.raises(SpecDecError, match="unknown speculative_config keys"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "ngram", "lookahead": 3})


def test_draft_model_without_model(model_dirs):
    with pytest.raises(SpecDecError, match="needs a draft 'model'"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "draft_model"})


def test_bad_ngram_bounds(model_dirs):
    with pytest.raises(SpecDecError, match="prompt_lookup_min <= prompt_lookup_max"):
        LLM(model_dirs["llama"]["target"],
            speculative_config={"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    alone = LLM(model_dirs["llama"]["target"], dtype="float64",  # a minimum alone: vLLM takes it as the maximum too
                speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5})
    assert (alone.speculative_config.prompt_lookup_min, alone.speculative_config.prompt_lookup_max) == (5, 5)


def test_draft_with_different_vocabulary(model_dirs, tmp_path):
    build_model("llama", seed=5, vocab=80).save_pretrained(tmp_path / "draft")
    spec = {"method": "draft_model", "model": str(tmp_path / "draft")}
    with pytest.raises(SpecDecError, match="must share a vocabulary"):
        LLM(model_dirs["llama"]["target"], speculative_config=spec)


def test_missing_model_folder(tmp_path):
    with pytest.raises(SpecDecError, match="does not exist"):
        LLM(tmp_path / "no-such-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(SpecDecError, match="has no config.json"):
        LLM(tmp_path)


def test_sliding_window_runs_on_both_backends(tmp_path):
    """A sliding-window cache used to be refused; it now runs on the fast backend (a window mask over the
    slot, picked by auto) and through transformers' forward (the cache kept whole), the window crossed and
    the output equal to transformers' own on both."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0,
                         bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    model.save_pretrained(tmp_path / "sliding")
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 10:].tolist()
    for backend, kind in (("auto", "FastLlamaLM"), ("hf", "HFCausalLM")):
        llm = LLM(tmp_path / "sliding", dtype="float64", backend=backend)
        assert type(llm.target).__name__ == kind
        out = llm.generate({"prompt_token_ids": prompt[0].tolist()}, SamplingParams(temperature=0, max_tokens=12))
        assert out[0].outputs[0].token_ids == expected, backend


def test_unknown_dtype_device_backend(model_dirs):
    target = model_dirs["llama"]["target"]
    with pytest.raises(SpecDecError, match="unknown dtype"):
        LLM(target, dtype="float8")
    with pytest.raises(SpecDecError, match="unknown backend"):
        LLM(target, backend="turbo")
    with pytest.raises(SpecDecError, match="unknown device"):
        LLM(target, device="toaster")


def test_vllms_dtype_names(model_dirs):
    """vLLM's (and torch's) other names of the dtypes: ``half``, ``float``, ``double``."""
    target = model_dirs["llama"]["target"]
    for name, dtype in (("half", torch.float16), ("float", torch.float32), ("double", torch.float64)):
        assert LLM(target, dtype=name, max_num_seqs=1, max_model_len=32).target.dtype == dtype


CLI_CASES = [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in"),
    (["--min-p", "2"], "min_p must be in"),
    (["--max-tokens", "0"], "max_tokens must be None or an integer >= 1"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens must be"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "65"], "num_speculative_tokens must be"),
    (["--speculative-method", "draft_model"], "needs --speculative-model"),
]


@pytest.mark.parametrize("flags,message", CLI_CASES)
def test_cli_bad_flags_exit_2_with_one_line(model_dirs, capsys, flags, message):
    prompt_file = model_dirs["llama"]["target"].parent / "prompt.jsonl"
    prompt_file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    code = main(["generate", "--prompts-file", str(prompt_file), "--model", str(model_dirs["llama"]["target"]),
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_missing_model_and_empty_prompt(model_dirs, capsys, tmp_path):
    assert main(["generate", "hi", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt_token_ids": []}\n')
    assert main(["generate", "--prompts-file", str(empty), "--model", str(model_dirs["llama"]["target"])]) == 2
    assert "empty prompt" in capsys.readouterr().err
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text("{nope\n")
    assert main(["generate", "--prompts-file", str(bad_json), "--model", str(model_dirs["llama"]["target"])]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_unknown_method_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--speculative-method", "magic"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------- issue 13: inputs that used to escape
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seed": 2**64}, "seed must be None or an integer in 0..2"),
        ({"seed": -1}, "seed must be None or an integer in 0..2"),
        ({"seed": True}, "seed must be None or an integer"),
        ({"temperature": True}, "temperature must be a finite number"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"max_tokens": True}, "max_tokens must be None or an integer"),
        ({"top_p": "0.5"}, "top_p must be in"),
        ({"min_p": None}, "min_p must be in"),
        ({"top_p": float("nan")}, "top_p must be in"),
        ({"stop": 5}, "stop must be a list of strings"),
        ({"stop": [1]}, "stop must be a list of strings"),
        ({"stop": "\ud800"}, "stop string is not valid UTF-8"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of integers"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be non-negative integers"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ],
)
def test_bad_sampling_params_escaping_before(kwargs, message):
    with pytest.raises(SpecDecError, match=message):
        SamplingParams(**kwargs)


def test_a_tiny_temperature_is_greedy(llm):
    greedy = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=6))[0]
    for temperature in (1e-45, 1e-300, 5e-6):
        params = SamplingParams(temperature=temperature, max_tokens=6, seed=3)
        assert params.greedy
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0]
        assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert not SamplingParams(temperature=1e-4).greedy


def test_sampling_params_are_immutable_and_replace_revalidates():
    import dataclasses

    params = SamplingParams(stop=["a"], stop_token_ids=[3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.stop = ["b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0
    assert dataclasses.replace(params, stop="b").stop_strings == ("b",)
    with pytest.raises(SpecDecError, match="temperature must be >= 0"):
        dataclasses.replace(params, temperature=-1.0)
    assert params.stop == ("a",) and params.stop_token_ids == (3,)


def test_bool_prompt_token_ids_are_rejected(llm):
    with pytest.raises(SpecDecError, match="prompt_token_ids must be a list of integers"):
        llm.generate({"prompt_token_ids": [True, 2]})


def test_prompt_token_ids_from_numpy_and_torch(llm):
    """Token ids as tokenizers and array code hold them (NumPy and torch integers, 1-D arrays) are the same
    prompt as a list of ints; floats, nested lists and a tokenizer's whole output are refused by what they are."""
    import numpy as np
    from transformers import BatchEncoding

    params = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate({"prompt_token_ids": [3, 5, 7]}, params)[0].outputs[0].token_ids
    for ids in (np.array([3, 5, 7]), torch.tensor([3, 5, 7]), [np.int64(3), np.int32(5), 7], (3, 5, 7)):
        out = llm.generate({"prompt_token_ids": ids}, params)[0]
        assert out.prompt_token_ids == [3, 5, 7] and out.outputs[0].token_ids == want
        assert all(type(t) is int for t in out.prompt_token_ids)
    for ids, got in ((np.array([3.0, 5.0]), "float 3.0"), ([[3, 5]], "list [3, 5]"), (torch.tensor([[3, 5]]), "Tensor"),
                     (BatchEncoding({"input_ids": [3, 5]}), "BatchEncoding: pass its ['input_ids']")):
        with pytest.raises(SpecDecError, match=re.escape(got)):
            llm.generate({"prompt_token_ids": ids}, params)


def test_lone_surrogates_in_a_prompt(text_model_dirs):
    llm = LLM(text_model_dirs["target"], dtype="float64")
    for prompt in ("\ud800", "abc\udcff"):
        with pytest.raises(SpecDecError, match="prompt is not valid UTF-8 text: lone surrogate"):
            llm.generate(prompt)
    with pytest.raises(SpecDecError, match="'prompt' must be a string"):
        llm.generate({"prompt": 5, "prompt_token_ids": [1, 2]})


@pytest.mark.parametrize(
    "prompts,params,message",
    [
        (None, None, "prompts must be a prompt or a list of prompts"),
        (5, None, "prompts must be a prompt or a list of prompts"),
        ([{"prompt_token_ids": [1]}], [{"temperature": 0}], "sampling_params must be SamplingParams"),
        ([{"prompt_token_ids": [1]}], {"temperature": 0}, "sampling_params must be SamplingParams"),
        ([{"prompt_token_ids": [1]}], 0.5, "sampling_params must be SamplingParams"),
        ([{"prompt_token_ids": [1]}], SamplingParams(stop_token_ids=[10_000]), "stop_token_ids .* outside the voc"),
    ],
)
def test_bad_generate_arguments(llm, prompts, params, message):
    with pytest.raises(SpecDecError, match=message):
        llm.generate(prompts, params)
    assert not llm.scheduler.has_work


def test_none_in_the_sampling_params_list_means_the_defaults(llm):
    out = llm.generate([{"prompt_token_ids": [1, 2]}], [None])
    assert len(out[0].outputs[0].token_ids) == SamplingParams().max_tokens


def test_out_of_vocabulary_stop_token_in_a_stream(llm):
    with pytest.raises(SpecDecError, match="outside the vocabulary"):
        llm.stream({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[96]))


def test_submit_checks_params_as_generate_does(llm):
    """A serving loop's ``submit`` runs the same checks as ``generate`` (it once skipped them)."""
    with pytest.raises(SpecDecError, match="outside the vocabulary"):
        llm.submit({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[96]))
    with pytest.raises(SpecDecError, match="sampling_params must be SamplingParams"):
        llm.submit({"prompt_token_ids": [1, 2]}, {"temperature": 0})
    assert not llm.scheduler.has_work


@pytest.mark.parametrize(
    "config,message",
    [
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram", "prompt_lookup_max": True}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"method": "ngram", "prompt_lookup_max": 10**7}, "prompt_lookup_max <= 32"),
        ({"method": "ngram", "model": "some/draft"}, "'ngram' takes no 'model'"),
        ({"method": ["ngram"]}, "unknown speculative method"),
    ],
)
def test_bad_speculative_config_escaping_before(model_dirs, config, message):
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], speculative_config=config)


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"hidden_size": "big"}, "hidden_size"),
        ({"vocab_size": -5}, "vocab_size=-5; it must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ],
)
def test_broken_draft_config(model_dirs, tmp_path, patch, message):
    draft = tmp_path / "draft"
    build_model("llama", seed=5, layers=1).save_pretrained(draft)
    config = json.loads((draft / "config.json").read_text())
    config.update(patch)
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecError, match=message):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "draft_model", "model": str(draft)})


def test_truncated_weights(model_dirs, tmp_path):
    draft = tmp_path / "draft"
    build_model("llama", seed=5, layers=1).save_pretrained(draft)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecDecError, match="could not load model"):
        LLM(model_dirs["llama"]["target"], speculative_config={"method": "draft_model", "model": str(draft)})
    (draft / "config.json").write_text("{nope")
    with pytest.raises(SpecDecError, match="could not load the config"):
        LLM(draft)


def test_head_methods_name_the_head_folder_they_need(model_dirs, capsys):
    """eagle3 without a folder asked for a head, not for the embedded draft model (which it was given and refused as
    "not an EAGLE-3 head"); medusa given a model folder says it holds no heads (it said 'num_heads' must be a
    positive integer)."""
    assert main(["generate", "x", "--speculative-method", "eagle3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--speculative-method eagle3 needs --speculative-model (EAGLE-3" in err[0]
    target = str(model_dirs["llama"]["target"])
    prompt_file = model_dirs["llama"]["target"].parent / "prompt.jsonl"
    prompt_file.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    assert main(["generate", "--prompts-file", str(prompt_file), "--model", target, "--speculative-method", "medusa",
                 "--speculative-model", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no Medusa heads" in err[0]


def test_vllms_none_defaults(model_dirs):
    """vLLM's defaults spelt out: ``seed=None`` (requests without a seed draw one from the OS), and None for
    ``enable_chunked_prefill`` and ``enable_prefix_caching`` (their defaults, on)."""
    target = model_dirs["llama"]["target"]
    params = SamplingParams(temperature=1.0, max_tokens=24)
    prompt = {"prompt_token_ids": [3, 5, 7]}

    def sample(seed):
        llm = LLM(target, dtype="float64", seed=seed, enable_chunked_prefill=None, enable_prefix_caching=None)
        assert llm.engine.cache.caches_prefixes
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    assert sample(0) == sample(0)
    assert sample(None) != sample(None)  # 24 draws from the tiny model's broad distribution
    with pytest.raises(SpecDecError, match="seed must be an integer in 0..2\\*\\*64-1 or None"):
        LLM(target, seed=-1)
