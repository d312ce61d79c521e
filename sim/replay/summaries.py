"""A replay's summaries: the run-level row (named as ``vllm bench serve`` names its
figures), the offload figures, and one row per data-parallel replica.

docs/architecture.md#outputs; column meanings are in ``reports/SCHEMA.md``. Everything is
computed from the recorder's tables, never from the engine.
"""

from __future__ import annotations

import json
import math
from array import array
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.sim.replay.output_columns import OFFLOAD, SPECULATIVE, assemble
from kvtwin.sim.replay.sustained import FAILURES, sustained_load
from kvtwin.sim.scenario.slo import SLO, admitted_attainment
from kvtwin.traces.expand import table_block_ids
from kvtwin.traces.schema import hash_block_tokens_of
from kvtwin.traces.stats import DEFAULT_BLOCK_TOKENS, prefix_reuse


def _stats(values: np.ndarray, prefix: str, scale: float = 1000.0) -> dict[str, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {f"mean_{prefix}": math.nan, f"median_{prefix}": math.nan, f"p90_{prefix}": math.nan,
                f"p99_{prefix}": math.nan}
    return {
        f"mean_{prefix}": float(finite.mean() * scale),
        f"median_{prefix}": float(np.percentile(finite, 50) * scale),
        f"p90_{prefix}": float(np.percentile(finite, 90) * scale),
        f"p99_{prefix}": float(np.percentile(finite, 99) * scale),
    }


# When a run counts as saturated (summary columns ``saturated``, ``saturation_reason``).
# A minute in line before the first schedule is more than any interactive service hides.
SATURATION_QUEUE_P90_S = 60.0
# Fewer than half the requests within the SLO: the deployment does not hold it.
SATURATION_SLO_ATTAINMENT = 0.5
# The engine still busy long after the last arrival: requests queued faster than served.
SATURATION_DRAIN_FACTOR = 1.5
SATURATION_DRAIN_MIN_S = 60.0


def _reuse_upper_bound(trace: pa.Table) -> float:
    """The infinite-cache share of prompt tokens (``kvtwin trace info``), NaN without identity.

    Measured at the trace's own hash block size, which costs a few milliseconds on the
    Mooncake hour; finer blocks would cost seconds and move the bound by under 1%.
    """
    block_tokens = hash_block_tokens_of(trace) or DEFAULT_BLOCK_TOKENS
    ids = table_block_ids(trace, block_tokens)
    if ids is None:
        return math.nan
    return prefix_reuse(ids, trace.column("prompt_tokens").to_numpy(), block_tokens).token_fraction


def _saturation(queue_p90_s: float, attainment: float, has_slo: bool, completed: int, duration_s: float,
                last_arrival_s: float) -> list[str]:
    """``attainment`` is over the requests admitted (``admitted_attainment``): whether the
    deployment keeps up, which the requests it refuses outright say nothing about."""
    reasons = []
    if queue_p90_s > SATURATION_QUEUE_P90_S:
        reasons.append("queueing")
    if has_slo and attainment < SATURATION_SLO_ATTAINMENT:
        reasons.append("slo")
    if (completed and duration_s > SATURATION_DRAIN_FACTOR * max(last_arrival_s, 1.0)
            and duration_s - last_arrival_s > SATURATION_DRAIN_MIN_S):
        reasons.append("drain")
    return reasons


def summarize(requests: pa.Table, steps: pa.Table, itl_s: array, slo: SLO, end_time_s: float, *,
              trace: pa.Table | None = None, num_replicas: int = 1, router: str = "round_robin",
              offload: dict | None = None, prefix_cache_retention: str = "0",
              client_overhead_s: float = 0.0) -> pa.Table:
    """``summary_parts`` as one row (the base figures, then any feature's)."""
    base, features = summary_parts(requests, steps, itl_s, slo, end_time_s, trace=trace, num_replicas=num_replicas,
                                   router=router, offload=offload, prefix_cache_retention=prefix_cache_retention,
                                   client_overhead_s=client_overhead_s)
    return pa.Table.from_pylist([assemble("summary", base, features)])


def summary_parts(requests: pa.Table, steps: pa.Table, itl_s: array, slo: SLO, end_time_s: float, *,
                  trace: pa.Table | None = None, num_replicas: int = 1, router: str = "round_robin",
                  offload: dict | None = None, prefix_cache_retention: str = "0",
                  client_overhead_s: float = 0.0) -> tuple[dict, dict[str, dict]]:
    """The run-level figures over ``requests``, named as ``vllm bench serve`` names them
    (times in ms): the base row, and the figures of each feature the tables have columns of
    (speculative decoding, offload tiers), by feature (``output_columns.assemble`` orders them).

    ``trace`` is the replayed trace: it gives the requests that never arrived (a time
    limit) and the prefix-reuse upper bound of those that did. ``num_replicas`` and
    ``router`` describe the cluster (figures are over all replicas); ``load_imbalance``
    is computed from the requests' ``replica`` column (``load_imbalance``). With offload
    tiers (the tables have their columns) the offload figures follow
    (``output_columns.OFFLOAD``); ``offload`` is the tiers' settings
    (``ResolvedOffload.describe()``). ``prefix_cache_retention`` is the engine's setting as
    a scenario spells it (``retention_label``: docs/semantics.md#retention-setting).
    ``client_overhead_s`` (the calibration's time outside the engine) is added to each
    TTFT before the SLO judges it: the SLO is a client's (docs/capacity.md#client-side-latency);
    the TTFT and E2E columns stay the server's.
    """
    status = requests.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    ttft = requests.column("ttft_s").to_numpy()
    tpot = requests.column("tpot_s").to_numpy()
    row = _throughput_figures(requests, status, done, end_time_s)
    row.update(_stats(ttft[done], "ttft_ms"))
    row.update(_stats(tpot[done], "tpot_ms"))
    row.update(_stats(np.frombuffer(itl_s, dtype=np.float64) if len(itl_s) else np.zeros(0), "itl_ms"))
    row.update(_stats(requests.column("e2el_s").to_numpy()[done], "e2el_ms"))
    row.update(_cache_and_step_figures(requests, steps))
    # TPOT needs no shift: the overhead is once per request, before the first token.
    met = int(np.array([slo.met(a + client_overhead_s, b) for a, b in zip(ttft[done], tpot[done])],
                       dtype=bool).sum())
    arrived = requests.num_rows
    row.update({
        "slo_ttft_ms": slo.ttft_s * 1000 if slo.ttft_s is not None else math.nan,
        "slo_tpot_ms": slo.tpot_s * 1000 if slo.tpot_s is not None else math.nan,
        # Over every arrival: a request refused or never finished was not served within the SLO.
        "slo_attainment": met / arrived if arrived else math.nan,
        "rejected_share": row["rejected"] / arrived if arrived else math.nan,
        "request_goodput": met / end_time_s if end_time_s > 0 else math.nan,
    })
    arrival = requests.column("arrival_time_s").to_numpy()
    scheduled = requests.column("first_scheduled_time_s").to_numpy()
    # A request still waiting at the end has queued at least until then.
    queue_s = np.where(np.isnan(scheduled), end_time_s - arrival, scheduled - arrival)[status != "rejected"]
    row.update(_stats(queue_s, "queue_delay_ms"))
    last_arrival_s = float(arrival.max()) if arrival.size else 0.0
    sustained = sustained_load(requests, end_time_s)
    # A load the deployment did not keep up with is saturation; a window too short to
    # judge is not (docs/capacity.md#sustained-load).
    saturation = _saturation_of(row, slo, end_time_s, last_arrival_s) + [
        r for r in sustained.reasons if r in FAILURES]
    row.update(_trace_figures(requests, trace, last_arrival_s, saturation))
    row.update(sustained.columns())
    row.update({"num_replicas": num_replicas, "router": router,
                "load_imbalance": load_imbalance(requests, num_replicas),
                "prefix_cache_retention": prefix_cache_retention})
    features = {}
    if SPECULATIVE.requests[0] in requests.column_names:
        features[SPECULATIVE.feature] = spec_summary(requests, steps)
    if OFFLOAD.requests[0] in requests.column_names:
        features[OFFLOAD.feature] = offload_summary(requests, steps, offload)
    return row, features


def spec_summary(requests: pa.Table, steps: pa.Table | None = None) -> dict:
    """Speculative decoding's figures (only in runs with drafts), as vLLM's spec-decode
    metrics name them: drafts verified, drafts accepted, their ratio
    (``spec_acceptance_rate``), the tokens a verify step yields on average, its sampled
    token included (``mean_acceptance_length``, vLLM's "mean acceptance length"), and
    with the steps' ``spec_accepted_by_position`` each draft position's acceptance rate
    (accepted there over verify steps, vLLM's "per-position acceptance rate")."""
    drafts = int(pc.sum(requests.column("draft_tokens")).as_py() or 0)
    accepted = int(pc.sum(requests.column("accepted_draft_tokens")).as_py() or 0)
    verify_steps = int(pc.sum(requests.column("verify_steps")).as_py() or 0)
    row: dict[str, object] = {"spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
                              "spec_acceptance_rate": accepted / drafts if drafts else math.nan,
                              "mean_acceptance_length": 1.0 + accepted / verify_steps if verify_steps else math.nan}
    if steps is not None and "spec_accepted_by_position" in steps.column_names:
        lists = steps.column("spec_accepted_by_position").combine_chunks()
        width = len(lists[0]) if len(lists) else 0
        by_position = (lists.flatten().to_numpy().reshape(-1, width).sum(axis=0) if width
                       else np.zeros(0, dtype=np.int64))
        row["spec_acceptance_by_position"] = [float(n) / verify_steps if verify_steps else math.nan
                                              for n in by_position]
    return row


def _throughput_figures(requests: pa.Table, status: np.ndarray, done: np.ndarray, duration_s: float) -> dict:
    """Request counts by outcome, and the finished requests' tokens per second."""
    generated = requests.column("generated_tokens").to_numpy()
    prompt = requests.column("prompt_tokens").to_numpy()
    input_tokens = int(prompt[done].sum())
    output_tokens = int(generated[done].sum())
    row: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": requests.num_rows,
        "completed": int(done.sum()),
        "rejected": int((status == "rejected").sum()),
        "unfinished": int(((status == "waiting") | (status == "running")).sum()),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": done.sum() / duration_s if duration_s > 0 else math.nan,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else math.nan,
    }
    return row


def _cache_and_step_figures(requests: pa.Table, steps: pa.Table) -> dict:
    """Prefix-cache totals, preemption and recompute, and the steps' tokens and KV usage."""
    step_durations = steps.column("duration_s").to_numpy() if steps.num_rows else np.zeros(0)
    usage = steps.column("kv_cache_usage").to_numpy() if steps.num_rows else np.zeros(0)
    busy_s = float(step_durations.sum())
    queries = int(requests.column("prefix_cache_queries").to_numpy().sum())
    hits = int(requests.column("prefix_cache_hits").to_numpy().sum())
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else math.nan,
        "num_preemptions": int(requests.column("num_preemptions").to_numpy().sum()),
        "recomputed_tokens": int(requests.column("recomputed_tokens").to_numpy().sum()),
        "num_evictions": int(steps.column("num_evictions").to_numpy().sum()) if steps.num_rows else 0,
        "num_steps": steps.num_rows,
        "prefill_tokens": int(steps.column("prefill_tokens").to_numpy().sum()) if steps.num_rows else 0,
        "decode_tokens": int(steps.column("decode_tokens").to_numpy().sum()) if steps.num_rows else 0,
        "busy_time_s": busy_s,
        "kv_cache_usage_peak": float(usage.max()) if usage.size else 0.0,
        # Time-weighted: a step's usage holds for its duration.
        "kv_cache_usage_mean": float((usage * step_durations).sum() / busy_s) if busy_s > 0 else 0.0,
    }


def _saturation_of(row: dict, slo: SLO, duration_s: float, last_arrival_s: float) -> list[str]:
    has_slo = slo.ttft_s is not None or slo.tpot_s is not None
    queue_p90_s = row["p90_queue_delay_ms"] / 1000 if not math.isnan(row["p90_queue_delay_ms"]) else 0.0
    return _saturation(queue_p90_s, admitted_attainment(row), has_slo, row["completed"], duration_s,
                       last_arrival_s)


def _trace_figures(requests: pa.Table, trace: pa.Table | None, last_arrival_s: float,
                   saturation: list[str]) -> dict:
    """What of the trace arrived, its reuse bound, the rejections by reason, saturation."""
    trace_rows = trace.num_rows if trace is not None else requests.num_rows
    reasons = requests.column("reject_reason").drop_null()
    by_reason = pc.value_counts(reasons.cast(pa.string())).to_pylist() if len(reasons) else []
    return {
        "last_arrival_s": last_arrival_s,
        "num_trace_requests": trace_rows,
        "not_arrived": max(trace_rows - requests.num_rows, 0),
        # Arrivals follow the trace's row order, so the rows that arrived are its first rows.
        "prefix_reuse_upper_bound": _reuse_upper_bound(trace.slice(0, requests.num_rows))
        if trace is not None else math.nan,
        "rejected_by_reason": json.dumps({d["values"]: d["counts"] for d in sorted(by_reason,
                                                                                  key=lambda d: d["values"])}),
        "saturated": bool(saturation),
        "saturation_reason": ",".join(saturation),
    }


def offload_summary(requests: pa.Table, steps: pa.Table, offload: dict | None = None) -> dict:
    """The offload figures of a run (``output_columns.OFFLOAD``): hits per tier at first
    admission over the prompt tokens of the requests admitted, the waits for KV (with the
    part before the load was issued, ``load_defer``, and the transfer), the tiers' traffic
    (sums of the step columns; a disk column is 0 without a disk tier)."""
    row: dict[str, object] = {name: None for name in OFFLOAD.summary}
    row.update(offload or {})
    status = requests.column("status").to_numpy(zero_copy_only=False)
    admitted = ~np.isnan(requests.column("first_scheduled_time_s").to_numpy()) & (status != "rejected")
    prompt = int(requests.column("prompt_tokens").to_numpy()[admitted].sum())
    total = 0
    for tier in ("gpu", "cpu", "disk"):
        hits = int(requests.column(f"{tier}_hit_tokens").to_numpy()[admitted].sum())
        total += hits
        row[f"{tier}_hit_tokens"] = hits
        row[f"hit_rate_{tier}"] = hits / prompt if prompt else math.nan
    row["hit_rate_total"] = total / prompt if prompt else math.nan
    wait = requests.column("load_wait_s").to_numpy()
    row["num_loads"] = int(np.isfinite(requests.column("load_transfer_s").to_numpy()).sum())
    row["num_load_waits"] = int(np.isfinite(wait).sum())
    row.update(_stats(wait, "load_wait_ms"))
    row.update(_stats(requests.column("load_transfer_s").to_numpy(), "load_transfer_ms"))
    row.update(_stats(requests.column("load_defer_s").to_numpy(), "load_defer_ms"))
    names = steps.column_names

    def total_of(column: str) -> int:
        return int(steps.column(column).to_numpy().sum()) if column in names and steps.num_rows else 0

    row["kv_offload_load_bytes"] = total_of("offload_load_bytes")
    row["kv_offload_store_bytes"] = total_of("offload_store_bytes")
    for tier in ("cpu", "disk"):
        for what in ("loaded", "stored", "evicted"):
            row[f"offload_{tier}_{what}_keys"] = total_of(f"offload_{tier}_{what}_keys")
    return row


def routed_counts(requests: pa.Table, num_replicas: int) -> np.ndarray:
    """Requests routed to each replica (every arrival, rejected ones included)."""
    if "replica" not in requests.column_names or requests.num_rows == 0:
        counts = np.zeros(num_replicas, dtype=np.int64)
        counts[0] = requests.num_rows
        return counts
    return np.bincount(requests.column("replica").to_numpy(), minlength=num_replicas)[:num_replicas]


def load_imbalance(requests: pa.Table, num_replicas: int) -> float:
    """Max over replicas of the requests routed there, over the mean (1.0 = even, N = all
    on one of N replicas); NaN when nothing arrived."""
    counts = routed_counts(requests, num_replicas)
    mean = counts.mean() if counts.size else 0.0
    return float(counts.max() / mean) if mean > 0 else math.nan


# Cluster-level columns of ``summarize`` that a per-replica row does not repeat.
_CLUSTER_ONLY = ("num_replicas", "router", "load_imbalance", "prefix_cache_retention")


class ReplicaRequests:
    """One replica's share of the requests table: the rows it served (``rows``, indices
    into ``table``), as it saw them (``table``: the requests table, or a view of it with
    that replica's own columns), and its load ratio (requests routed there over the mean
    per replica of its kind)."""

    def __init__(self, rows: np.ndarray, table: pa.Table, load_ratio: float):
        self.rows = rows
        self.table = table
        self.load_ratio = load_ratio


def routed_replica_requests(requests: pa.Table, num_replicas: int) -> list[ReplicaRequests]:
    """Each data-parallel replica's requests: the rows routed there (column ``replica``)."""
    counts = routed_counts(requests, num_replicas)
    mean = counts.mean() if counts.size else 0.0
    replica_of_request = (requests.column("replica").to_numpy() if "replica" in requests.column_names
                          else np.zeros(requests.num_rows, np.int32))
    return [ReplicaRequests(np.flatnonzero(replica_of_request == replica), requests,
                            float(counts[replica] / mean) if mean > 0 else math.nan)
            for replica in range(num_replicas)]


def summarize_replicas(requests: pa.Table, steps: pa.Table, itl_by_replica: list[array], slo: SLO,
                       end_time_s: float, *, trace: pa.Table | None = None,
                       cluster_summary: pa.Table | None = None, offload: dict | None = None,
                       per_replica: list[ReplicaRequests] | None = None,
                       roles: list[str] | None = None, client_overhead_s: float = 0.0) -> pa.Table:
    """One row per replica: ``replica``, then ``summarize``'s figures over that replica's
    requests, steps and inter-token latencies (the cluster-only ``num_replicas``,
    ``router`` and ``load_imbalance`` left out), then ``load_ratio`` (requests routed
    there over the mean). Durations and rates use the cluster's ``end_time_s``; a
    replica's trace is the rows routed to it (so ``prefix_reuse_upper_bound`` is the
    reuse available within its own stream, and ``not_arrived`` is 0). With one replica
    the row is ``cluster_summary``'s, if given (the same figures, not computed twice).

    ``per_replica`` says which requests each replica served, as it saw them (default:
    ``routed_replica_requests``; a P/D deployment's come from ``pd_summaries``), and ``roles``
    adds each replica's role after ``replica``. ``client_overhead_s``: as in ``summarize``."""
    num_replicas = len(itl_by_replica)
    if num_replicas == 1 and cluster_summary is not None and per_replica is None:
        row = cluster_summary.to_pylist()[0]
        row["not_arrived"] = 0
        row["num_trace_requests"] = requests.num_rows
        for name in _CLUSTER_ONLY:
            del row[name]
        table = pa.Table.from_pylist([{"replica": 0, **row, "load_ratio": 1.0 if requests.num_rows else math.nan}])
        return table.set_column(0, "replica", table.column("replica").cast(pa.int32()))
    if per_replica is None:
        per_replica = routed_replica_requests(requests, num_replicas)
    replica_of_step = (steps.column("replica").to_numpy() if "replica" in steps.column_names
                       else np.zeros(steps.num_rows, np.int32))
    arrived = trace.slice(0, requests.num_rows) if trace is not None else None
    rows = []
    for replica, mine in enumerate(per_replica):
        sub_requests = mine.table.take(mine.rows)
        sub_steps = steps.take(np.flatnonzero(replica_of_step == replica))
        sub_trace = arrived.take(mine.rows) if arrived is not None else None
        row = summarize(sub_requests, sub_steps, itl_by_replica[replica], slo, end_time_s,
                        trace=sub_trace, offload=offload, client_overhead_s=client_overhead_s).to_pylist()[0]
        for name in _CLUSTER_ONLY:
            del row[name]
        head: dict[str, object] = {"replica": replica}
        if roles is not None:
            head["role"] = roles[replica]
        rows.append({**head, **row, "load_ratio": mine.load_ratio})
    table = pa.Table.from_pylist(rows)
    return table.set_column(0, "replica", table.column("replica").cast(pa.int32()))
