"""Scale-out: many engine replicas of specdec's server behind Ray Serve (``pip install 'specdec[ray]'``).

See :mod:`specdec.serve_ray.deployment` and ``docs/scale-out.md``. Names are imported lazily, so that
this package can be named without ray installed (the proxy middleware needs only Starlette).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {name: "specdec.serve_ray.deployment" for name in (
    "ReplicaSettings", "app_builder", "application", "default_pair_kwargs", "proxy_middlewares", "serve_replicas",
    "stop_replicas")}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec.serve_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
