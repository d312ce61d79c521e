"""``capacity.parquet``: one row per sweep point (point, status, error, one column per sweep
key, the replay's summary columns, the point's clock, its GPUs, with a rate search the rate
and cost columns of ``capacity_points`` and with a load curve those of ``load_curve``).
Each point's search (scale, holds) is kept in the schema metadata under
``kvtwin.capacity``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pyarrow as pa

from kvtwin.sim.calibration.band import CLOCK_COLUMNS
from kvtwin.sim.replay.capacity_points import MAX_RATE_COLUMNS
from kvtwin.sim.replay.load_curve import LOAD_CURVE_COLUMNS, knees
from kvtwin.sim.replay.output_columns import DISAGGREGATION, OFFLOAD
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.run_tables import RunSettings, run_tables
from kvtwin.sim.replay.sustained import SHORT_WINDOW
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.scenario.sweep_keys import Axis, Point

CAPACITY_METADATA_KEY = b"kvtwin.capacity"
# A sweep key's column type, by the kind of its field.
ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}


class _SummarySchema:
    """The columns of ``summary.parquet`` (from an empty run, so failed points get typed
    nulls), made once per process."""

    schema: pa.Schema | None = None

    @classmethod
    def get(cls) -> pa.Schema:
        if cls.schema is None:
            cls.schema = run_tables(MetricsRecorder(1), 0.0, RunSettings(SLO(), None, "round_robin", "0")).summary.schema
        return cls.schema


def summary_schema() -> pa.Schema:
    return _SummarySchema.get()


def _judged_sustained(summary: dict) -> bool | None:
    """Whether a replay's load was sustained; None where its window was too short to judge."""
    if SHORT_WINDOW in (summary.get("sustained_reason") or "").split(","):
        return None
    return bool(summary["sustained"])


def _load_curve_columns(rows: Sequence[dict], by_point: dict[int, Point], axes: Sequence[Axis]) -> dict:
    """``LOAD_CURVE_COLUMNS``, the knee found per curve: the points that share every swept
    value. A failed point is on no curve (its columns are null)."""
    curves: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if r["status"] == "ok":
            values = by_point[r["point"]].values
            curves.setdefault(repr([values[a.key.key] for a in axes]), []).append(i)
    values = {name: [None] * len(rows) for name in LOAD_CURVE_COLUMNS}
    for name in LOAD_CURVE_COLUMNS:
        for i, r in enumerate(rows):
            if r["status"] == "ok":
                values[name][i] = r.get(name)
    members = list(curves.values())
    found = knees([[(rows[i]["offered_request_rate"], _judged_sustained(rows[i]["summary"])) for i in curve]
                   for curve in members])
    for curve, (knee, past) in zip(members, found):
        for i, is_past in zip(curve, past):
            values["knee_request_rate"][i] = knee
            values["past_knee"][i] = is_past
    return {name: pa.array([None if isinstance(v, float) and math.isnan(v) else v for v in values[name]], kind)
            for name, kind in LOAD_CURVE_COLUMNS.items()}


def capacity_table(rows: Sequence[dict], points: Sequence[Point], axes: Sequence[Axis], *,
                   find_max_rate: bool = False, load_curve: bool = False) -> pa.Table:
    """``capacity.parquet``: point, status, error, one column per sweep key, the summary
    columns, with ``find_max_rate`` the rate and cost columns and with ``load_curve`` the
    curve's (module docstring)."""
    by_point = {p.index: p for p in points}
    rows = sorted(rows, key=lambda r: r["point"])
    columns: dict[str, pa.Array] = {
        "point": pa.array([r["point"] for r in rows], pa.int64()),
        "status": pa.array([r["status"] for r in rows], pa.string()),
        "error": pa.array([r["error"] for r in rows], pa.string()),
    }
    for axis in axes:
        columns[axis.key.key] = pa.array([by_point[r["point"]].values[axis.key.key] for r in rows],
                                         ARROW_TYPES[axis.key.kind])
    for field in summary_schema():
        if field.name in columns:
            continue
        values = [(r["summary"] or {}).get(field.name) if r["summary"] is not None else None for r in rows]
        columns[field.name] = pa.array(values, field.type)
    for name in CLOCK_COLUMNS:
        columns[name] = pa.array([r.get(name) for r in rows], pa.string())
    # The offload columns, when a point ran with offloading (null in the points without).
    if any(r["summary"] is not None and "hit_rate_total" in r["summary"] for r in rows):
        for name, kind in OFFLOAD.summary.items():
            if name in columns:
                continue
            values = [(r["summary"] or {}).get(name) for r in rows]
            columns[name] = pa.array(values, kind)
    # Every point's GPUs: xPyD and aggregated deployments compare at equal GPU count, and
    # the replicas a rate search says are needed read as GPUs (num_gpus over num_replicas each).
    columns["num_gpus"] = pa.array([r.get("num_gpus") for r in rows], pa.int64())
    # Disaggregated points: their P/D columns (null in aggregated points).
    if any(r["summary"] is not None and "pd_link" in r["summary"] for r in rows):
        for name, kind in DISAGGREGATION.summary.items():
            columns[name] = pa.array([(r["summary"] or {}).get(name) for r in rows], kind)
    if find_max_rate:
        for name, kind in MAX_RATE_COLUMNS.items():
            values = [r.get(name) if r["status"] == "ok" else None for r in rows]
            columns[name] = pa.array([None if isinstance(v, float) and math.isnan(v) else v for v in values], kind)
    if load_curve:
        columns.update(_load_curve_columns(rows, by_point, axes))
    table = pa.table(columns)
    searches = {str(r["point"]): r["search"] for r in rows if r.get("search") is not None}
    if searches:
        table = table.replace_schema_metadata({CAPACITY_METADATA_KEY: json.dumps(searches, sort_keys=True).encode()})
    return table
