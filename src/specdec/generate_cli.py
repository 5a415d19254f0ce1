"""``specdec generate``: speculative (or plain) generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError
from specdec.jsonl import read_jsonl

METHODS = ("draft_model", "ngram", "none")


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
    p.add_argument("--model", help="target model folder or hub id (default: the embedded default target)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model's folder)")
    p.add_argument("--speculative-model", help="draft model folder or hub id (method draft_model)")
    p.add_argument("--speculative-method", choices=METHODS, help="drafting method (default: draft_model when a "
                   "draft model is known, else none)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens per step, k (default 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram matched by ngram (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched by ngram (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default 128)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    p.add_argument("--speculative-dtype", default=None,
                   help="draft model dtype (default: the target's; float32 for a bf16/fp16 target on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=("auto", "fast", "hf"), help="model backend (default auto)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """(target, draft or None, method) from the flags and the embedded default pair."""
    from specdec.assets import require_default_pair

    model, draft, method = args.model, args.speculative_model, args.speculative_method
    if model is None:
        pair = require_default_pair()
        model = str(pair[0])
        if draft is None and method in (None, "draft_model"):
            draft = str(pair[1])
    if method is None:
        method = "draft_model" if draft else "none"
    if method == "draft_model" and not draft:
        raise SpecDecError("--speculative-method draft_model needs --speculative-model")
    if method != "draft_model":
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
    for number, item in read_jsonl(args.prompts_file, "prompts file"):
        if "prompt_token_ids" in item:
            prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
        elif isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        else:
            raise SpecDecError(f"{args.prompts_file}:{number}: expected an object with 'prompt' or 'prompt_token_ids'")
    return prompts


def _summary(metrics, method: str, k: int) -> str:
    line = (f"[specdec] {metrics.num_generated_tokens} tokens in {metrics.time_total:.2f} s, "
            f"{metrics.tokens_per_second:.1f} tokens/s, tau {metrics.mean_acceptance_length:.2f}")
    if method != "none":
        line += f", acceptance rate {metrics.acceptance_rate:.2f} ({method}, k={k})"
    return line


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.llm import LLM
    from specdec.sampling import SamplingParams

    prompts = _read_prompts(args)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed,
    )
    model, draft, method = _resolve_models(args)
    k = args.num_speculative_tokens
    spec = None
    if method == "draft_model":
        spec = {"method": method, "model": draft, "num_speculative_tokens": k, "dtype": args.speculative_dtype}
    elif method == "ngram":
        spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    llm = LLM(model, tokenizer=args.tokenizer, speculative_config=spec, dtype=args.dtype, device=args.device,
              backend=args.backend)
    for prompt in prompts:
        if args.stream and not args.json:
            last = None
            for last in llm.stream(prompt, params):
                sys.stdout.write(last.text)
                sys.stdout.flush()
            print()
            print(_summary(last.metrics, method, k), file=sys.stderr)
            continue
        out = llm.generate([prompt], params)[0]
        if args.json:
            print(json.dumps({
                "text": out.outputs[0].text,
                "token_ids": out.outputs[0].token_ids,
                "finish_reason": out.outputs[0].finish_reason,
                "model": model,
                "speculative_model": draft,
                "method": method,
                "num_speculative_tokens": k if spec else None,
                "metrics": out.metrics.to_dict(),
            }))
        else:
            print(out.outputs[0].text)
            print(_summary(out.metrics, method, k), file=sys.stderr)
    return 0
