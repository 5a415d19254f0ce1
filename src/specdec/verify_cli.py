"""``specdec verify``: checks a speculative configuration's losslessness on the user's own models.

Same model and speculative flags as ``specdec generate`` (no ``--model``: the embedded pair).
Greedy equality against plain decoding on N prompts (rounding ties told apart from mismatches),
then a chi-square test of the first two sampled tokens on a few prompts; prints the numbers and a
verdict, and exits 0 on pass, 1 on fail (2 on bad input, as every command).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from specdec.errors import SpecDecError
from specdec.generate_cli import (
    PLAIN,
    _resolve_models,
    _speculative_config,
    add_model_flags,
    add_penalty_flags,
    checked_config,
    penalties_of,
)
from specdec.jsonl import read_jsonl

PROMPTS = [
    "def quicksort(arr):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef walk(path):",
    "The capital of France is", "for i in range(10):", "def parse(line):\n    \"\"\"Parse one line.",
    "Once upon a time", "SELECT name FROM users WHERE",
]
"""Default greedy prompts (a model without a tokenizer gets random token ids instead)."""

MAX_TOP_K = 64
"""Largest ``--top-k`` of the sampling test. Its k² outcomes are enumerated (one target forward per first
token, k² products); outcomes expected fewer than 5 times (``MIN_EXPECTED``) are pooled into one cell, so
64² = 4096 outcomes already need 20,480 samples per prompt (20x the default) before the rarest can be tested on
their own: a larger k only adds outcomes to the pooled cell, not power, at a cost that grows as k² (k = 8192
took minutes)."""

MAX_SEED = 2**32 - 1
"""Largest ``--seed``: request ``i`` of sampling prompt ``j`` gets seed ``(seed + j) * 1_000_003 + i``, which
stays far within the 64-bit seeds of :class:`~specdec.sampling.SamplingParams`."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify", help="check that a speculative configuration is lossless on your models",
        description="Compare a speculative configuration with plain decoding of the same target: greedy outputs "
        "of N prompts must be identical (at a first difference the target's logit gap tells a rounding tie from "
        "a mismatch), and the first two sampled tokens of many seeded requests on a few prompts must follow the "
        "target's exact top-k distribution (chi-square). Exits 0 on pass, 1 on fail. With no --model, the "
        "embedded default pair. The dtype defaults to the one specdec generate runs (auto), so the check covers "
        "what users run; --dtype float64 on a small model removes rounding ties altogether.",
    )
    add_model_flags(p, memory_share=False)
    p.add_argument("--prompts-file", type=Path, help="JSONL with 'prompt' or 'prompt_token_ids' (default: built in)")
    p.add_argument("--num-prompts", type=int, default=8, help="greedy prompts (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--sampling-prompts", type=int, default=2,
                   help="prompts of the sampling test, the first ones (default 2; 0 skips it)")
    p.add_argument("--samples", type=int, default=1000, help="seeded requests per sampling prompt (default 1000)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling test temperature, above 0 (default 1.0)")
    p.add_argument("--top-k", type=int, default=8,
                   help=f"sampling test top-k: k² outcomes enumerated (default 8, at most {MAX_TOP_K})")
    p.add_argument("--significance", type=float, default=1e-3,
                   help="a sampling prompt fails when its chi-square p-value is below this (default 0.001)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled requests (default 0)")
    add_penalty_flags(p)  # both checks run with them; the reference adjusts the target's logits alike
    p.set_defaults(func=run)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens),
                        ("--samples", args.samples), ("--top-k", args.top_k)):
        if value < 1:
            raise SpecDecError(f"{flag} must be at least 1, got {value}")
    if args.sampling_prompts < 0:
        raise SpecDecError(f"--sampling-prompts must be at least 0, got {args.sampling_prompts}")
    if args.sampling_prompts > args.num_prompts:
        raise SpecDecError(f"--sampling-prompts {args.sampling_prompts} is more than --num-prompts "
                           f"{args.num_prompts}: the sampling test takes the first of the greedy prompts")
    if not 0 < args.significance < 1:
        raise SpecDecError(f"--significance must be in (0, 1), got {args.significance}")
    if args.top_k > MAX_TOP_K:
        raise SpecDecError(f"--top-k must be at most {MAX_TOP_K}: the sampling test enumerates k² outcomes, and "
                           f"beyond {MAX_TOP_K ** 2} its chi-square test only pools the rare ones, at a cost that "
                           f"grows as k²; got {args.top_k}")
    if not 0 <= args.seed <= MAX_SEED:
        raise SpecDecError(f"--seed must be an integer in 0..2**32-1, got {args.seed}")
    if args.sampling_prompts and args.temperature == 0:
        raise SpecDecError("--temperature 0 is greedy: the sampling test would have a single outcome and could not "
                           "fail; give a temperature above 0, or --sampling-prompts 0 to run the greedy check alone")
    if args.sampling_prompts and not 0 < args.temperature < math.inf:
        raise SpecDecError(f"--temperature must be a finite number above 0, got {args.temperature}")
    if args.gpu_memory_utilization is not None:
        raise SpecDecError("--gpu-memory-utilization: verify runs two LLMs side by side (plain decoding and the "
                           "method), and the first would take the share; size each pool with --kv-cache-memory")


def _prompts(args: argparse.Namespace, llm) -> list[list[int]]:
    """Token ids of the greedy prompts: the file's, the built-in ones, or random ids without a tokenizer."""
    if args.prompts_file is not None:
        items = [item.get("prompt_token_ids", item.get("prompt")) for _, item in
                 read_jsonl(args.prompts_file, "prompts file")]
        prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in items]
    elif llm.tokenizer is None:
        rng = random.Random(args.seed)
        prompts = [{"prompt_token_ids": [rng.randrange(llm.target.vocab_size) for _ in range(8)]}
                   for _ in range(args.num_prompts)]
    else:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    return [llm.encode_prompt(p)[1] for p in prompts[: args.num_prompts]]


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.llm import LLM
    from specdec.lossless_check import greedy_equality, sampling_exactness
    from specdec.models.loader import load_hf_model, load_tokenizer, resolve_device
    from specdec.sampling import SamplingParams

    _check_flags(args)
    penalties = {name: value for name, value in penalties_of(args).items()
                 if value != SamplingParams.__dataclass_fields__[name].default}
    SamplingParams(**penalties)  # bad values are a SpecDecError before anything loads
    model, draft, method = _resolve_models(args)
    spec = checked_config(_speculative_config(args, draft, method))
    if spec is None:
        raise SpecDecError(f"--speculative-method {PLAIN} is plain decoding: nothing to verify")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    device = resolve_device(args.device)
    target, _ = load_hf_model(model, args.dtype, device)  # one copy of the weights for both LLMs
    tokenizer = args.tokenizer or (model if load_tokenizer(model, required=False) is not None else None)

    def llm(config):
        return LLM(target, tokenizer=tokenizer, speculative_config=config, dtype=target.dtype,
                   device=device, backend=args.backend, max_num_seqs=args.max_num_seqs,
                   max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                   enable_chunked_prefill=args.enable_chunked_prefill,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                   deterministic=args.deterministic)

    reference, candidate = llm(None), llm(spec)
    print(f"specdec verify: target {model}, {method}, k={candidate.speculative_config.num_speculative_tokens}"
          + (f", draft {draft}" if draft else "") + f", {str(target.dtype).removeprefix('torch.')} on {device}"
          + "".join(f", {name.replace('_', ' ')} {value:g}" for name, value in penalties.items()), flush=True)
    prompts = _prompts(args, reference)
    if len(prompts) < args.sampling_prompts:
        raise SpecDecError(f"--sampling-prompts {args.sampling_prompts} is more than the {len(prompts)} prompts of "
                           f"{args.prompts_file}: the sampling test takes the first of the greedy prompts")
    print(f"greedy: generating {len(prompts)} prompts x {args.max_tokens} tokens, plain and speculative ...",
          flush=True)
    verdicts = greedy_equality(reference, candidate, prompts, args.max_tokens, penalties)
    ties = [(i, v) for i, v in enumerate(verdicts) if v.kind == "tie"]
    mismatches = [(i, v) for i, v in enumerate(verdicts) if v.kind == "mismatch"]
    print(f"greedy: {len(prompts)} prompts x {args.max_tokens} tokens, one batch: "
          f"{len(verdicts) - len(ties) - len(mismatches)} identical, {len(ties)} rounding ties, "
          f"{len(mismatches)} mismatches", flush=True)
    for i, v in ties + mismatches:
        top2 = f", target top-2 gap {v.top2_gap:.4g}" if v.top2_gap is not None else ""
        print(f"  prompt {i}: {v.describe()}{top2}", flush=True)
    failed = bool(mismatches)
    if args.sampling_prompts:
        print(f"sampling: first 2 tokens, temperature {args.temperature}, top-k {args.top_k}, {args.samples} "
              f"seeded requests per prompt, fail below p = {args.significance:g}; one line per prompt as it "
              "finishes", flush=True)
    for i, prompt in enumerate(prompts[: args.sampling_prompts]):
        check = sampling_exactness(reference, candidate, prompt, args.temperature, args.top_k, args.samples,
                                   args.seed + i, penalties)
        ok = check.pvalue >= args.significance
        failed |= not ok
        impossible = f", {check.impossible} samples the target cannot produce" if check.impossible else ""
        print(f"  prompt {i}: chi-square {check.statistic:.1f} on {check.dof} dof ({check.cells} outcomes), "
              f"p = {check.pvalue:.3g}{impossible}: {'ok' if ok else 'FAIL'}", flush=True)
    print(f"verdict: {'FAIL' if failed else 'PASS'}")
    return 1 if failed else 0
