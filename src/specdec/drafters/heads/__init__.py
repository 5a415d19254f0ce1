"""Drafters on the target's own features (hidden states): Medusa heads, an EAGLE layer, MTP modules.

Each is a ``speculative_config`` method whose ``model`` is a folder of trained heads
(:mod:`.common`); ``specdec train medusa|eagle|mtp`` trains them, and the embedded target ships its own.
``eagle``, ``eagle3`` and ``medusa`` also load published heads in the layouts vLLM and SGLang load
(:mod:`.published`).
"""

from specdec.drafters.heads import eagle, medusa, mtp  # noqa: F401  (registration)
