"""The replay report's plots: KV cache usage per group, the prefix cache hit rate, the
queues and preemptions over time, the latency CDFs, with offload tiers their use, their
traffic and the requests waiting for KV, and with several replicas the load on each.
Steps are binned first (``TIME_BINS`` bins over the run)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa

from kvtwin.reports import plots
from kvtwin.reports.binning import (bin_index, cdf_values, column_array, combined_state, hit_rate_bins, replica_ids,
                                    select_columns, usage_matrix)
from kvtwin.reports.figure_jobs import PendingFigure, render_figures
from kvtwin.reports.summary_text import format_duration_ms, missing

TIME_BINS = 400       # state over time (KV usage, queues, preemptions)
HIT_RATE_BINS = 100   # per-request hit rate over time

# The columns the plots read (the report reads no others of the two tables).
STEP_COLUMNS = ("time_s", "duration_s", "num_running", "num_waiting", "num_preempted", "kv_cache_usage",
                "kv_cache_usage_by_group", "replica", "offload_cpu_used_chunks", "offload_disk_used_chunks",
                "offload_load_bytes", "offload_store_bytes", "offload_disk_loaded_keys", "offload_disk_stored_keys",
                "num_waiting_for_kv")
REQUEST_COLUMNS = ("status", "arrival_time_s", "first_scheduled_time_s", "prompt_tokens", "prefix_cache_hits",
                   "prefix_cache_queries", "ttft_s", "tpot_s", "e2el_s", "replica")


@dataclass(frozen=True)
class _Timeline:
    """The steps placed on the run's time bins."""

    steps: pa.Table
    t_end: float  # the run's end, seconds (at least the summary's duration)
    has_steps: bool
    nbins: int
    bin_s: float
    centers: np.ndarray  # the bins' middles (empty without steps)
    idx: np.ndarray  # each step's bin
    step_replica: np.ndarray | None  # each step's replica, with more than one

    @classmethod
    def of(cls, steps: pa.Table, duration_s: float) -> _Timeline:
        t = column_array(steps, "time_s") if "time_s" in steps.column_names else np.zeros(0)
        t_end = duration_s
        if len(t):
            t_end = max(t_end, float(np.nanmax(t + column_array(steps, "duration_s")))
                        if "duration_s" in steps.column_names else float(np.nanmax(t)))
        t_end = t_end if t_end > 0 else 1.0
        nbins = TIME_BINS
        bin_s = t_end / nbins
        centers = (np.arange(nbins) + 0.5) * bin_s if len(t) else np.zeros(0)
        return cls(steps, t_end, bool(len(t)), nbins, bin_s, centers, bin_index(t, t_end, nbins), replica_ids(steps))

    def state(self, column: str, how: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mean, minimum and maximum per bin of an integer state column."""
        values = column_array(self.steps, column, np.int64).astype(float)
        return combined_state(self.idx, values, self.nbins, self.step_replica, how)


def replay_figures(requests: pa.Table, steps: pa.Table, s: dict, plan: dict | None) -> list[str]:
    steps = select_columns(steps, STEP_COLUMNS)
    requests = select_columns(requests, REQUEST_COLUMNS)
    timeline = _Timeline.of(steps, float(s.get("duration_s") or 0.0))
    pending = [_usage_figure(timeline, plan), _hit_rate_figure(requests, timeline.t_end, s),
               *_queue_figures(timeline), _latency_figure(requests, s)]
    if "offload_cpu_used_chunks" in steps.column_names:
        pending += _offload_figures(timeline, s)
    req_replica = replica_ids(requests)
    if req_replica is not None:
        pending.append(_replica_load_figure(requests, req_replica))
    return render_figures(pending)


def _group_labels(plan: dict | None, count: int) -> list[str]:
    groups = ((plan or {}).get("hybrid_on", plan) or {}).get("groups") or []
    labels = []
    for i in range(count):
        g = groups[i] if i < len(groups) else None
        if g is None:
            labels.append(f"group {i}" if count > 1 else "all groups")
        else:
            labels.append(f"group {g.get('group_id', i)}: {g.get('kind', '?')}, {g.get('num_layers', '?')} layers, "
                          f"block {g.get('block_size', '?')}")
    return labels


def _usage_figure(tl: _Timeline, plan: dict | None) -> PendingFigure:
    usage, width = usage_matrix(tl.steps)
    if tl.has_steps:
        per_group = np.column_stack([combined_state(tl.idx, usage[:, g], tl.nbins, tl.step_replica, "mean")[0]
                                     for g in range(width)])
        peak = combined_state(tl.idx, usage.sum(axis=1), tl.nbins, tl.step_replica, "mean")[2]
    else:
        per_group, peak = np.zeros((0, width)), None
    return PendingFigure(partial(plots.kv_usage_by_group, tl.centers, per_group, _group_labels(plan, width), peak),
                         f"KV cache usage by KV cache group over time, stacked: blocks in use over the usable blocks "
                         f"(steps.parquet kv_cache_usage_by_group), mean per {tl.bin_s:,.3g} s bin, with the highest "
                         f"total in each bin as a line"
                         + (", averaged over replicas" if tl.step_replica is not None else "") + ".",
                         "KV cache usage by group")


def _hit_rate_figure(requests: pa.Table, t_end: float, s: dict) -> PendingFigure:
    hbins = HIT_RATE_BINS
    h_centers, rate = hit_rate_bins(requests, t_end, hbins)
    return PendingFigure(partial(plots.hit_rate_over_time, h_centers, rate,
                                 s.get("prefix_cache_hit_rate"), s.get("prefix_reuse_upper_bound")),
                         f"Prefix cache hit rate over time: prompt tokens found over tokens looked up, summed over the "
                         f"requests first scheduled in each {t_end / hbins:,.3g} s bin (requests.parquet "
                         f"prefix_cache_hits / prefix_cache_queries), with the whole run's rate and the trace's "
                         f"infinite-cache bound.", "prefix cache hit rate over time")


def _queue_figures(tl: _Timeline) -> list[PendingFigure]:
    if tl.has_steps:
        running, *running_range = tl.state("num_running", "sum")
        waiting, *waiting_range = tl.state("num_waiting", "sum")
        preempted = np.bincount(tl.idx, weights=column_array(tl.steps, "num_preempted", np.int64), minlength=tl.nbins)
        ranges = (tuple(running_range), tuple(waiting_range))
    else:
        running = waiting = preempted = np.zeros(0)
        ranges = (None, None)
    return [PendingFigure(partial(plots.queues_over_time, tl.centers, running, waiting, *ranges),
                          f"Running and waiting requests after each step, mean per {tl.bin_s:,.3g} s bin (lines) and "
                          "the least to the most in the bin (bands)"
                          + (", summed over replicas" if tl.step_replica is not None else "") + ".",
                          "running and waiting queues"),
            PendingFigure(partial(plots.preemptions_over_time, tl.centers, preempted, tl.bin_s),
                          f"Preemptions (recompute) per {tl.bin_s:,.3g} s bin (steps.parquet num_preempted).",
                          "preemptions over time")]


def _offload_figures(tl: _Timeline, s: dict) -> list[PendingFigure]:
    """The tiers' use (chunks in use over each tier's chunks, averaged over replicas), their
    traffic (bytes per second of each bin, summed over replicas) and the requests waiting
    for KV (summed over replicas)."""
    use = []
    for tier, label in (("cpu", "CPU tier"), ("disk", "disk tier")):
        column, capacity = f"offload_{tier}_used_chunks", s.get(f"offload_{tier}_chunks")
        if column in tl.steps.column_names and capacity and tl.has_steps:
            mean, low, high = tl.state(column, "mean")
            use.append((label, mean * 100 / capacity, low * 100 / capacity, high * 100 / capacity))
    chunk_bytes = s.get("offload_chunk_bytes") or 0
    traffic = []
    for title, lines in (("PCIe (GPU ↔ CPU)", (("loaded CPU → GPU", "offload_load_bytes", 1),
                                               ("stored GPU → CPU", "offload_store_bytes", 1))),
                         ("disk (CPU ↔ disk)", (("promoted disk → CPU", "offload_disk_loaded_keys", chunk_bytes),
                                                ("written CPU → disk", "offload_disk_stored_keys", chunk_bytes)))):
        series = []
        for label, column, scale in lines:
            if column in tl.steps.column_names and tl.has_steps:
                moved = np.bincount(tl.idx, weights=column_array(tl.steps, column, np.int64) * float(scale),
                                    minlength=tl.nbins)
                series.append((label, moved / tl.bin_s / 1e9))
        if series or title.startswith("PCIe"):
            traffic.append((title, series))
    waiting = []
    if "num_waiting_for_kv" in tl.steps.column_names and tl.has_steps:
        waiting.append(("waiting for KV", *tl.state("num_waiting_for_kv", "sum")))
    replicas = tl.step_replica is not None
    return [PendingFigure(partial(plots.states_over_time, tl.centers, use, ylabel="chunks in use (%)",
                                  title="Offload tier use", top=100),
                          f"Offload tiers: chunks holding a key over the tier's chunks (steps.parquet "
                          f"offload_cpu_used_chunks, offload_disk_used_chunks), mean per {tl.bin_s:,.3g} s bin "
                          f"(lines) and the least to the most in the bin (bands)"
                          + (", averaged over replicas" if replicas else "") + ".", "offload tier use"),
            PendingFigure(partial(plots.rates_over_time, tl.centers, traffic, ylabel="GB/s"),
                          f"Offload traffic per {tl.bin_s:,.3g} s bin, GB/s: KV loaded into and stored from the "
                          "GPUs over PCIe (steps.parquet offload_load_bytes, offload_store_bytes) and, with a disk "
                          "tier, chunks promoted from and written to the disk (offload_disk_loaded_keys, "
                          "offload_disk_stored_keys, times offload_chunk_bytes), each counted in the step that "
                          "issued (PCIe) or finished (disk) it" + (", summed over replicas" if replicas else "")
                          + ".", "offload traffic"),
            PendingFigure(partial(plots.states_over_time, tl.centers, waiting, ylabel="requests",
                                  title="Requests waiting for KV from a tier"),
                          f"Requests waiting for KV from an offload tier after each step (steps.parquet "
                          f"num_waiting_for_kv: from the first lookup that found their hit in a tier, a disk "
                          f"promotion or a store still running, until they are scheduled), mean per "
                          f"{tl.bin_s:,.3g} s bin (line) and the least to the most in the bin (band)"
                          + (", summed over replicas" if replicas else "") + ".", "requests waiting for KV")]


def _latency_figure(requests: pa.Table, s: dict) -> PendingFigure:
    finished = (np.asarray(requests.column("status").to_pylist()) == "finished") if requests.num_rows else \
        np.zeros(0, dtype=bool)
    series = [(name, cdf_values(column_array(requests, col)[finished] * 1000) if requests.num_rows else np.zeros(0))
              for name, col in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E latency", "e2el_s"))]
    slo = {"TTFT": s.get("slo_ttft_ms"), "TPOT": s.get("slo_tpot_ms")}
    slo = {k: float(v) for k, v in slo.items() if not missing(v)}
    # The band's factors, read back from the p99 and its edges (docs/capacity.md#the-band).
    band = {}
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E latency", "e2el_ms")):
        p99, low, high = s.get(f"p99_{key}"), s.get(f"p99_{key}_low"), s.get(f"p99_{key}_high")
        if not missing(p99) and not missing(low) and float(p99) > 0:
            band[name] = (float(low) / float(p99), float(high) / float(p99))
    clock = (f" Shaded: the band the clock's calibration ({s.get('calibration')}) implies from its held-out "
             "error." if band else " The clock is uncalibrated: no error band." if s.get("calibration") ==
             "uncalibrated" else "")
    overhead = s.get("client_overhead_ms")
    # Whose figures these are (docs/capacity.md#client-side-latency): the server's, and what a client adds.
    side = (f" TTFT and E2E are the server's; a client sees each {format_duration_ms(overhead)} later (time "
            "outside the engine), and the SLO judges the client's TTFT." if not missing(overhead) and overhead
            else " TTFT and E2E are the server's (the calibration sets no time outside the engine: a client "
            "sees the same)." if not missing(overhead) else "")
    return PendingFigure(partial(plots.latency_cdfs, series, slo, band),
                         "Cumulative distributions of TTFT, TPOT and end-to-end latency over finished requests "
                         "(dashed: the scenario's SLO)." + side + clock, "latency CDFs")


def _replica_load_figure(requests: pa.Table, req_replica: np.ndarray) -> PendingFigure:
    ids = np.unique(req_replica)
    counts = np.array([(req_replica == r).sum() for r in ids])
    tokens = (np.array([column_array(requests, "prompt_tokens", np.int64)[req_replica == r].sum() for r in ids])
              if "prompt_tokens" in requests.column_names else None)
    return PendingFigure(partial(plots.replica_load, [str(r) for r in ids], counts, tokens),
                         f"Load per replica: requests routed to each of the {len(ids)} replicas"
                         + (" and their prompt tokens" if tokens is not None else "") + ".",
                         "per-replica load")
