"""``specdec serve``: an OpenAI-compatible HTTP server over the batched engine.

``create_app(llm)`` (in :mod:`specdec.server.app`) builds the ASGI app; the ``specdec serve``
command (:mod:`specdec.server.cli`) runs it under uvicorn. ``create_app`` is imported lazily, so
that the CLI's help does not pay for importing torch and FastAPI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name != "create_app":
        raise AttributeError(f"module 'specdec.server' has no attribute {name!r}")
    from specdec.server.app import create_app

    return create_app
