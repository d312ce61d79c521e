"""One point of a capacity sweep, run: its replay, and with a rate search the rate and cost
columns of ``capacity.parquet``.

A point is plain data (``PointTask``: the scenario's TOML mapping with the point applied),
so any backend (``sweep_backends``) can ship it to a worker; ``run_point`` never raises for
bad input, a failure is the row's ``error``.

Derived columns of a rate search (``rate_search``): ``max_request_rate`` (requests/s of the
trace at ``lo``: (n - 1) over the span of arrivals), ``max_request_rate_per_replica``
(divided by the point's replicas), ``replicas_needed_trace_rate`` (ceil of the point's own
trace rate over the per-replica rate), ``replicas_needed_target_rate`` (the same for
``target_rate``), ``cost_per_hour`` (the GPU's ``price_per_hour`` times
``tensor_parallel_size x replicas`` GPUs of the point's deployment) and
``cost_per_million_tokens`` (that cost over the summary's ``total_token_throughput`` at
``lo``). Where no scale holds, ``max_rate_scale`` and the figures derived from it are null
and the summary is the last replay's; otherwise the summary columns are those of the replay
at ``lo``. The ``*_pessimistic`` columns repeat the search with every step slower by the
calibration's held-out step error (``step_error``, ``calibration_data.pessimistic``); null
for an uncalibrated clock. The replicas are engine replicas of the point's own shape, each
``tensor_parallel_size`` GPUs (times ``num_gpus / num_replicas`` they read as GPUs), not the
swept ``engine.replicas``.

The search judges sustained load, never a burst (docs/capacity.md#enough-load). A
``limit`` (``--limit N``) is read as a duration: the simulated time the point's first N
requests span at its own rate scale; every scale the search tries replays the requests of
the trace, scaled, that arrive within that time of the first (about N times the scale over
the start), so the load lasts as long at every rate. A scale whose steady window is still
too short to judge (``sustained_reason`` ``short_window``) counts as not holding, and
``rate_search_refusal`` says what it lacked; where no scale was judged to hold, it says
what the point needs instead of a rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.offload import ResolvedOffload
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.replay.calibration_data import pessimistic, step_error
from kvtwin.sim.replay.rate_search import RateSearch, SearchResult, bracket_and_bisect, replicas_for, request_rate, \
    slo_holds
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.replay.sustained import SHORT_WINDOW, needs
from kvtwin.sim.scenario.efficiency import Efficiency
from kvtwin.sim.scenario.parse import Workload
from kvtwin.sim.scenario.resolve import ResolvedScenario, resolve_scenario
from kvtwin.traces.errors import TraceError

# The columns a rate search adds to a point's row, and their types; reports/SCHEMA.md
# documents each with its unit (tests/reports/test_schema_capacity.py keeps them in step).
MAX_RATE_COLUMNS: dict[str, pa.DataType] = {
    "max_rate_scale": pa.float64(),
    "max_request_rate": pa.float64(),
    "max_request_rate_per_replica": pa.float64(),
    "replicas_needed_trace_rate": pa.int64(),
    "replicas_needed_target_rate": pa.int64(),
    "cost_per_hour": pa.float64(),
    "cost_per_million_tokens": pa.float64(),
    "step_error": pa.float64(),
    "max_rate_scale_pessimistic": pa.float64(),
    "max_request_rate_pessimistic": pa.float64(),
    "replicas_needed_trace_rate_pessimistic": pa.int64(),
    "replicas_needed_target_rate_pessimistic": pa.int64(),
    "rate_search_refusal": pa.string(),
}


@dataclass(frozen=True)
class PointTask:
    """One point, as shipped to a worker (plain data: picklable for any backend)."""

    index: int
    scenario_path: str
    data: dict  # the scenario's TOML mapping with the point applied
    search: RateSearch | None = None


class SourceCache:
    """Sources read in this process, by what they are: a worker running many points (or many
    rates of one point) reads the trace once. Holds a few; a new one past that starts over."""

    def __init__(self, size: int = 4):
        self.size = size
        self.tables: dict[str, pa.Table] = {}

    def get(self, workload: Workload) -> pa.Table:
        key = repr((str(workload.trace), workload.load_options,
                    json.dumps(workload.synth, sort_keys=True, default=str), str(workload.base_dir)))
        table = self.tables.get(key)
        if table is None:
            if len(self.tables) >= self.size:
                self.tables.clear()
            table = self.tables[key] = workload.load_source()
        return table


# One per worker process: each point of that worker reuses its reads.
_SOURCES = SourceCache()


class PointReplays:
    """Replays of one planned point at any rate scale, from its loaded source."""

    def __init__(self, resolved: ResolvedScenario, planned: Plan, offload: ResolvedOffload | None, source: pa.Table):
        self.resolved = resolved
        self.planned = planned
        self.offload = offload
        self.workload = resolved.require_workload()
        self.source = source
        self._duration_s: float | None = None

    def duration_s(self) -> float | None:
        """A ``limit`` read as a duration (module docstring): the arrival span of the point's
        own cut; None without a limit (the search then scales the whole cut)."""
        if "limit" not in self.workload.transforms:
            return None
        if self._duration_s is None:
            arrivals = self.workload.cut(self.source).column("arrival_time_s").to_numpy()
            self._duration_s = float(arrivals.max() - arrivals.min())
        return self._duration_s

    def cut_at(self, scale: float | None) -> pa.Table:
        """The trace a replay at ``scale`` runs (None: the workload's own cut)."""
        if scale is None:
            return self.workload.cut(self.source)
        duration_s = self.duration_s()
        transforms = {**self.workload.transforms, "rate_scale": scale}
        if duration_s is None:
            return dataclasses.replace(self.workload, transforms=transforms).cut(self.source)
        del transforms["limit"]
        scaled = dataclasses.replace(self.workload, transforms=transforms).cut(self.source)
        arrivals = scaled.column("arrival_time_s").to_numpy()
        # The span's own last request is kept at the start scale despite rounding.
        keep = arrivals <= arrivals.min() + duration_s * (1 + 1e-12)
        return scaled.filter(pa.array(keep))

    def replay(self, scale: float | None, efficiency: Efficiency | None = None) -> tuple[dict, pa.Table]:
        """The summary row and the cut trace of one replay (``scale`` None: the workload's own)."""
        trace = self.cut_at(scale)
        resolved = self.resolved
        result = run_replay(self.planned, trace, deployment=resolved.deployment,
                            efficiency=efficiency if efficiency is not None else resolved.efficiency,
                            slo=resolved.slo, time_limit_s=resolved.time_limit_s, offload=self.offload,
                            disaggregation=resolved.disaggregation, speculative=resolved.speculative)
        return result.summary.to_pylist()[0], trace


class SLOProbe:
    """``holds(scale)`` for the rate search: replays at ``scale`` and remembers each run."""

    def __init__(self, replays: PointReplays, goodput: float | None, efficiency: Efficiency | None = None):
        self.replays = replays
        self.goodput = goodput
        self.efficiency = efficiency
        self.runs: dict[float, tuple[dict, pa.Table]] = {}
        # Scales whose steady window was too short to judge, and what each lacked.
        self.short: dict[float, str] = {}

    def __call__(self, scale: float) -> bool:
        self.runs[scale] = self.replays.replay(scale, self.efficiency)
        summary = self.runs[scale][0]
        if SHORT_WINDOW in summary["sustained_reason"].split(","):
            self.short[scale] = needs(summary)
        return slo_holds(summary, self.replays.resolved.slo, self.goodput)

    def refusal(self, found: SearchResult) -> str | None:
        """One line when a scale could not be judged (docs/capacity.md#enough-load): no rate
        at all, or the bracket above the answer is a window too short rather than a failure."""
        if not self.short:
            return None
        if found.lo is None:
            scale = max(self.short)
            return (f"no rate judged to hold: at rate scale {scale:g} the replay needs {self.short[scale]}; "
                    f"raise --limit (or workload.limit) or replay more of the trace")
        if found.hi is not None and found.hi in self.short:
            return (f"{found.lo:g} is a lower bound: rate scale {found.hi:g} could not be judged, it needs "
                    f"{self.short[found.hi]}")
        return None


def point_replicas(resolved: ResolvedScenario) -> int:
    """The point's replicas: its prefill and decode replicas when disaggregated (each one
    planned engine of ``tensor_parallel_size`` GPUs, as an aggregated replica)."""
    if resolved.disaggregation is not None:
        return resolved.disaggregation.num_replicas
    return resolved.deployment.replicas


def run_point(task: PointTask) -> dict:
    """Run one point; never raises for bad input: a failure is the row's ``error``."""
    try:
        return _point_row(task)
    except (ConfigError, TraceError) as err:
        return {"point": task.index, "status": "failed", "error": str(err), "summary": None}
    except Exception as err:  # a sweep of hours must not die on one point: say what broke
        return {"point": task.index, "status": "failed", "error": f"{type(err).__name__}: {err}", "summary": None}


def _point_row(task: PointTask) -> dict:
    row: dict = {"point": task.index, "status": "ok", "error": None, "summary": None}
    resolved = resolve_scenario(Path(task.scenario_path), data=task.data)
    # Which clock the point runs on, and why not a calibrated one (its hardware may differ).
    row["calibration"] = resolved.calibration.label
    row["calibration_note"] = resolved.calibration.note
    workload = resolved.require_workload()
    planned = resolved.plan()
    kv_config = planned.require_fits()
    resolved.require_host_memory(planned)
    row["kv_cache_blocks"] = kv_config.num_blocks - 1  # less the null block
    row["num_gpus"] = resolved.engine.tensor_parallel_size * point_replicas(resolved)
    replays = PointReplays(resolved, planned, resolved.offload_for(planned), _SOURCES.get(workload))
    if task.search is None:
        row["summary"] = replays.replay(None)[0]
        return row
    row.update(_searched_columns(replays, task.search))
    return row


def _searched_columns(replays: PointReplays, search: RateSearch) -> dict:
    """The row's summary, search record and ``MAX_RATE_COLUMNS`` for one point."""
    resolved = replays.resolved
    start = float(replays.workload.transforms.get("rate_scale", 1.0))
    probe = SLOProbe(replays, search.goodput)
    found = bracket_and_bisect(probe, start, search.tolerance, search.max_replays)
    out: dict = dict.fromkeys(MAX_RATE_COLUMNS)
    out["search"] = {"start_rate_scale": start, "converged": found.converged,
                     "tried": [[x, ok] for x, ok in found.history]}
    out["rate_search_refusal"] = probe.refusal(found)
    trace_rate = request_rate(probe.runs[start][1])
    replicas = point_replicas(resolved)
    price = resolved.gpu.price_per_hour
    gpus = resolved.engine.tensor_parallel_size * replicas
    if price is not None:
        out["cost_per_hour"] = price * gpus
    if found.lo is None:
        out["summary"] = probe.runs[found.history[-1][0]][0]
    else:
        summary, trace = probe.runs[found.lo]
        out["summary"] = summary
        rate = request_rate(trace)
        per_replica = rate / replicas
        out.update(max_rate_scale=found.lo, max_request_rate=rate, max_request_rate_per_replica=per_replica,
                   replicas_needed_trace_rate=replicas_for(trace_rate, per_replica),
                   replicas_needed_target_rate=replicas_for(search.target_rate, per_replica))
        throughput = summary["total_token_throughput"]
        if price is not None and throughput and math.isfinite(throughput) and throughput > 0:
            out["cost_per_million_tokens"] = price * gpus / (throughput * 3600) * 1e6
    out.update(_pessimistic_columns(replays, search, start, trace_rate))
    return out


def _pessimistic_columns(replays: PointReplays, search: RateSearch, start: float, trace_rate: float) -> dict:
    """The same search with every step slower by the calibration's held-out step error."""
    resolved = replays.resolved
    error = step_error(resolved.calibration) if resolved.calibration is not None else None
    if error is None:
        return {}
    probe = SLOProbe(replays, search.goodput, pessimistic(resolved.efficiency, error))
    edge: SearchResult = bracket_and_bisect(probe, start, search.tolerance, search.max_replays)
    out: dict = {"step_error": error}
    if edge.lo is not None:
        rate = request_rate(probe.runs[edge.lo][1])
        per_replica = rate / point_replicas(resolved)
        out.update(max_rate_scale_pessimistic=edge.lo, max_request_rate_pessimistic=rate,
                   replicas_needed_trace_rate_pessimistic=replicas_for(trace_rate, per_replica),
                   replicas_needed_target_rate_pessimistic=replicas_for(search.target_rate, per_replica))
    return out
