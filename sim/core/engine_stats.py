"""The engine's figures after a batch is applied: what a step row needs, read in one place.

vLLM's scheduler hands its logger a ``SchedulerStats`` from ``make_stats`` (queue lengths,
KV usage, prefix-cache counters) so the logger never walks the scheduler. ``EngineStats``
is that snapshot here: the replay's recorder writes a step row from it and from the batch
record alone, and never reads the pool or the queues itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.block_pool import BlockPool
from kvtwin.sim.core.kv_connector import KVTransferWorker
from kvtwin.sim.core.offload.manager import OffloadingManager
from kvtwin.sim.core.spec_decode_stats import SpecDecodingStats


@dataclass
class EngineStats:
    """Queues and pool after a batch's update (gauges), and cumulative counters."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    # Each KV cache group's share of the usable pool (the blocks it holds), by group id.
    kv_cache_usage_by_group: list[float]
    # Cumulative over the run: cached blocks evicted to make room.
    num_evictions: int
    # With an offload tier: its cumulative counters and gauges by step column name
    # (``offload_tier_counters``); None without one.
    offload_counters: dict[str, int] | None = None
    # With a timed offload tier: each load job's seconds on the link, by job id (the
    # worker's own table, not a copy); None on a step clock or without a tier.
    load_seconds: dict[int, float] | None = None
    # With drafts: what the batch's update verified (vLLM's ``SchedulerStats.spec_decoding_stats``);
    # None without drafts, or for a batch that verified none.
    spec_decoding_stats: SpecDecodingStats | None = None

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python.
    def __init__(self, num_running_reqs: int, num_waiting_reqs: int, num_free_blocks: int, num_cached_blocks: int,
                 kv_cache_usage: float, kv_cache_usage_by_group: list[float], num_evictions: int,
                 offload_counters: dict[str, int] | None = None, load_seconds: dict[int, float] | None = None,
                 spec_decoding_stats: SpecDecodingStats | None = None):
        self.num_running_reqs = num_running_reqs
        self.num_waiting_reqs = num_waiting_reqs
        self.num_free_blocks = num_free_blocks
        self.num_cached_blocks = num_cached_blocks
        self.kv_cache_usage = kv_cache_usage
        self.kv_cache_usage_by_group = kv_cache_usage_by_group
        self.num_evictions = num_evictions
        self.offload_counters = offload_counters
        self.load_seconds = load_seconds
        self.spec_decoding_stats = spec_decoding_stats


def pool_stats(pool: BlockPool, num_running_reqs: int, num_waiting_reqs: int,
               offload_counters: dict[str, int] | None, load_seconds: dict[int, float] | None,
               spec_decoding_stats: SpecDecodingStats | None = None) -> EngineStats:
    """A snapshot of ``pool`` and the queue lengths, with the features' own figures."""
    usable = pool.num_gpu_blocks - 1  # the null block is never handed out
    return EngineStats(num_running_reqs, num_waiting_reqs, pool.get_num_free_blocks(), pool.num_cached_blocks(),
                       pool.get_usage(), [n / usable for n in pool.num_used_by_group], pool.num_evictions,
                       offload_counters, load_seconds, spec_decoding_stats)


def offload_tier_counters(manager: OffloadingManager, transfers: KVTransferWorker) -> dict[str, int]:
    """An offload tier's cumulative counters (gauges as they are), by step column: the
    manager's (the CPU tier's, and a disk tier's when it has one) and the bytes moved over PCIe."""
    out = manager.counters()
    out["offload_load_bytes"], out["offload_store_bytes"] = transfers.moved_bytes()
    return out
