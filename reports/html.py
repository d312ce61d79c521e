"""``report.html``: a replay or capacity directory as one self-contained HTML file.

Inline CSS, the plots as base64 PNG data URIs (``reports.plots``), no external URL; every
string that comes from data (scenario text, request ids, errors, sweep values) is
HTML-escaped. Nothing depends on the wall clock, so the same directory gives the same bytes.

Steps are binned before plotting (``TIME_BINS`` bins over the run), so a run with a
million steps renders in about a second. A small inline script marks each image with
``data-loaded="1"`` once the browser has decoded it (used by the browser test).
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvtwin import __version__
from kvtwin.reports import plots
from kvtwin.reports.run_dir import METADATA_KEY
from kvtwin.reports.summary_text import format_bytes, format_duration_ms, format_duration_s, format_percent, missing
from kvtwin.sim.core.errors import ConfigError

__all__ = ["REPLAY_FILES", "CAPACITY_FILES", "render_capacity_report", "render_replay_report", "render_report_dir",
           "report_kind", "write_report"]

REPORT_NAME = "report.html"
REPLAY_FILES = ("requests.parquet", "steps.parquet", "summary.parquet", "plan.json")
CAPACITY_FILES = ("capacity.parquet",)
TIME_BINS = 400       # state over time (KV usage, queues, preemptions)
HIT_RATE_BINS = 100   # per-request hit rate over time
CDF_POINTS = 2000     # a CDF is drawn through this many quantiles at most

STEP_COLUMNS = ("time_s", "duration_s", "num_running", "num_waiting", "num_preempted", "kv_cache_usage",
                "kv_cache_usage_by_group", "replica")
REQUEST_COLUMNS = ("status", "arrival_time_s", "first_scheduled_time_s", "prompt_tokens", "prefix_cache_hits",
                   "prefix_cache_queries", "ttft_s", "tpot_s", "e2el_s", "replica")

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.wide{overflow-x:auto}.meta td{text-align:left}
figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#555;margin-top:.3em}
pre{background:#f7f7f7;padding:.6em;font-size:.8em;overflow-x:auto}
.note{color:#555;font-size:.9em}
"""

LOADED_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img"), ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    var good = imgs[i].complete && imgs[i].naturalWidth > 0;
    imgs[i].setAttribute("data-loaded", good ? "1" : "0");
    if (good) { ok++; }
  }
  document.body.setAttribute("data-plots-rendered", ok + "/" + imgs.length);
});
"""


# ---------------------------------------------------------------------------------------------
# HTML pieces


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _figure(png: bytes, caption: str, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _kv_table(rows: Sequence[tuple[str, object]], cls: str = "meta") -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _fmt_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return "-"
        if float(value).is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return str(value)


def _frame_table(frame: pd.DataFrame) -> str:
    shown = frame.copy()
    for column in shown.columns:
        shown[column] = [_fmt_cell(v) for v in shown[column].tolist()]
    # to_html escapes every cell and header (escape=True).
    return '<div class="wide">' + shown.to_html(index=False, escape=True, border=0, na_rep="-") + "</div>"


def _page(title: str, sections: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(sections)
            + f"\n<script>{LOADED_SCRIPT}</script>\n</body></html>\n"
            # Pure ASCII whatever the locale writes files in: other characters as references.
            ).encode("ascii", "xmlcharrefreplace").decode("ascii")


def _scenario_facts(metadata: dict) -> tuple[str, str]:
    """(description, trace) from the run metadata's scenario text and overrides."""
    try:
        scenario = tomllib.loads(metadata.get("scenario") or "")
    except tomllib.TOMLDecodeError:
        scenario = {}
    overrides = metadata.get("overrides") or {}
    description = scenario.get("description") or "(no description)"
    workload = scenario.get("workload") if isinstance(scenario.get("workload"), dict) else {}
    trace = overrides.get("trace") or workload.get("trace") or "(none named)"
    return str(description), str(trace)


def _header(kind: str, metadata: dict, sources: Sequence[str], extra: Sequence[tuple[str, object]] = ()) -> str:
    description, trace = _scenario_facts(metadata)
    overrides = metadata.get("overrides") or {}
    rows = [("scenario", description),
            ("scenario file", metadata.get("scenario_file") or "-"),
            ("trace", trace),
            ("command-line overrides", ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "none"),
            ("kvtwin version (run)", metadata.get("kvtwin_version") or "-"),
            ("kvtwin version (report)", __version__),
            ("generated from", ", ".join(sources)),
            *extra]
    out = f"<h1>kvtwin {_e(kind)} report</h1><p class=\"note\">{_e(description)}</p>" + _kv_table(rows)
    if metadata.get("scenario"):
        out += ("<details><summary>scenario file text</summary><pre>" + _e(metadata["scenario"]) + "</pre></details>")
    return out


def _plan_section(plan: dict | None) -> str:
    if not plan:
        return "<h2>Plan</h2><p class=\"note\">no plan recorded</p>"
    if "hybrid_on" in plan:  # a --compare-hybrid plan: the layout the run used is the hybrid one
        plan = plan["hybrid_on"]

    def get(key):
        value = plan.get(key)
        return "-" if value is None else value

    rows = [("model", get("model")), ("GPU", get("gpu")), ("tensor parallel", get("tensor_parallel_size")),
            ("max_model_len", _fmt_cell(plan.get("max_model_len"))),
            ("max_num_seqs / max_num_batched_tokens",
             f"{_fmt_cell(plan.get('max_num_seqs'))} / {_fmt_cell(plan.get('max_num_batched_tokens'))}"),
            ("KV cache dtype", get("kv_cache_dtype")),
            ("prefix caching", _fmt_cell(plan.get("enable_prefix_caching"))),
            ("hybrid KV cache manager", _fmt_cell(plan.get("hybrid_kv_cache_manager"))),
            ("KV cache groups", _fmt_cell(plan.get("num_groups"))),
            ("num_blocks (incl. the null block)", _fmt_cell(plan.get("num_blocks"))),
            ("bytes per block", _fmt_cell(plan.get("bytes_per_block"))),
            ("KV cache tokens", _fmt_cell(plan.get("kv_cache_tokens"))),
            ("max concurrency (requests of max_model_len)", _fmt_cell(plan.get("max_concurrency"))),
            ("steady-state concurrency", _fmt_cell(plan.get("steady_state_concurrency"))),
            ("concurrency limit", _fmt_cell(plan.get("concurrency_limit"))),
            ("fits", _fmt_cell(plan.get("fits")))]
    out = "<h2>Plan</h2>" + _kv_table([(k, v) for k, v in rows if str(v) not in ("-", "- / -")])
    groups = plan.get("groups") or []
    if groups:
        skip = {"layer_indices", "layer_page_bytes"}
        columns = ["group_id", "kind", "num_layers", "block_size"]
        # Sorted: plan.json is written with sorted keys, the in-memory plan is not.
        for g in groups:
            columns += sorted(k for k, v in g.items() if k not in skip and k not in columns
                              and not isinstance(v, (list, dict)))
        columns = [c for c in columns if any(c in g for g in groups)]
        frame = pd.DataFrame([{c: g.get(c) for c in columns} for g in groups], columns=columns)
        out += "<h3>KV cache groups</h3>" + _frame_table(frame)
    return out


# ---------------------------------------------------------------------------------------------
# Binning


def _np(table: pa.Table, name: str, dtype=float) -> np.ndarray:
    column = table.column(name)
    if dtype is float:
        return column.to_numpy(zero_copy_only=False).astype(float)
    return column.fill_null(0).to_numpy(zero_copy_only=False).astype(dtype)


def _bin_index(t: np.ndarray, t_end: float, nbins: int) -> np.ndarray:
    width = t_end / nbins if t_end > 0 else 1.0
    return np.clip((t / width).astype(np.int64), 0, nbins - 1)


def _state_bins(idx: np.ndarray, values: np.ndarray, nbins: int) -> np.ndarray:
    """Mean per bin of a state sampled at steps; an empty bin keeps the previous bin's state."""
    counts = np.bincount(idx, minlength=nbins)
    sums = np.bincount(idx, weights=values, minlength=nbins)
    out = np.full(nbins, np.nan)
    np.divide(sums, counts, out=out, where=counts > 0)
    # Forward fill; before the first step the state is empty (0).
    filled = np.where(np.isnan(out), 0, 1)
    last = np.maximum.accumulate(np.where(filled == 1, np.arange(nbins), -1))
    return np.where(last >= 0, out[np.maximum(last, 0)], 0.0)


def _combined_state(idx: np.ndarray, values: np.ndarray, nbins: int, replica: np.ndarray | None,
                    how: str) -> np.ndarray:
    """``_state_bins`` per replica, then summed (queues) or averaged (usage) over replicas."""
    if replica is None:
        return _state_bins(idx, values, nbins)
    parts = [_state_bins(idx[replica == r], values[replica == r], nbins) for r in np.unique(replica)]
    stacked = np.vstack(parts)
    return stacked.sum(axis=0) if how == "sum" else stacked.mean(axis=0)


def _usage_matrix(steps: pa.Table) -> tuple[np.ndarray, int]:
    """``kv_cache_usage_by_group`` as an (n, groups) array (``kv_cache_usage`` if absent)."""
    n = steps.num_rows
    if "kv_cache_usage_by_group" not in steps.column_names:
        return _np(steps, "kv_cache_usage").reshape(n, 1), 1
    lists = steps.column("kv_cache_usage_by_group").combine_chunks()
    if n == 0:
        return np.zeros((0, 1)), 1
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    width = int(lengths.max()) if len(lengths) else 1
    flat = pc.list_flatten(lists).fill_null(0).to_numpy(zero_copy_only=False).astype(float)
    if width > 0 and (lengths == width).all():
        return flat.reshape(n, width), width
    out = np.zeros((n, max(width, 1)))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(n):  # ragged lists: only in hand-made tables
        out[i, :lengths[i]] = flat[offsets[i]:offsets[i + 1]]
    return out, max(width, 1)


def _replica_ids(table: pa.Table) -> np.ndarray | None:
    """The ``replica`` column when it names more than one replica, else None."""
    if "replica" not in table.column_names or table.num_rows == 0:
        return None
    ids = table.column("replica").fill_null(-1).to_numpy(zero_copy_only=False)
    return ids if len(np.unique(ids)) > 1 else None


def _cdf_values(values: np.ndarray) -> np.ndarray:
    values = np.sort(values[np.isfinite(values)])
    if len(values) > CDF_POINTS:
        values = np.quantile(values, np.linspace(0, 1, CDF_POINTS))
    return values


def _select(table: pa.Table, names: Sequence[str]) -> pa.Table:
    return table.select([n for n in names if n in table.column_names])


# ---------------------------------------------------------------------------------------------
# The replay report


def _summary_row(summary) -> dict:
    if isinstance(summary, pa.Table):
        rows = summary.to_pylist()
        return rows[0] if rows else {}
    return dict(summary)


def _clock_text(s: dict) -> str:
    """The calibration and the band on each p99 (summary.parquet's band columns)."""
    name = s.get("calibration")
    if missing(name):
        return "-"
    bands = [f"{label} {format_duration_ms(s[f'p99_{key}_ms_low'])}-{format_duration_ms(s[f'p99_{key}_ms_high'])}"
             for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E", "e2el"))
             if not missing(s.get(f"p99_{key}_ms_low"))]
    return f"{name}" + (f"; p99 band: {', '.join(bands)}" if bands else "")


def _replay_metrics(s: dict) -> list[tuple[str, str]]:
    def ms(name):
        return " / ".join(format_duration_ms(s.get(f"{stat}_{name}_ms")) for stat in ("mean", "median", "p90", "p99"))

    has_slo = any(not missing(s.get(k)) for k in ("slo_ttft_ms", "slo_tpot_ms"))
    rows = [("requests: completed / rejected / unfinished",
             f"{_fmt_cell(s.get('completed'))} / {_fmt_cell(s.get('rejected'))} / {_fmt_cell(s.get('unfinished'))}"),
            ("simulated duration", format_duration_s(s.get("duration_s"))),
            ("request throughput (req/s)", _fmt_cell(s.get("request_throughput"))),
            ("output / all tokens per s",
             f"{_fmt_cell(s.get('output_throughput'))} / {_fmt_cell(s.get('total_token_throughput'))}"),
            ("TTFT mean / p50 / p90 / p99", ms("ttft")),
            ("TPOT mean / p50 / p90 / p99", ms("tpot")),
            ("ITL mean / p50 / p90 / p99", ms("itl")),
            ("E2E latency mean / p50 / p90 / p99", ms("e2el")),
            ("clock calibration", _clock_text(s)),
            ("queue delay mean / p50 / p90 / p99", ms("queue_delay")),
            ("prefix cache hit rate (tokens)", format_percent(s.get("prefix_cache_hit_rate"))),
            ("infinite-cache bound (trace)", format_percent(s.get("prefix_reuse_upper_bound"))),
            ("preemptions / recomputed tokens",
             f"{_fmt_cell(s.get('num_preemptions'))} / {_fmt_cell(s.get('recomputed_tokens'))}"),
            ("evicted cached blocks", _fmt_cell(s.get("num_evictions"))),
            ("KV cache usage peak / mean",
             f"{format_percent(s.get('kv_cache_usage_peak'))} / {format_percent(s.get('kv_cache_usage_mean'))}")]
    if has_slo:
        rows += [("SLO: TTFT / TPOT at most",
                  f"{format_duration_ms(s.get('slo_ttft_ms'))} / {format_duration_ms(s.get('slo_tpot_ms'))}"),
                 ("SLO attainment / goodput (req/s)",
                  f"{format_percent(s.get('slo_attainment'))} / {_fmt_cell(s.get('request_goodput'))}")]
    if s.get("hit_rate_total") is not None:
        # Offload tiers: hits per tier, the loads, the traffic.
        rows += [("offload tiers (policy)", f"{format_bytes(s.get('offload_cpu_bytes'))} CPU"
                  + (f" + {format_bytes(s.get('offload_disk_bytes'))} disk" if s.get("offload_disk_chunks") else "")
                  + f" ({s.get('offload_policy')})"),
                 ("hit rate GPU / CPU / disk / total (prompt tokens)",
                  " / ".join(format_percent(s.get(f"hit_rate_{t}")) for t in ("gpu", "cpu", "disk", "total"))),
                 ("loads; wait mean / p50 / p90 / p99", f"{_fmt_cell(s.get('num_loads'))}; {ms('load_wait')}"),
                 ("KV loaded / stored over PCIe",
                  f"{format_bytes(s.get('kv_offload_load_bytes'))} / {format_bytes(s.get('kv_offload_store_bytes'))}")]
    if "saturated" in s:
        rows.append(("saturated", ("yes: " + str(s.get("saturation_reason") or "")) if s.get("saturated") else "no"))
    if s.get("rejected_by_reason") not in (None, "", "{}"):
        rows.append(("rejected by reason", s["rejected_by_reason"]))
    return rows


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


def _replay_plots(requests: pa.Table, steps: pa.Table, s: dict, plan: dict | None) -> list[str]:
    steps = _select(steps, STEP_COLUMNS)
    requests = _select(requests, REQUEST_COLUMNS)
    t = _np(steps, "time_s") if "time_s" in steps.column_names else np.zeros(0)
    t_end = float(s.get("duration_s") or 0.0)
    if len(t):
        t_end = max(t_end, float(np.nanmax(t + _np(steps, "duration_s")))
                    if "duration_s" in steps.column_names else float(np.nanmax(t)))
    t_end = t_end if t_end > 0 else 1.0
    nbins = TIME_BINS
    bin_s = t_end / nbins
    centers = (np.arange(nbins) + 0.5) * bin_s if len(t) else np.zeros(0)
    idx = _bin_index(t, t_end, nbins)
    step_replica = _replica_ids(steps)
    out = []

    usage, width = _usage_matrix(steps)
    per_group = (np.column_stack([_combined_state(idx, usage[:, g], nbins, step_replica, "mean")
                                  for g in range(width)]) if len(t) else np.zeros((0, width)))
    out.append(_figure(plots.kv_usage_by_group(centers, per_group, _group_labels(plan, width)),
                       f"KV cache usage by KV cache group over time, stacked: blocks in use over the usable blocks "
                       f"(steps.parquet kv_cache_usage_by_group), mean per {bin_s:,.3g} s bin"
                       + (", averaged over replicas" if step_replica is not None else "") + ".",
                       "KV cache usage by group"))

    sched = _np(requests, "first_scheduled_time_s") if requests.num_rows else np.zeros(0)
    seen = np.isfinite(sched)
    hbins = HIT_RATE_BINS
    h_idx = _bin_index(sched[seen], t_end, hbins)
    queries = np.bincount(h_idx, weights=_np(requests, "prefix_cache_queries", np.int64)[seen], minlength=hbins)
    hits = np.bincount(h_idx, weights=_np(requests, "prefix_cache_hits", np.int64)[seen], minlength=hbins)
    rate = np.full(hbins, np.nan)
    np.divide(hits, queries, out=rate, where=queries > 0)
    h_centers = (np.arange(hbins) + 0.5) * (t_end / hbins) if seen.any() else np.zeros(0)
    out.append(_figure(plots.hit_rate_over_time(h_centers, rate if seen.any() else np.zeros(0),
                                                s.get("prefix_cache_hit_rate"), s.get("prefix_reuse_upper_bound")),
                       f"Prefix cache hit rate over time: prompt tokens found over tokens looked up, summed over the "
                       f"requests first scheduled in each {t_end / hbins:,.3g} s bin (requests.parquet "
                       f"prefix_cache_hits / prefix_cache_queries), with the whole run's rate and the trace's "
                       f"infinite-cache bound.", "prefix cache hit rate over time"))

    if len(t):
        running = _combined_state(idx, _np(steps, "num_running", np.int64).astype(float), nbins, step_replica, "sum")
        waiting = _combined_state(idx, _np(steps, "num_waiting", np.int64).astype(float), nbins, step_replica, "sum")
        preempted = np.bincount(idx, weights=_np(steps, "num_preempted", np.int64), minlength=nbins)
    else:
        running = waiting = preempted = np.zeros(0)
    out.append(_figure(plots.queues_over_time(centers, running, waiting),
                       f"Running and waiting requests after each step, mean per {bin_s:,.3g} s bin"
                       + (", summed over replicas" if step_replica is not None else "") + ".",
                       "running and waiting queues"))
    out.append(_figure(plots.preemptions_over_time(centers, preempted, bin_s),
                       f"Preemptions (recompute) per {bin_s:,.3g} s bin (steps.parquet num_preempted).",
                       "preemptions over time"))

    finished = (np.asarray(requests.column("status").to_pylist()) == "finished") if requests.num_rows else \
        np.zeros(0, dtype=bool)
    series = [(name, _cdf_values(_np(requests, col)[finished] * 1000) if requests.num_rows else np.zeros(0))
              for name, col in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("E2E latency", "e2el_s"))]
    slo = {"TTFT": s.get("slo_ttft_ms"), "TPOT": s.get("slo_tpot_ms")}
    slo = {k: float(v) for k, v in slo.items() if not missing(v)}
    band = {name: float(s[column]) for name, column in (("TTFT", "error_ttft"), ("TPOT", "error_tpot"),
                                                        ("E2E latency", "error_e2el"))
            if not missing(s.get(column))}
    clock = (f" Shaded: the band the clock's calibration ({s.get('calibration')}) implies from its held-out "
             "error." if band else " The clock is uncalibrated: no error band." if s.get("calibration") ==
             "uncalibrated" else "")
    out.append(_figure(plots.latency_cdfs(series, slo, band),
                       "Cumulative distributions of TTFT, TPOT and end-to-end latency over finished requests "
                       "(dashed: the scenario's SLO)." + clock, "latency CDFs"))

    req_replica = _replica_ids(requests)
    if req_replica is not None:
        ids = np.unique(req_replica)
        counts = np.array([(req_replica == r).sum() for r in ids])
        tokens = (np.array([_np(requests, "prompt_tokens", np.int64)[req_replica == r].sum() for r in ids])
                  if "prompt_tokens" in requests.column_names else None)
        out.append(_figure(plots.replica_load([str(r) for r in ids], counts, tokens),
                           f"Load per replica: requests routed to each of the {len(ids)} replicas"
                           + (" and their prompt tokens" if tokens is not None else "") + ".",
                           "per-replica load"))
    return out


def render_replay_report(requests: pa.Table, steps: pa.Table, summary, plan: dict, metadata: dict, *,
                         sources: Sequence[str] = REPLAY_FILES) -> str:
    """The replay report as one HTML string (tables as written to a run directory)."""
    s = _summary_row(summary)
    metadata = metadata or {}
    extra = [("requests replayed", _fmt_cell(s.get("num_requests")))]
    if s.get("num_trace_requests") is not None:
        extra.append(("trace requests (after the scenario's cuts)", _fmt_cell(s.get("num_trace_requests"))))
    sections = [_header("replay", metadata, sources, extra), _plan_section(plan),
                "<h2>Key metrics</h2>" + _kv_table(_replay_metrics(s), "meta"),
                "<h2>Plots</h2>", *_replay_plots(requests, steps, s, plan)]
    return _page(f"kvtwin replay report: {_scenario_facts(metadata)[0]}", sections)


# ---------------------------------------------------------------------------------------------
# The capacity report

RATE_KEY = "workload.rate_scale"
KV_KEY = "engine.kv_cache_memory_bytes"
ROUTER_KEY = "engine.router"
OFFLOAD_KEY = "offload.cpu_bytes"


def _sweep_keys(frame: pd.DataFrame) -> list[str]:
    """Sweep keys are the dotted columns (``engine.replicas``); summary columns have no dot."""
    return [c for c in frame.columns if "." in c]


def _varying(frame: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    return [k for k in keys if frame[k].astype(str).nunique() > 1]


def _key_value(key: str, value) -> str:
    """A sweep value as people read it: byte sizes in GiB."""
    if key.endswith("_bytes") and isinstance(value, (int, float, np.integer, np.floating)) and not missing(value):
        return f"{float(value) / 2**30:,.4g} GiB"
    return _fmt_cell(value)


def _combo_label(row: pd.Series, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1].removesuffix('_memory_bytes')}={_key_value(k, row[k])}" for k in keys)


def _finite(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    values = pd.to_numeric(frame[column], errors="coerce")
    return frame[np.isfinite(values.to_numpy(dtype=float))]


def _lines_by_combo(ok: pd.DataFrame, x: str, y: str, others: Sequence[str]):
    data = _finite(ok, y)
    if others:
        grouped = data.groupby([data[k].astype(str) for k in others], sort=True)
        parts = [g for _, g in grouped]
    else:
        parts = [data] if len(data) else []
    series = []
    for part in parts:
        part = part.sort_values(x)
        label = _combo_label(part.iloc[0], others) if others else ""
        series.append((label, part[x].to_numpy(dtype=float), part[y].to_numpy(dtype=float)))
    return series


def _tokens_per_block(hit_curve: pa.Table | None) -> float | None:
    if hit_curve is None or not hit_curve.num_rows or not {"kv_cache_blocks", "kv_cache_tokens"} <= set(
            hit_curve.column_names):
        return None
    blocks = hit_curve.column("kv_cache_blocks").to_numpy(zero_copy_only=False).astype(float)
    tokens = hit_curve.column("kv_cache_tokens").to_numpy(zero_copy_only=False).astype(float)
    usable = blocks > 0
    return float(np.median(tokens[usable] / blocks[usable])) if usable.any() else None


def _kv_points(ok: pd.DataFrame, hit_curve: pa.Table | None, plan: dict | None):
    """The sweep's hit rates on the axis the curve uses: (x, y, in_tokens), or None.

    The x is the point's KV cache in tokens: its ``kv_cache_tokens`` column, else its
    ``kv_cache_blocks`` (or ``engine.kv_cache_memory_bytes`` over the plan's
    ``bytes_per_block``, less the null block) times the curve's tokens per block; failing
    those, the memory in GiB (``in_tokens`` False)."""
    if KV_KEY not in ok.columns or "prefix_cache_hit_rate" not in ok.columns:
        return None
    data = _finite(ok, "prefix_cache_hit_rate")
    hits = data["prefix_cache_hit_rate"].to_numpy(dtype=float)
    if "kv_cache_tokens" in data.columns:
        return pd.to_numeric(data["kv_cache_tokens"], errors="coerce").to_numpy(dtype=float), hits, True
    per_token_block = _tokens_per_block(hit_curve)
    plan = (plan or {}).get("hybrid_on", plan) or {}
    per_block = plan.get("bytes_per_block")
    if per_token_block is not None:
        if "kv_cache_blocks" in data.columns:
            blocks = pd.to_numeric(data["kv_cache_blocks"], errors="coerce").to_numpy(dtype=float)
            return blocks * per_token_block, hits, True
        if per_block:
            blocks = np.floor(data[KV_KEY].to_numpy(dtype=float) / per_block) - 1  # less the null block
            return blocks * per_token_block, hits, True
    return data[KV_KEY].to_numpy(dtype=float) / 2**30, hits, False


def _capacity_plots(frame: pd.DataFrame, hit_curve: pa.Table | None, plan: dict | None) -> list[str]:
    keys = _sweep_keys(frame)
    ok = frame[frame["status"].astype(str) == "ok"] if "status" in frame.columns else frame
    varying = _varying(ok, keys) if len(ok) else []
    out = []
    if RATE_KEY in keys:
        others = [k for k in varying if k != RATE_KEY]
        by = " (one line per " + ", ".join(others) + ")" if others else ""
        for column, ylabel, title, percent in (
                ("request_throughput", "requests per second", "Throughput vs rate", False),
                ("slo_attainment", "requests within the SLO (%)", "SLO attainment vs rate", True)):
            if column not in ok.columns:
                continue
            series = _lines_by_combo(ok, RATE_KEY, column, others)
            if not series:
                continue
            caption = (f"{title}: {column} at each {RATE_KEY} (arrival-rate multiplier){by}."
                       + (" Output token throughput is in the table below." if column == "request_throughput"
                          else ""))
            out.append(_figure(plots.lines(series, xlabel=f"{RATE_KEY} (x the trace's rate)", ylabel=ylabel,
                                           title=title, percent=percent), caption, title))
    curve = None
    if hit_curve is not None and hit_curve.num_rows and "hit_rate" in hit_curve.column_names:
        x_name = "kv_cache_tokens" if "kv_cache_tokens" in hit_curve.column_names else "kv_cache_blocks"
        order = np.argsort(hit_curve.column(x_name).to_numpy(zero_copy_only=False))
        curve = (hit_curve.column(x_name).to_numpy(zero_copy_only=False).astype(float)[order],
                 hit_curve.column("hit_rate").to_numpy(zero_copy_only=False).astype(float)[order], x_name)
    points = _kv_points(ok, hit_curve, plan) if KV_KEY in keys else None
    if curve is not None or points is not None:
        x_label = {"kv_cache_tokens": "KV cache (tokens)", "kv_cache_blocks": "KV cache (blocks)"}
        if points is not None and not points[2]:
            if curve is not None:
                out.append(_figure(plots.hit_rate_vs_capacity(curve[:2], None, xlabel=x_label[curve[2]]),
                                   "One-pass prefix-cache hit-rate curve (hit_curve.parquet).", "hit-rate curve"))
            out.append(_figure(plots.hit_rate_vs_capacity(None, points[:2], xlabel="KV cache memory (GiB)"),
                               f"Prefix cache hit rate of each replayed sweep point against its {KV_KEY} (no plan "
                               f"to put them on the curve's axis).", "hit rate vs KV capacity"))
        else:
            xlabel = x_label[curve[2]] if curve is not None else "KV cache (tokens)"
            what = []
            if curve is not None:
                what.append("the line is the one-pass curve (hit_curve.parquet)")
            if points is not None:
                what.append(f"the dots are sweep points replayed exactly at each {KV_KEY}")
            out.append(_figure(plots.hit_rate_vs_capacity(curve[:2] if curve else None,
                                                          points[:2] if points else None, xlabel=xlabel),
                               "Prefix cache hit rate vs KV cache capacity: " + "; ".join(what) + ".",
                               "hit rate vs KV capacity"))
    out += _offload_plots(ok, varying) if OFFLOAD_KEY in keys else []
    needed = [c for c in ("replicas_needed_trace_rate", "replicas_needed_target_rate")
              if c in ok.columns and len(_finite(ok, c))]
    if needed:
        data = ok[np.isfinite(ok[needed].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)).any(axis=1)]
        labels = [_combo_label(r, varying) if varying else f"point {r.get('point', i)}"
                  for i, (_, r) in enumerate(data.iterrows())]
        groups = [(c.replace("replicas_needed_", "at the ").replace("_", " "),
                   pd.to_numeric(data[c], errors="coerce").to_numpy(dtype=float)) for c in needed]
        out.append(_figure(plots.bars(labels, groups, ylabel="replicas", title="Replicas needed"),
                           "Replicas needed to serve the trace's rate and the target rate within the SLO, per sweep "
                           "point (" + ", ".join(needed) + ").", "replicas needed"))
    if ROUTER_KEY in keys and len(ok):
        routers = list(dict.fromkeys(ok[ROUTER_KEY].astype(str)))
        others = [k for k in varying if k != ROUTER_KEY]
        metrics = [(c, t, y, p) for c, t, y, p in (
            ("slo_attainment", "SLO attainment", "%", True),
            ("prefix_cache_hit_rate", "prefix cache hit rate", "%", True),
            ("p99_ttft_ms", "p99 TTFT", "ms", False),
            ("request_throughput", "throughput", "req/s", False)) if c in ok.columns and len(_finite(ok, c))][:3]
        if metrics:
            combo_of = np.array([_combo_label(r, others) if others else "" for _, r in ok.iterrows()], dtype=object)
            router_of = ok[ROUTER_KEY].astype(str).to_numpy()
            combos = list(dict.fromkeys(combo_of.tolist()))
            panels = []
            for column, title, ylabel, percent in metrics:
                column_values = pd.to_numeric(ok[column], errors="coerce").to_numpy(dtype=float)
                groups = []
                for combo in combos:
                    values = []
                    for router in routers:
                        match = column_values[(router_of == router) & (combo_of == combo)]
                        match = match[np.isfinite(match)]
                        v = float(match.mean()) if len(match) else np.nan
                        values.append(v * 100 if percent else v)
                    groups.append((combo, np.array(values, dtype=float)))
                panels.append((title, ylabel, groups))
            out.append(_figure(plots.bars(routers, [], ylabel="", title="", panels=panels),
                               "Router comparison: " + ", ".join(m[0] for m in metrics) + f" per {ROUTER_KEY}"
                               + (" (one bar per " + ", ".join(others) + ")" if others else "") + ".",
                               "router comparison"))
    return out


def _offload_plots(ok: pd.DataFrame, varying: Sequence[str]) -> list[str]:
    """Hit rate per tier and TTFT against the CPU tier's size (one line per other varying
    key), next to the KV-capacity curve: what host memory buys on this trace."""
    data = ok.copy()
    data["offload_gib"] = pd.to_numeric(data[OFFLOAD_KEY], errors="coerce").fillna(0) / 2**30
    others = [k for k in varying if k != OFFLOAD_KEY]
    by = " (one line per " + ", ".join(others) + ")" if others else ""
    out = []
    total = "hit_rate_total" if "hit_rate_total" in data.columns else "prefix_cache_hit_rate"
    if total in data.columns:
        # A point without a tier has no tier columns: its total is its GPU hit rate.
        if total == "hit_rate_total" and "prefix_cache_hit_rate" in data.columns:
            data[total] = pd.to_numeric(data[total], errors="coerce").fillna(
                pd.to_numeric(data["prefix_cache_hit_rate"], errors="coerce"))
        series = [(f"{label} total".strip(), x, y) for label, x, y in _lines_by_combo(data, "offload_gib", total, others)]
        if "hit_rate_cpu" in data.columns:
            data["hit_rate_cpu"] = pd.to_numeric(data["hit_rate_cpu"], errors="coerce").fillna(0.0)
            series += [(f"{label} from CPU".strip(), x, y)
                       for label, x, y in _lines_by_combo(data, "offload_gib", "hit_rate_cpu", others)]
        if series:
            out.append(_figure(plots.lines(series, xlabel="CPU offload tier (GiB)", ylabel="prompt tokens hit (%)",
                                           title="Hit rate vs CPU offload size", percent=True),
                               f"Prompt tokens served from a cache against {OFFLOAD_KEY}: all tiers together, and "
                               f"the part loaded from the CPU tier{by}. 0 GiB is the run without offloading.",
                               "hit rate vs offload size"))
    ttft = [(c, label) for c, label in (("median_ttft_ms", "median"), ("p99_ttft_ms", "p99")) if c in data.columns]
    series = [(f"{label} {name}".strip(), x, y) for column, name in ttft
              for label, x, y in _lines_by_combo(data, "offload_gib", column, others)]
    if series:
        out.append(_figure(plots.lines(series, xlabel="CPU offload tier (GiB)", ylabel="TTFT (ms)",
                                       title="TTFT vs CPU offload size"),
                           f"Time to first token (median, p99) against {OFFLOAD_KEY}{by}.", "TTFT vs offload size"))
    return out


def _capacity_metrics(frame: pd.DataFrame) -> list[tuple[str, str]]:
    keys = _sweep_keys(frame)
    status = frame["status"].astype(str) if "status" in frame.columns else pd.Series(["ok"] * len(frame))
    ok = frame[status.to_numpy() == "ok"]
    rows = [("sweep points", f"{len(frame):,} ({int((status == 'ok').sum()):,} ok, "
                             f"{int((status != 'ok').sum()):,} failed)")]
    for key in keys:
        values = list(dict.fromkeys(_key_value(key, v) for v in frame[key].tolist()))
        rows.append((f"swept: {key}", ", ".join(values)))
    for column, how, label in (("max_request_rate", "max", "highest sustainable request rate (req/s)"),
                               ("max_rate_scale", "max", "highest sustainable rate scale"),
                               ("max_request_rate_per_replica", "max", "highest rate per replica (req/s)"),
                               ("replicas_needed_trace_rate", "min", "fewest replicas for the trace's rate"),
                               ("replicas_needed_target_rate", "min", "fewest replicas for the target rate"),
                               # The same with every step slower by the calibration's held-out error.
                               ("max_request_rate_pessimistic", "max",
                                "highest sustainable request rate, pessimistic edge (req/s)"),
                               ("replicas_needed_trace_rate_pessimistic", "min",
                                "fewest replicas for the trace's rate, pessimistic edge"),
                               ("cost_per_million_tokens", "min", "lowest cost per million tokens"),
                               ("slo_attainment", "max", "best SLO attainment"),
                               ("prefix_cache_hit_rate", "max", "best prefix cache hit rate")):
        if column in ok.columns and len(_finite(ok, column)):
            values = pd.to_numeric(_finite(ok, column)[column])
            value = values.max() if how == "max" else values.min()
            shown = format_percent(value) if column in ("slo_attainment", "prefix_cache_hit_rate") else _fmt_cell(value)
            rows.append((label, shown))
    return rows


def _capacity_table(frame: pd.DataFrame) -> str:
    keys = _sweep_keys(frame)
    first = [c for c in ("point", "status", "error") if c in frame.columns] + keys
    rest = [c for c in frame.columns if c not in first]
    return _frame_table(frame[first + rest])


def render_capacity_report(capacity: pa.Table, hit_curve: pa.Table | None, metadata: dict,
                           plan: dict | None = None, *, sources: Sequence[str] | None = None) -> str:
    """The capacity (sweep) report as one HTML string."""
    frame = capacity.to_pandas()
    metadata = metadata or {}
    sources = sources or (("capacity.parquet",) + (("hit_curve.parquet",) if hit_curve is not None else ()))
    figures = _capacity_plots(frame, hit_curve, plan)
    sections = [_header("capacity", metadata, sources), _plan_section(plan) if plan else "",
                "<h2>Key metrics</h2>" + _kv_table(_capacity_metrics(frame)),
                "<h2>Plots</h2>", *(figures or ['<p class="note">no sweep key this report plots</p>']),
                "<h2>All sweep points</h2>", _capacity_table(frame)]
    return _page(f"kvtwin capacity report: {_scenario_facts(metadata)[0]}", sections)


# ---------------------------------------------------------------------------------------------
# Directories


def report_kind(directory: Path) -> str | None:
    directory = Path(directory)
    if all((directory / name).is_file() for name in REPLAY_FILES):
        return "replay"
    if all((directory / name).is_file() for name in CAPACITY_FILES):
        return "capacity"
    return None


def _metadata(path: Path) -> dict:
    metadata = pq.read_schema(path).metadata or {}
    try:
        return json.loads(metadata[METADATA_KEY])
    except (KeyError, ValueError):
        return {}


def _read(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    try:
        if columns is None:
            return pq.read_table(path)
        present = set(pq.read_schema(path).names)
        return pq.read_table(path, columns=[c for c in columns if c in present])
    except pa.ArrowException as err:
        raise ConfigError(str(path), "a parquet file kvtwin wrote", str(err).splitlines()[0][:200]) from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(str(path), "a JSON object (kvtwin plan --json)", str(err)) from None


def render_report_dir(directory: str | os.PathLike) -> str:
    """Render the report of a replay or capacity directory (the kind is told by its files)."""
    directory = Path(directory)
    kind = report_kind(directory)
    if kind == "replay":
        plan = _read_json(directory / "plan.json")
        return render_replay_report(_read(directory / "requests.parquet", REQUEST_COLUMNS),
                                    _read(directory / "steps.parquet", STEP_COLUMNS),
                                    _read(directory / "summary.parquet"), plan,
                                    _metadata(directory / "summary.parquet"))
    if kind == "capacity":
        curve_path = directory / "hit_curve.parquet"
        plan_path = directory / "plan.json"
        hit_curve = _read(curve_path) if curve_path.is_file() else None
        plan = _read_json(plan_path) if plan_path.is_file() else None
        sources = ["capacity.parquet"] + [p.name for p in (curve_path, plan_path) if p.is_file()]
        return render_capacity_report(_read(directory / "capacity.parquet"), hit_curve,
                                      _metadata(directory / "capacity.parquet"), plan, sources=sources)
    if not directory.exists():
        got = "no such directory"
    elif not directory.is_dir():
        got = "a file"
    else:
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        got = ("an empty directory" if not names else
               "a directory holding " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    raise ConfigError(str(directory), f"a replay directory ({', '.join(REPLAY_FILES)}) or a capacity directory "
                                      f"(capacity.parquet)", got)


def write_report(directory: str | os.PathLike) -> Path:
    """Write ``directory/report.html`` (via a temporary file and a rename); return its path."""
    directory = Path(directory)
    text = render_report_dir(directory)
    path = directory / REPORT_NAME
    tmp = directory / f".{REPORT_NAME}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
