"""Text on top of token ids: incremental detokenization, stop strings and streaming deltas."""

from __future__ import annotations

import re

CONTEXT = 4
"""Tokens before the new ones that :class:`IncrementalText` decodes again with them (more where they hold no text)."""


class IncrementalText:
    """The text of a growing list of token ids, ``tokenizer.decode(ids, skip_special_tokens=...)``, kept up to date
    in work that does not grow with the list (decoding all of it at every token costs quadratic time: 3 s of a
    2-core CPU over a 4,000-token stream, all on the engine's step).

    Each :meth:`append` decodes a *window*: the new tokens after a few committed ones (the *context*, at least
    :data:`CONTEXT` tokens and some text). The window's text minus the context's is the new tokens' text, as the
    whole decode has it: a tokenizer's decoder acts on the first token of what it decodes (SentencePiece drops its
    leading space) or on neighbouring tokens (clean-up of spaces before punctuation), and the context gives both
    the same neighbours as in the whole output. The new text is committed once it does not end in U+FFFD (a
    character whose bytes are not all there yet), so a window never starts inside a character, nor inside a run of
    SentencePiece's byte tokens (``<0xE6>``: byte fallback decodes a run as a whole, each byte of an invalid run
    becoming U+FFFD; skipped special tokens do not end a run). Where the window's text does not begin with the
    context's (a decoder that changed text already committed), the whole list is decoded instead, and the text is
    what the whole decode is.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._committed = ""  # the text of ids[:_read]
        self._read = 0
        self._start = 0  # the window's first token
        self._context = ""  # the text of ids[_start:_read], decoded alone
        # What a tokenizer needs beyond decode(): its special ids and token pieces (a stand-in may lack both).
        self._skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._piece = getattr(tokenizer, "convert_ids_to_tokens", lambda _: None)

    def decode(self, ids: list[int]) -> str:
        """``ids`` decoded alone, as this text decodes them."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, ids: list[int]) -> str:
        """Add ``ids``; returns the whole text."""
        self.ids.extend(ids)
        window = self.decode(self.ids[self._start:])
        if window.startswith(self._context):
            self.text = self._committed + window[len(self._context):]
        else:
            self.text = self.decode(self.ids)
        if self.text != self._committed and not self.text.endswith("\ufffd"):
            self._committed, self._read = self.text, len(self.ids)
            start, self._context = self._read, ""
            while start > 0 and not self._context:
                start = max(0, start - CONTEXT)
                while start > 0 and self._in_run(start - 1) and self._in_run(start):
                    start -= 1
                self._context = self.decode(self.ids[start:self._read])
            self._start = start
        return self.text

    def _in_run(self, index: int) -> bool:
        """Whether token ``index`` may be inside a run of byte tokens: one of them, or a special token (skipped, so
        the bytes around it join)."""
        token = self.ids[index]
        piece = self._piece(token) or ""
        return token in self._skipped or _BYTE_TOKEN.fullmatch(piece) is not None


_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


class TextTracker:
    """Follows one request's output tokens and turns them into text.

    ``add(token_ids, stop_token)`` returns how many of the tokens to keep: fewer than given when a stop
    string completes inside them (the text is then cut before the stop string, or after it with ``include_stop``),
    never within the first ``min_tokens`` tokens (a stop string that completes there does not count, later
    either, as in vLLM). ``stop_token``: the last token is the stop token (a ``stop_token_ids`` token or
    end-of-sequence) that ended the output; as in vLLM v1 its text is left out unless ``include_stop`` (vLLM's
    ``include_stop_str_in_output``), and it is kept among the tokens. ``delta()`` returns the text that is safe
    to stream: never a part of a possible stop string (unless ``include_stop``, where the stop string is text),
    nor an incomplete UTF-8 sequence.

    The decoded text ends in U+FFFD while the bytes of its last character are incomplete; those
    replacement characters are not text yet (the next token may turn them into a character that
    completes a stop string), so the ``hold_back`` characters that may start a stop string are
    counted back from the text before them.

    Without stop strings and without streaming, text is decoded once, by ``finish``.
    """

    def __init__(self, tokenizer, stop_strings: tuple[str, ...], streaming: bool, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self._floor = 0  # decoded characters of the first min_tokens tokens: a stop string must end past them
        self.streaming = streaming
        # A stop string may start this many characters before a new token's text.
        self.hold_back = max((len(s) for s in stop_strings), default=1) - 1
        self._text = IncrementalText(tokenizer, skip_special_tokens)
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._streamed = 0

    @property
    def token_ids(self) -> list[int]:
        """The tokens of the text: one list, :class:`IncrementalText`'s (appended to directly where nothing is
        decoded until :meth:`finish`)."""
        return self._text.ids

    def add(self, token_ids: list[int], stop_token: bool = False) -> int:
        shown = token_ids[:-1] if stop_token and not self.include_stop else token_ids
        kept = self._add(shown)
        if self.stopped:  # a stop string ended the text at or before the stop token's place
            return kept
        return len(token_ids)

    def _add(self, token_ids: list[int]) -> int:
        if self.tokenizer is None:
            self.token_ids.extend(token_ids)
            return len(token_ids)
        if not self.stop_strings:
            if self.streaming:
                self.text = self._text.append(token_ids)
            else:
                self.token_ids.extend(token_ids)
            return len(token_ids)
        for kept, token in enumerate(token_ids, start=1):
            # A stop string that starts before the last hold_back decoded characters was found already.
            searched_from = max(0, _decoded_len(self.text) - self.hold_back)
            self.text = self._text.append([token])
            if len(self.token_ids) <= self.min_tokens:
                self._floor = _decoded_len(self.text)
                continue
            found = [(i, s) for s in self.stop_strings
                     if (i := self.text.find(s, max(searched_from, self._floor - len(s) + 1))) >= 0]
            if found:
                cut, self.stop_reason = min(found)
                self.text = self.text[:cut + len(self.stop_reason) if self.include_stop else cut]
                self.stopped = True
                return kept
        return len(token_ids)

    def finish(self) -> str:
        """The final text (decoded now if nothing required it earlier)."""
        if self.tokenizer is not None and not self.streaming and not self.stop_strings:
            self.text = self._text.decode(self.token_ids)
        return self.text

    def delta(self, final: bool) -> str:
        """Text not streamed yet; unless ``final``, holds back what a stop string or UTF-8 may change."""
        end = len(self.text)
        if not final:
            held = self.hold_back if self.stop_strings and not self.include_stop else 0
            end = max(self._streamed, _decoded_len(self.text) - held)
        piece = self.text[self._streamed : end]
        self._streamed = end
        return piece


def _decoded_len(text: str) -> int:
    """Length of ``text`` without its trailing U+FFFD (the bytes of a character not complete yet)."""
    return len(text.rstrip("\ufffd"))


class TokenTexts:
    """The text and the bytes of single tokens (cached per id), for logprobs.

    ``text(id)`` is the token decoded alone (special tokens kept), as vLLM's ``decoded_token``: a token that
    holds part of a UTF-8 character decodes to U+FFFD. ``bytes(id)`` is exact for byte-level BPE tokenizers
    (GPT-2's byte alphabet mapped back) and the UTF-8 of ``text(id)`` otherwise. Without a tokenizer both
    are None.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_level = _is_byte_level(tokenizer)

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int] | None:
        if self.tokenizer is None:
            return None
        data = self._bytes.get(token_id)
        if data is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self._byte_level else None
            if piece is not None and token_id not in self.tokenizer.all_special_ids and all(
                    c in _BYTE_OF for c in piece):
                data = [_BYTE_OF[c] for c in piece]
            else:
                data = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = data
        return data


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


def _is_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is a fast tokenizer with a byte-level decoder."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"
