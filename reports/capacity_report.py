"""The capacity (sweep) report: what ran, the plan, the sweep's best figures, the plots
(``reports.capacity_plots``) and every sweep point."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import pyarrow as pa

from kvtwin.reports.capacity_plots import capacity_figures
from kvtwin.reports.html_page import page
from kvtwin.reports.html_tables import fmt_cell, frame_table, kv_table
from kvtwin.reports.paths import CAPACITY_FILES  # noqa: F401  (re-exported: where the files are named)
from kvtwin.reports.run_facts import header, plan_section, scenario_facts
from kvtwin.reports.summary_text import format_percent
from kvtwin.reports.sweep_frame import finite, key_value, sweep_keys


# (column, best is its max or min, label): the sweep's best point by each figure.
_BEST = (("max_request_rate", "max", "highest sustainable request rate (req/s)"),
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
         ("prefix_cache_hit_rate", "max", "best prefix cache hit rate"))


def render_capacity_report(capacity: pa.Table, hit_curve: pa.Table | None, metadata: dict,
                           plan: dict | None = None, *, sources: Sequence[str] | None = None) -> str:
    """The capacity (sweep) report as one HTML string."""
    frame = capacity.to_pandas()
    metadata = metadata or {}
    sources = sources or (("capacity.parquet",) + (("hit_curve.parquet",) if hit_curve is not None else ()))
    figures = capacity_figures(frame, hit_curve, plan)
    sections = [header("capacity", metadata, sources), plan_section(plan) if plan else "",
                "<h2>Key metrics</h2>" + kv_table(_capacity_metrics(frame)),
                "<h2>Plots</h2>", *(figures or ['<p class="note">no sweep key this report plots</p>']),
                *_pd_section(frame),
                "<h2>All sweep points</h2>", _capacity_table(frame)]
    return page(f"kvtwin capacity report: {scenario_facts(metadata)[0]}", sections)


def _capacity_metrics(frame: pd.DataFrame) -> list[tuple[str, str]]:
    keys = sweep_keys(frame)
    status = frame["status"].astype(str) if "status" in frame.columns else pd.Series(["ok"] * len(frame))
    ok = frame[status.to_numpy() == "ok"]
    rows = [("sweep points", f"{len(frame):,} ({int((status == 'ok').sum()):,} ok, "
                             f"{int((status != 'ok').sum()):,} failed)")]
    for key in keys:
        values = list(dict.fromkeys(key_value(key, v) for v in frame[key].tolist()))
        rows.append((f"swept: {key}", ", ".join(values)))
    for column, how, label in _BEST:
        if column in ok.columns and len(finite(ok, column)):
            values = pd.to_numeric(finite(ok, column)[column])
            value = values.max() if how == "max" else values.min()
            shown = format_percent(value) if column in ("slo_attainment", "prefix_cache_hit_rate") else fmt_cell(value)
            rows.append((label, shown))
    return rows


# What the P/D comparison shows of each point, when present.
_PD_COLUMNS = ("num_gpus", "num_replicas", "router", "pd_prefill_replicas", "pd_decode_replicas", "pd_link",
               "request_throughput", "output_throughput", "p99_ttft_ms", "p99_tpot_ms", "slo_attainment",
               "pd_transfer_mean_ms", "pd_transfer_share_of_ttft", "max_request_rate", "cost_per_million_tokens")


def _pd_section(frame: pd.DataFrame) -> list[str]:
    """Disaggregated points (xPyD) beside aggregated ones, by GPU count: empty unless the
    sweep ran a P/D point (``disaggregation.shape=2P1D,1P2D,none``)."""
    if "pd_link" not in frame.columns:
        return []
    keys = sweep_keys(frame)
    shown = [c for c in ("point", *keys, *_PD_COLUMNS) if c in frame.columns]
    ordered = frame.sort_values(["num_gpus", "point"], kind="stable") if "num_gpus" in frame.columns else frame
    note = ('<p class="note">Each replica is one planned engine (its tensor-parallel GPUs); an xPyD point uses '
            '(x + y) of them. Aggregated points have no pd_ columns. TTFT of a P/D point is the decode side\'s '
            'first token (prefill, KV read, and the decode step that recomputes the last prompt token).</p>')
    return ["<h2>Disaggregated against aggregated, by GPUs</h2>", note, frame_table(ordered[list(shown)])]


def _capacity_table(frame: pd.DataFrame) -> str:
    keys = sweep_keys(frame)
    first = [c for c in ("point", "status", "error") if c in frame.columns] + keys
    rest = [c for c in frame.columns if c not in first]
    return frame_table(frame[first + rest])
