"""The KV pool's figures in ``/metrics``, under vLLM's names, read from the pool when it is scraped.

- ``vllm:kv_cache_usage_perc``: the fraction (0 to 1, as vLLM reports it) of the target's KV blocks
  referenced by some sequence (cached blocks no sequence references count as free: they are evicted on
  demand). 0 once every request has ended or was aborted: no block leaks.
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens looked up in
  the prefix cache, and of them the tokens found cached (both 0 with prefix caching off).
- ``vllm:num_preemptions_total``: sequences preempted because the pool ran out of blocks.
- ``specdec:kv_cache_blocks`` and ``specdec:kv_cache_block_size``: the pool's size.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.models.base import KVCache
from specdec.scheduler import Scheduler


class KVCacheCollector:
    """The figures of one engine's target pool (``cache``) and scheduler, for a registry."""

    def __init__(self, cache: KVCache, scheduler: Scheduler, model_name: str) -> None:
        self.cache, self.scheduler, self.model_name = cache, scheduler, model_name

    def collect(self):
        cache, labels, name = self.cache, ["model_name"], [self.model_name]
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use "
                                  "(1 means 100 percent).", labels=labels)
        usage.add_metric(name, cache.num_used_blocks / cache.num_blocks if cache.num_blocks else 0.0)
        blocks = GaugeMetricFamily("specdec:kv_cache_blocks", "Blocks of the target's KV pool.", labels=labels)
        blocks.add_metric(name, cache.num_blocks)
        size = GaugeMetricFamily("specdec:kv_cache_block_size", "Tokens per KV block.", labels=labels)
        size.add_metric(name, cache.block_size)
        looked_up, found = cache.prefix_cache_counts()
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        queries.add_metric(name, looked_up)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=labels)
        hits.add_metric(name, found)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted (KV blocks ran out).",
                                          labels=labels)
        preemptions.add_metric(name, self.scheduler.num_preemptions)
        return [usage, blocks, size, queries, hits, preemptions]
