"""``specdec serve`` (the OpenAI-compatible server under uvicorn) and ``specdec bench-serve`` (its load
generator). Flag names follow ``vllm serve`` where vLLM has one.

SIGTERM (or Ctrl+C): the server stops admitting (new connections are refused and idle keep-alive ones closed; a
request that still reaches the app gets 503), lets running requests finish for ``--graceful-timeout`` seconds, ends
the rest with a 503 in OpenAI's shape (a stream: an error event, then ``data: [DONE]``), then exits with status 0.
A second SIGTERM or Ctrl+C while it drains ends the running requests at once, each with that answer.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from specdec.cli_checks import number
from specdec.errors import SpecDecError
from specdec.generate_cli import (
    _resolve_models,
    _speculative_config,
    add_model_flags,
    checked_config,
    kv_kwargs,
    speculative_config_json,
)
from specdec.reasoning import PARSERS as REASONING
from specdec.tools import PARSERS

DEFAULT_SERVED_NAME = "specdec-default-pair"
SHUTDOWN_BACKSTOP = 5.0
"""Seconds past --graceful-timeout after which uvicorn cancels what is left."""
API_KEY_ENV = "SPECDEC_API_KEY"
BACKLOG = 2048
"""Connections the listening socket queues (uvicorn's default)."""


def _served_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"is empty ({text!r}); omit it to serve under MODEL's name")
    return text


def _api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; omit it to serve without a key")
    return text


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
    p.add_argument("--port", type=number(int, 0, 65535, " (0: any free port)"), default=8000,
                   help="port to listen on, 0..65535; 0: any free port, named in the startup line (default 8000)")
    p.add_argument("--served-model-name", type=_served_name, help="the model name clients send (default: MODEL, or "
                   f"{DEFAULT_SERVED_NAME!r} for the embedded pair)")
    p.add_argument("--prefill-share", type=float, default=None, metavar="SHARE",
                   help="on a CPU, where chunked prefill's default budget is paced: what a step's prompt tokens "
                   "may add to it, as a share of a decoding step; more feeds waiting prompts sooner (time to first "
                   "token), the running streams wait longer between tokens (default 0.5)")
    p.add_argument("--max-queue-len", type=number(int, 0), default=256,
                   help="sequences that may wait for a slot; more get HTTP 429 (default 256)")
    p.add_argument("--max-stored-responses", type=number(int, 0), default=None,
                   help="Responses API responses kept in memory for previous_response_id and GET /v1/responses/ID, "
                   "the least recently used dropped first; 0: none (default 1024, and none with more "
                   "than one replica: each would keep its own)")
    p.add_argument("--max-request-bytes", type=number(int, 1), default=4 * 1024 * 1024,
                   help="largest request body accepted; more get HTTP 413 (default 4 MiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the seeds of unseeded requests (default 0)")
    p.add_argument("--api-key", type=_api_key,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECDEC_API_KEY; unset or empty: "
                   "no auth)")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve chat's tool_choice 'auto' (the default with tools), the calls read out of the text by "
                   "--tool-call-parser; 'none', 'required' and a named function need neither flag")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING),
                   help="split chat outputs into reasoning_content (the thinking between <think> and </think>) and "
                   "content: deepseek_r1 (output starts thinking: DeepSeek-R1, its distills, QwQ) or qwen3 (thinks "
                   "when it opens <think>); a constraint (response_format, a forced tool call) then holds for the "
                   "answer after the thinking")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="how the model writes its tool calls: hermes (<tool_call>{...}</tool_call>: Qwen 2.5 and 3, "
                   "Hermes 2 and 3), llama3_json (a JSON call, or several separated by ';': Llama 3.1 to 3.3), "
                   "pythonic ([f(a=1), g()]: Llama 3.2 and 4) or mistral ([TOOL_CALLS][{...}] or "
                   "[TOOL_CALLS]f[ARGS]{...}: Mistral 7B v0.3, Nemo, Small, Large)")
    p.add_argument("--graceful-timeout", type=number(float, 0), default=30.0,
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

    api_key = resolved_api_key(args.api_key, os.environ)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SpecDecError("--enable-auto-tool-choice needs --tool-call-parser to read the calls "
                           f"({', '.join(sorted(PARSERS))})")
    template = None if args.chat_template is None else read_chat_template(args.chat_template)
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
                      deterministic=args.deterministic, serving=True, prefill_share=args.prefill_share,
                      reasoning_parser=args.reasoning_parser, **kv_kwargs(args))
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    app_kwargs = dict(served_model_name=name, api_key=api_key or "", chat_template=template,
                      max_queue_len=args.max_queue_len, max_body_bytes=args.max_request_bytes,
                      max_stored_responses=_stored_responses(args, settings),
                      enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser)
    # The address before the model loads: a port in use or a bad host is one line now, not a uvicorn error after.
    sockets = bind_sockets(args.host, args.port)
    if settings is not None:  # Ray Serve's proxy binds the port itself: only checked here
        for sock in sockets:
            sock.close()
        return _run_replicas(args, settings, llm_kwargs, app_kwargs, f"{name!r} (target {model}; {what})", api_key)
    try:
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        llm = LLM(**llm_kwargs)
        app = create_app(llm, **app_kwargs)
        listen(sockets, args.host, args.port)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    state = app.state.specdec
    port = sockets[0].getsockname()[1]  # the port chosen for --port 0
    url = f"http://{address(args.host, port)}"

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal while draining: end what runs now, each with its answer
                # (uvicorn's own second Ctrl+C would force its exit and cut the streams mid-body)
                if state.loop is not None:
                    state.loop.call_soon_threadsafe(state.end_in_flight, "the server was stopped a second time")
                return
            state.draining = True
            if state.loop is not None:  # in a signal handler: hand it to the loop
                state.loop.call_soon_threadsafe(state.drain, args.graceful_timeout)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn says where it listens only when it binds the sockets itself
                logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)

    # The app ends the requests still running at --graceful-timeout itself, each with an answer in
    # OpenAI's shape; uvicorn's own timeout (which cancels them with none) is a backstop past it.
    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_timeout + SHUTDOWN_BACKSTOP)
    print(f"specdec serve: {name!r} (target {model}; {backend_line(llm.target)}; {what}; {llm.device}, "
          f"max_num_seqs {llm.max_num_seqs}, max_model_len {llm.max_model_len}; "
          f"auth {'on' if api_key else 'off'}) at {url}/v1", file=sys.stderr, flush=True)
    if llm.kv_cache_description is not None:
        print(f"specdec serve: {llm.kv_cache_description}", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down: let that be a no-op, so a
    # graceful SIGTERM or Ctrl+C ends with status 0 (Ctrl+C's default would exit 130).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    Server(config).run(sockets=sockets)
    return 0


def resolved_api_key(flag: str | None, environ) -> str | None:
    """The key ``/v1`` requires: ``--api-key`` (never empty: argparse refuses that), else ``$SPECDEC_API_KEY``,
    where empty means unset (None: no auth), and blank (spaces only) is refused like an empty flag."""
    if flag is not None:
        return flag
    key = environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise SpecDecError(f"${API_KEY_ENV} is blank ({key!r}); unset it (or set it empty) to serve without a key")
    return key


def read_chat_template(path: Path) -> str:
    """The text of ``--chat-template``, compiled here as ``transformers`` will render it, so that a syntax
    error stops the server at start rather than failing every chat request with a 400."""
    import jinja2

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecDecError(f"cannot read --chat-template {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SpecDecError(f"cannot read --chat-template {str(path)!r}: not UTF-8 text ({exc.reason} at byte "
                           f"{exc.start})") from None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # an older or newer transformers: its environment's syntax, near enough
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[loopcontrols]).from_string
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        message = " ".join(str(exc.message).split())
        raise SpecDecError(f"--chat-template {str(path)!r} is not a valid Jinja template: line {exc.lineno}: "
                           f"{message}") from None
    return text


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cannot_listen(host: str, port: int, exc: OSError) -> SpecDecError:
    reason = exc.strerror or errno.errorcode.get(exc.errno or 0) or str(exc)
    return SpecDecError(f"cannot listen on {address(host, port)}: {reason[:1].lower()}{reason[1:]}")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening: until the app is ready a client is refused, not kept waiting) to every
    address of ``host`` at ``port``, as uvicorn binds them (``SO_REUSEADDR``, IPv6 sockets IPv6-only); with
    ``port`` 0 the first gets a free port and the others the same. Held from before the model loads until uvicorn
    serves on them, so that no other process can take the port meanwhile; a port in use or a host that is no
    address of this machine is a :class:`SpecDecError`."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise _cannot_listen(host, port, exc if isinstance(exc, OSError) else OSError(0, "not a host name")) \
            from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, where in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                where = (where[0], sockets[0].getsockname()[1], *where[2:])
            sock.bind(where)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise _cannot_listen(host, port, exc) from None
    return sockets


def listen(sockets: list[socket.socket], host: str, port: int) -> None:
    """Start listening on ``sockets`` (:func:`bind_sockets`): a process that bound the same port meanwhile and
    listens first makes this a :class:`SpecDecError`."""
    try:
        for sock in sockets:
            sock.listen(BACKLOG)
    except OSError as exc:
        raise _cannot_listen(host, port, exc) from None


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


def _stored_responses(args: argparse.Namespace, settings) -> int:
    """``--max-stored-responses``, or its default: none where more than one replica may serve (each keeps its own, and
    Ray Serve sends a continuation to any of them)."""
    from specdec.server.response_store import DEFAULT_CAPACITY

    several = settings is not None and (settings.num_replicas > 1 or settings.max_replicas is not None)
    if not several:
        return DEFAULT_CAPACITY if args.max_stored_responses is None else args.max_stored_responses
    if args.max_stored_responses:
        raise SpecDecError("--max-stored-responses needs a single replica: each replica keeps its own responses and "
                           "Ray Serve routes a previous_response_id to any of them (clients send the whole input)")
    return 0


def _run_replicas(args: argparse.Namespace, settings, llm_kwargs: dict[str, Any], app_kwargs: dict[str, Any],
                  what: str, api_key: str | None) -> int:
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
          f"{settings.torch_threads} torch threads) behind Ray Serve; auth {'on' if api_key else 'off'}; at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        pass
    print("specdec serve: stopping the replicas (running requests get --graceful-timeout seconds)",
          file=sys.stderr, flush=True)
    stop_replicas(shutdown_serve=args.ray_address is None and not os.environ.get("RAY_ADDRESS"))
    return 0
