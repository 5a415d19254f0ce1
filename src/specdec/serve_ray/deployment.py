"""N engine replicas of specdec's ASGI app behind Ray Serve's HTTP proxy.

Each replica is a Ray Serve replica that builds its own :class:`~specdec.llm.LLM` (with
``torch.set_num_threads(threads)``) and serves :func:`specdec.server.app.create_app` of it unchanged:
the same routes, streaming, auth, limits and error shapes as ``specdec serve``. Ray Serve's proxy
routes each request to one replica (power of two choices over the replicas' ongoing requests).
Two things are answered across replicas by :class:`Gateway`, with the :class:`~specdec.serve_ray.board.Board`
deployment: ``GET /metrics`` (every replica's metrics, labelled ``replica``) and ``GET /health``. The
proxy runs :class:`~specdec.serve_ray.proxy.OpenAIErrors`, so a replica that dies mid-request still
leaves its clients an answer in OpenAI's shape.

Entry points: :func:`serve_replicas` (start Serve and the application from Python),
:func:`application` (the bound application, for ``serve.run``), :func:`app_builder` (for ``serve run``
and KubeRay's ``serveConfigV2``: ``import_path: specdec.serve_ray:app_builder``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.middleware import Middleware

from specdec.errors import SpecDecError
from specdec.serve_ray.board import Board, labelled
from specdec.serve_ray.proxy import OpenAIErrors

log = logging.getLogger("specdec.serve_ray")

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "specdec.serve_ray:proxy_middlewares"
BOARD_TIMEOUT = 5.0
"""Seconds ``/metrics`` and ``/health`` wait for the board before answering with this replica alone."""


@dataclass(frozen=True)
class ReplicaSettings:
    """How many replicas, what each one gets, and Ray Serve's autoscaling.

    ``num_replicas``: fixed replica count (the initial count when autoscaling). ``min_replicas`` /
    ``max_replicas`` / ``target_ongoing_requests``: Ray Serve's autoscaling (on when ``max_replicas``
    is given). ``max_ongoing_requests``: requests Serve sends one replica at once (default: the
    engine's ``max_num_seqs``; more wait in the proxy for a free replica). ``num_cpus`` /
    ``num_gpus``: Ray resources each replica reserves. ``threads``: torch threads of each replica
    (default: ``num_cpus`` rounded up, at least 1). ``graceful_shutdown_timeout_s``: how long a
    stopping replica lets its requests finish. ``metrics_push_interval_s``: how often a replica tells
    the board its metrics and health.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    graceful_shutdown_timeout_s: float = 30.0
    metrics_push_interval_s: float = 2.0

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise SpecDecError(f"{name} must be {what}, got {getattr(self, name)!r}")

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check("num_replicas", integer(self.num_replicas) and self.num_replicas >= 1, "an integer >= 1")
        for name in ("min_replicas", "max_replicas", "max_ongoing_requests", "threads"):
            value = getattr(self, name)
            low = 0 if name == "min_replicas" else 1
            check(name, value is None or (integer(value) and value >= low), f"None or an integer >= {low}")
        for name in ("num_cpus", "num_gpus", "graceful_shutdown_timeout_s"):
            check(name, isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0, "a number >= 0")
        for name in ("target_ongoing_requests", "metrics_push_interval_s"):
            value = getattr(self, name)
            check(name, value is None or (isinstance(value, (int, float)) and value > 0), "a number > 0")
        if self.max_replicas is None and (self.min_replicas is not None or self.target_ongoing_requests is not None):
            raise SpecDecError("min_replicas and target_ongoing_requests are Ray Serve's autoscaling settings: "
                               "give max_replicas too")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if not low <= self.num_replicas <= self.max_replicas:
                raise SpecDecError(f"autoscaling needs min_replicas ({low}) <= num_replicas (the initial count, "
                                   f"{self.num_replicas}) <= max_replicas ({self.max_replicas})")

    @property
    def torch_threads(self) -> int:
        return self.threads or max(1, math.ceil(self.num_cpus))

    def deployment_options(self, max_num_seqs: int) -> dict[str, Any]:
        """The options of the replicas' Ray Serve deployment."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests or max_num_seqs,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
        }
        if self.max_replicas is None:
            options["num_replicas"] = self.num_replicas
        else:
            scaling = {"min_replicas": 1 if self.min_replicas is None else self.min_replicas,
                       "initial_replicas": self.num_replicas, "max_replicas": self.max_replicas}
            if self.target_ongoing_requests is not None:
                scaling["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = scaling
        return options


class SpecDecReplica:
    """One replica: an LLM, the ASGI app of :func:`~specdec.server.app.create_app` over it, and the
    pushes to the board. Ray Serve builds it with the arguments given to ``bind``."""

    def __init__(self, llm_kwargs: dict[str, Any], app_kwargs: dict[str, Any], threads: int, board: Any,
                 push_interval: float) -> None:
        import torch

        from specdec.llm import LLM
        from specdec.server.app import create_app

        torch.set_num_threads(threads)
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        # each replica its own seed of the seeds of unseeded requests (the same seed would make two
        # replicas answer the same unseeded requests identically)
        seeded = {**llm_kwargs, "seed": llm_kwargs.get("seed", 0) + context.rank.rank}
        # (not ``self.app``: Ray Serve's ingress wrapper owns that name)
        self.specdec_app = create_app(LLM(**seeded), **app_kwargs)
        self.state = self.specdec_app.state.specdec
        self.board = board
        self.push_interval = push_interval
        self._pusher = asyncio.get_running_loop().create_task(self._push_loop())

    def __serve_build_asgi_app__(self):
        return Gateway(self.specdec_app, self)

    @property
    def healthy(self) -> bool:
        return not self.state.draining and self.state.worker.alive

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if not self.state.worker.alive:
            raise RuntimeError("the engine thread of this replica stopped")

    async def push(self) -> None:
        """Tell the board this replica's metrics and health now."""
        await self.board.push.remote(self.replica, labelled(self.state.metrics.registry, self.replica), self.healthy)

    async def _push_loop(self) -> None:
        while True:
            try:
                await self.push()
            except Exception:  # the board is being replaced: try again next time
                log.debug("pushing metrics to the board failed", exc_info=True)
            await asyncio.sleep(self.push_interval)

    async def __del__(self) -> None:
        if hasattr(self, "_pusher"):  # (not when __init__ failed)
            self._pusher.cancel()
        with contextlib.suppress(Exception):
            await self.board.leave.remote(self.replica)


class Gateway:
    """The ASGI app a replica serves: the specdec app, with ``GET /metrics`` and ``GET /health``
    answered for every replica (from the board) instead of this one alone."""

    def __init__(self, app: Any, replica: SpecDecReplica) -> None:
        self.app, self.replica = app, replica

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and scope["path"] in ("/metrics", "/health"):
            response = await (self.metrics() if scope["path"] == "/metrics" else self.health())
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    async def _board(self, method: str) -> Any:
        await self.replica.push()
        return await asyncio.wait_for(getattr(self.replica.board, method).remote(), BOARD_TIMEOUT)

    async def metrics(self) -> Response:
        """Every fresh replica's metrics, each sample labelled ``replica``."""
        try:
            body = await self._board("metrics")
        except Exception:
            log.warning("the board did not answer; /metrics shows this replica alone", exc_info=True)
            from specdec.serve_ray.board import Snapshot, render

            body = render({self.replica.replica: Snapshot(labelled(self.replica.state.metrics.registry,
                                                                   self.replica.replica), True, 0.0)})
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> Response:
        """200 ``{"status": "ok", "replica", "replicas": {id: healthy}}`` while this replica serves
        (the proxy sends ``/health`` to a serving one); 503 while it stops."""
        local = self.replica.healthy
        try:
            replicas = await self._board("health")
        except Exception:
            replicas = {self.replica.replica: local}
        body = {"status": "ok" if local else "unavailable", "replica": self.replica.replica, "replicas": replicas,
                "healthy_replicas": sum(replicas.values())}
        return JSONResponse(body, status_code=200 if local else 503)


def proxy_middlewares() -> list[Middleware]:
    """The proxy's middlewares (Ray Serve calls this in the proxy when
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specdec.serve_ray:proxy_middlewares`` is set there)."""
    return [Middleware(OpenAIErrors)]


def application(llm_kwargs: dict[str, Any], *, app_kwargs: dict[str, Any] | None = None,
                settings: ReplicaSettings | None = None):
    """The Ray Serve application: the replicas' deployment bound to ``LLM(**llm_kwargs)`` and
    ``create_app(llm, **app_kwargs)``, and the board. Run it with ``serve.run(app, route_prefix="/")``."""
    settings = settings or ReplicaSettings()
    app_kwargs = dict(app_kwargs or {})
    board = serve.deployment(Board, name="specdec-board", num_replicas=1, max_ongoing_requests=1000,
                             ray_actor_options={"num_cpus": 0}).bind(settings.metrics_push_interval_s)
    max_num_seqs = llm_kwargs.get("max_num_seqs") or _default_max_num_seqs()
    replicas = serve.deployment(serve.ingress()(SpecDecReplica), name="specdec",
                                **settings.deployment_options(max_num_seqs))
    return replicas.bind(dict(llm_kwargs), app_kwargs, settings.torch_threads, board,
                         settings.metrics_push_interval_s)


def _default_max_num_seqs() -> int:
    from specdec.llm import DEFAULT_MAX_NUM_SEQS

    return DEFAULT_MAX_NUM_SEQS


def app_builder(args: dict[str, Any]):
    """``serve run specdec.serve_ray:app_builder`` and KubeRay's ``import_path``: ``args`` is
    ``{"llm": LLM keyword arguments, "app": create_app keyword arguments, "replicas": ReplicaSettings
    fields}`` (each optional; no ``llm``: the embedded default pair)."""
    unknown = set(args) - {"llm", "app", "replicas"}
    if unknown:
        raise SpecDecError(f"unknown application argument(s) {sorted(unknown)}: expected llm, app, replicas")
    names = {f.name for f in fields(ReplicaSettings)}
    given = dict(args.get("replicas") or {})
    if set(given) - names:
        raise SpecDecError(f"unknown replicas setting(s) {sorted(set(given) - names)}: expected {sorted(names)}")
    llm_kwargs = dict(args.get("llm") or default_pair_kwargs())
    return application(llm_kwargs, app_kwargs=args.get("app"), settings=ReplicaSettings(**given))


def default_pair_kwargs() -> dict[str, Any]:
    """``LLM`` keyword arguments of the embedded default pair with draft_model speculation, k=4 (the
    model of ``specdec serve`` without a MODEL)."""
    from specdec.assets import require_default_pair

    target, draft = require_default_pair()
    return {"model": str(target), "speculative_config": {"method": "draft_model", "model": str(draft),
                                                         "num_speculative_tokens": 4}}


def serve_replicas(llm_kwargs: dict[str, Any], *, app_kwargs: dict[str, Any] | None = None,
                   settings: ReplicaSettings | None = None, host: str = "127.0.0.1", port: int = 8000,
                   name: str = "specdec", ray_address: str | None = None) -> None:
    """Start Ray Serve (connecting to ``ray_address``, default: the running cluster or a new local one)
    with its proxy at ``http://host:port`` and run :func:`application` there as ``name`` at route ``/``.
    Returns once every replica is up; stop with :func:`stop_replicas`."""
    import ray

    # The proxy reads its middlewares from this variable; processes of a local Ray instance started
    # here inherit it (a cluster started elsewhere must set it itself: see docs/scale-out.md).
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if not ray.is_initialized():
        ray.init(address=ray_address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(llm_kwargs, app_kwargs=app_kwargs, settings=settings), name=name, route_prefix="/",
              blocking=False)


def stop_replicas(name: str = "specdec", *, shutdown_serve: bool = True) -> None:
    """Graceful shutdown: delete the application (each replica stops taking requests and lets its
    running ones finish for ``graceful_shutdown_timeout_s``; the proxy answers the rest in OpenAI's
    shape), then stop Serve (unless ``shutdown_serve`` is False: other applications of a shared
    cluster keep running) and disconnect from Ray."""
    import ray

    with contextlib.suppress(Exception):
        serve.delete(name)
    if shutdown_serve:
        serve.shutdown()
    ray.shutdown()


__all__ = ["ReplicaSettings", "app_builder", "application", "default_pair_kwargs", "proxy_middlewares",
           "serve_replicas", "stop_replicas"]
