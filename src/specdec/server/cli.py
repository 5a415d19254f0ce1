"""``specdec serve`` (the OpenAI-compatible server under uvicorn) and ``specdec bench-serve`` (its load
generator). Flag names follow ``vllm serve`` where vLLM has one.

SIGTERM (or Ctrl+C): the server stops admitting (new connections are refused, new requests on open
ones get 503), lets running requests finish for ``--graceful-timeout`` seconds, ends the rest with a
503 in OpenAI's shape (a stream: an error event, then ``data: [DONE]``), then exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from specdec.errors import SpecDecError
from specdec.generate_cli import (
    PLAIN,
    LazyChoices,
    _method_names,
    _resolve_models,
    _speculative_config,
    speculative_config_json,
)

DEFAULT_SERVED_NAME = "specdec-default-pair"
SHUTDOWN_BACKSTOP = 5.0
"""Seconds past --graceful-timeout after which uvicorn cancels what is left."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: the embedded default pair with its draft model) at /v1/completions, "
        "/v1/chat/completions, /v1/models, /health and /metrics, with continuous batching.",
    )
    p.add_argument("model", nargs="?", help="target model folder or hub id (default: the embedded default target)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL, or "
                   f"{DEFAULT_SERVED_NAME!r} for the embedded pair)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the model's folder)")
    p.add_argument("--speculative-config", help="the speculative_config dict of the Python API, as JSON (instead "
                   "of the --speculative-* shorthand)")
    p.add_argument("--speculative-model", help="draft model folder or hub id")
    p.add_argument("--speculative-method", choices=LazyChoices(_method_names), metavar="METHOD",
                   help=f"drafting method: %(choices)s (default: draft_model when a draft model is known, "
                   f"else {PLAIN})")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens per step, k (default 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=3, help="longest n-gram matched by ngram (default 3)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="shortest n-gram matched by ngram (default 1)")
    p.add_argument("--speculative-dtype", default=None, help="draft model dtype (default: see specdec generate)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded at once (default 16)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt and output; caps max_tokens (default: the context window)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="sequences that may wait for a slot; more get HTTP 429 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted; more get HTTP 413 (default 4 MiB)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--backend", default="auto", choices=("auto", "fast", "hf"), help="model backend (default auto)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs on a GPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the seeds of unseeded requests (default 0)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY; unset: no auth)")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_serve)


def _speculative(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None, str]:
    """(target, speculative_config or None, a one-line description of the method)."""
    if args.speculative_config is None:
        model, draft, method = _resolve_models(args)
        spec = _speculative_config(args, draft, method)
        what = "plain decoding" if spec is None else f"{method}, k={args.num_speculative_tokens}" + (
            f", draft {draft}" if draft else "")
        return model, spec, what
    model, spec = speculative_config_json(args)
    return model, spec, f"speculative_config {json.dumps(spec)}"


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from transformers.utils import logging as hf_logging

    from specdec.llm import LLM
    from specdec.server.app import create_app

    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecDecError(f"cannot read --chat-template {str(args.chat_template)!r}: {exc.strerror}") from None
    model, spec, what = _speculative(args)
    if template is None and args.model is None:  # the embedded pair: its shipped template
        from specdec.assets import DEFAULT_CHAT_TEMPLATE

        template = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    llm = LLM(model, tokenizer=args.tokenizer, speculative_config=spec, dtype=args.dtype, device=args.device,
              seed=args.seed, backend=args.backend, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    app = create_app(llm, served_model_name=name, api_key=args.api_key or None, chat_template=template,
                     max_queue_len=args.max_queue_len, max_body_bytes=args.max_request_bytes)
    state = app.state.specdec

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            state.draining = True
            if state.loop is not None and not self.should_exit:  # in a signal handler: hand it to the loop
                state.loop.call_soon_threadsafe(state.drain, args.graceful_timeout)
            super().handle_exit(sig, frame)

    # The app ends the requests still running at --graceful-timeout itself, each with an answer in
    # OpenAI's shape; uvicorn's own timeout (which cancels them with none) is a backstop past it.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout + SHUTDOWN_BACKSTOP)
    print(f"specdec serve: {name!r} (target {model}; {what}; {llm.device}, max_num_seqs {llm.max_num_seqs}, "
          f"max_model_len {llm.max_model_len}; auth {'on' if args.api_key else 'off'}) at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down: let that be a no-op, so a
    # graceful SIGTERM ends with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    Server(config).run()
    return 0
