"""``specdec verify`` passes on a correct configuration and fails on deliberately broken verifiers.

Tiny float64 models without a tokenizer (the command then uses random token-id prompts): a target
and an independent draft whose distributions overlap about half, so that rejections (and the
residual) matter.
"""

import pytest
from helpers import build_model

import specdec.engine
import specdec.verify
from specdec.cli import main

VOCAB = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_cli")
    build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0).save_pretrained(root / "target")
    build_model("llama", seed=12, vocab=VOCAB, layers=1, scale=3.0).save_pretrained(root / "draft")
    return root


def verify(pair, *extra):
    return main(["verify", "--model", str(pair / "target"), "--speculative-model", str(pair / "draft"),
                 "--dtype", "float64", "--num-prompts", "4", "--max-tokens", "24", "--sampling-prompts", "1",
                 "--samples", "1000", "--top-k", "6", *extra])


@pytest.mark.parametrize("k", ["2", "auto"])
def test_passes_on_a_correct_configuration(pair, capsys, k):
    assert verify(pair, "--num-speculative-tokens", k) == 0
    out = capsys.readouterr().out
    assert "4 identical, 0 rounding ties, 0 mismatches" in out
    assert ": ok" in out and "verdict: PASS" in out


PENALTIES = ["--presence-penalty", "-1.5", "--frequency-penalty", "-1", "--repetition-penalty", "1.5"]
"""Negative presence and frequency penalties: a repeat is likelier, so counting a draft's path wrong shows."""


def test_passes_with_penalties_and_fails_when_the_drafts_path_is_not_counted(pair, capsys, monkeypatch):
    """Both checks run with the penalties (the reference adjusts the target's logits as plain decoding does);
    the target's columns adjusted for the output alone, not the drafts before them, fail."""
    assert verify(pair, "--num-speculative-tokens", "2", *PENALTIES) == 0
    out = capsys.readouterr().out
    assert "presence penalty -1.5, frequency penalty -1, repetition penalty 1.5" in out
    assert "4 identical" in out and "verdict: PASS" in out
    adjust = specdec.engine.adjust
    monkeypatch.setattr(specdec.engine, "adjust",
                        lambda logits, seqs, rows, *drafts: adjust(logits, seqs, rows))
    assert verify(pair, "--num-speculative-tokens", "2", *PENALTIES) == 1
    assert "verdict: FAIL" in capsys.readouterr().out


def test_fails_when_the_residual_is_wrong(pair, capsys, monkeypatch):
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    assert verify(pair, "--num-speculative-tokens", "1") == 1
    out = capsys.readouterr().out
    assert "0 mismatches" in out  # greedy rows are untouched by the residual
    assert ": FAIL" in out and "verdict: FAIL" in out


def test_fails_when_greedy_verification_accepts_everything(pair, capsys, monkeypatch):
    def accept_all(target_tokens, draft_tokens, num_draft):
        return num_draft

    monkeypatch.setattr(specdec.engine, "greedy_accepted", accept_all)
    assert verify(pair, "--num-speculative-tokens", "2", "--sampling-prompts", "0") == 1
    out = capsys.readouterr().out
    assert "mismatch at token" in out and "verdict: FAIL" in out


def test_plain_is_a_bad_input(pair, capsys):
    assert verify(pair, "--speculative-method", "none") == 2
    assert "error:" in capsys.readouterr().err


def test_a_prompts_file_shorter_than_the_sampling_prompts_is_a_bad_input(pair, capsys, tmp_path):
    """--sampling-prompts past the prompts a file holds ran the test on fewer prompts, silently."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    assert verify(pair, "--prompts-file", str(prompts), "--sampling-prompts", "2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampling-prompts 2 is more than the 1 prompts of" in err[0]


def test_a_bad_penalty_is_a_bad_input(pair, capsys):
    assert verify(pair, "--presence-penalty", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "presence_penalty must be a number in [-2, 2], got 3.0" in err[0]
