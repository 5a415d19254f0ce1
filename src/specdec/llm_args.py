"""The arguments of ``LLM(...)`` before anything loads: their defaults, the checks of the plain ones, and vLLM's
arguments specdec takes at the values that change nothing here (:data:`VLLM_NEUTRAL`, read by
:class:`~specdec.vllm_names.VLLMNames`)."""

from __future__ import annotations

from specdec.errors import SpecDecError
from specdec.sampling import is_seed
from specdec.vllm_names import ANY

DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_MODEL_LEN = 8192
"""Tokens per sequence when ``max_model_len`` is not given, if the model's context is longer: every
slot of a KV pool is allocated at this length, so a 128k-token config would otherwise ask for 16 x 128k
tokens of cache (256 GiB for an 8B Llama in bf16); 8192 holds a long chat turn or document prompt and
its answer (16 GiB there at 16 slots). Pass ``max_model_len`` for more."""


VLLM_NEUTRAL = {
    "tensor_parallel_size": (1,), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "trust_remote_code": (False, True), "revision": (None,), "tokenizer_revision": (None,), "code_revision": (None,),
    "tokenizer_mode": ("auto",), "skip_tokenizer_init": (False,), "quantization": (None,), "download_dir": (None,),
    "load_format": ("auto",), "kv_cache_dtype": ("auto",), "block_size": (None, 16), "cpu_offload_gb": (0, 0.0),
    "enable_lora": (False,), "distributed_executor_backend": (None,), "compilation_config": (None,),
    "hf_overrides": (None,), "swap_space": ANY, "disable_log_stats": ANY, "disable_custom_all_reduce": ANY,
    "max_seq_len_to_capture": ANY, "task": ("auto", "generate"), "runner": ("auto", "generate"),
    "logprobs_mode": ("raw_logprobs",), "generation_config": ("vllm",), "max_logprobs": ANY, "async_scheduling": ANY,
    "hf_token": ANY, "served_model_name": ANY, "limit_mm_per_prompt": ANY, "disable_chunked_mm_input": ANY,
    "mm_processor_kwargs": ANY,
}
"""vLLM's ``LLM`` arguments that specdec does not implement, with the values that change nothing here (``ANY``: every
value): given so, they are accepted (code written for vLLM runs); given otherwise, :class:`SpecDecError` names them.
``trust_remote_code`` is accepted either way: specdec never runs a checkpoint's own code; the multimodal ones too,
since no prompt here carries anything but text or token ids. ``generation_config="auto"`` (vLLM's default, sampling
defaults from the checkpoint's ``generation_config.json``) is refused: here only ``SamplingParams`` set them."""


def check_arguments(max_num_seqs: object, max_model_len: object, seed: object,
                    **flags: object) -> tuple[bool, bool]:
    """A :class:`SpecDecError` naming the first bad one of ``LLM``'s plain arguments: ``max_num_seqs`` (an integer
    >= 1), ``max_model_len`` (None or an integer >= 2), ``seed`` (None or an integer in 0..2**64-1: with None,
    requests without a seed of their own draw one from the operating system's entropy, vLLM's meaning) and the
    boolean ``flags``. Returns ``enable_chunked_prefill`` and ``enable_prefix_caching`` with None (vLLM's default
    of both) read as their default, on."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise SpecDecError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
        raise SpecDecError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
    for name in ("enable_chunked_prefill", "enable_prefix_caching"):
        flags[name] = True if flags[name] is None else flags[name]
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise SpecDecError(f"{name} must be True or False, got {flag!r}")
    if seed is not None and not is_seed(seed):
        raise SpecDecError(f"seed must be an integer in 0..2**64-1 or None, got {seed!r}")
    return flags["enable_chunked_prefill"], flags["enable_prefix_caching"]
