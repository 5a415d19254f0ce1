"""Draft vocabularies (``draft_vocab_size``): head drafters and the trained early exit score only the most
frequent tokens of their folder's counts. Output stays the target's (greedy equality, chi-square with
probability outside the draft vocabulary), drafts come from the draft vocabulary only, layer_skip's
last draft forward runs no output head, and bad settings are refused by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers import VOCAB as MODEL_VOCAB
from helpers import build_model, run_graph_bodies_eagerly
from test_early_exit import make_adapter
from test_greedy_equality import MAX_TOKENS, PROMPTS, check_outputs, run_batch
from test_heads import llama, make_heads, references  # noqa: F401 - module fixtures
from test_sampling_exactness import BATCH, PROMPT, VOCAB, assert_matches_target

from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.draft_vocab import TOKEN_COUNTS_FILE, DraftVocab, save_token_counts

DRAFT_VOCAB = 24


def write_counts(folder, vocab: int, seed: int, default_size: int = 0) -> np.ndarray:
    """Random token counts for ``folder``, its default draft vocabulary ``default_size``; returns them."""
    tokens = np.random.default_rng(seed).integers(0, vocab, size=20 * vocab)
    save_token_counts(folder, tokens, vocab, default_size)
    return np.bincount(tokens, minlength=vocab)


def expected_ids(counts: np.ndarray, size: int) -> list[int]:
    """The ``size`` most frequent token ids, ties by id."""
    return sorted(range(len(counts)), key=lambda t: (-counts[t], t))[:size]


def record_drafts(llm) -> list[int]:
    """Every token the ``llm``'s drafter proposes from now on."""
    drafter, seen = llm.engine.drafter, []
    propose = drafter.propose

    def recording(seqs, ks, sampling):
        draft = propose(seqs, ks, sampling)
        for b in range(len(seqs)):
            seen.extend(draft.tokens[b, : draft.num_draft[b]].tolist())
        return draft

    drafter.propose = recording
    return seen


def test_draft_vocab_picks_the_most_frequent_tokens(tmp_path):
    lm_head = torch.randn(10, 4, dtype=torch.float64)
    save_token_counts(tmp_path, np.array([[3, 3, 7, 7, 1], [9, 0, 0, 0, 7]]), 10)
    vocab = DraftVocab.load(tmp_path, 3, lm_head)
    assert vocab.ids.tolist() == [0, 7, 3]  # 0 (three), 7 (three, higher id), 3 (two)
    assert torch.equal(vocab.head, lm_head[[0, 7, 3]])
    full = vocab.full(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64))
    assert full[0, [0, 7, 3]].tolist() == [1.0, 2.0, 3.0]
    assert torch.isinf(full).sum() == 7 and full.max() == 3.0
    assert DraftVocab.load(tmp_path, 0, lm_head) is None and DraftVocab.load(tmp_path, 10, lm_head) is None
    with pytest.raises(SpecDecError, match="cover \\(10,\\) tokens, not the 12 of the output head"):
        DraftVocab.load(tmp_path, 3, torch.randn(12, 4))
    with pytest.raises(SpecDecError, match=f"has no {TOKEN_COUNTS_FILE}"):
        DraftVocab.load(tmp_path / "none", 3, lm_head)


@pytest.mark.parametrize(("method", "extra"), [("medusa", {}), ("eagle", {}), ("mtp", {}),
                                               ("medusa", {"num_candidates": 2}), ("eagle", {"num_candidates": 2})])
def test_heads_with_a_draft_vocab_match_transformers(model_dirs, llama, references, tmp_path, method, extra):  # noqa: F811
    make_heads(llama, method, tmp_path / method, seed=1)
    counts = write_counts(tmp_path / method, MODEL_VOCAB, seed=2)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 4,
            "draft_vocab_size": DRAFT_VOCAB, **extra}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    drafts = record_drafts(llm)
    check_outputs(run_batch(llm), references)
    assert len(drafts) > 50 and set(drafts) <= set(expected_ids(counts, DRAFT_VOCAB))


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_captured_drafting_with_a_draft_vocab_matches_transformers(model_dirs, llama, references, tmp_path,  # noqa: F811
                                                                    monkeypatch, method):
    """What a GPU captures, on a CPU (each graph's body run once in place of a capture and replay): the drafter's
    forwards and its whole greedy draft chain score the draft vocabulary's rows of the head and map their argmax
    to token ids. Output equals transformers' greedy output; drafts come from the draft vocabulary."""
    run_graph_bodies_eagerly(monkeypatch)
    folder = tmp_path / method
    if method == "eagle":
        make_heads(llama, method, folder, seed=1)
    else:
        shutil.copytree(model_dirs["llama"]["truncated"], folder)
    counts = write_counts(folder, MODEL_VOCAB, seed=2)
    spec = {"method": method, "model": str(folder), "num_speculative_tokens": 4, "draft_vocab_size": DRAFT_VOCAB}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    drafter = llm.engine.drafter
    model = drafter.layer if method == "eagle" else drafter.model
    model.use_cuda_graphs = True
    drafts = record_drafts(llm)
    check_outputs(run_batch(llm), references)
    assert len(drafts) > 50 and set(drafts) <= set(expected_ids(counts, DRAFT_VOCAB))
    head = (drafter.vocab.head.data_ptr(), len(drafter.vocab.head))
    keys = list(drafter.cache.graphs.graphs)
    assert any(k[0] == "greedy_chain" and k[-1] == head for k in keys), keys
    assert any(k[0] == "forward" and head in k for k in keys), keys


def test_the_folder_sets_the_default_draft_vocab(model_dirs, llama, tmp_path):  # noqa: F811
    """The default size stored with a folder's counts applies; the speculative config's wins."""
    make_heads(llama, "mtp", tmp_path / "mtp", seed=3)
    counts = write_counts(tmp_path / "mtp", MODEL_VOCAB, seed=4, default_size=8)
    target = model_dirs["llama"]["target"]
    for override, allowed in ((None, expected_ids(counts, 8)), (0, range(MODEL_VOCAB))):
        spec = {"method": "mtp", "model": str(tmp_path / "mtp"), "draft_vocab_size": override}
        llm = LLM(target, speculative_config=spec, dtype="float64")
        drafts = record_drafts(llm)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=30))
        assert drafts and set(drafts) <= set(allowed)
        if override == 0:
            assert not set(drafts) <= set(expected_ids(counts, 8)), "the whole vocabulary drafts other tokens too"


def test_early_exit_with_a_draft_vocab_matches_transformers(model_dirs, llama, references, tmp_path):  # noqa: F811
    """The trained early exit scores the draft vocabulary; its last draft forward (hidden states for
    verification only) runs no output head."""
    make_adapter(llama, tmp_path / "ee", 1, seed=5)
    counts = write_counts(tmp_path / "ee", MODEL_VOCAB, seed=6)
    spec = {"method": "layer_skip", "model": str(tmp_path / "ee"), "num_speculative_tokens": 3,
            "draft_vocab_size": DRAFT_VOCAB}
    llm = LLM(model_dirs["llama"]["target"], speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    target, heads = llm.engine.target, []
    forward = target.forward

    def recording(batch, cache):
        out = forward(batch, cache)
        if batch.exit_adapter is not None:
            heads.append((batch.output_head.shape[0], out.logits.shape[-1], out.hidden is not None))
        return out

    target.forward = recording
    drafts = record_drafts(llm)
    check_outputs(run_batch(llm), references)
    assert len(drafts) > 50 and set(drafts) <= set(expected_ids(counts, DRAFT_VOCAB))
    assert set(heads) == {(DRAFT_VOCAB, DRAFT_VOCAB, True), (0, 0, True)}  # logits [M, V'] and none


def test_a_skip_set_from_layer_zero_runs_no_forward_for_hidden_states(model_dirs):
    """Training-free layer_skip skipping layer 0 reuses no hidden state: k forwards draft k tokens."""
    llm = LLM(model_dirs["llama"]["target"], dtype="float64", max_num_seqs=2,
              speculative_config={"method": "layer_skip", "skip_layers": [0], "num_speculative_tokens": 3})
    target, drafter, forwards, calls = llm.engine.target, llm.engine.drafter, [], []
    forward, propose = target.forward, drafter.propose

    def counting(batch, cache):
        forwards.append(batch.layers)
        return forward(batch, cache)

    def recording(seqs, ks, sampling):
        forwards.clear()
        draft = propose(seqs, ks, sampling)
        calls.append((max(ks), len(forwards)))
        return draft

    target.forward, drafter.propose = counting, recording
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=9))
    assert calls and all(k == n for k, n in calls), calls


@pytest.mark.parametrize("method", ["eagle", "mtp", "early_exit"])
def test_sampling_with_a_draft_vocab_matches_target(tmp_path, method):
    """Half the target's tokens lie outside the draft vocabulary: verification's residual restores them."""
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    target.save_pretrained(tmp_path / "target")
    if method == "early_exit":
        make_adapter(target, tmp_path / "heads", 1, seed=4, scale=3.0)
        spec = {"method": "layer_skip", "model": str(tmp_path / "heads")}
    else:
        make_heads(target, method, tmp_path / "heads", seed=4, scale=3.0, num_heads=2)
        spec = {"method": method, "model": str(tmp_path / "heads")}
    write_counts(tmp_path / "heads", VOCAB, seed=7)
    llm = LLM(tmp_path / "target", speculative_config={**spec, "num_speculative_tokens": 2,
                                                        "draft_vocab_size": VOCAB // 2},
              dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, f"{method} with a draft vocabulary")


def test_bad_draft_vocab_settings(model_dirs, llama, tmp_path):  # noqa: F811
    target = model_dirs["llama"]["target"]
    make_heads(llama, "eagle", tmp_path / "eagle", seed=8)
    cases = [
        ({"method": "ngram", "draft_vocab_size": 8}, "'ngram' takes no draft_vocab_size"),
        ({"method": "eagle", "model": str(tmp_path / "eagle"), "draft_vocab_size": -1}, "integer >= 0"),
        ({"method": "eagle", "model": str(tmp_path / "eagle"), "draft_vocab_size": True}, "integer >= 0"),
        ({"method": "eagle", "model": str(tmp_path / "eagle"), "draft_vocab_size": 8}, f"no {TOKEN_COUNTS_FILE}"),
        ({"method": "layer_skip", "draft_vocab_size": 8}, "only with its trained early exit"),
    ]
    for spec, message in cases:
        with pytest.raises(SpecDecError, match=message):
            LLM(target, speculative_config=spec, dtype="float64")
    (tmp_path / "eagle" / TOKEN_COUNTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(SpecDecError, match="cannot read the token counts"):
        LLM(target, speculative_config={"method": "eagle", "model": str(tmp_path / "eagle"), "draft_vocab_size": 8},
            dtype="float64")
    (tmp_path / "eagle" / "model.safetensors").write_bytes(b"not safetensors either")
    with pytest.raises(SpecDecError, match="cannot read the head weights"):
        LLM(target, speculative_config={"method": "eagle", "model": str(tmp_path / "eagle")}, dtype="float64")


@pytest.fixture(scope="module")
def arch_references(model_dirs):
    """transformers' greedy continuations of the shared prompts, per architecture."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch in ("llama", "qwen2", "gpt2"):
        model = AutoModelForCausalLM.from_pretrained(model_dirs[arch]["target"], dtype=torch.float64)
        refs[arch] = []
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            refs[arch].append(out[0, len(prompt):].tolist())
    return refs


def draft_folder(source, dest, vocab: int, seed: int, default_size: int = 0):
    """A copy of the draft model folder ``source`` at ``dest`` with random token counts; returns the counts."""
    shutil.copytree(source, dest)
    return write_counts(dest, vocab, seed, default_size)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_draft_model_with_a_draft_vocab_matches_transformers(model_dirs, arch_references, tmp_path, arch):
    """Every draft forward scores the draft vocabulary (batched rows, and one row through the one-row greedy
    chain); greedy output is the target's."""
    counts = draft_folder(model_dirs[arch]["truncated"], tmp_path / "draft", MODEL_VOCAB, seed=9)
    allowed = set(expected_ids(counts, DRAFT_VOCAB))
    for max_num_seqs in (16, 1):
        spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 4,
                "draft_vocab_size": DRAFT_VOCAB}
        llm = LLM(model_dirs[arch]["target"], speculative_config=spec, dtype="float64", max_num_seqs=max_num_seqs)
        drafts = record_drafts(llm)
        check_outputs(run_batch(llm), arch_references[arch])
        assert len(drafts) > 100 and set(drafts) <= allowed
        assert 0 < llm.batch_metrics.num_accepted_tokens < llm.batch_metrics.num_draft_tokens


def test_a_draft_model_and_a_cascade_with_a_draft_vocab_sample_the_target(tmp_path):
    target = build_model("llama", seed=11, vocab=VOCAB, layers=2, scale=3.0)
    target.save_pretrained(tmp_path / "target")
    for name, seed in (("draft", 12), ("small", 13)):
        build_model("llama", seed=seed, vocab=VOCAB, layers=1, scale=3.0).save_pretrained(tmp_path / name)
        write_counts(tmp_path / name, VOCAB, seed=seed, default_size=VOCAB // 2)  # the folder's default
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    llm = LLM(tmp_path / "target", speculative_config=spec, dtype="float64", max_num_seqs=BATCH)
    assert llm.engine.drafter.vocab.ids.numel() == VOCAB // 2
    assert_matches_target(target, llm, PROMPT, "draft_model with a draft vocabulary")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float64)  # its folder's counts
    shared = LLM(tmp_path / "target", speculative_config={**spec, "model": loaded}, dtype="float64")
    assert torch.equal(shared.engine.drafter.vocab.ids, llm.engine.drafter.vocab.ids)
    cascade = {"method": "cascade", "num_speculative_tokens": 2, "stages": [
        {"method": "draft_model", "model": str(tmp_path / "small"), "num_speculative_tokens": 1},
        {"method": "draft_model", "model": str(tmp_path / "draft")}]}
    llm = LLM(tmp_path / "target", speculative_config=cascade, dtype="float64", max_num_seqs=BATCH)
    assert_matches_target(target, llm, PROMPT, "cascade with draft vocabularies")


def test_draft_model_vocab_errors_and_the_transformers_backend(model_dirs, arch_references, tmp_path):
    """An explicit size needs the fast backend and a local folder with counts; a folder's default is left
    unused on the transformers backend (output unchanged)."""
    draft_folder(model_dirs["gpt2"]["truncated"], tmp_path / "gpt2", MODEL_VOCAB, seed=10, default_size=8)
    target = model_dirs["gpt2"]["target"]
    with pytest.raises(SpecDecError, match="needs the draft model on the fast backend"):
        LLM(target, speculative_config={"method": "draft_model", "model": str(tmp_path / "gpt2"),
                                        "draft_vocab_size": 8}, dtype="float64")
    llm = LLM(target, speculative_config={"method": "draft_model", "model": str(tmp_path / "gpt2")}, dtype="float64")
    assert llm.engine.drafter.vocab is None
    check_outputs(run_batch(llm), arch_references["gpt2"])
    with pytest.raises(SpecDecError, match=f"has no {TOKEN_COUNTS_FILE}"):
        LLM(model_dirs["llama"]["target"], dtype="float64", speculative_config={
            "method": "draft_model", "model": str(model_dirs["llama"]["truncated"]), "draft_vocab_size": 8})


def test_a_folders_default_is_not_used_under_cuda_graphs(tmp_path):
    """A draft's CUDA-graph forwards (a GPU) outweigh its head: the folder's default stays unused there,
    an explicit size still applies."""
    from types import SimpleNamespace

    from specdec.drafters import SpeculativeConfig
    from specdec.drafters.draft_model import DraftModelDrafter

    write_counts(tmp_path, 10, seed=1, default_size=4)
    graphed = SimpleNamespace(use_cuda_graphs=True, supports_layer_subsets=True, lm_head=torch.randn(10, 3))
    eager = SimpleNamespace(use_cuda_graphs=False, supports_layer_subsets=True, lm_head=torch.randn(10, 3))
    default = SpeculativeConfig(method="draft_model", model=str(tmp_path))
    explicit = SpeculativeConfig(method="draft_model", model=str(tmp_path), draft_vocab_size=4)
    assert DraftModelDrafter._vocab(default, graphed) is None
    assert DraftModelDrafter._vocab(explicit, graphed).ids.numel() == 4
    assert DraftModelDrafter._vocab(default, eager).ids.numel() == 4


def test_train_token_counts_writes_a_folders_counts_and_default(text_model_dirs, tmp_path, capsys):
    """``specdec train token-counts`` counts the training split with the target's tokenizer into a folder
    (its default size in the metadata); a missing folder or a negative size is a one-line error, exit 2."""
    from test_train import MODULES
    from test_train import _module_source as module_source

    from specdec.train.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in MODULES:
        (corpus / f"{name}.py").write_text(module_source(name))
    out = tmp_path / "heads"
    out.mkdir()
    common = ["--target", str(text_model_dirs["target"]), "--corpus", str(corpus), "--cache-dir", str(tmp_path / "c")]
    assert main(["token-counts", *common, "--out", str(out), "--draft-vocab-size", "8"]) == 0
    from transformers import AutoConfig

    size = AutoConfig.from_pretrained(text_model_dirs["target"]).vocab_size
    vocab = DraftVocab.load(out, None, torch.randn(size, 4))  # the folder's default: 8
    assert vocab is not None and vocab.ids.numel() == 8
    assert main(["token-counts", *common, "--out", str(tmp_path / "missing")]) == 2
    assert main(["token-counts", *common, "--out", str(out), "--draft-vocab-size", "-1"]) == 2
    assert "is not a folder" in capsys.readouterr().err
