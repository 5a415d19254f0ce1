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
from specdec.structured.thinking import after_thinking

INSTALL_HINT = ('structured output needs the llguidance package: pip install "specdec[structured]" '
                "(or pip install llguidance)")
MAX_CACHED_GRAMMARS = 256
PROBE_STEPS = 4  # tokens a new constraint is walked at compile time (see _probe)
MAX_MESSAGE_CHARS = 400
DUMP_MARKERS = ("<state>", "<backtrace>", "<non-verbose/>")  # llguidance appends its state or a backtrace after
# How llguidance's errors for a constraint past its resource limits begin (a regex's own parse errors, which echo
# the regex, begin otherwise):
RESOURCE_ERRORS = ("lexer error: too many", "parser error: too many", "too many", "recursion limit", "lexer error: "
                   "fuel", "parser error: fuel")
KNOWN_PANICS = {"grammar.symbols.len() < u16::MAX": "too many grammar symbols (llguidance allows about 65,000)"}


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
    that every request copies (a copy costs microseconds; compiling a schema costs milliseconds).

    A compiled constraint is probed before it is cached (:func:`_probe`), so that a constraint that matches no
    text, or one past llguidance's resource limits, is a SpecDecError when the request is submitted instead of
    an empty output or a failure mid-generation.

    ``opens_inside`` (of :meth:`compile` and :meth:`matcher`): None, the constraint holds from the output's first
    token; True or False, it holds for the answer after a reasoning model's thinking, which the output starts
    inside (True) or may open (False) (:func:`specdec.structured.thinking.after_thinking`). The answer's grammar
    alone is what is probed."""

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
        self._hf_tokenizer = tokenizer
        self._cache: OrderedDict[tuple, list] = OrderedDict()  # (constraint, opens_inside, budget): [matcher, s]

    def compile(self, params: StructuredOutputsParams | None, opens_inside: bool | None = None,
                budget: int | None = None) -> float:
        """Compile ``params`` unless it is cached; returns the seconds it took (0.0 when cached). An invalid
        schema, regex or grammar, or a keyword llguidance does not implement, is a SpecDecError naming the
        problem. ``params`` None (with ``opens_inside`` set): a free answer, for a thinking ``budget``."""
        key = (None if params is None else params.key, opens_inside, budget)
        if key in self._cache:
            self._cache.move_to_end(key)
            return 0.0
        start = time.perf_counter()
        prototype = self._compile(*key)
        seconds = time.perf_counter() - start
        self._cache[key] = [prototype, seconds]
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return seconds

    def matcher(self, params: StructuredOutputsParams | None, opens_inside: bool | None = None,
                budget: int | None = None) -> tuple[Any, float]:
        """A fresh llguidance ``LLMatcher`` for ``params`` (compiled if need be; the arguments as :meth:`compile`
        takes them) and the seconds its compilation took, reported once: to the first matcher made after it (0.0
        for every later one)."""
        key = (None if params is None else params.key, opens_inside, budget)
        self.compile(params, opens_inside, budget)
        entry = self._cache[key]
        # Copies share the prototype's lexer: one that a request drove past llguidance's limits fails every later
        # copy at its first mask (which would then allow only end-of-sequence). Such a prototype is compiled anew.
        matcher = entry[0].deep_copy()
        matcher.compute_logit_bias()
        if matcher.is_error():
            del self._cache[key]
            self.compile(params, opens_inside, budget)
            entry = self._cache[key]
            matcher = entry[0].deep_copy()
        seconds, entry[1] = entry[1], 0.0
        return matcher, seconds

    def _compile(self, key: tuple[str, str, bool] | None, opens_inside: bool | None, budget: int | None) -> Any:
        if key is None:  # a free answer after a budgeted thinking
            grammar = after_thinking(None, bool(opens_inside), self._hf_tokenizer, self.eos_ids, budget)
            return self._matcher(grammar, "thinking budget")
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
            raise compile_error(what, str(exc)) from None
        matcher = self._matcher(grammar, what)
        _probe(matcher, what, self.eos_ids)
        if opens_inside is None:
            return matcher
        grammar = after_thinking(grammar, opens_inside, self._hf_tokenizer, self.eos_ids, budget)
        return self._matcher(grammar, f"{what} after the thinking")

    def _matcher(self, grammar: str, what: str) -> Any:
        """An ``LLMatcher`` of ``grammar`` (llguidance's text) in its initial state, validated first; a SpecDecError
        naming ``what`` where llguidance refuses it."""
        lib = llguidance()
        limits = lib.LLParserLimits(verbose_errors=False)  # no parser state dumped into messages
        failed, messages = lib.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=limits)
        if failed:
            raise compile_error(what, messages[0])
        matcher = lib.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise compile_error(what, matcher.get_error())
        return matcher


def _probe(matcher: Any, what: str, eos_ids: frozenset[int]) -> None:
    """Walk a copy of a freshly compiled ``matcher`` :data:`PROBE_STEPS` tokens down one path (the lowest allowed
    token id each time), computing each mask: llguidance builds its lexer lazily, so a constraint past its limits
    (``a{1000000}``: "too many expressions constructed") fails only there, and so does one that matches no text
    (the initial state allows no token and does not accept). Either is a SpecDecError. A constraint that accepts
    the empty text (only end-of-sequence allowed at first) passes: it may end at once."""
    probe = matcher.deep_copy()
    for step in range(PROBE_STEPS + 1):
        allowed = probe.compute_logit_bias()  # one byte per token: 0 (forbidden) or 200 (allowed)
        if probe.is_error():
            message = probe.get_error()
            if step == 0 and clean_message(message) in ("NoExtension", "NoExtensionBias"):
                raise SpecDecError(f"the {what} in structured_outputs matches no text (no output can satisfy it)")
            raise compile_error(what, message)
        token = _first_allowed(allowed, eos_ids)
        if token is None:
            if step == 0 and not probe.is_accepting():
                raise SpecDecError(f"the {what} in structured_outputs matches no text (no output can satisfy it)")
            return
        if step == PROBE_STEPS:
            return
        if not probe.consume_token(token) or probe.is_error():
            raise compile_error(what, probe.get_error())


def _first_allowed(allowed: bytes, eos_ids: frozenset[int]) -> int | None:
    """The lowest token id that ``allowed`` (one byte per token, nonzero: allowed) allows, other than ``eos_ids``."""
    index = allowed.find(200)
    while index in eos_ids:
        index = allowed.find(200, index + 1)
    return index if index >= 0 else None


def compile_error(what: str, message: str) -> SpecDecError:
    """llguidance's compilation error ``message`` as a SpecDecError: a constraint past its resource limits is "too
    large", anything else "invalid"."""
    text = clean_message(message)
    if text.lower().startswith(RESOURCE_ERRORS) or text in KNOWN_PANICS.values():
        return SpecDecError(f"the {what} in structured_outputs is too large for the grammar engine: {text}")
    if message.startswith("panic: "):
        return SpecDecError(f"the grammar engine failed on the {what} in structured_outputs: {text}")
    return SpecDecError(f"invalid {what} in structured_outputs: {text}")


def clean_message(message: str) -> str:
    """llguidance's ``message`` on one line (it may draw a caret under the error over several lines) without the
    parser state or the Rust backtrace it may append (build paths, dozens of frames), at most
    :data:`MAX_MESSAGE_CHARS` characters; a Rust panic's known assertions in words."""
    lines = []
    for line in message.splitlines():
        if line.strip() in DUMP_MARKERS:
            break
        lines.append(line)
    text = " ".join(" ".join(lines).split())
    text = text.removeprefix("panic: ")
    for assertion, words in KNOWN_PANICS.items():
        if assertion in text:
            text = words
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."
