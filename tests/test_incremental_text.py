"""Incremental detokenization (:class:`specdec.text.IncrementalText`): after every append, the text equals the whole
output decoded at once, for the kinds of tokenizer models ship (byte-level BPE, SentencePiece's metaspace with byte
fallback and a stripped first space, WordPiece with its clean-up of spaces), with special tokens skipped, added
tokens and characters split across tokens (random token ids: invalid byte runs too); and the work per append does not
grow with the output."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec import LLM, SamplingParams
from specdec.text import IncrementalText, TextTracker

TRIALS = 30
PIECES = ["a", "b", "the", "é", "日本", "ing", " ", ".", ",", "?", "'s", "n't", "\n", "x"]


def _sentencepiece(strip_decoder: bool) -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral style (replace, byte fallback, fuse, strip) or the metaspace decoder (newer SentencePiece
    conversions), with <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in PIECES:
        for form in (piece, "▁" + piece):
            vocab.setdefault(form.replace(" ", "▁"), len(vocab))
    vocab.setdefault("▁", len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    if strip_decoder:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _wordpiece() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[SEP]": 1}
    for piece in PIECES:
        for form in (piece.strip() or "x", "##" + (piece.strip() or "x")):
            vocab.setdefault(form, len(vocab))
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.add_special_tokens([AddedToken("[SEP]", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", sep_token="[SEP]")


def tokenizers_under_test(tokenizer_dir) -> dict[str, PreTrainedTokenizerFast]:
    byte_level = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    byte_level.add_tokens(["<think>", "</think>"])
    return {"byte_level": byte_level, "sentencepiece": _sentencepiece(True),
            "metaspace": _sentencepiece(False), "wordpiece": _wordpiece()}


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "metaspace", "wordpiece"])
def test_the_text_is_the_whole_decode_after_every_append(tokenizer_dir, name, skip):
    tokenizer = tokenizers_under_test(tokenizer_dir)[name]
    rng = random.Random(0)
    vocab = len(tokenizer)
    special = sorted(tokenizer.all_special_ids)
    for trial in range(TRIALS):
        text, ids = IncrementalText(tokenizer, skip_special_tokens=skip), []
        while len(ids) < 120:
            chunk = [rng.choice(special) if rng.random() < 0.08 else rng.randrange(vocab)
                     for _ in range(rng.randint(1, 5))]
            ids += chunk
            assert text.append(chunk) == tokenizer.decode(ids, skip_special_tokens=skip), (name, trial, ids)


def test_a_tracker_streams_what_the_whole_decode_holds(tokenizer_dir):
    tokenizer = tokenizers_under_test(tokenizer_dir)["sentencepiece"]
    ids = tokenizer.encode("the é日本 isn't a b.\nthe x", add_special_tokens=False) * 8
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    stop = whole[50:56]
    for stops in ((), (stop,)):
        tracker, streamed = TextTracker(tokenizer, stops, streaming=True), ""
        for i in range(0, len(ids), 3):
            tracker.add(ids[i:i + 3])
            streamed += tracker.delta(False)
            if tracker.stopped:
                break
        streamed += tracker.delta(True)
        assert streamed == tracker.finish() and streamed == (whole[:whole.index(stop)] if stops else whole)


def test_an_append_costs_the_same_late_in_a_long_output(tokenizer_dir):
    """Not a speed measurement: the work of an append must not grow with the output (it was a whole decode)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode("def f(x):\n    return x + 1\n" * 400)
    text = IncrementalText(tokenizer)
    calls = []
    decode = tokenizer.decode

    def counting(token_ids, **kwargs):
        calls.append(len(token_ids))
        return decode(token_ids, **kwargs)

    tokenizer.decode = counting
    for i in range(0, len(ids), 2):
        text.append(ids[i:i + 2])
    assert max(calls[len(calls) // 2:]) <= 16, "late appends decode only a window of tokens"
    assert text.text == decode(ids, skip_special_tokens=True)


def test_skip_special_tokens_false_keeps_them_in_the_text(text_model_dirs):
    """vLLM's ``skip_special_tokens``: the end-of-sequence token, made likely and not a stop (ignore_eos), is in the
    text only when special tokens are kept; whole, streamed and with a stop string alike."""
    llm = LLM(text_model_dirs["target"], dtype="float64")
    eos = llm.tokenizer.eos_token_id
    for skip in (True, False):
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias={eos: 50.0},
                                skip_special_tokens=skip)
        whole = llm.generate(["def"], params)[0].outputs[0].text
        streamed = "".join(piece.text for piece in llm.stream("def", params))
        stopped = llm.generate(["def"], dataclasses.replace(params, stop=["zzz"]))[0].outputs[0].text
        expected = "" if skip else "<|endoftext|>" * 5
        assert whole == streamed == stopped == expected, skip
