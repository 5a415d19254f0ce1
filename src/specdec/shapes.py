"""Named model shapes after real models, in one table: the random-weight models of ``specdec bench
--synthetic`` and the shapes the embedded pair is inflated to (``specdec inflate``, ``bench --shape``).

A shape is a Llama layout. ``head_dim`` is the real model's; inflation keeps the source's head width
instead (64 for the embedded pair) and takes from the shape its query width ``num_heads * head_dim``
and KV width ``num_kv_heads * head_dim``, so that weights, KV bytes and FLOPs are the real model's
(:mod:`specdec.inflate.layout`). ``draft`` names the draft shape that goes with a target shape, at a
parameter ratio of about 8:1 to 15:1 with the pair's 8192-token vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecDecError


@dataclass(frozen=True)
class Shape:
    """A Llama shape; a draft built from it takes the target's vocabulary and context instead."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    description: str
    head_dim: int = 64
    draft: str | None = None
    """The draft shape of ``bench --shape`` (None: not a target shape there)."""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


SHAPES: dict[str, Shape] = {
    "1b": Shape(2048, 22, 32, 8, 5632, 32000, 2048, 10000.0,
                "TinyLlama-1.1B's layers with Llama-3.2-1B's 8 KV heads (1.12B parameters; the pair inflated: 1.01B)",
                draft="1b-draft"),
    "1b-draft": Shape(768, 12, 12, 4, 2048, 32000, 2048, 10000.0,
                      "a 12-layer 768-wide draft for 1b (125M; the pair's draft inflated: 82M, 12:1)"),
    "3b": Shape(3072, 28, 24, 8, 8192, 128256, 8192, 500000.0,
                "Llama-3.2-3B untied (3.61B parameters; the pair inflated: 2.84B)", head_dim=128, draft="3b-draft"),
    "3b-draft": Shape(1024, 16, 16, 4, 4096, 128256, 8192, 500000.0,
                      "a 16-layer 1024-wide draft for 3b (506M; the pair's draft inflated: 252M, 11:1)"),
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0,
                "Llama-3-8B (8.03B parameters; the pair inflated: 7.01B)", head_dim=128, draft="8b-draft"),
    "8b-draft": Shape(2048, 12, 32, 8, 8192, 128256, 8192, 500000.0,
                      "12 of Llama-3.2-1B's layers, a draft for 8b (1.26B; the pair's draft inflated: 747M, 9.4:1)"),
    "1b-2l": Shape(2048, 2, 32, 4, 5632, 32000, 2048, 10000.0, "2 layers of TinyLlama's width (a draft)"),
    "tiny": Shape(640, 7, 10, 10, 1280, 8192, 512, 10000.0,
                  "a little wider and deeper than the embedded pair's target, for smoke tests (the pair inflated: 34M)",
                  draft="tiny-draft"),
    "tiny-draft": Shape(320, 3, 5, 5, 768, 8192, 512, 10000.0, "the draft of tiny (the pair's draft inflated: 6M)"),
    "test": Shape(64, 4, 4, 2, 128, 512, 512, 10000.0, "0.2M parameters, for tests", head_dim=16),
}
"""Every named shape; ``vocab_size``/``max_position_embeddings``/``rope_theta`` are used by random-weight
models only (inflation keeps the source's)."""

TARGET_SHAPES = tuple(name for name, shape in SHAPES.items() if shape.draft is not None)
"""The shapes ``bench --shape`` takes (those with a draft shape)."""


def get_shape(name: str) -> Shape:
    """The shape called ``name``, or a :class:`SpecDecError` listing them."""
    if name not in SHAPES:
        raise SpecDecError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]
