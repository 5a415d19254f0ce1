"""Training of the tokenizer, target LM and draft model behind ``specdec train``.

Modules: :mod:`~specdec.train.corpus` (files, by-module split, token blocks, code prompts),
:mod:`~specdec.train.tokenizer`, :mod:`~specdec.train.presets`, :mod:`~specdec.train.loop` (the
shared training loop), :mod:`~specdec.train.lm`, :mod:`~specdec.train.draft` and
:mod:`~specdec.train.cli`.
"""
