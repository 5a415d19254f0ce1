"""A constraint that holds for a reasoning model's answer only: with a ``reasoning_parser``
(:mod:`specdec.reasoning`), the compiled grammar lets the thinking run free and starts the constraint right after
``</think>``, as vLLM does (its grammar is not applied until the reasoning ends).

One llguidance grammar does it (not a switch in the step): the answer's grammar becomes the sub-grammar ``@answer``
of a Lark grammar for the whole output, so drafting, verification and their exactness are those of any constraint
(:mod:`specdec.structured.state`). Each request's prompt decides whether its output thinks at all
(:func:`specdec.reasoning.output_thinking`; one that closed the thinking gets the constraint alone). With
``opens_inside`` (``deepseek_r1``) the output is thinking that may close
with ``</think>`` and the answer; otherwise (``qwen3``) it is either the answer or ``<think>``, thinking, and
optionally ``</think>`` and the answer. Until ``</think>`` the grammar is complete, so end-of-sequence may end the
thinking (the output then has no answer, as in vLLM); after it, the answer must be whole before it may end, and no
second ``</think>`` follows.

A thinking budget (``SamplingParams.thinking_token_budget``, vLLM's name) bounds the thinking to that many tokens in
the same grammar: after them ``</think>`` must follow (as vLLM forces it); a request with a budget and no constraint
gets a free answer (any tokens), so the budget changes nothing else.

A tag that the tokenizer holds as one token (DeepSeek-R1's and Qwen3's do) is matched as that token: llguidance
reads an added token only as itself, never as text. The thinking is then any token but ``</think>`` and the
end-of-sequence tokens. A tag the tokenizer spells in several tokens is matched as text, the thinking being any text
without ``</think>``, as :class:`~specdec.reasoning.ReasoningSplit` splits it. The answer starts right after
``</think>``: whitespace there is the answer's, allowed only where its constraint allows it, so the server's
``content`` is exactly a constrained text; and a ``qwen3`` output opens with ``<think>`` itself, not after spaces.
"""

from __future__ import annotations

import json
from typing import Any

from specdec.errors import SpecDecError
from specdec.reasoning import CLOSE, OPEN

ANSWER = "answer"  # the sub-grammar's name

# Text without CLOSE (llguidance's regex intersection and complement), and that text closed by CLOSE.
_TEXT_THINKING = (
    'FREE: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n'
    'THOUGHT: FREE "</think>"\n'
)


def single_token(tokenizer: Any, tag: str) -> int | None:
    """The id of ``tag`` if the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def after_thinking(grammar: str | None, opens_inside: bool, tokenizer: Any, eos_ids: frozenset[int],
                   budget: int | None = None) -> str:
    """The llguidance grammar (top-level JSON) of an output whose thinking is free and whose answer is ``grammar``
    (what llguidance's ``grammar_from`` builds: top-level JSON with one grammar, or Lark text; None: a free answer,
    any tokens); ``tokenizer``: the model's (a ``PreTrainedTokenizerFast``), ``eos_ids``: its end-of-sequence
    tokens. ``budget``: at most this many thinking tokens (``SamplingParams.thinking_token_budget``), after which
    ``</think>`` must follow (before it, the output may end while thinking, as without a budget); it needs
    ``</think>`` to be one token of the tokenizer."""
    if budget is not None:
        check_budget_tags(tokenizer, opens_inside)
    close = single_token(tokenizer, CLOSE)
    answer = f"@{ANSWER}" if grammar is not None else "answer"
    vocab = len(tokenizer)
    if close is None:
        reasoned, rules = f"FREE | THOUGHT {answer}", _TEXT_THINKING
    elif budget is None:
        reasoned = f"thinking (<[{close}]> {answer})?"
        rules = f"thinking: {_all_but({close, *eos_ids}, vocab)}*\n"
    elif budget == 0:
        reasoned, rules = f"<[{close}]> {answer}", ""
    else:  # fewer than budget tokens may end or close; budget tokens must close
        thought = _all_but({close, *eos_ids}, vocab)
        under = f"{thought}{{0,{budget - 1}}} " if budget > 1 else ""
        reasoned, rules = f"{under}(<[{close}]> {answer})? | {thought}{{{budget}}} <[{close}]> {answer}", ""
    if grammar is None:
        rules += f"answer: {_all_but(set(eos_ids), vocab)}*\n"  # any token; the end once the output wants it
    if opens_inside:
        start = f"start: {reasoned}\n"
    else:
        open_id = single_token(tokenizer, OPEN)
        opening = json.dumps(OPEN) if open_id is None else f"<[{open_id}]>"
        unopened = answer
        if grammar is None:  # a free answer must not open too: the thinking would be either, the budget unheld
            unopened = f"({_all_but({open_id, *eos_ids}, vocab)} {answer})?"  # (a budget's tags are single tokens)
        start = f"start: {unopened} | {opening} reasoned\nreasoned: {reasoned}\n"
    grammars = [{"lark_grammar": start + rules}]
    if grammar is not None:
        grammars.append({**_one_grammar(grammar), "name": ANSWER})
    return json.dumps({"grammars": grammars})


def check_budget_tags(tokenizer: Any, opens_inside: bool) -> None:
    """A SpecDecError unless a thinking budget can be held with this tokenizer: ``</think>`` one token (the budget
    counts the thinking's tokens up to it), and ``<think>`` too where the output may open its thinking
    (``opens_inside`` False)."""
    for tag, needed in ((CLOSE, True), (OPEN, not opens_inside)):
        if needed and single_token(tokenizer, tag) is None:
            raise SpecDecError(f"thinking_token_budget needs {tag} to be one token of the model's tokenizer (the "
                               "budget counts the thinking's tokens between the tags); this tokenizer spells it in "
                               "several")


def _all_but(excluded: set[int], vocab: int) -> str:
    """A Lark token class of every token id below ``vocab`` but ``excluded``: ``<[0-9,11-20]>``."""
    ranges, start = [], 0
    for token in sorted(t for t in excluded if 0 <= t < vocab) + [vocab]:
        if token > start:
            ranges.append(f"{start}-{token - 1}" if token - 1 > start else str(start))
        start = token + 1
    return f"<[{','.join(ranges)}]>"


def _one_grammar(grammar: str) -> dict[str, Any]:
    """``grammar`` as one entry of llguidance's grammar list."""
    try:
        top = json.loads(grammar)
    except ValueError:
        return {"lark_grammar": grammar}
    (entry,) = top["grammars"]
    return {key: value for key, value in entry.items() if key != "name"}
