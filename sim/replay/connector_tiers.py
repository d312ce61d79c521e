"""Each replica's connector tier on the SimPy clock, built in one place from the resolved features.

An engine has one connector slot (``sim/core/connector_tier.py``;
docs/architecture.md#a-new-kv-connector). ``connector_tiers`` fills it for every replica of
a replay: an offload tier from the scenario's ``[offload]`` table (a ``ResolvedOffload``:
the CPU tier, over a disk tier when ``disk_bytes > 0``, with transfers timed on the replay's
clock), or a P/D connector from its ``[disaggregation]`` table (a ``PDConnector`` and a
``PDTransfers`` worker reading over the replica's inbound link), or nothing. The table of
features refuses both at once (docs/architecture.md#features-and-their-combinations).
``run_with_executor`` builds every replay's engines' tiers here.
"""

from __future__ import annotations

import simpy

from kvtwin.sim.core.config import CacheConfig
from kvtwin.sim.core.connector_tier import ConnectorTier
from kvtwin.sim.core.offload.build import DiskTierSpec, OffloadTier, build_offload_tier
from kvtwin.sim.core.offload.promotion_clock import TimedPromotions
from kvtwin.sim.core.offload.transfers import TimedTransfers
from kvtwin.sim.core.pd_connector import PDConnector, PDLink, PDTier, PDTransfers
from kvtwin.sim.core.spec import KVCacheConfig
from kvtwin.sim.planner.offload import BLOCKS_PER_CHUNK, ResolvedOffload
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.scenario.disaggregation import Disaggregation


def connector_tiers(plan: Plan, env: simpy.Environment, num_replicas: int, *,
                    offload: ResolvedOffload | None = None,
                    disaggregation: Disaggregation | None = None) -> list[ConnectorTier | None]:
    """One tier per replica of ``plan``'s engine, its transfers on ``env``'s clock: a P/D
    tier with ``disaggregation``, an offload tier with ``offload``, else none."""
    # Refused when the scenario is resolved (docs/architecture.md#features-and-their-combinations).
    assert offload is None or disaggregation is None, "an engine has one connector slot"
    kv_cache_config = plan.require_fits()
    tiers: list[ConnectorTier | None] = [None] * num_replicas
    if disaggregation is not None:
        bandwidth = disaggregation.link_bytes_per_s(plan.gpu.interconnect_bytes_per_s, plan.gpu.nic_bytes_per_s)
        tiers = [pd_tier(kv_cache_config, env, bandwidth, disaggregation.link_latency_s) for _ in range(num_replicas)]
    elif offload is not None:
        tiers = [offload_tier(offload, env, kv_cache_config, plan.engine.cache) for _ in range(num_replicas)]
    return tiers


def link_copies(plan: Plan) -> int:
    """The workers that each move their own share of a P/D read (the tensor parallel size,
    1 with MLA, as the offload tier counts them): a read's bytes are one worker's times this."""
    tp = plan.engine.tensor_parallel_size
    return 1 if plan.model.uses_mla and tp > 1 else tp


def pd_tier(kv_cache_config: KVCacheConfig, env: simpy.Environment, bandwidth_bytes_per_s: float,
            latency_s: float) -> PDTier:
    """One P/D replica's connector and its worker, reading over its own inbound link."""
    return PDTier(PDConnector(kv_cache_config),
                  PDTransfers(lambda: env.now, PDLink(bandwidth_bytes_per_s, latency_s)))


class SimPyClock:
    """Now on a SimPy environment, for the offload tiers' transfer clocks."""

    def __init__(self, env: simpy.Environment):
        self.env = env

    def now_s(self) -> float:
        return self.env.now


def offload_tier(offload: ResolvedOffload, env: simpy.Environment, kv_cache_config: KVCacheConfig,
                 cache_config: CacheConfig) -> OffloadTier:
    """One replica's offload tiers on ``env``'s clock: the CPU tier (over a disk tier when
    ``offload`` has disk chunks) and the timed PCIe transfers."""
    now_s = SimPyClock(env).now_s
    disk = None
    if offload.has_disk:
        config = offload.config
        disk = DiskTierSpec(offload.num_disk_chunks,
                            TimedPromotions(config.disk_bandwidth_bytes_per_s, config.disk_latency_s, now_s),
                            chunk_bytes=offload.kv_bytes_per_chunk)
    transfers = TimedTransfers(now_s, offload.h2d_bytes_per_s, offload.d2h_bytes_per_s, offload.bytes_per_key)
    return build_offload_tier(kv_cache_config, cache_config, transfers, num_cpu_chunks=offload.num_cpu_chunks,
                              policy=offload.policy, blocks_per_chunk=BLOCKS_PER_CHUNK, disk=disk)
