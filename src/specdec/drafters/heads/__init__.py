"""Drafters on the target's own features (hidden states): Medusa heads, an EAGLE layer, MTP modules.

Each is a ``speculative_config`` method whose ``model`` is a folder of trained heads
(:mod:`.common`); ``specdec train medusa|eagle|mtp`` trains them, and the embedded target ships its own.
"""

from specdec.drafters.heads import eagle, medusa, mtp  # noqa: F401  (registration)
