"""Automatic prefix caching: a later prompt that begins with an earlier context reuses its KV blocks, and
every output equals the output without the cache (float64 tiny models: greedy, seeded sampling, with
speculation). Blocks are shared by reference count, evicted least recently used first, and none is
left referenced after every request ended or was aborted."""

import pytest
from helpers import build_model

from specdec import LLM, SamplingParams
from specdec.models.kv_pool import BLOCK_SIZE
from specdec.models.prefix_cache import PrefixCache

SYSTEM = [(7 * i + 3) % 90 + 1 for i in range(45)]  # a shared "system prompt" of almost three blocks


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=101)


def _llm(model, cache: bool, **kwargs) -> LLM:
    return LLM(model, dtype="float64", backend="fast", max_model_len=192, max_num_seqs=4,
               enable_prefix_caching=cache, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _chat(llm: LLM, params) -> list[list[int]]:
    """Three turns: each prompt is the previous prompt, its answer and a new user message."""
    prompt, answers = list(SYSTEM), []
    for turn in range(3):
        answer = _run(llm, [prompt], params)[0]
        answers.append(answer)
        prompt = prompt + answer + [11 + turn, 12, 13]
    return answers


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
SPECS = [None, {"method": "draft_model", "model": "truncated", "num_speculative_tokens": 3},
         {"method": "ngram", "num_speculative_tokens": 3}]


def _spec(spec, model_dirs):
    if spec is not None and spec.get("model") == "truncated":
        return {**spec, "model": str(model_dirs["llama"]["truncated"])}
    return spec


@pytest.mark.parametrize("spec", SPECS)
def test_chat_turns_reuse_the_history_and_keep_greedy_outputs(target, model_dirs, spec):
    spec = _spec(spec, model_dirs)
    without = _chat(_llm(target, False, speculative_config=spec), GREEDY)
    llm = _llm(target, True, speculative_config=spec)
    assert _chat(llm, GREEDY) == without
    prefix = llm.engine.cache.prefix
    # turns 2 and 3 find the previous turns' prompt and answer blocks
    assert prefix.hits >= 2 * (len(SYSTEM) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    assert all(p.num_used_blocks == 0 for p in llm.engine.kv_pools())


def test_seeded_sampling_with_speculation_is_unchanged(target, model_dirs):
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["random"]), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=30, seed=5, ignore_eos=True)
    without = _chat(_llm(target, False, speculative_config=spec), params)
    llm = _llm(target, True, speculative_config=spec)
    assert _chat(llm, params) == without
    assert llm.engine.cache.prefix.hits > 0
    assert llm.engine.drafter.cache.prefix.hits > 0  # the draft model's own pool caches prefixes too


def test_a_shared_system_prompt_and_repeated_prompts_in_one_batch(target):
    """Prompts admitted together that share their first blocks (a system prompt; n > 1 as repeated
    prompts) are prefilled in turns, so the later ones reuse the first one's blocks."""
    prompts = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], SYSTEM + [1, 2, 3], SYSTEM + [1, 2, 3]]
    params = [SamplingParams(temperature=0.7, max_tokens=20, seed=i, ignore_eos=True) for i in range(4)]
    without = _run(_llm(target, False), prompts, params)
    llm = _llm(target, True)
    assert _run(llm, prompts, params) == without
    assert llm.engine.cache.prefix.hits >= 3 * (len(SYSTEM) // BLOCK_SIZE) * BLOCK_SIZE


def test_reset_prefix_cache_forgets_every_pool_s_unused_blocks(target, model_dirs):
    """``LLM.reset_prefix_cache``: a prompt asked again after it finds nothing cached, in the target's pool or
    the draft model's, while blocks a request in flight holds stay; the outputs are unchanged."""
    spec = _spec(SPECS[1], model_dirs)
    llm = _llm(target, True, speculative_config=spec)
    pools = llm.engine.kv_pools()
    prompt = SYSTEM + [1, 2, 3]
    first = _run(llm, [prompt], GREEDY)
    hits = [p.prefix.hits for p in pools]
    assert _run(llm, [prompt], GREEDY) == first and all(p.prefix.hits > h for p, h in zip(pools, hits))
    running = llm.submit({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=24, ignore_eos=True))
    llm.step()
    held = pools[0].num_used_blocks
    assert not running.done
    llm.reset_prefix_cache()
    assert pools[0].num_used_blocks == held > 0 and all(not p.prefix.evictable for p in pools)
    while not running.done:
        llm.step()
    hits = [p.prefix.hits for p in pools]
    assert _run(llm, [prompt], GREEDY) == first and [p.prefix.hits for p in pools] == hits


def test_eviction_under_a_small_pool_stays_exact(target):
    """A pool of 24 blocks serving many different prompts evicts cached blocks (least recently used first)
    to make room, and outputs stay the same."""
    prompts = [[(i * 13 + j * 7) % 90 + 1 for j in range(40 + i)] for i in range(10)]
    prompts += prompts[:3]  # asked again after others may have evicted their blocks
    config = target.config
    head_dim = config.hidden_size // config.num_attention_heads
    budget = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 8 * 24 * BLOCK_SIZE
    without = _run(_llm(target, False), prompts, GREEDY)
    llm = _llm(target, True, kv_cache_memory=budget)
    assert _run(llm, prompts, GREEDY) == without
    pool = llm.engine.cache
    assert pool.num_blocks == 24 and pool.num_used_blocks == 0
    assert len(pool.prefix.evictable) <= 24


def test_aborted_requests_leave_no_block_referenced(target, model_dirs):
    spec = {"method": "draft_model", "model": str(model_dirs["llama"]["truncated"]), "num_speculative_tokens": 3}
    llm = _llm(target, True, speculative_config=spec)
    handles = [llm.submit({"prompt_token_ids": SYSTEM + [i]}, SamplingParams(temperature=0.0, max_tokens=40))
               for i in range(6)]
    for _ in range(3):
        llm.step()
    for h in handles[::2]:
        llm.abort(h.seq.request_id)
    while llm.scheduler.has_work:
        llm.step()
    for h in handles[1::2]:
        llm.abort(h.seq.request_id)
    assert all(p.num_used_blocks == 0 for p in llm.engine.kv_pools())
    reference = _run(_llm(target, False), [SYSTEM + [9]], GREEDY)
    assert _run(llm, [SYSTEM + [9]], GREEDY) == reference


def test_keys_include_the_prefix():
    """The same tokens after a different prefix are another block."""
    cache = PrefixCache()
    a = cache.register(0, 0, [1, 2])
    b = cache.register(1, a, [3, 4])
    assert cache.lookup(0, [1, 2]) == (0, a) and cache.lookup(a, [3, 4]) == (1, b)
    assert cache.lookup(0, [3, 4]) is None and cache.lookup(b, [3, 4]) is None
    assert cache.register(5, 0, [1, 2]) == a and not cache.is_registered(5)  # same content: the first stays


def test_only_full_blocks_of_cached_entries_are_registered(target):
    """A context of 2 blocks whose last token is pending (not cached) registers its first block only."""
    from specdec.models.base import ForwardBatch

    llm = _llm(target, True)
    fast, pool = llm.target, llm.engine.cache
    tokens = SYSTEM[: 2 * BLOCK_SIZE]
    fast.forward(ForwardBatch.from_rows([tokens[:-1]], [0], [0], fast.device, logits="none"), pool)
    pool.commit_prefix(0, tokens)
    assert pool.prefix.lookup(0, tokens[:BLOCK_SIZE]) is not None
    assert len(pool.prefix.by_key) == 1
    assert pool.match_prefix(1, tokens + [5]) == BLOCK_SIZE  # the second block is not shared


@pytest.fixture(scope="module")
def eagle_spec(target, tmp_path_factory):
    """A random EAGLE head, sharp enough to be accepted: its layer attends over the hidden states of the
    whole context (Medusa and MTP read the last position's only)."""
    from test_heads import make_heads

    folder = tmp_path_factory.mktemp("prefix_eagle")
    make_heads(target, "eagle", folder, seed=11, scale=3.0)
    return {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}


def _chat_steps(llm: LLM, params) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`_chat`'s answers, and each turn's accepted drafts per step (which a drafter fed other hidden
    states than the target's would change)."""
    prompt, answers, accepted = list(SYSTEM), [], []
    for turn in range(3):
        handle = llm.submit({"prompt_token_ids": prompt}, params)
        tokens, counts = [], []
        while llm.scheduler.has_work:
            for out in llm.step():
                tokens += out.token_ids
                counts.append(out.num_accepted)
        answers.append(tokens)
        accepted.append(counts)
        assert handle.seq.finished
        prompt = prompt + tokens + [11 + turn, 12, 13]
    return answers, accepted


def test_a_drafter_that_reads_hidden_states_reuses_the_history(target, eagle_spec):
    """With a drafter that reads the target's hidden states, a chat turn finds the history's blocks with
    their hidden states: the target feeds only the new tokens, and every accepted count and output token
    is the one without the cache (a drafter handed only the new tokens' states drafts otherwise)."""
    spec = eagle_spec
    without, without_accepted = _chat_steps(_llm(target, False, speculative_config=spec), GREEDY)
    assert sum(map(sum, without_accepted)) > 0  # the heads' drafts are accepted: the comparison has teeth
    llm = _llm(target, True, speculative_config=spec)
    answers, accepted = _chat_steps(llm, GREEDY)
    assert answers == without and accepted == without_accepted
    assert llm.engine.cache.prefix.hits >= 2 * (len(SYSTEM) // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    assert llm.engine.drafter.cache.prefix.hits >= 2 * BLOCK_SIZE  # the EAGLE layer's own pool too
    assert llm.engine.cache.num_used_blocks == 0 and llm.engine.drafter.cache.num_used_blocks == 0


def test_eagle_pool_keys_cover_the_token_after_each_entry_and_the_first():
    """Entry ``j`` of an EAGLE pool pairs ``f_j`` with ``t_{j+1}``: two contexts that differ only at the
    token after a block's last entry, or only at their first token, must not share that block."""
    from specdec.drafters.heads.eagle import PairKeys

    a = list(range(1, 40))
    b = a[:32] + [99] + a[33:]  # differs at t_32, the pair token of entry 31 (the second block's last)
    assert PairKeys(a, 100)[0:16] == PairKeys(b, 100)[0:16]
    assert PairKeys(a, 100)[16:32] != PairKeys(b, 100)[16:32]
    c = [7] + a[1:]  # differs at t_0 only
    assert PairKeys(a, 100)[0:16] != PairKeys(c, 100)[0:16] and PairKeys(a, 100)[16:32] == PairKeys(c, 100)[16:32]
    assert len(PairKeys(a, 100)) == len(a) - 1 and a == list(range(1, 40))  # the tokens are not changed


def test_each_output_says_how_many_prompt_tokens_came_from_the_cache(target):
    """``RequestOutput.num_cached_tokens`` (vLLM's): whole blocks of the prompt found in the prefix cache at
    admission, 0 for a first prompt and without the cache; the sum over requests is the pool's hit count."""
    llm = _llm(target, True)
    first = llm.generate({"prompt_token_ids": SYSTEM}, GREEDY)[0]
    again = llm.generate({"prompt_token_ids": SYSTEM + [5, 6]}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert first.prompt_logprobs is None and first.outputs[0].finished()  # vLLM's other fields read alike
    assert again.num_cached_tokens == len(SYSTEM) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert again.num_cached_tokens == again.metrics.to_dict()["num_cached_tokens"]
    assert first.num_cached_tokens + again.num_cached_tokens == llm.engine.cache.prefix.hits
    off = _llm(target, False)
    off.generate({"prompt_token_ids": SYSTEM}, GREEDY)
    assert off.generate({"prompt_token_ids": SYSTEM + [5, 6]}, GREEDY)[0].num_cached_tokens == 0
