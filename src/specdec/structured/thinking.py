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


def after_thinking(grammar: str, opens_inside: bool, tokenizer: Any, eos_ids: frozenset[int]) -> str:
    """The llguidance grammar (top-level JSON) of an output whose thinking is free and whose answer is ``grammar``
    (what llguidance's ``grammar_from`` builds: top-level JSON with one grammar, or Lark text); ``tokenizer``: the
    model's (a ``PreTrainedTokenizerFast``), ``eos_ids``: its end-of-sequence tokens."""
    close = single_token(tokenizer, CLOSE)
    if close is None:
        reasoned, rules = f"FREE | THOUGHT @{ANSWER}", _TEXT_THINKING
    else:
        reasoned = f"thinking (<[{close}]> @{ANSWER})?"
        rules = f"thinking: {_all_but({close, *eos_ids}, len(tokenizer))}*\n"
    if opens_inside:
        start = f"start: {reasoned}\n"
    else:
        opening = single_token(tokenizer, OPEN)
        opening = json.dumps(OPEN) if opening is None else f"<[{opening}]>"
        start = f"start: @{ANSWER} | {opening} reasoned\nreasoned: {reasoned}\n"
    return json.dumps({"grammars": [{"lark_grammar": start + rules}, {**_one_grammar(grammar), "name": ANSWER}]})


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
