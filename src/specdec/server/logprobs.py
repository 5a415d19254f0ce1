"""OpenAI's two ``logprobs`` shapes, built from the Python API's per-token logprobs
(:data:`~specdec.outputs.TokenLogprobDict`: the chosen token first, then the top tokens best first).

Completions (``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
``top_logprobs`` entry maps the text of the ``N`` most likely tokens, and of the chosen token when it is not
among them, to its logprob (up to ``N + 1`` entries, as OpenAI documents; two tokens with the same text share a
key). A token holding part of a UTF-8 character is written ``bytes:\\xNN...`` (OpenAI's way). ``text_offset``
is where each token's text starts in the choice's text (the sum of the decoded lengths of the tokens before it,
vLLM's way: a partial character counts as its U+FFFD).

Chat (``logprobs: true, top_logprobs: N``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}] * N}], "refusal": null}``; ``bytes`` are the token's exact bytes for byte-level
tokenizers (:class:`~specdec.text.TokenTexts`).

The values are the target's raw logprobs (:mod:`specdec.logprobs` says which distribution, under
speculation and under a structured-output constraint).
"""

from __future__ import annotations

from typing import Any

from specdec.logprobs import Logprob
from specdec.outputs import TokenLogprobDict
from specdec.text import TokenTexts


def _top(entry: TokenLogprobDict, token: int, num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely tokens of one position, best first."""
    ranked = sorted(((t, lp) for t, lp in entry.items() if t != token or lp.rank <= num_top),
                    key=lambda item: (item[1].rank, -item[1].logprob))
    return ranked[:num_top]


def _text(texts: TokenTexts, token: int, logprob: Logprob) -> str:
    """A token's string as OpenAI writes it: its text, or ``bytes:\\xe2\\x80`` for a token that holds part of
    a UTF-8 character (its text would be U+FFFD), or ``token_id:N`` without a tokenizer."""
    text = logprob.decoded_token
    if text is None:
        return f"token_id:{token}"
    if "\ufffd" in text:
        data = bytes(texts.bytes(token))
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    return text


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprobDict], num_top: int, texts: TokenTexts,
                        offset: int) -> tuple[dict[str, Any], int]:
    """The completions shape of some tokens whose text starts at character ``offset`` of the choice's
    text; returns it and the offset after them."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = _text(texts, token, chosen)
        tokens.append(text)
        values.append(chosen.logprob)
        top = {_text(texts, t, lp): lp.logprob for t, lp in _top(entry, token, num_top)}
        top.setdefault(text, chosen.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(chosen.decoded_token if chosen.decoded_token is not None else text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def prompt_completion_logprobs(prompt_ids: list[int], entries: list[TokenLogprobDict | None], num_top: int,
                               texts: TokenTexts) -> tuple[dict[str, Any], int]:
    """The completions shape of an echoed prompt (``entries``: the Python API's ``prompt_logprobs``, None for the
    first token, whose values are null as in OpenAI's API); returns it and the offset after the prompt."""
    first = prompt_ids[0]
    text = texts.text(first)
    head = {"tokens": [_text(texts, first, Logprob(0.0, None, text))], "token_logprobs": [None],
            "top_logprobs": [None], "text_offset": [0]}
    rest, offset = completion_logprobs(prompt_ids[1:], entries[1:], num_top, texts, len(text or ""))
    return {key: head[key] + rest[key] for key in head}, offset


def vllm_prompt_logprobs(entries: list[TokenLogprobDict | None]) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first token, then ``{token id: {"logprob", "rank",
    "decoded_token"}}`` per prompt token."""
    return [None if entry is None else {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                                                     "decoded_token": lp.decoded_token}
                                        for token, lp in entry.items()} for entry in entries]


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobDict], num_top: int,
                  texts: TokenTexts) -> dict[str, Any]:
    """The chat shape of some tokens."""
    def item(token: int, logprob: Logprob) -> dict[str, Any]:
        return {"token": _text(texts, token, logprob), "logprob": logprob.logprob, "bytes": texts.bytes(token)}

    content = [{**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, token, num_top)]}
               for token, entry in zip(token_ids, entries)]
    return {"content": content, "refusal": None}
