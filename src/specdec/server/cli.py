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
    p.add_argument("--prefill-share", type=float, default=None, metavar="SHARE",
                   help="on a CPU, where chunked prefill's default budget is paced: what a step's prompt tokens "
                   "may add to it, as a share of a decoding step; more feeds waiting prompts sooner (time to first "
                   "token), the running streams wait longer between tokens (default 0.5)")
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
    _add_replica_flags(p)
    p.set_defaults(func=run_serve)


RAY_FLAGS = ("num_cpus_per_replica", "num_gpus_per_replica", "threads_per_replica", "min_replicas", "max_replicas",
             "target_ongoing_requests", "max_ongoing_requests", "ray_address")
RAY_MISSING = ("--replicas needs Ray Serve, which is not installed: pip install 'specdec[ray]' "
               "(in a checkout: pip install -e '.[ray]')")


def _add_replica_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; pip install 'specdec[ray]'; see docs/scale-out.md)")
    g.add_argument("--replicas", type=int, metavar="N",
                   help="serve N engine replicas behind Ray Serve's HTTP proxy at --host/--port (the initial count "
                   "when --max-replicas autoscales; default: one process, no Ray)")
    g.add_argument("--num-cpus-per-replica", type=float, help="Ray CPUs each replica reserves (default 1)")
    g.add_argument("--num-gpus-per-replica", type=float, help="Ray GPUs each replica reserves (default 0)")
    g.add_argument("--threads-per-replica", type=int,
                   help="torch threads of each replica (default: its CPUs rounded up)")
    g.add_argument("--min-replicas", type=int, help="Ray Serve autoscaling: fewest replicas (default 1)")
    g.add_argument("--max-replicas", type=int, help="Ray Serve autoscaling: most replicas (turns autoscaling on)")
    g.add_argument("--target-ongoing-requests", type=float,
                   help="Ray Serve autoscaling: ongoing requests per replica it aims at (default: Ray Serve's)")
    g.add_argument("--max-ongoing-requests", type=int,
                   help="requests the proxy sends one replica at once (default: --max-num-seqs); more wait")
    g.add_argument("--ray-address", help="Ray cluster to join, e.g. 'auto' or 'ray://head:10001' (default: the "
                   "cluster of RAY_ADDRESS, or a new local one)")


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
    from specdec.models.loader import backend_line, resolve_device
    from specdec.scheduler import prefill_share_of
    from specdec.server.app import create_app

    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            raise SpecDecError(f"cannot read --chat-template {str(args.chat_template)!r}: {exc.strerror}") from None
    # here, not in each replica's LLM: a bad share is one line before anything loads
    device = _replica_device(args) if args.replicas is not None else resolve_device(args.device)
    prefill_share_of(args.prefill_share, args.enable_chunked_prefill, args.max_num_batched_tokens, device,
                     serving=True)
    settings = _replica_settings(args)
    _model_flag(args)
    model, spec, what = _speculative(args)
    checked_config(spec)
    if template is None and args.model is None:  # the embedded pair: its shipped template
        from specdec.assets import DEFAULT_CHAT_TEMPLATE

        template = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
    llm_kwargs = dict(model=model, tokenizer=args.tokenizer, speculative_config=spec, dtype=args.dtype,
                      device=args.device, seed=args.seed, backend=args.backend, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                      enable_chunked_prefill=args.enable_chunked_prefill,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                      deterministic=args.deterministic, serving=True, prefill_share=args.prefill_share)
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    if settings is not None:
        app_kwargs = dict(served_model_name=name, api_key=args.api_key or None, chat_template=template,
                          max_queue_len=args.max_queue_len, max_body_bytes=args.max_request_bytes)
        return _run_replicas(args, settings, llm_kwargs, app_kwargs, f"{name!r} (target {model}; {what})")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    llm = LLM(**llm_kwargs)
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


def _replica_device(args: argparse.Namespace):
    """The device each ``--replicas`` replica runs on: ``--device auto`` is a GPU where each replica reserves one
    (``--num-gpus-per-replica``), else the CPU (Ray hides the GPUs from a replica that reserves none), whatever
    this machine has; a device named is that device."""
    import torch

    from specdec.models.loader import resolve_device

    if str(args.device) == "auto":
        return torch.device("cuda" if (args.num_gpus_per_replica or 0) > 0 else "cpu")
    return resolve_device(args.device)


def _replica_settings(args: argparse.Namespace):
    """The :class:`~specdec.serve_ray.ReplicaSettings` of ``--replicas`` and its flags, or None
    without ``--replicas`` (then no replica flag may be given)."""
    if args.replicas is None:
        given = [f"--{flag.replace('_', '-')}" for flag in RAY_FLAGS if getattr(args, flag) is not None]
        if given:
            raise SpecDecError(f"{', '.join(given)} only apply with --replicas N")
        return None
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise SpecDecError(RAY_MISSING) from None
    from specdec.serve_ray import ReplicaSettings

    cpus = 1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica
    return ReplicaSettings(num_replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                           target_ongoing_requests=args.target_ongoing_requests,
                           max_ongoing_requests=args.max_ongoing_requests, num_cpus=cpus,
                           num_gpus=args.num_gpus_per_replica or 0.0, threads=args.threads_per_replica,
                           graceful_shutdown_timeout_s=args.graceful_timeout)


def _run_replicas(args: argparse.Namespace, settings, llm_kwargs: dict[str, Any], app_kwargs: dict[str, Any],
                  what: str) -> int:
    """Serve ``settings.num_replicas`` replicas behind Ray Serve until SIGTERM or Ctrl+C, then stop them
    gracefully (see :func:`specdec.serve_ray.stop_replicas`) and exit with status 0."""
    import threading

    from specdec.serve_ray import serve_replicas, stop_replicas

    serve_replicas(llm_kwargs, app_kwargs=app_kwargs, settings=settings, host=args.host, port=args.port,
                   ray_address=args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    scaling = (f"autoscaling {settings.min_replicas or 1}..{settings.max_replicas}" if settings.max_replicas
               else f"{settings.num_replicas} replicas")
    print(f"specdec serve: {what}; {scaling} x ({settings.num_cpus:g} CPU, {settings.num_gpus:g} GPU, "
          f"{settings.torch_threads} torch threads) behind Ray Serve; auth {'on' if args.api_key else 'off'}; at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        pass
    print("specdec serve: stopping the replicas (running requests get --graceful-timeout seconds)",
          file=sys.stderr, flush=True)
    stop_replicas(shutdown_serve=args.ray_address is None and not os.environ.get("RAY_ADDRESS"))
    return 0
