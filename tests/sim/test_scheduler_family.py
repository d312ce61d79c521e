"""The scheduler classes and their seams: which class a config gets, the connector state
every scheduler has, and the offload tier built in one place."""

from __future__ import annotations

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore, make_scheduler
from kvtwin.sim.core.engine_stats import offload_tier_counters
from kvtwin.sim.core.offload.build import DiskTierSpec, build_offload_tier
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.promotion_clock import StepPromotions
from kvtwin.sim.core.offload.tiered_manager import TieredOffloadingManager
from kvtwin.sim.core.offload.transfers import StepTransfers
from kvtwin.sim.core.scheduler import Scheduler

from .builders import EchoModel, full, kv_config, new_request, tokens


def test_the_config_picks_the_scheduler_class():
    kv = kv_config(full())
    assert type(make_scheduler(kv, SchedulerConfig(max_model_len=4096, async_scheduling=False))) is Scheduler
    assert type(make_scheduler(kv, SchedulerConfig(max_model_len=4096, async_scheduling=True))) is AsyncScheduler
    assert type(EngineCore(kv, SchedulerConfig(max_model_len=4096, async_scheduling=True)).scheduler) is AsyncScheduler


def test_a_scheduler_without_a_connector_keeps_empty_connector_state():
    scheduler = make_scheduler(kv_config(full()), SchedulerConfig(max_model_len=4096, async_scheduling=True))
    state = scheduler.connector_state
    assert scheduler.connector is None
    assert len(state.kv_holding_waiting) == 0 and not state.inflight_prefills
    assert not state.defer_block_free  # only with a connector that loads into blocks
    scheduler.update_connector_output(None)  # no worker report: nothing happens


def test_an_engine_without_offload_steps_through_the_null_worker():
    engine = EngineCore(kv_config(full()), SchedulerConfig(max_model_len=4096, max_num_batched_tokens=64,
                                                           async_scheduling=False))
    engine.add_request(new_request("a", tokens(0, 20), max_tokens=2))
    results = [engine.step(EchoModel()) for _ in range(3)]
    # The worker that does nothing reports nothing, and nothing waits or is timed.
    assert all(r.connector_output is None for r in results)
    assert not engine.has_unfinished_requests() and not engine.has_pending_transfers()
    assert not engine.has_connector and not engine.waits_for_transfers()
    assert engine.next_transfer_event_s() is None
    assert engine.make_stats().offload_counters is None and engine.make_stats().load_seconds is None


def test_the_offload_builder_makes_the_tier_the_engine_uses():
    kv = kv_config(full())
    tier = build_offload_tier(kv, CacheConfig(), StepTransfers(), num_cpu_chunks=8, policy="lru")
    assert isinstance(tier.manager, CPUOffloadingManager)
    engine = EngineCore(kv, SchedulerConfig(max_model_len=4096, async_scheduling=True), CacheConfig(), tier)
    assert engine.scheduler.connector is tier.connector
    engine.add_request(new_request("a", tokens(0, 20), max_tokens=2))
    engine.step_async(EchoModel())
    # The engine's worker is the tier's: the first batch went to it.
    assert tier.transfers.next_batch == 1
    # A step clock times nothing; the tier's counters are the engine's step columns.
    assert engine.next_transfer_event_s() is None
    assert engine.make_stats().offload_counters == offload_tier_counters(tier.manager, tier.transfers)
    # Unfinished requests wait for transfers; an offload tier's stores keep nobody waiting.
    assert engine.waits_for_transfers() and not tier.keeps_engine_waiting()
    assert engine.scheduler.connector_state.defer_block_free
    disk = DiskTierSpec(16, StepPromotions(1))
    tiered = build_offload_tier(kv, CacheConfig(), StepTransfers(), num_cpu_chunks=8, policy="arc", disk=disk)
    assert isinstance(tiered.manager, TieredOffloadingManager) and tiered.manager.disk_num_chunks == 16
