"""A draft model with another tokenizer: drafts converted through text, output exactly the target's.

The target is a tiny Llama that has memorised a few lines of code (so its greedy text is
canonically tokenized) behind a byte-level BPE with merges. Two drafts: ``permuted``, the
target itself behind a tokenizer whose ids are permuted (a different vocabulary that agrees
with the target, so most drafts are accepted and the text conversion is exercised), and
``other``, a random model behind a BPE with another size and other merges.
"""

import copy
import json

import numpy as np
import pytest
import torch
from helpers import build_model, spy
from scipy.stats import chisquare
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import specdec.verify
from specdec import LLM, SamplingParams, SpecDecError
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter, target_continuation
from specdec.sampling import logits_to_probs
from specdec.verify import common_prefix

CORPUS = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n", "def g(y):\n    return y * 2\n"]
PROMPTS = ["def f(x):\n", "for i in range(", "def g(y):\n    return", "    print(i)\n"]


def bpe(vocab_size: int, special: str, text: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (256 bytes, ``special``, merges learnt from ``text``)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special)


def trained_target(tokenizer: PreTrainedTokenizerFast):
    """A tiny Llama that has memorised ``CORPUS`` (so its greedy text is canonically tokenized)."""
    model = build_model("llama", seed=7, vocab=len(tokenizer), layers=2)
    ids = torch.tensor([tokenizer.encode("".join(CORPUS * 3))])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(80):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """``target`` (a folder with its BPE), the loaded ``model``, and the ``permuted`` and ``other`` drafts."""
    root = tmp_path_factory.mktemp("cross")
    tok = bpe(300, "<|endoftext|>", CORPUS)
    target = trained_target(tok)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    # permuted: the target's weights, token ids reversed (the special token 0 kept).
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    size = len(vocab)
    perm = [0] + list(range(size - 1, 0, -1))  # old id -> new id, an involution
    spec["model"]["vocab"] = {token: perm[i] for token, i in vocab.items()}
    permuted_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                           eos_token="<|endoftext|>")
    permuted_tok.save_pretrained(root / "permuted")
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight[perm])
        draft.lm_head.weight.copy_(target.lm_head.weight[perm])
    draft.save_pretrained(root / "permuted")
    # other: another BPE (other size, other merges) and a random model.
    other_tok = bpe(280, "<s>", ["x = [i * 2 for i in items]\nreturn sorted(x)\n"])
    other_tok.save_pretrained(root / "other")
    build_model("llama", seed=3, vocab=len(other_tok), layers=1).save_pretrained(root / "other")
    return {"target": root / "target", "model": target, "permuted": root / "permuted", "other": root / "other"}


def plain_greedy(target_dir, prompts, max_tokens):
    llm = LLM(target_dir, dtype="float64", max_num_seqs=len(prompts))
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


@pytest.mark.parametrize("which,backend", [("permuted", "auto"), ("other", "auto"), ("permuted", "hf")])
def test_greedy_equals_plain_greedy_batched(pair, which, backend):
    spec = {"method": "draft_model", "model": str(pair[which]), "num_speculative_tokens": 3}
    llm = LLM(pair["target"], speculative_config=spec, dtype="float64", max_num_seqs=4, backend=backend)
    assert isinstance(llm.engine.drafter, CrossTokenizerDrafter)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    expected = plain_greedy(pair["target"], PROMPTS, 24)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    batch = llm.batch_metrics
    assert batch.mean_batch_size > 1, "the prompts must have run batched"
    assert batch.num_draft_tokens > 0
    if which == "permuted":  # the same model in another token space: its drafts are mostly right
        assert batch.num_accepted_tokens > 0.5 * batch.num_draft_tokens


def test_target_continuation_keeps_whole_tokens(pair):
    tok = PreTrainedTokenizerFast.from_pretrained(pair["target"])
    committed = tok.encode("def f(x):")
    whole = tok.encode("def f(x):\n    return x + 1\n")
    assert whole[: len(committed)] == committed
    tokens = target_continuation(tok, committed, "\n    return x + 1\n", limit=64, vocab_size=len(tok))
    assert tokens == whole[len(committed):-1]  # the last token may be cut by the text's end
    assert len(tokens) > 2
    assert target_continuation(tok, committed, "\n    return x + 1\n", limit=2, vocab_size=len(tok)) == tokens[:2]
    assert target_continuation(tok, committed, "\n    return x + 1\n", limit=64, vocab_size=3) == []
    # "\n" then "    " merge into one target token: the committed "\n" cannot be extended by "    return".
    newline = tok.encode("def f(x):\n")
    assert tok.encode("def f(x):\n    return")[: len(newline)] != newline
    assert target_continuation(tok, newline, "    return x", limit=64, vocab_size=len(tok)) == []


def test_drafts_are_deterministic(pair):
    """Verification gets ``probs`` None under sampling: a one-hot q, exact whatever the draft."""
    spec = {"method": "draft_model", "model": str(pair["permuted"]), "num_speculative_tokens": 2}
    llm = LLM(pair["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    drafter = llm.engine.drafter
    seen = []
    propose = drafter.propose

    def spy(seqs, ks, sampling):
        batch = propose(seqs, ks, sampling)
        seen.append(batch)
        return batch

    drafter.propose = spy
    llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True))
    assert seen and all(batch.probs is None for batch in seen)
    assert sum(sum(batch.num_draft) for batch in seen) > 0


def test_draft_pool_rolls_back_in_its_own_token_space(pair):
    """After every step the draft's pool holds a prefix of the new context (in draft tokens), all of
    what it shares with it, and only the unshared tail is fed again."""
    spec = {"method": "draft_model", "model": str(pair["permuted"]), "num_speculative_tokens": 3}
    llm = LLM(pair["target"], speculative_config=spec, dtype="float64", max_num_seqs=4)
    drafter = llm.engine.drafter
    observe, gaps = drafter.observe, []

    def checked(seqs, num_accepted):
        held = {s.slot: list(drafter.fed[s.slot]) for s in seqs}
        observe(seqs, num_accepted)
        for s in seqs:
            if not held[s.slot]:  # nothing in the pool (the row has not drafted): encoded when it does
                assert s.slot not in drafter.context and drafter.cache.lengths[s.slot] == 0
                continue
            context, fed = drafter.context[s.slot], drafter.fed[s.slot]
            assert drafter.cache.lengths[s.slot] == len(fed) < len(context)
            assert fed == context[: len(fed)] == held[s.slot][: len(fed)]
            assert len(fed) == min(len(context) - 1, common_prefix(held[s.slot], context))
            gaps.append(len(context) - len(fed))

    drafter.observe = checked
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert gaps and sum(gaps) / len(gaps) < 3


def test_a_row_that_sits_out_costs_the_draft_nothing_and_catches_up_when_it_drafts(pair):
    """A row that does not draft (auto k's k = 0) is neither encoded in the draft's tokens nor fed to the draft;
    ``backlog`` counts the draft tokens its next proposal feeds; that proposal feeds them all, and the output
    is still the target's greedy output."""
    spec = {"method": "draft_model", "model": str(pair["permuted"]), "num_speculative_tokens": 2}
    llm = LLM(pair["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    engine, drafter = llm.engine, llm.engine.drafter
    encodes = spy(drafter, "_draft_context")
    forwards = spy(drafter.model, "forward")
    tok = PreTrainedTokenizerFast.from_pretrained(pair["target"])
    prompt = tok.encode(PROMPTS[0])
    llm.submit({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    engine.policy.choose = lambda seqs, limits, *_: [0] * len(seqs)  # sit out
    outputs = [o.token_ids for _ in range(4) for o in llm.step()]
    seq = llm.scheduler.running[0]
    assert not encodes and not forwards and drafter.cache.lengths[seq.slot] == 0
    text = tok.decode(seq.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    committed = len(drafter.draft_tokenizer.encode(text))
    assert drafter.backlog([seq]) == [committed] and committed > len(prompt)
    engine.policy.choose = lambda seqs, limits, *_: [min(2, limit) for limit in limits]
    left, catch_up = [], drafter.catch_up
    drafter.catch_up = lambda seqs, ks: (catch_up(seqs, ks), left.append(drafter.backlog(seqs)))
    outputs += [o.token_ids for o in llm.step()]
    assert left[0] == [2]  # the engine's catch-up first: the proposal's forward feeds the last two draft tokens
    assert forwards and drafter.backlog([seq])[0] <= 2  # caught up: the pending token and an accepted draft
    while llm.scheduler.has_work:
        outputs += [o.token_ids for o in llm.step()]
    assert [t for out in outputs for t in out] == plain_greedy(pair["target"], [PROMPTS[0]], 16)[0]
    assert llm.batch_metrics.num_draft_tokens > 0


SAMPLES = 1200


def first_token_counts(llm, prompt_ids, vocab, settings):
    counts = np.zeros(vocab)
    for call in range(SAMPLES // 16):
        params = [SamplingParams(max_tokens=2, seed=call * 16 + j + 1, ignore_eos=True, **settings) for j in range(16)]
        for out in llm.generate([{"prompt_token_ids": prompt_ids}] * 16, params):
            counts[out.outputs[0].token_ids[0]] += 1
    return counts


def pvalue(counts, probs):
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def sampling_case(pair):
    """The first token after a prompt, at a temperature where the target's top token has about half
    the mass (many rejections of the draft's greedy token), with the permuted draft."""
    tok = PreTrainedTokenizerFast.from_pretrained(pair["target"])
    prompt_ids = tok.encode(PROMPTS[0])
    settings = {"temperature": 2.0, "top_k": 4}
    with torch.no_grad():
        probs = logits_to_probs(pair["model"](torch.tensor([prompt_ids])).logits[0, -1], SamplingParams(**settings))
    spec = {"method": "draft_model", "model": str(pair["permuted"]), "num_speculative_tokens": 2}
    llm = LLM(pair["target"], speculative_config=spec, dtype="float64", max_num_seqs=16)
    return llm, prompt_ids, settings, probs.numpy()


def test_first_token_follows_target_distribution(pair):
    llm, prompt_ids, settings, probs = sampling_case(pair)
    counts = first_token_counts(llm, prompt_ids, len(probs), settings)
    assert llm.batch_metrics.num_draft_tokens > 0
    assert pvalue(counts, probs) > 1e-3


def test_broken_residual_is_caught(pair, monkeypatch):
    """Recovering from p instead of p without the rejected draft over-produces the draft token."""
    monkeypatch.setattr(specdec.verify, "residual_distribution", lambda p, q: p)
    llm, prompt_ids, settings, probs = sampling_case(pair)
    assert 0.2 < probs.max() < 0.9, "the first token's distribution must make rejections frequent"
    counts = first_token_counts(llm, prompt_ids, len(probs), settings)
    assert pvalue(counts, probs) < 1e-6


def test_draft_without_tokenizer_and_other_vocabulary(pair, tmp_path):
    build_model("llama", seed=5, vocab=80).save_pretrained(tmp_path / "draft")
    spec = {"method": "draft_model", "model": str(tmp_path / "draft")}
    with pytest.raises(SpecDecError, match="the draft has no tokenizer"):
        LLM(pair["target"], speculative_config=spec)


def test_target_without_tokenizer_and_other_vocabulary(model_dirs, pair):
    spec = {"method": "draft_model", "model": str(pair["other"])}
    with pytest.raises(SpecDecError, match="the target has no tokenizer"):
        LLM(model_dirs["llama"]["target"], speculative_config=spec)


def test_confidence_threshold_is_refused(pair):
    spec = {"method": "draft_model", "model": str(pair["other"]), "draft_confidence_threshold": 0.5}
    with pytest.raises(SpecDecError, match="draft_confidence_threshold is not supported"):
        LLM(pair["target"], speculative_config=spec)
