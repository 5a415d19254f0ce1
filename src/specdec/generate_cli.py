"""``specdec generate``: speculative (or plain) generation from the command line.

The ``--speculative-method`` choices are the drafter registry's methods plus ``none``; the registry
is read only when the flag is checked or help is printed, since importing the drafters imports torch.
With ``--prompts-file`` all prompts go to one batched ``LLM.generate`` call (``--stream`` streams them
one after the other).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from functools import cached_property
from pathlib import Path
from typing import Any

from specdec.cli_checks import number
from specdec.errors import SpecDecError
from specdec.jsonl import json_object, read_jsonl

PLAIN = "none"
DEFAULT_WITH_DRAFT = "draft_model"
"""The method used when a draft model is known and no --speculative-method is given."""
AUTO_CANDIDATES = ("ngram", "suffix")
"""The candidates of a composite method (auto) given by --speculative-method, beside the draft model when one
is known."""


class LazyChoices(Sequence_[str]):
    """argparse ``choices`` computed on first use (a membership check or help), not when the parser is built."""

    def __init__(self, load: Callable[[], Iterable[str]]) -> None:
        self._load = load

    @cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(self._load())

    def __getitem__(self, index):
        return self._names[index]

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def _method_names() -> list[str]:
    from specdec.drafters import DRAFTERS

    return [*DRAFTERS, PLAIN]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate a continuation of PROMPT (or of each line of --prompts-file). With no --model, "
        "the embedded default pair (a code model and its distilled draft) is used with the draft_model method.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.add_argument("--prompts-file", type=Path,
                   help="JSONL file: one object per line with 'prompt' or 'prompt_token_ids'")
    add_model_flags(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default 128)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no end-of-sequence token or stop string before this many new tokens (default 0)")
    add_penalty_flags(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed warm-up generations (the first prompt, at most 8 tokens) before the timed one, "
                   "so that tokens/s leaves out one-time costs; drafters forget what the warm-up taught them "
                   "(default 1; 0: the figure includes them)")
    p.set_defaults(func=run)


def add_penalty_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's three penalties (``specdec generate`` and ``specdec verify``; :func:`penalties_of` reads them)."""
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token the output holds (-2..2, default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per occurrence in the output (-2..2, default 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the positive logits of prompt and output tokens, multiplies the others (default 1)")


def penalties_of(args: argparse.Namespace) -> dict[str, float]:
    """The ``SamplingParams`` fields of :func:`add_penalty_flags`' flags."""
    return {"presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty}


def _k_value(text: str) -> int | str:
    """``--num-speculative-tokens``: an integer, or ``auto``."""
    from specdec.adaptive import AUTO

    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or {AUTO!r}, got {text!r}") from None


class Given(argparse.Action):
    """Stores a flag's value and notes the flag in ``namespace.given``, so that a flag the command would drop (a
    drafting setting beside ``--speculative-config``, or with plain decoding) is an error rather than ignored."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", ()) + (option_string,)


def add_model_flags(p: argparse.ArgumentParser, dtype_default: str = "auto", memory_share: bool = True) -> None:
    """The flags that build an ``LLM``: models, speculative method and its settings, dtype, device,
    backend and pool size (``specdec generate``, ``specdec verify`` and ``specdec serve``; without
    ``memory_share``, ``--gpu-memory-utilization`` is hidden from the help: the command refuses it). The flag
    names are vLLM's; ``--draft-model``, ``--draft-dtype`` and ``--k`` are the same flags under the short names
    ``specdec bench`` also takes."""
    p.add_argument("--model", help="target model folder or hub id (default: the embedded default target)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model's folder)")
    p.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                   help="draft model folder or hub id (for methods that need one, such as draft_model)")
    p.add_argument("--speculative-method", choices=LazyChoices(_method_names), metavar="METHOD",
                   help=f"drafting method: %(choices)s (default: the one the --speculative-model folder means, a "
                   f"heads folder's own method, else {DEFAULT_WITH_DRAFT}; without --model, {DEFAULT_WITH_DRAFT} "
                   f"with the embedded draft; else {PLAIN}); auto chooses per request among "
                   f"{', '.join(AUTO_CANDIDATES)} (and draft_model when a draft model is known)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="the Python API's speculative_config dict as JSON, instead of the other speculative flags "
                   "(e.g. method auto and its candidates); with no --model, a draft_model config or candidate "
                   "without a 'model' uses the embedded draft")
    p.add_argument("--num-speculative-tokens", "--k", dest="num_speculative_tokens", type=_k_value, default=4,
                   action=Given, metavar="K", help="draft tokens per step, k, or 'auto': each row's k per step from "
                   "measured acceptance and cost (default 4)")
    p.add_argument("--max-num-speculative-tokens", type=int, default=8, action=Given,
                   help="with --num-speculative-tokens auto, the largest k (default 8)")
    p.add_argument("--max-step-time-ratio", type=float, default=None, metavar="RATIO", action=Given,
                   help="with --num-speculative-tokens auto, draft only as much as keeps a step's predicted time "
                   "within RATIO plain steps (e.g. 1.1): a bound on the longest inter-token gap (default: none)")
    p.add_argument("--draft-confidence-threshold", type=float, default=None, action=Given,
                   help="draft_model: stop a row's draft before a token whose top draft probability is below this")
    p.add_argument("--prompt-lookup-max", type=int, default=3, action=Given,
                   help="longest n-gram matched by ngram (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, action=Given,
                   help="shortest n-gram matched by ngram (default 1)")
    p.add_argument("--dtype", default=dtype_default, help=f"auto, float32, bfloat16, float16 or float64 "
                   f"(default {dtype_default}: the checkpoint's dtype on a GPU; on a CPU bfloat16 for a bfloat16 "
                   "checkpoint where the CPU has bfloat16 instructions, else float32)")
    p.add_argument("--speculative-dtype", "--draft-dtype", dest="speculative_dtype", default=None, action=Given,
                   help="draft model dtype (default: the target's; float32 for a float16 target on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=("auto", "fast", "hf"), help="model backend (default auto)")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="sequences decoded at once (KV pool slots); more prompts wait for a free slot (default 16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt and output (default: the model's context window)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on a GPU (always eager on CPU)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="feed long prompts in chunks beside the running sequences' steps, within "
                   "--max-num-batched-tokens per step (default on, as vLLM)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="with chunked prefill, the most tokens one step feeds the target, decoding rows first "
                   "(default: 2048 on a GPU, 128 on a CPU, at least --max-num-seqs)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels (fast backend, CPU): a request's tokens do not depend on the batch "
                   "and greedy speculation equals plain decoding bit for bit (see docs/determinism.md)")
    add_kv_flags(p, prefix_caching_default=True)
    p.add_argument("--gpu-memory-utilization", type=number(float, 0, 1, above=True), default=None, metavar="FRACTION",
                   help=argparse.SUPPRESS if not memory_share else "instead of --kv-cache-memory, the share of the "
                   "device's memory (on a CPU, the machine's) "
                   "that the weights, the KV pools and a step take together, e.g. 0.9 (vLLM's flag); the pools get "
                   "what the loaded weights and a step leave")


def kv_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` arguments of :func:`add_kv_flags`' flags and ``--gpu-memory-utilization``."""
    return dict(kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                gpu_memory_utilization=args.gpu_memory_utilization)


def add_kv_flags(p: argparse.ArgumentParser, prefix_caching_default: bool) -> None:
    """``--kv-cache-memory`` and ``--enable-prefix-caching`` (vLLM's names; see docs/serving.md)."""
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="memory of the target's paged KV pool, e.g. 4GiB or 512MiB (default: room for "
                   "--max-num-seqs sequences of --max-model-len tokens); a draft model's pool holds as many tokens")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=prefix_caching_default,
                   help="reuse the KV blocks of earlier prompts' common prefixes (exact: the same outputs) "
                   f"(default {'on' if prefix_caching_default else 'off'})")


def speculative_config_json(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(target, speculative_config) of ``--speculative-config``; with no ``--model`` the embedded pair's
    target, and its draft for a draft_model config, candidate or stage that names no model."""
    from specdec.assets import require_default_pair

    if args.speculative_model is not None or args.speculative_method is not None:
        raise SpecDecError("give either --speculative-config or --speculative-model/--speculative-method")
    spec = json_object(args.speculative_config, "--speculative-config")
    if args.model is not None:
        return args.model, spec
    target, draft = require_default_pair()
    nested = [spec.get(name) for name in ("candidates", "stages")]  # auto's candidates, cascade's stages
    for config in [spec, *(c for configs in nested if isinstance(configs, list) for c in configs)]:
        if isinstance(config, dict) and config.get("method") == DEFAULT_WITH_DRAFT:
            config.setdefault("model", str(draft))
    return str(target), spec


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """(target, draft or None, method) from the flags and the embedded default pair."""
    from specdec.assets import require_default_pair
    from specdec.drafters import DRAFTERS
    from specdec.drafters.method_of import method_of

    if getattr(args, "speculative_config", None) is not None:
        model, spec = speculative_config_json(args)
        draft = spec.get("model")
        draft = draft if isinstance(draft, str) else None
        return model, draft, str(spec.get("method") or method_of(draft))
    model, draft, method = args.model, args.speculative_model, args.speculative_method
    kind = DRAFTERS[method] if method not in (None, PLAIN) else None
    takes_pair_draft = method is None or (kind is not None and (kind.draft_lm or kind.composite))
    if model is None:
        pair = require_default_pair()
        model = str(pair[0])
        if draft is None and takes_pair_draft:
            draft = str(pair[1])
    if method is None:  # what the draft's folder means (a heads folder's method), as a config without a method
        method = method_of(draft) if draft else PLAIN
    if method != PLAIN and DRAFTERS[method].needs_model:
        if not draft:
            raise SpecDecError(f"--speculative-method {method} needs --speculative-model "
                               f"({DRAFTERS[method].description})")
    elif method != PLAIN and DRAFTERS[method].optional_model:
        draft = args.speculative_model  # its own default (the embedded target's heads) when None
    elif method != PLAIN and DRAFTERS[method].composite:
        pass  # the draft, when known, is one of its candidates
    elif args.speculative_model is not None:
        raise SpecDecError(f"--speculative-method {method} takes no --speculative-model")
    else:
        draft = None
    return model, draft, method


def _read_prompts(args: argparse.Namespace) -> list[Any]:
    if args.prompts_file is None:
        if args.prompt is None:
            raise SpecDecError("give a PROMPT or --prompts-file")
        return [args.prompt]
    if args.prompt is not None:
        raise SpecDecError("give either a PROMPT or --prompts-file, not both")
    prompts = []
    for line, item in read_jsonl(args.prompts_file, "prompts file"):
        unknown = sorted(set(item) - {"prompt", "prompt_token_ids"})
        if unknown:  # as the Python API's prompt dicts: a setting here would be silently ignored
            raise SpecDecError(f"{args.prompts_file}:{line}: unknown key {unknown[0]!r}: a line takes 'prompt' or "
                               f"'prompt_token_ids' (sampling settings are flags, such as --max-tokens)")
        if "prompt_token_ids" in item and "prompt" in item:
            raise SpecDecError(f"{args.prompts_file}:{line}: give 'prompt' or 'prompt_token_ids', not both")
        if "prompt_token_ids" in item:
            prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
        elif isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        else:
            raise SpecDecError(f"{args.prompts_file}:{line}: expected an object with 'prompt' or 'prompt_token_ids'")
    return prompts


WARMUP_TOKENS = 8
"""Tokens of each untimed warm-up generation of ``specdec generate``."""


def _timing_note(warmup: int) -> str:
    """What the printed tokens/s includes."""
    if warmup:
        return f"after {warmup} untimed warm-up call{'s' if warmup > 1 else ''}"
    return "includes one-time warm-up costs (--warmup 0)"


def _summary(metrics, method: str, k: int, warmup: int) -> str:
    line = (f"[specdec] {metrics.num_generated_tokens} tokens in {metrics.time_total:.2f} s, "
            f"{metrics.tokens_per_second:.1f} tokens/s ({_timing_note(warmup)}), "
            f"tau {metrics.mean_acceptance_length:.2f}")
    if method != PLAIN:
        line += f", acceptance rate {metrics.acceptance_rate:.2f} ({method}, k={k})"
    return line


def warm_up(llm, prompt: Any, params, calls: int) -> None:
    """``calls`` short untimed generations of ``prompt`` (one-time costs: first allocations, kernels chosen,
    graphs captured), then the drafter forgets what they taught it (a suffix cache must not have seen the
    timed request)."""
    from dataclasses import replace

    tokens = min(params.max_tokens, WARMUP_TOKENS)
    short = replace(params, max_tokens=tokens, min_tokens=min(params.min_tokens, tokens), stop=None)
    for _ in range(calls):
        llm.generate([prompt], short)
    if llm.engine.drafter is not None:
        llm.engine.drafter.forget()


METHOD_FLAGS = {"--speculative-dtype": "dtype", "--draft-dtype": "dtype", "--prompt-lookup-max": "prompt_lookup_max",
                "--prompt-lookup-min": "prompt_lookup_min"}
"""Flags that set a field only some methods read (``Drafter.reads``): refused for the others."""


def _speculative_config(args: argparse.Namespace, draft: str | None, method: str) -> dict[str, Any] | None:
    """The ``speculative_config`` of the flags (None for plain decoding); each method (auto's candidates each) gets
    the fields it reads, and a flag that no method run reads is an error."""
    given = getattr(args, "given", ())
    if getattr(args, "speculative_config", None) is not None:
        if given:
            raise SpecDecError(f"{given[0]} does not combine with --speculative-config: give its field in the JSON")
        return speculative_config_json(args)[1]
    from specdec.drafters import DRAFTERS
    from specdec.drafters.base import methods_reading

    if method == PLAIN:
        if given:
            raise SpecDecError(f"{given[0]} sets drafting, and this runs plain decoding: give a --speculative-method "
                               "(or a --speculative-model)")
        return None
    k = args.num_speculative_tokens
    fields = {"dtype": args.speculative_dtype, "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min}
    composite = DRAFTERS[method].composite  # auto: the draft model when one is known, and the lookup methods
    names = ([DEFAULT_WITH_DRAFT] if draft else []) + list(AUTO_CANDIDATES) if composite else [method]
    for flag in given:  # a method's own setting given for methods that do not read it would change nothing
        field = METHOD_FLAGS.get(flag)
        if field is not None and not any(field in DRAFTERS[name].reads for name in names):
            raise SpecDecError(f"{flag} applies to {', '.join(methods_reading(field))}, and this runs {method}"
                               + (f" (its candidates: {', '.join(names)})" if composite else ""))
    if composite:
        fixed_k = args.max_num_speculative_tokens if k == "auto" else k
        candidates = [{"method": name, "num_speculative_tokens": fixed_k, **DRAFTERS[name].fields_read(fields),
                       **({"model": draft, "draft_confidence_threshold": args.draft_confidence_threshold}
                          if name == DEFAULT_WITH_DRAFT else {})} for name in names]
        return {"method": method, "num_speculative_tokens": k, "candidates": candidates,
                "max_num_speculative_tokens": args.max_num_speculative_tokens,
                "max_step_time_ratio": args.max_step_time_ratio}
    return {"method": method, "num_speculative_tokens": k, "model": draft, **DRAFTERS[method].fields_read(fields),
            "max_num_speculative_tokens": args.max_num_speculative_tokens,
            "draft_confidence_threshold": args.draft_confidence_threshold,
            "max_step_time_ratio": args.max_step_time_ratio}


def checked_config(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """``spec`` once it is known to be a valid speculative_config, before any model is loaded: a bad
    method, field or candidate is an error in a second, not after the weights are read."""
    from specdec.drafters.base import SpeculativeConfig

    if spec is not None:
        SpeculativeConfig.from_dict(dict(spec))
    return spec


def separator(index: int, count: int) -> str:
    """The line printed before the output of prompt ``index`` (from 1) of ``count`` in plain mode (none for one)."""
    return f"--- prompt {index}/{count} ---" if count > 1 else ""


def _stream(llm, prompts: list[Any], params, method: str, k: int, warmup: int) -> None:
    """Print each prompt's text as it is generated, one prompt after the other, with a summary line."""
    for index, prompt in enumerate(prompts, start=1):
        if len(prompts) > 1:
            print(separator(index, len(prompts)), flush=True)
        last = None
        for last in llm.stream(prompt, params):
            sys.stdout.write(last.text)
            sys.stdout.flush()
        print()
        print(_summary(last.metrics, method, k, warmup), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.llm import LLM
    from specdec.models.loader import backend_line
    from specdec.sampling import SamplingParams

    if args.stream and args.json:
        raise SpecDecError("--stream and --json do not combine: --json prints one object per prompt when it is done")
    prompts = _read_prompts(args)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed,
        min_tokens=args.min_tokens, **penalties_of(args),
    )
    if args.warmup < 0:
        raise SpecDecError(f"--warmup must be at least 0, got {args.warmup}")
    model, draft, method = _resolve_models(args)
    k = args.num_speculative_tokens
    spec = checked_config(_speculative_config(args, draft, method))
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    llm = LLM(model, tokenizer=args.tokenizer, speculative_config=spec, dtype=args.dtype, device=args.device,
              backend=args.backend, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, enable_chunked_prefill=args.enable_chunked_prefill,
              max_num_batched_tokens=args.max_num_batched_tokens,
              deterministic=args.deterministic, **kv_kwargs(args))
    llm.check_params(params)
    longest = max(len(llm.encode_prompt(p)[1]) for p in prompts)  # a bad prompt: the one line of an error, first
    print(f"[specdec] {backend_line(llm.target)}", file=sys.stderr, flush=True)
    if params.max_tokens > llm.max_model_len - longest:  # the API generates what the context leaves, as vLLM's
        print(f"[specdec] --max-tokens {params.max_tokens}: at most {llm.max_model_len - longest} tokens fit after "
              f"the {'longest ' if len(prompts) > 1 else ''}prompt in --max-model-len {llm.max_model_len}; a prompt "
              "stops there (finish_reason length)", file=sys.stderr, flush=True)
    if llm.speculative_config is not None:
        k = llm.speculative_config.num_speculative_tokens
    warm_up(llm, prompts[0], params, args.warmup)
    if args.stream and not args.json:
        _stream(llm, prompts, params, method, k, args.warmup)
        return 0
    tic = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - tic
    dtype = str(llm.target.dtype).removeprefix("torch.")
    draft_model = getattr(llm.engine.drafter, "model", None)
    draft_dtype = str(draft_model.dtype).removeprefix("torch.") if draft_model is not None else None
    for index, out in enumerate(outputs, start=1):
        if args.json:
            print(json.dumps({
                "text": out.outputs[0].text,
                "token_ids": out.outputs[0].token_ids,
                "finish_reason": out.outputs[0].finish_reason,
                "model": model,
                "speculative_model": draft,
                "method": method,
                "num_speculative_tokens": k if spec else None,
                "dtype": dtype,
                "speculative_dtype": draft_dtype,
                "metrics": out.metrics.to_dict(),
            }))
        else:
            if len(outputs) > 1:
                print(separator(index, len(outputs)))
            print(out.outputs[0].text, flush=True)
            print(_summary(out.metrics, method, k, args.warmup), file=sys.stderr)
    if len(outputs) > 1 and not args.json:
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        print(f"[specdec] {len(outputs)} prompts in one batch: {tokens} tokens in {seconds:.2f} s, "
              f"{tokens / seconds:.1f} tokens/s ({_timing_note(args.warmup)})", file=sys.stderr)
    return 0
