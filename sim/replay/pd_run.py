"""A disaggregated prefill/decode replay: xPyD engines, their P/D connectors and links.

``run_replay`` comes here when the scenario has a ``[disaggregation]`` table
(``sim/scenario/disaggregation.py``). Every replica is the planned engine with a
``PDConnector`` and a ``PDTransfers`` worker on the replay's clock; each decode replica
reads over its own inbound link (``PDLink``) at one worker's link rate, each tensor
parallel worker moving its own share (``copies`` of the per-worker bytes: the tensor
parallel size, 1 with MLA, as the offload tier counts them). ``PDCluster`` moves the
requests between the roles; the outputs get the P/D columns (``reports/SCHEMA.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import simpy

from kvtwin.sim.core.engine import EngineCore, ModelExecutor, PDTier
from kvtwin.sim.core.pd_connector import PDConnector, PDLink, PDTransfers
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.replay.clock.pd_cluster import PDCluster
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.scenario.disaggregation import Disaggregation


def link_copies(plan: Plan) -> int:
    """Workers that each move their own share of a read."""
    tp = plan.engine.tensor_parallel_size
    return 1 if plan.model.uses_mla and tp > 1 else tp


def pd_engines(plan: Plan, disaggregation: Disaggregation, env: simpy.Environment) -> list[EngineCore]:
    """The deployment's engines, prefill replicas first, each with its connector and worker."""
    kv_cache_config = plan.require_fits()
    eng = plan.engine
    bandwidth = disaggregation.link_bytes_per_s(plan.gpu.interconnect_bytes_per_s, plan.gpu.nic_bytes_per_s)
    engines = []
    for _ in range(disaggregation.num_replicas):
        tier = PDTier(PDConnector(kv_cache_config),
                      PDTransfers(lambda: env.now, PDLink(bandwidth, disaggregation.link_latency_s)))
        engines.append(EngineCore(kv_cache_config, eng.scheduler, eng.cache, pd=tier))
    return engines


def run_pd_simulation(plan: Plan, trace, executors: Sequence[ModelExecutor], disaggregation: Disaggregation, *,
                      window_pricing: Callable[[ModelExecutor], object], time_limit_s: float | None = None,
                      on_progress: Callable[[ReplayClock], None] | None = None,
                      env: simpy.Environment | None = None) -> tuple[MetricsRecorder, float]:
    """Replay ``trace`` on the P/D deployment; the recorder and the end time."""
    env = env if env is not None else simpy.Environment()
    engines = pd_engines(plan, disaggregation, env)
    num_prefill = disaggregation.prefill_replicas
    router = PDRouter(engines[:num_prefill], engines[num_prefill:], disaggregation.prefill_router,
                      disaggregation.decode_router)
    roles = ["prefill"] * num_prefill + ["decode"] * disaggregation.decode_replicas
    recorder = MetricsRecorder(len(plan.require_fits().groups), len(engines), roles=roles)
    replicas = [Replica(engine, executor, window_pricing(executor)) for engine, executor in zip(engines, executors)]
    cluster = PDCluster(env, replicas, router, recorder, time_limit_s=time_limit_s, on_progress=on_progress,
                        num_prefill=num_prefill, copies=link_copies(plan))
    end_s = cluster.run(arrivals_from_trace(trace))
    return recorder, end_s


def pd_summary_columns(requests) -> dict[str, float]:
    """The summary's P/D figures over finished requests (``reports/SCHEMA.md``): mean read
    seconds and bytes, and the share of TTFT the read took (mean of per-request shares,
    and the total read time over the total TTFT)."""
    import numpy as np

    status = requests.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    transfer = requests.column("transfer_s").to_numpy()[done]
    ttft = requests.column("ttft_s").to_numpy()[done]
    num_bytes = requests.column("transfer_bytes").to_numpy()[done]
    ok = ~np.isnan(transfer) & (ttft > 0)
    if not ok.any():
        nan = float("nan")
        return {"pd_transfer_mean_ms": nan, "pd_transfer_bytes_mean": nan, "pd_transfer_share_of_ttft": nan,
                "pd_transfer_share_of_ttft_total": nan}
    return {
        "pd_transfer_mean_ms": float(transfer[ok].mean() * 1000),
        "pd_transfer_bytes_mean": float(num_bytes[ok].mean()),
        "pd_transfer_share_of_ttft": float((transfer[ok] / ttft[ok]).mean()),
        "pd_transfer_share_of_ttft_total": float(transfer[ok].sum() / ttft[ok].sum()),
    }


def pd_load_imbalance(requests, disaggregation: Disaggregation) -> float:
    """The worse of the prefill side's and the decode side's load imbalance (requests per
    replica over the mean, each side over its own replicas; ``summaries.load_imbalance``)."""
    import math

    import numpy as np

    worst = math.nan
    for column, first, count in (("prefill_replica", 0, disaggregation.prefill_replicas),
                                 ("decode_replica", disaggregation.prefill_replicas, disaggregation.decode_replicas)):
        picked = requests.column(column).to_numpy()
        picked = picked[picked >= 0] - first
        counts = np.bincount(picked, minlength=count)[:count] if picked.size else np.zeros(count)
        mean = counts.mean()
        if mean > 0:
            worst = max(float(counts.max() / mean), worst) if not math.isnan(worst) else float(counts.max() / mean)
    return worst
