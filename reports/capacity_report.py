"""The capacity (sweep) report: what ran, the plan, the sweep's best figures, the plots
(``reports.capacity_plots``) and every sweep point."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from kvtwin.reports.capacity_plots import capacity_figures
from kvtwin.reports.html_page import page
from kvtwin.reports.html_tables import fmt_cell, frame_table, kv_table
from kvtwin.reports.paths import CAPACITY_FILES  # noqa: F401  (re-exported: where the files are named)
from kvtwin.reports.run_facts import clock_note, header, plan_section, scenario_facts
from kvtwin.reports.summary_text import format_percent, missing
from kvtwin.reports.sweep_frame import (column_values, finite_mask, key_value, numbers, rows_where, sweep_keys,
                                        sweep_table, texts)
from kvtwin.sim.calibration.band import CLOCK_COLUMNS, points_clocks


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
    frame = sweep_table(capacity)
    metadata = metadata or {}
    sources = sources or (("capacity.parquet",) + (("hit_curve.parquet",) if hit_curve is not None else ()))
    figures = capacity_figures(frame, hit_curve, plan)
    sections = [header("capacity", metadata, sources), clock_note(_clocks(frame, calibrated=False)),
                plan_section(plan) if plan else "",
                "<h2>Key metrics</h2>" + kv_table(_capacity_metrics(frame)),
                "<h2>Plots</h2>", *(figures or ['<p class="note">no sweep key this report plots</p>']),
                *_pd_section(frame),
                "<h2>All sweep points</h2>", _capacity_table(frame)]
    return page(f"kvtwin capacity report: {scenario_facts(metadata)[0]}", sections)


def _clocks(frame: pa.Table, *, calibrated: bool) -> list[str]:
    """The calibrated (or the uncalibrated) clocks of the points, as ``kvtwin capacity``
    printed them; none for a capacity.parquet written before the clock columns."""
    if not set(CLOCK_COLUMNS) <= set(frame.column_names):
        return []
    clocks = points_clocks(frame.select(["point", *CLOCK_COLUMNS]).to_pylist(),
                           slow_edge="max_rate_scale" in frame.column_names)
    return [line for ok, line in clocks if ok == calibrated]


def _capacity_metrics(frame: pa.Table) -> list[tuple[str, str]]:
    status = texts(frame, "status") if "status" in frame.column_names else ["ok"] * frame.num_rows
    ok = rows_where(frame, [s == "ok" for s in status])
    passed = sum(s == "ok" for s in status)
    rows = [("sweep points", f"{frame.num_rows:,} ({passed:,} ok, {len(status) - passed:,} failed)")]
    for key in sweep_keys(frame):
        values = list(dict.fromkeys(key_value(key, v) for v in column_values(frame, key)))
        rows.append((f"swept: {key}", ", ".join(values)))
    rows += [("clock calibration", line.removeprefix("clock: ")) for line in _clocks(frame, calibrated=True)]
    for column, how, label in _BEST:
        if column in ok.column_names and finite_mask(ok, column).any():
            values = _finite_values(ok, column)
            value = values.max() if how == "max" else values.min()
            shown = format_percent(value) if column in ("slo_attainment", "prefix_cache_hit_rate") else fmt_cell(value)
            rows.append((label, shown))
    return rows


def _finite_values(frame: pa.Table, column: str) -> np.ndarray:
    """The column's finite values; integers stay integers (``12`` is shown as such)."""
    values = frame.column(column)
    keep = finite_mask(frame, column)
    if pa.types.is_integer(values.type):
        return values.to_numpy()[keep]
    return numbers(frame, column)[keep]


# What the P/D comparison shows of each point, when present.
_PD_COLUMNS = ("num_gpus", "num_replicas", "router", "pd_prefill_replicas", "pd_decode_replicas", "pd_link",
               "request_throughput", "output_throughput", "p99_ttft_ms", "p99_tpot_ms", "slo_attainment",
               "pd_transfer_mean_ms", "pd_transfer_share_of_ttft", "max_request_rate", "cost_per_million_tokens")


def _pd_section(frame: pa.Table) -> list[str]:
    """Disaggregated points (xPyD) beside aggregated ones, by GPU count: empty unless the
    sweep ran a P/D point (``disaggregation.shape=2P1D,1P2D,none``)."""
    if "pd_link" not in frame.column_names:
        return []
    keys = sweep_keys(frame)
    shown = [c for c in ("point", *keys, *_PD_COLUMNS) if c in frame.column_names]
    ordered = _by_gpus_then_point(frame) if "num_gpus" in frame.column_names else frame
    note = ('<p class="note">Each replica is one planned engine (its tensor-parallel GPUs); an xPyD point uses '
            '(x + y) of them. Aggregated points have no pd_ columns. TTFT of a P/D point is the decode side\'s '
            'first token (prefill, KV read, and the decode step that recomputes the last prompt token).</p>')
    return ["<h2>Disaggregated against aggregated, by GPUs</h2>", note, _frame_table(ordered.select(shown))]


def _by_gpus_then_point(frame: pa.Table) -> pa.Table:
    """The points by GPU count, then point number: a stable sort, a missing value last in
    each key (pandas' ``sort_values(kind="stable")``)."""
    gpus, points = column_values(frame, "num_gpus"), column_values(frame, "point")

    def key(row: int) -> tuple:
        return tuple((missing(v), 0 if missing(v) else v) for v in (gpus[row], points[row]))

    return frame.take(pa.array(sorted(range(frame.num_rows), key=key), pa.int64()))


def _capacity_table(frame: pa.Table) -> str:
    keys = sweep_keys(frame)
    first = [c for c in ("point", "status", "error") if c in frame.column_names] + keys
    rest = [c for c in frame.column_names if c not in first]
    return _frame_table(frame.select(first + rest))


def _frame_table(frame: pa.Table) -> str:
    return frame_table(frame.column_names, [column_values(frame, name) for name in frame.column_names])
