"""``LLM.get_metrics()`` (vLLM's offline metrics API): the engine's figures as Counter, Gauge, Vector and Histogram
objects under vLLM's names, equal to what the requests themselves counted (a stop string that cuts an accepted run
takes its tokens back from both), read by the loop of vLLM's speculative-decoding example unchanged."""

from specdec import LLM, SamplingParams
from specdec.metrics import RequestMetrics
from specdec.metrics_reader import Counter, Gauge, Histogram, Vector

PROMPTS = [[3, 5, 7, 3, 5, 7, 11, 3, 5], [42, 1, 17, 29, 8, 64, 2], [7], [90, 91, 90, 91, 90]]


def by_name(metrics) -> dict:
    found = {}
    for metric in metrics:
        assert metric.name not in found, f"{metric.name} listed twice"
        assert metric.labels["model_name"]
        found[metric.name] = metric
    return found


def totals(outputs) -> RequestMetrics:
    total = RequestMetrics()
    for out in outputs:
        total.merge(out.metrics)
    return total


def vllm_example_acceptance(metrics, num_spec_tokens: int) -> tuple[float, list[float]]:
    """What vLLM's ``examples/offline_inference/spec_decode.py`` computes from ``llm.get_metrics()``."""
    num_drafts = num_accepted = 0
    acceptance_counts = [0] * num_spec_tokens
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]
    return 1 + num_accepted / num_drafts, [count / num_drafts for count in acceptance_counts]


def test_the_counters_are_the_requests_own(model_dirs):
    dirs = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(dirs["truncated"]), "num_speculative_tokens": 4}
    llm = LLM(dirs["target"], speculative_config=spec, dtype="float64", max_num_seqs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=24))
    total = totals(outputs)
    metrics = by_name(llm.get_metrics())
    assert total.num_drafts > 0 and 0 < total.num_accepted_tokens < total.num_draft_tokens
    expected = {"vllm:prompt_tokens": sum(map(len, PROMPTS)), "vllm:generation_tokens": 4 * 24,
                "vllm:spec_decode_num_drafts": total.num_drafts,
                "vllm:spec_decode_num_draft_tokens": total.num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": total.num_accepted_tokens,
                "vllm:num_preemptions": 0, "vllm:prefix_cache_queries": sum(map(len, PROMPTS)),
                "vllm:prefix_cache_hits": 0}  # prefix caching is on by default, and no prompt shares a block
    for name, value in expected.items():
        assert isinstance(metrics[name], Counter) and metrics[name].value == value, name
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and per_position.values == total.accepted_per_position
    assert len(per_position.values) == 4
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert isinstance(metrics[name], Gauge) and metrics[name].value == 0, name  # all done: nothing held

    # The requests' latencies: a first token each, an inter-token latency for every token after a request's first
    # output (one to k + 1 tokens), an end-to-end latency each.
    ttft, itl, e2e = (metrics[f"vllm:{name}"] for name in ("time_to_first_token_seconds",
                                                          "inter_token_latency_seconds", "e2e_request_latency_seconds"))
    assert all(isinstance(h, Histogram) for h in (ttft, itl, e2e))
    assert (ttft.count, e2e.count) == (4, 4) and 4 * 24 - 4 * 5 <= itl.count <= 4 * 24 - 4
    assert ttft.buckets["+Inf"] == 4 and list(ttft.buckets.values()) == sorted(ttft.buckets.values())
    assert 0 < ttft.sum < e2e.sum and itl.sum < e2e.sum

    tau, rates = vllm_example_acceptance(llm.get_metrics(), num_spec_tokens=4)
    assert tau == 1 + total.num_accepted_tokens / total.num_drafts > 1
    assert rates == [a / total.num_drafts for a in total.accepted_per_position]
    assert rates == sorted(rates, reverse=True)  # position i is reached only past 0..i-1

    stream = llm.stream({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=24))
    next(stream)
    running = by_name(llm.get_metrics())
    assert running["vllm:num_requests_running"].value == 1 and running["vllm:kv_cache_usage_perc"].value > 0
    stream.close()
    assert by_name(llm.get_metrics())["vllm:kv_cache_usage_perc"].value == 0


def test_a_stop_string_takes_its_accepted_drafts_back(text_model_dirs):
    spec = {"method": "draft_model", "model": str(text_model_dirs["draft"]), "num_speculative_tokens": 8}
    llm = LLM(text_model_dirs["target"], speculative_config=spec, dtype="float64")
    prompt = "def f(x):\n"
    whole = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stop = whole[0].outputs[0].text[8:11]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    cut = len(stopped[0].outputs[0].token_ids)
    assert cut < 40 and stopped[0].metrics.num_generated_tokens == cut
    total = totals([*whole, *stopped])
    assert total.num_draft_tokens > total.num_accepted_tokens  # the stopped run's cut drafts: drafted, not kept
    metrics = by_name(llm.get_metrics())
    assert metrics["vllm:generation_tokens"].value == 40 + cut == total.num_generated_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == total.num_accepted_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values == total.accepted_per_position


def test_plain_decoding_counts_no_drafts(model_dirs):
    llm = LLM(model_dirs["llama"]["target"], dtype="float64")
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=5))
    metrics = by_name(llm.get_metrics())
    assert metrics["vllm:generation_tokens"].value == 20 and metrics["vllm:spec_decode_num_drafts"].value == 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos" not in metrics  # no position was ever drafted
