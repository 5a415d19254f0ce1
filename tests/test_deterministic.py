"""``LLM(..., deterministic=True)`` in bfloat16 (:mod:`specdec.models.deterministic`).

- The kernels: a row's product and a query's attention have the same bits whatever else is in the
  forward (rows, queries, key length); the default kernels do not (the same checks find differences).
- A request's greedy tokens are the same alone, batched, reversed in the batch and under continuous
  batching (more requests than slots: they join and leave); greedy speculation equals plain greedy
  decoding bit for bit for every method, chains and trees; seeded sampling with every method (auto k
  and a suffix cache fed by another request included), batched, equals plain decoding's alone (keyed
  noise); with the mode off, draft_model's seeded tokens differ from plain decoding's. With the mode
  off the batch comparisons find a difference on this model (bfloat16 rounding
  that depends on the batch), so the checks can fail. (Speculative against plain output with the mode
  off differed on other seeds of this shape, 0-3 of 8 prompts, but not on this fixture's six prompts:
  see the lab note; the kernel tests above show the verification/decode difference directly.)
- Refusals: transformers' backend and models the fast backend cannot run raise a clear error.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import truncated_copy
from test_heads import make_heads
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import LLM, SamplingParams
from specdec.errors import SpecDecError
from specdec.models import deterministic as det
from specdec.models.base import ForwardBatch
from specdec.models.cpu_linear import linear, pack
from specdec.models.layers import attend
from specdec.models.loader import load_causal_lm

VOCAB = 256
CONTEXT = 160
MAX_TOKENS = 24
rng = random.Random(3)
PROMPTS = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 17, 9, 30, 5, 12)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


# ---------------------------------------------------------------- kernels
def test_products_are_row_invariant_and_default_ones_are_not():
    """A row of a product (reduced width 1536: past oneDNN's single block; bfloat16 and float32, plain and
    packed) alone and in batches of 2..64 rows at any place: identical bits with :func:`rows_linear`;
    not by default (a lone bfloat16 row differs with two threads, float32 rows below four with any; where oneDNN
    runs AMX, bfloat16 rows past 32 and plain float32 rows past 12)."""
    torch.manual_seed(0)
    weight = (torch.randn(256, 1536) * 0.05).bfloat16()
    rows = torch.randn(64, 1536)
    differ = {"det": 0, "default": 0}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for w in (weight, pack(weight), weight.float(), pack(weight.float(), bfloat16_storage=False)):
            _count_row_differences(w, rows.to(w.dtype), differ)
    finally:
        torch.set_num_threads(threads)
    assert differ["det"] == 0
    assert differ["default"] > 0, "the default products were expected to depend on the rows (this CPU?)"


def test_packed_products_are_row_invariant_by_default():
    """A packed bfloat16 product (:func:`~specdec.models.cpu_linear.linear`, which computes fewer than 4 rows of
    more than 1024 as 4) gives a row the same bits alone and in 2..24 rows, wide or narrow: why
    :func:`rows_linear` leaves packed weights unpadded (a verification's 5 rows stay 5)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for width in (512, 2048):  # at 2048 a lone row unpadded takes the one-row kernel and differs
            weight = pack((torch.randn(2048, width) * 0.05).bfloat16())
            differ = {"det": 0, "default": 0}
            _count_row_differences(weight, torch.randn(24, width).bfloat16(), differ)
            assert differ == {"det": 0, "default": 0}, width
    finally:
        torch.set_num_threads(threads)


def _count_row_differences(w: torch.Tensor, rows: torch.Tensor, differ: dict[str, int]) -> None:
    for m in (n for n in (2, 3, 5, 24, 40, 64) if n <= len(rows)):
        batch = rows[:m]
        for label, fn in (("det", lambda x: det.rows_linear(linear, x, w)), ("default", lambda x: linear(x, w))):
            full = fn(batch)
            differ[label] += sum(not torch.equal(full[i], fn(batch[i : i + 1])[0]) for i in range(m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (8, 2, 128), (32, 4, 64)])
def test_attention_is_query_and_key_invariant_and_sdpa_is_not(heads, kv_heads, dim, dtype):
    """A query's attention output as a one-token decode (exact key length) against the same query in a
    verification of 2..9 queries or a prefill chunk of 33, over a key length padded past it: identical with
    :func:`det.attend`, not with the default SDPA. A head size of 128 with 4 queries per KV head gives products
    over 8 to 132 query columns (on an AMX Xeon, queries as a product's rows took other bits past 4 of them). In
    float32 nothing rounds the output afterwards: with 4 or 8 query columns against 12 or more, the AVX2 EPYC's
    products differed in 42-53 of these 53 queries until the columns were padded to 16."""
    torch.manual_seed(1)
    keys, values = torch.randn(2, 1, kv_heads, 400, dim).to(dtype).unbind(0)
    q = torch.randn(1, heads, 400, dim).to(dtype)
    differ = {True: 0, False: 0}
    for deterministic in (True, False):
        for start, width, extra in ((40, 5, 0), (100, 9, 30), (300, 4, 70), (63, 2, 1), (200, 33, 0)):
            length = start + width + extra
            mask = (torch.arange(length)[None, :] <= torch.arange(start, start + width)[:, None])[None, None]
            out = attend(q[:, :, start : start + width], keys[:, :, :length], values[:, :, :length], mask,
                         dim**-0.5, heads != kv_heads, False, deterministic=deterministic)
            for t in range(width):
                p = start + t
                alone = attend(q[:, :, p : p + 1], keys[:, :, : p + 1], values[:, :, : p + 1], None, dim**-0.5,
                               heads != kv_heads, True, deterministic=deterministic)
                differ[deterministic] += not torch.equal(out[:, :, t : t + 1], alone)
    assert differ[True] == 0
    assert differ[False] > 0, "SDPA was expected to depend on the query count and key length (this CPU?)"


def test_blocked_attention_matches_sdpa_closely():
    torch.manual_seed(2)
    q = torch.randn(2, 8, 5, 16)
    keys, values = torch.randn(2, 2, 2, 150, 16).unbind(0)
    mask = torch.rand(2, 1, 5, 150) > 0.3
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(det.attend(q, keys, values, mask, 16**-0.5), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- end to end
def _float32_llama(bfloat16_values: bool, root) -> str:
    """A random float32 Llama (8 heads over 2 KV heads, so a verification's queries fill several product columns)
    saved under ``root``; ``bfloat16_values``: its weights hold bfloat16 values (stored in bfloat16 where the
    bfloat16-weight product runs, else float32 products as the others)."""
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=CONTEXT)
    model = LlamaForCausalLM(config).eval()
    if bfloat16_values:
        model = model.bfloat16().float()
    model.save_pretrained(root)
    return str(root)


def _row_logits(lm, tokens: list[int], feeds: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
    """Row 0's logits from its 8th token on, its 12 tokens fed as ``feeds`` say (each a list of (row, count));
    row 1 feeds ``tokens[20:]`` beside it where a feed names it."""
    cache, fed, out = lm.new_cache(2, 96), [0, 0], []
    for feed in feeds:
        rows = [tokens[20 * r + fed[r] : 20 * r + fed[r] + n] for r, n in feed]
        batch = ForwardBatch.from_rows(rows, [fed[r] for r, _ in feed], [r for r, _ in feed], lm.device)
        out.append(lm.forward(batch, cache).logits.reshape(-1, VOCAB)[: feed[0][1]])
        for r, n in feed:
            fed[r] += n
    return list(torch.cat(out)[7:])


@pytest.mark.parametrize("bfloat16_values", [False, True])
def test_float32_logits_do_not_depend_on_the_forward(tmp_path, bfloat16_values):
    """In float32 a position's logits have the same bits fed one token at a time (plain decoding), as one of 5
    tokens fed together (a verification), and beside a row with a longer cache and more tokens (a batch). Not
    so with the mode off."""
    folder = _float32_llama(bfloat16_values, tmp_path / "model")
    tokens = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    differ = {}
    for deterministic in (True, False):
        lm = load_causal_lm(folder, dtype=torch.float32, device="cpu", backend="fast", deterministic=deterministic)
        one_by_one = _row_logits(lm, tokens, [[(0, 7)], *[[(0, 1)]] * 5])
        verified = _row_logits(lm, tokens, [[(0, 7)], [(0, 5)]])
        batched = _row_logits(lm, tokens, [[(0, 7), (1, 30)], [(0, 5), (1, 9)]])
        differ[deterministic] = sum(not torch.equal(a, b) for a, b in zip(one_by_one, verified)) + sum(
            not torch.equal(a, b) for a, b in zip(one_by_one, batched))
    assert differ[True] == 0
    assert differ[False] > 0, "the default forward was expected to depend on the tokens beside (this CPU?)"


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A random bfloat16 Llama (MLP width 1536, so the down projection reduces past one oneDNN block),
    its first layer as a draft, and medusa/eagle heads; folders by name."""
    root = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.to(torch.bfloat16).save_pretrained(root / "target")
    truncated_copy(model, 1).save_pretrained(root / "draft")
    for method in ("medusa", "eagle", "mtp"):
        make_heads(model.double(), method, root / method, seed=5)
    return {name: root / name for name in ("target", "draft", "medusa", "eagle", "mtp")}


def llm(dirs, deterministic: bool, spec=None, slots: int = 8) -> LLM:
    return LLM(dirs["target"], speculative_config=spec, dtype="bfloat16", max_num_seqs=slots,
               max_model_len=CONTEXT, deterministic=deterministic)


def tokens(engine: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate([{"prompt_token_ids": p} for p in prompts], params)]


def batch_variants(dirs, deterministic: bool) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens alone, all batched, batched in reverse order, and 6 prompts through
    2 slots (continuous batching: rows join and leave between steps)."""
    engine = llm(dirs, deterministic)
    alone = [tokens(engine, [p])[0] for p in PROMPTS]
    return {"alone": alone, "batched": tokens(engine, PROMPTS), "reversed": tokens(engine, PROMPTS[::-1])[::-1],
            "continuous": tokens(llm(dirs, deterministic, slots=2), PROMPTS)}


def test_tokens_do_not_depend_on_the_batch(bf16):
    on = batch_variants(bf16, True)
    for name, outputs in on.items():
        assert outputs == on["alone"], name
    off = batch_variants(bf16, False)
    assert any(outputs != off["alone"] for outputs in off.values()), "mode off: expected a batch-dependent token"


def test_streams_joining_mid_generation_match_alone(bf16):
    """Streams started at different steps (one joins while the others run, one leaves early)."""
    engine = llm(bf16, True)
    alone = [tokens(engine, [p])[0] for p in PROMPTS[:3]]
    streams = [engine.stream({"prompt_token_ids": p}, GREEDY) for p in PROMPTS[:3]]
    got = [[], [], []]
    got[0].extend(next(streams[0]).token_ids)
    got[0].extend(next(streams[0]).token_ids)
    got[1].extend(next(streams[1]).token_ids)
    early = engine.stream({"prompt_token_ids": PROMPTS[3]}, GREEDY)
    next(early)
    early.close()  # leaves after one step
    for i, stream in enumerate(streams):
        for out in stream:
            got[i].extend(out.token_ids)
    assert got == alone


CHAIN = {
    "draft_model": lambda d: {"method": "draft_model", "model": str(d["draft"]), "num_speculative_tokens": 4},
    "ngram": lambda d: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                        "prompt_lookup_min": 1},
    "suffix": lambda d: {"method": "suffix", "num_speculative_tokens": 4},
    "layer_skip": lambda d: {"method": "layer_skip", "num_speculative_tokens": 3, "skip_layers": [1]},
    "mtp": lambda d: {"method": "mtp", "model": str(d["mtp"]), "num_speculative_tokens": 2},
    "cascade": lambda d: {"method": "cascade", "num_speculative_tokens": 4, "stages": [
        {"method": "draft_model", "model": str(d["draft"]), "num_speculative_tokens": 2},
        {"method": "draft_model", "model": str(d["draft"])}]},
    "auto": lambda d: {"method": "auto", "num_speculative_tokens": 3, "candidates": [
        {"method": "ngram", "prompt_lookup_min": 1}, {"method": "draft_model", "model": str(d["draft"])}]},
}
TREE = {
    "ngram tree": lambda d: {"method": "ngram", "num_speculative_tokens": 4, "num_candidates": 2,
                             "prompt_lookup_min": 1},
    "lookahead": lambda d: {"method": "lookahead", "num_speculative_tokens": 4},
    "medusa tree": lambda d: {"method": "medusa", "model": str(d["medusa"]), "num_speculative_tokens": 4,
                              "num_candidates": 2},
    "eagle tree": lambda d: {"method": "eagle", "model": str(d["eagle"]), "num_speculative_tokens": 4,
                             "num_candidates": 2},
}


@pytest.fixture(scope="module")
def plain_tokens(bf16):
    return tokens(llm(bf16, True), PROMPTS)


@pytest.mark.parametrize("method", [*CHAIN, *TREE])
def test_greedy_speculation_equals_plain_bit_for_bit(bf16, plain_tokens, method):
    spec = {**CHAIN, **TREE}[method](bf16)
    engine = llm(bf16, True, spec)
    assert tokens(engine, PROMPTS) == plain_tokens
    assert engine.batch_metrics.num_draft_tokens > 0


ADJUSTED = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2, "logit_bias": {7: 1.5}}
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95, seed=10 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                          **(ADJUSTED if i % 2 else {})) for i in range(len(PROMPTS))]
"""Every other request with penalties and a bias (:mod:`specdec.penalties`): the drafter draws from adjusted
logits, the target's are adjusted at every column, and the tokens stay plain decoding's."""


@pytest.fixture(scope="module")
def plain_sampled(bf16):
    """Each prompt's seeded sampled tokens alone, plain decoding."""
    engine = llm(bf16, True)
    return [tokens(engine, [p], q)[0] for p, q in zip(PROMPTS, SAMPLED)]


def sampled_batched(engine: LLM) -> list[list[int]]:
    """The prompts' seeded sampled tokens in one batch, in reverse order."""
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS][::-1], SAMPLED[::-1])
    return [o.outputs[0].token_ids for o in outputs][::-1]


AUTO_K = {"draft_model auto k": lambda d: {"method": "draft_model", "model": str(d["draft"]),
                                           "num_speculative_tokens": "auto"}}


@pytest.mark.parametrize("method", [None, *CHAIN, *TREE, *AUTO_K])
def test_seeded_sampling_equals_plain_alone_with_every_method(bf16, plain_sampled, method):
    """Keyed noise (:mod:`specdec.keyed_noise`): a seeded request's tokens, batched with any method, are
    those plain decoding samples for it alone, also where drafts depend on other requests (suffix: a
    warm-up request feeds its cache first) or on timings (auto k)."""
    spec = None if method is None else {**CHAIN, **TREE, **AUTO_K}[method](bf16)
    engine = llm(bf16, True, spec)
    if method == "suffix":
        tokens(engine, [PROMPTS[1] + PROMPTS[0]], SAMPLED[0])
    assert sampled_batched(engine) == plain_sampled
    if spec is not None:
        metrics = engine.batch_metrics  # drafts were verified, and kept (n-grams of random tokens never are)
        assert metrics.num_draft_tokens > 0 and (metrics.num_accepted_tokens > 0 or method.startswith("ngram"))


def test_sampled_speculation_differs_from_plain_with_the_mode_off(bf16):
    """Without keyed noise, rejection sampling draws a uniform per draft token from the request's
    generator: draft_model's seeded tokens (distributed as plain decoding's) are not plain decoding's."""
    plain = [tokens(llm(bf16, False), [p], q)[0] for p, q in zip(PROMPTS, SAMPLED)]
    engine = llm(bf16, False, CHAIN["draft_model"](bf16))
    assert sampled_batched(engine) != plain


# ---------------------------------------------------------------- refusals
def test_transformers_backend_refuses(bf16, model_dirs):
    with pytest.raises(SpecDecError, match="deterministic mode needs the fast backend"):
        LLM(bf16["target"], backend="hf", deterministic=True)
    with pytest.raises(SpecDecError, match="fast backend cannot run"):
        LLM(model_dirs["gpt2"]["target"], deterministic=True)


def test_backend_line_names_the_mode(bf16):
    from specdec.models.loader import backend_line

    assert backend_line(llm(bf16, True).target) == "backend: fast (bfloat16, deterministic)"


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "verify"])
def test_every_command_takes_the_flag(command):
    from specdec.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command, "--deterministic"]).deterministic
    assert not parser.parse_args([command]).deterministic
