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
    _resolve_models,
    _speculative_config,
    add_model_flags,
    checked_config,
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
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="target model folder or hub id, as in 'vllm serve MODEL' (or --model; default: the embedded "
                   "default target)")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL, or "
                   f"{DEFAULT_SERVED_NAME!r} for the embedded pair)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="sequences that may wait for a slot; more get HTTP 429 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted; more get HTTP 413 (default 4 MiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the seeds of unseeded requests (default 0)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY; unset: no auth)")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_serve)


def _model_flag(args: argparse.Namespace) -> None:
    """``specdec serve MODEL`` and ``specdec serve --model MODEL`` alike: the positional MODEL into ``args.model``."""
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise SpecDecError(f"give the model once: MODEL {args.model_arg!r} and --model {args.model!r} differ")
        args.model = args.model_arg


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
    from specdec.models.loader import backend_line
    from specdec.server.app import create_app

    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecDecError(f"cannot read --chat-template {str(args.chat_template)!r}: {exc.strerror}") from None
    _model_flag(args)
    model, spec, what = _speculative(args)
    checked_config(spec)
    if template is None and args.model is None:  # the embedded pair: its shipped template
        from specdec.assets import DEFAULT_CHAT_TEMPLATE

        template = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    llm = LLM(model, tokenizer=args.tokenizer, speculative_config=spec, dtype=args.dtype, device=args.device,
              seed=args.seed, backend=args.backend, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, deterministic=args.deterministic)
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
    print(f"specdec serve: {name!r} (target {model}; {backend_line(llm.target)}; {what}; {llm.device}, "
          f"max_num_seqs {llm.max_num_seqs}, max_model_len {llm.max_model_len}; "
          f"auth {'on' if args.api_key else 'off'}) at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down: let that be a no-op, so a
    # graceful SIGTERM ends with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    Server(config).run()
    return 0
