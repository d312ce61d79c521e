"""A disaggregated prefill/decode replay: xPyD engines, their P/D connectors and links.

``run_replay`` comes here when the scenario has a ``[disaggregation]`` table
(``sim/scenario/disaggregation.py``). Every replica is the planned engine with a
``PDConnector`` and a ``PDTransfers`` worker on the replay's clock (its ``PDTier``, which
``connector_tiers.py`` builds and ``PDCluster`` keeps for the hand-overs); each decode replica
reads over its own inbound link (``PDLink``) at one worker's link rate, each tensor
parallel worker moving its own share (``copies`` of the per-worker bytes: the tensor
parallel size, 1 with MLA, as the offload tier counts them). ``PDCluster`` moves the
requests between the roles; the outputs get the P/D columns (``reports/SCHEMA.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import simpy

from kvtwin.sim.core.engine import EngineCore, ModelExecutor
from kvtwin.sim.core.pd_connector import PDTier
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.replay.clock.pd_cluster import PDCluster
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.connector_tiers import connector_tiers
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.summaries import ReplicaRequests
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.scenario.disaggregation import Disaggregation


def link_copies(plan: Plan) -> int:
    """Workers that each move their own share of a read."""
    tp = plan.engine.tensor_parallel_size
    return 1 if plan.model.uses_mla and tp > 1 else tp


def pd_engines(plan: Plan, disaggregation: Disaggregation,
               env: simpy.Environment) -> tuple[list[EngineCore], list[PDTier]]:
    """The deployment's engines, prefill replicas first, and the connector tier each was
    built with (its connector and worker), in the same order."""
    kv_cache_config = plan.require_fits()
    eng = plan.engine
    tiers = []
    for tier in connector_tiers(plan, env, disaggregation.num_replicas, disaggregation=disaggregation):
        assert isinstance(tier, PDTier)
        tiers.append(tier)
    return [EngineCore(kv_cache_config, eng.scheduler, eng.cache, tier) for tier in tiers], tiers


def run_pd_simulation(plan: Plan, trace, executors: Sequence[ModelExecutor], disaggregation: Disaggregation, *,
                      window_pricing: Callable[[ModelExecutor], object], time_limit_s: float | None = None,
                      on_progress: Callable[[ReplayClock], None] | None = None,
                      env: simpy.Environment | None = None) -> tuple[MetricsRecorder, float]:
    """Replay ``trace`` on the P/D deployment; the recorder and the end time."""
    env = env if env is not None else simpy.Environment()
    engines, tiers = pd_engines(plan, disaggregation, env)
    num_prefill = disaggregation.prefill_replicas
    router = PDRouter(engines[:num_prefill], engines[num_prefill:], disaggregation.prefill_router,
                      disaggregation.decode_router)
    roles = ["prefill"] * num_prefill + ["decode"] * disaggregation.decode_replicas
    recorder = MetricsRecorder(len(plan.require_fits().groups), len(engines), roles=roles)
    replicas = [Replica(engine, executor, window_pricing(executor)) for engine, executor in zip(engines, executors)]
    cluster = PDCluster(env, replicas, tiers, router, recorder, time_limit_s=time_limit_s, on_progress=on_progress,
                        num_prefill=num_prefill, copies=link_copies(plan))
    end_s = cluster.run(arrivals_from_trace(trace))
    return recorder, end_s


def pd_summary_columns(requests) -> dict[str, float]:
    """The summary's P/D figures over finished requests (``reports/SCHEMA.md``): mean read
    seconds and bytes, and the share of TTFT the read took (mean of per-request shares,
    and the total read time over the total TTFT)."""
    status = requests.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    transfer = requests.column("transfer_s").to_numpy()[done]
    ttft = requests.column("ttft_s").to_numpy()[done]
    num_bytes = requests.column("transfer_bytes").to_numpy()[done]
    ok = ~np.isnan(transfer) & (ttft > 0)
    if not ok.any():
        nan = math.nan
        return {"pd_transfer_mean_ms": nan, "pd_transfer_bytes_mean": nan, "pd_transfer_share_of_ttft": nan,
                "pd_transfer_share_of_ttft_total": nan}
    return {
        "pd_transfer_mean_ms": float(transfer[ok].mean() * 1000),
        "pd_transfer_bytes_mean": float(num_bytes[ok].mean()),
        "pd_transfer_share_of_ttft": float((transfer[ok] / ttft[ok]).mean()),
        "pd_transfer_share_of_ttft_total": float(transfer[ok].sum() / ttft[ok].sum()),
    }


# The prefix-cache request columns and the decode side's own counterparts.
DECODE_SIDE_PREFIX_COLUMNS = {"prefix_hit_tokens": "decode_prefix_hit_tokens",
                              "prefix_cache_queries": "decode_prefix_cache_queries",
                              "prefix_cache_hits": "decode_prefix_cache_hits"}


def _side_counts(requests, column: str, first: int, count: int):
    """Requests routed to each replica of one side (``column`` names the replica)."""
    picked = requests.column(column).to_numpy()
    picked = picked[picked >= 0] - first
    return np.bincount(picked, minlength=count)[:count] if picked.size else np.zeros(count, np.int64)


def pd_replica_requests(requests, disaggregation: Disaggregation) -> list:
    """Each replica's requests as it saw them (``summaries.ReplicaRequests``): a prefill
    replica the requests it prefilled, with their prefix-cache columns as they are (the
    prefill side's); a decode replica the requests it decoded, with the decode side's own
    lookups in their place (``DECODE_SIDE_PREFIX_COLUMNS``). Load ratios are over the mean
    of the replica's own side."""
    decode_view = requests
    for name, source in DECODE_SIDE_PREFIX_COLUMNS.items():
        decode_view = decode_view.set_column(decode_view.schema.get_field_index(name), name,
                                             requests.column(source))
    out = []
    num_prefill = disaggregation.prefill_replicas
    for column, first, count, table in (("prefill_replica", 0, num_prefill, requests),
                                        ("decode_replica", num_prefill, disaggregation.decode_replicas, decode_view)):
        counts = _side_counts(requests, column, first, count)
        mean = counts.mean()
        replica_of_request = requests.column(column).to_numpy()
        for index in range(count):
            out.append(ReplicaRequests(np.flatnonzero(replica_of_request == first + index), table,
                                       float(counts[index] / mean) if mean > 0 else math.nan))
    return out


def pd_side_imbalance(requests, disaggregation: Disaggregation) -> tuple[float, float]:
    """Each side's load imbalance: requests per prefill replica over their mean, and per
    decode replica over theirs (``summaries.load_imbalance``); NaN for a side nothing reached."""
    sides = []
    for column, first, count in (("prefill_replica", 0, disaggregation.prefill_replicas),
                                 ("decode_replica", disaggregation.prefill_replicas, disaggregation.decode_replicas)):
        counts = _side_counts(requests, column, first, count)
        mean = counts.mean()
        sides.append(float(counts.max() / mean) if mean > 0 else math.nan)
    return sides[0], sides[1]


def pd_load_imbalance(requests, disaggregation: Disaggregation) -> float:
    """The worse of the prefill side's and the decode side's load imbalance (``pd_side_imbalance``)."""
    known = [side for side in pd_side_imbalance(requests, disaggregation) if not math.isnan(side)]
    return max(known) if known else math.nan
