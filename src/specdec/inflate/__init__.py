"""Function-preserving inflation: a small Llama/Qwen2 checkpoint (and its heads) made into a model of
a real shape (:data:`specdec.shapes.SHAPES`) with the same logits, so that speed is measured at the
sizes users run while acceptance stays that of the trained pair.

- :mod:`~specdec.inflate.layout`: the construction and why it is exact (index maps);
- :mod:`~specdec.inflate.model`: state dicts, configs and loaded models;
- :mod:`~specdec.inflate.checkpoint`: checkpoint folders (:func:`inflate_checkpoint`);
- :mod:`~specdec.inflate.heads`: head folders;
- :mod:`~specdec.inflate.pair`: pair folders and the cache ``specdec bench --shape`` uses
  (:func:`inflate_pair`, :func:`cached_pair`);
- :mod:`~specdec.inflate.cli`: ``specdec inflate``.

torch is imported by the submodules, not here, so that the CLI starts without it.
"""
