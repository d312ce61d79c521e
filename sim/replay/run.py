"""A simulated replay: a planned layout, a trace and a cost model, run in SimPy time.

Puts the pieces together: the planner's ``KVCacheConfig`` and engine settings build the
``EngineCore``; the trace's rows become requests arriving at their times; the cost model
backend predicts each step's duration and samples synthetic output tokens; the metrics
recorder turns what happened into the three tables of a run directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.replay.cost_model import CostModel, Efficiency
from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.metrics import SLO, MetricsRecorder, summarize
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler import SchedulerOutput
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.replay.workload import ReplayClock, run_simulation


@dataclass(frozen=True)
class SchedulerSettings:
    """Scheduler knobs the planner does not need (vLLM 0.33 defaults)."""

    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    adaptive_long_prefill_threshold: bool = False
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    prefix_caching_hash_algo: str = "builtin"


class CostModelBackend:
    """The simulator's backend: predicted step time, synthetic output tokens.

    Output token ids are unique per request and position, so decoded blocks are never
    shared by accident; what later turns reuse of earlier outputs comes from the trace's
    own prompt identity.
    """

    def __init__(self, cost_model: CostModel, requests: dict[str, Request]):
        self.cost_model = cost_model
        self.requests = requests
        self._token_base: dict[str, int] = {}

    def execute(self, output: SchedulerOutput, ready_to_sample: list[Request]) -> Execution:
        requests = self.requests
        scheduled = output.num_scheduled_tokens.items()
        decode_ends = [requests[rid].num_computed_tokens for rid, n in scheduled if n == 1]
        prefill_items = [(n, requests[rid].num_computed_tokens - n) for rid, n in scheduled if n != 1]
        cost = self.cost_model.split_step_cost(decode_ends, prefill_items)
        sampled = {}
        bases = self._token_base
        for request in ready_to_sample:
            request_id = request.request_id
            base = bases.get(request_id)
            if base is None:
                base = bases[request_id] = (len(bases) + 1) << 24
            sampled[request_id] = [base + len(request.output_token_ids)]
        return Execution(sampled, cost.total_s, cost)


@dataclass
class ReplayResult:
    requests: pa.Table
    steps: pa.Table
    summary: pa.Table
    end_time_s: float
    rejected: int


def run_replay(plan: Plan, trace: pa.Table, *, scheduler: SchedulerSettings = SchedulerSettings(),
               efficiency: Efficiency = Efficiency(), slo: SLO = SLO(), time_limit_s: float | None = None,
               on_progress: Callable[[ReplayClock], None] | None = None) -> ReplayResult:
    kv_cache_config = plan.kv_cache_config
    if kv_cache_config is None:
        raise ConfigError("model", f"a model that fits: {plan.model.name} needs {plan.shortfall_bytes} more bytes "
                          f"of KV cache on {plan.gpu.name} at max_model_len {plan.engine.max_model_len} "
                          f"(see kvtwin plan)")
    eng = plan.engine
    scheduler_config = SchedulerConfig(
        max_model_len=eng.max_model_len, max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        enable_chunked_prefill=scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
        adaptive_long_prefill_threshold=scheduler.adaptive_long_prefill_threshold, policy=scheduler.scheduling_policy,
        watermark=scheduler.watermark, scheduler_reserve_full_isl=scheduler.scheduler_reserve_full_isl,
        async_scheduling=eng.async_scheduling)
    cache_config = CacheConfig(enable_prefix_caching=eng.enable_prefix_caching,
                               prefix_caching_hash_algo=scheduler.prefix_caching_hash_algo)
    engine = EngineCore(kv_cache_config, scheduler_config, cache_config)
    cost_model = CostModel(plan.model, plan.gpu, plan.layers.specs, tensor_parallel_size=eng.tensor_parallel_size,
                           async_scheduling=eng.async_scheduling, efficiency=efficiency)
    backend = CostModelBackend(cost_model, engine.scheduler.requests)
    metrics = MetricsRecorder(len(kv_cache_config.groups))
    end_s = run_simulation(engine, backend, arrivals_from_trace(trace), metrics, time_limit_s=time_limit_s,
                           on_progress=on_progress)
    requests = metrics.requests_table()
    steps = metrics.steps_table()
    summary = summarize(requests, steps, metrics.itl_s, slo, end_s)
    return ReplayResult(requests, steps, summary, end_s, len(engine.rejected))
