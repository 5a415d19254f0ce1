"""Compiling constraints with llguidance, cached per constraint for one tokenizer.

Why llguidance (and not xgrammar): its wheel has no Python dependencies at all, while xgrammar
requires torch, transformers and triton (a GPU compiler a CPU user does not need, and a torch
requirement that may pull another torch); both are maintained and used by vLLM and SGLang. It
computes a token mask in tens of microseconds, takes JSON schema, regex, Lark and GBNF grammars, and
refuses a schema keyword it does not implement instead of ignoring it.

llguidance is the optional extra ``structured`` (``pip install "specdec[structured]"``); a
constrained request without it is a :class:`~specdec.errors.SpecDecError` saying how to install it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from specdec.errors import SpecDecError
from specdec.structured.params import StructuredOutputsParams

INSTALL_HINT = ('structured output needs the llguidance package: pip install "specdec[structured]" '
                "(or pip install llguidance)")
MAX_CACHED_GRAMMARS = 256


def llguidance() -> Any:
    """The llguidance module, or a SpecDecError saying how to install it."""
    try:
        import llguidance as module
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise SpecDecError(INSTALL_HINT) from None
    return module


class GrammarCache:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer (a ``PreTrainedTokenizerFast``) and a
    model vocabulary of ``vocab_size`` rows (token ids past the tokenizer's are never allowed);
    ``eos_ids`` end a sequence once its constraint is complete. The most recent
    :data:`MAX_CACHED_GRAMMARS` compiled constraints are kept, each as a matcher in its initial state
    that every request copies (a copy costs microseconds; compiling a schema costs milliseconds)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        lib = llguidance()
        if tokenizer is None:
            raise SpecDecError("structured output needs the model's tokenizer (prompts given as token ids are fine, "
                               "but pass tokenizer= or use a model folder with one)")
        if not eos_ids:
            raise SpecDecError("structured output needs an end-of-sequence token (the tokenizer defines none): the "
                               "output ends with it once the constraint is complete")
        try:
            self.tokenizer = lib.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        except ValueError as exc:
            raise SpecDecError(f"structured output cannot use this tokenizer: {exc}") from None
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._cache: OrderedDict[tuple[str, str, bool], list] = OrderedDict()  # [matcher, unreported s]

    def compile(self, params: StructuredOutputsParams) -> float:
        """Compile ``params`` unless it is cached; returns the seconds it took (0.0 when cached). An invalid
        schema, regex or grammar, or a keyword llguidance does not implement, is a SpecDecError naming the
        problem."""
        key = params.key
        if key in self._cache:
            self._cache.move_to_end(key)
            return 0.0
        start = time.perf_counter()
        prototype = self._compile(key)
        seconds = time.perf_counter() - start
        self._cache[key] = [prototype, seconds]
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return seconds

    def matcher(self, params: StructuredOutputsParams) -> tuple[Any, float]:
        """A fresh llguidance ``LLMatcher`` for ``params`` (compiled if need be) and the seconds its compilation
        took, reported once: to the first matcher made after it (0.0 for every later one)."""
        self.compile(params)
        entry = self._cache[params.key]
        seconds, entry[1] = entry[1], 0.0
        return entry[0].deep_copy(), seconds

    def _compile(self, key: tuple[str, str, bool]) -> Any:
        lib = llguidance()
        kind, text, compact = key
        what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
        try:
            if kind == "json":
                grammar = lib.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": not compact})
            elif kind == "regex":
                grammar = lib.LLMatcher.grammar_from_regex(text)
            else:  # choice: a JSON list; grammar: Lark or GBNF
                grammar = lib.grammar_from("choice" if kind == "choice" else "grammar", text)
        except ValueError as exc:
            raise SpecDecError(f"invalid {what} in structured_outputs: {_one_line(str(exc))}") from None
        failed, messages = lib.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise SpecDecError(f"invalid {what} in structured_outputs: {_one_line(messages[0])}")
        matcher = lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SpecDecError(f"invalid {what} in structured_outputs: {_one_line(matcher.get_error())}")
        return matcher


def _one_line(message: str) -> str:
    """llguidance's message (which may draw a caret under the error over several lines) on one line."""
    return " ".join(message.split())
