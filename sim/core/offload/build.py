"""One engine's offload tier, built in one place: the CPU tier (over a disk tier when one
is asked for), the worker stand-in that decides when transfers finish, and the connector
the scheduler talks to. Every clock (the lockstep runner, the SimPy replay, tests) builds
its tiers here and hands the result to ``EngineCore``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.config import CacheConfig
from kvtwin.sim.core.engine_stats import offload_tier_counters
from kvtwin.sim.core.offload.connector import OffloadingConnector
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.manager import OffloadingManager
from kvtwin.sim.core.offload.promotion_clock import PromotionClock
from kvtwin.sim.core.offload.tiered_manager import TieredOffloadingManager
from kvtwin.sim.core.offload.transfers import StepTransfers, TimedTransfers
from kvtwin.sim.core.spec import KVCacheConfig


@dataclass(frozen=True)
class DiskTierSpec:
    """A disk tier below the CPU tier: its chunks, when CPU↔disk jobs finish (its clock),
    and the bytes of one chunk (which size those jobs on a timed clock)."""

    num_chunks: int
    promotion: PromotionClock
    chunk_bytes: int = 0


class OffloadTier:
    """An engine's offload tier, its connector tier (``connector_tier.ConnectorTier``): the
    manager that holds the chunks (CPU, or CPU over disk: one ``OffloadingManager``), the
    worker stand-in that decides when transfers finish (its clock), and the scheduler-side
    connector over the manager."""

    def __init__(self, manager: OffloadingManager, transfers: StepTransfers | TimedTransfers,
                 connector: OffloadingConnector):
        self.manager = manager
        self.transfers = transfers
        self.connector = connector

    def step_counters(self) -> dict[str, int] | None:
        return offload_tier_counters(self.manager, self.transfers)

    def job_load_seconds(self) -> dict[int, float] | None:
        return self.transfers.job_load_seconds()

    def next_event_s(self) -> float | None:
        """The earlier of the next GPU↔CPU job's end and the next CPU↔disk job's."""
        transfer_s = self.transfers.next_completion_s()
        disk_s = self.manager.next_finish_s()
        if transfer_s is None:
            return disk_s
        return transfer_s if disk_s is None else min(transfer_s, disk_s)

    def keeps_engine_waiting(self) -> bool:
        # A store in flight delays no request; a load's request is unfinished, which the
        # engine counts itself (EngineCore.waits_for_transfers).
        return False


def build_offload_tier(kv_cache_config: KVCacheConfig, cache_config: CacheConfig,
                       transfers: StepTransfers | TimedTransfers, *, num_cpu_chunks: int, policy: str,
                       blocks_per_chunk: int = 1, disk: DiskTierSpec | None = None) -> OffloadTier:
    """The tier of one engine over ``kv_cache_config``: ``num_cpu_chunks`` CPU chunks of
    ``blocks_per_chunk`` blocks under cache ``policy`` (over ``disk`` if given, under the
    same policy), transfers finishing as ``transfers`` says."""
    cpu = CPUOffloadingManager(num_cpu_chunks, policy)
    manager: OffloadingManager = cpu
    if disk is not None:
        manager = TieredOffloadingManager(cpu, disk.num_chunks, policy, disk.promotion, chunk_bytes=disk.chunk_bytes)
    connector = OffloadingConnector(kv_cache_config, manager, cache_config.enable_prefix_caching, blocks_per_chunk,
                                    cache_config.prefix_cache_retention_interval)
    return OffloadTier(manager, transfers, connector)
