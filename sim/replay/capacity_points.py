"""One point of a capacity sweep, run: its replay, and with a rate search the rate and cost
columns of ``capacity.parquet``.

A point is plain data (``PointTask``: the scenario's TOML mapping with the point applied),
so any backend (``sweep_backends``) can ship it to a worker; ``run_point`` never raises for
bad input, a failure is the row's ``error``.

Derived columns of a rate search (``rate_search``): ``max_request_rate`` (requests/s of the
point's whole cut trace, (n - 1) over the span of its arrivals, at ``lo``: the rate a user
compares with their traffic), ``judged_request_rate`` (the arrival rate of the replay the
answer was judged on: the same without a limit, the busiest stretch's with one),
``max_request_rate_per_replica`` (divided by the point's replicas),
``replicas_needed_trace_rate`` (ceil of the whole cut trace's rate at the point's own scale
over the per-replica rate), ``replicas_needed_target_rate`` (the same for ``target_rate``),
``cost_per_hour`` (the GPU's ``price_per_hour`` times the point's GPUs: each replica's
``tensor_parallel_size x pipeline_parallel_size``, times its replicas) and ``cost_per_million_tokens`` (that cost over the
summary's ``total_token_throughput`` at ``lo``). Where no scale holds, ``max_rate_scale``
and the figures derived from it are null and the summary is the last replay's; otherwise
the summary columns are those of the replay at ``lo``. The ``*_pessimistic`` columns repeat
the search with every step slower by the calibration's held-out step error
(``step_error``, ``band.pessimistic``); null for an uncalibrated clock. The
replicas are engines of the point's own shape (each data-parallel rank is one, as in vLLM,
where every rank is an engine core with its own pool), each ``gpus_per_replica`` GPUs
(``num_gpus / num_replicas`` they read as GPUs), not the swept ``engine.replicas``.

The search judges sustained load, never a burst (docs/capacity.md#enough-load). A
``limit`` (``--limit N``) is read as a duration (``Stretch``): the shortest time in which
N of the trace's requests arrive, at the point's own scale. Every scale the search (or a
load curve) tries replays that much simulated time, from the stretch of the scaled trace
that holds the most arrivals in it: the load lasts as long at every rate, a higher rate is
more requests rather than a shorter burst, and the busiest part of the trace decides. The
answer is stated as the whole trace's rate at the scale its busiest stretch held: every
other stretch as long is no denser, so a short replay errs low rather than high. A
synthetic workload is drawn anew instead (``PointReplays.generated_at``): its arrival rate
times the scale, for as long as its requests (or the limit's) span at the point's own
scale. A start whose window is too short to
judge is doubled (``SLOProbe.judged_start``); a scale still too short (``sustained_reason``
``short_window``) counts as not holding, and ``rate_search_refusal`` says what it lacked;
where no scale was judged to hold, it says what the point needs instead of a rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.offload import ResolvedOffload
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.calibration.band import pessimistic, step_error
from kvtwin.sim.replay.load_curve import offered_scale
from kvtwin.sim.replay.rate_search import RateSearch, SearchResult, bracket_and_bisect, judged_requests, \
    replicas_for, request_rate, slo_holds, too_few_requests
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.replay.sustained import MIN_STEADY_ARRIVALS, SHORT_WINDOW, needs, window_arrivals
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.scenario.parse import Workload
from kvtwin.sim.scenario.resolve import ResolvedScenario, resolve_scenario
from kvtwin.traces.errors import TraceError

# Synthetic workloads drawn at other rates that a point keeps (``PointReplays.generated_at``).
MAX_GENERATED = 8
# A start too short to judge is doubled at most this often (``SLOProbe.judged_start``).
MAX_START_DOUBLINGS = 6

# The columns a rate search adds to a point's row, and their types; reports/SCHEMA.md
# documents each with its unit (tests/reports/test_schema_capacity.py keeps them in step).
MAX_RATE_COLUMNS: dict[str, pa.DataType] = {
    "max_rate_scale": pa.float64(),
    "max_request_rate": pa.float64(),
    "max_request_rate_per_replica": pa.float64(),
    "judged_request_rate": pa.float64(),
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
    offered_rate: float | None = None  # requests/s, a point of a load curve (``load_curve``)


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


@dataclass(frozen=True)
class Stretch:
    """A ``limit`` read as a duration (docs/capacity.md#enough-load): the time the trace's
    busiest ``limit`` requests span at the point's own scale, replayed at every scale from
    the trace's busiest stretch of that length."""

    duration_s: float
    start_scale: float

    @classmethod
    def of(cls, arrivals_s: np.ndarray, count: int, start_scale: float) -> "Stretch":
        """The shortest span of ``count`` consecutive arrivals (trace time, before any rate
        scale), as simulated time at ``start_scale``; all of them when there are no more."""
        n = len(arrivals_s)
        count = min(count, n)
        spans = arrivals_s[count - 1:] - arrivals_s[:n - count + 1]
        return cls(float(spans.min()) / start_scale, start_scale)

    def window(self, arrivals_s: np.ndarray, scale: float) -> tuple[float, float]:
        """The trace time that arrives in ``duration_s`` at ``scale``, where it holds the most
        arrivals (the earliest such window): the stretch a replay at that rate is judged on."""
        length = self.duration_s * scale
        # The window's own end arrival is kept despite rounding.
        ends = np.searchsorted(arrivals_s, arrivals_s + length * (1 + 1e-12), side="right")
        first = int(np.argmax(ends - np.arange(len(arrivals_s))))
        return float(arrivals_s[first]), float(arrivals_s[first]) + length


class PointReplays:
    """Replays of one planned point at any rate scale, from its loaded source."""

    def __init__(self, resolved: ResolvedScenario, planned: Plan, offload: ResolvedOffload | None, source: pa.Table):
        self.resolved = resolved
        self.planned = planned
        self.offload = offload
        self.workload = resolved.require_workload()
        self.source = source
        self.start_scale = float(self.workload.transforms.get("rate_scale", 1.0))
        self._unscaled: pa.Table | None = None
        self._stretch: Stretch | None = None
        self._generated: dict[float, pa.Table] = {}

    def unscaled(self) -> pa.Table:
        """The point's trace with its window and sample cut, neither scaled nor limited."""
        if self._unscaled is None:
            self._unscaled = dataclasses.replace(self.workload, transforms=self._window_cuts()).cut(self.source)
        return self._unscaled

    def _window_cuts(self) -> dict:
        """The workload's cuts but its rate scale and limit, which a search sets itself."""
        return {k: v for k, v in self.workload.transforms.items() if k not in ("rate_scale", "limit")}

    def stretch(self) -> Stretch | None:
        """A ``limit`` read as a duration, the shortest time that many requests take (module
        docstring); None without a limit (every scale then replays the whole cut). A
        synthetic workload always has one: the span of its first ``limit`` requests, or of
        all of them."""
        if "limit" not in self.workload.transforms and self.workload.synth is None:
            return None
        if self._stretch is None:
            arrivals = self.unscaled().column("arrival_time_s").to_numpy()
            count = int(self.workload.transforms.get("limit", len(arrivals)))
            if self.workload.synth is not None:
                # Drawn anew at every rate, a stationary workload has no busiest part: the
                # duration is its own first requests' (the point's own replay at its scale).
                arrivals = arrivals[:count]
            self._stretch = Stretch.of(arrivals, count, self.start_scale)
        return self._stretch

    def trace_rate(self, scale: float) -> float:
        """Requests/s of the point's whole cut trace at ``scale`` (no limit): the rate a
        search's answer is stated in. A synthetic workload's is the one generated at it."""
        if self.workload.synth is not None:
            return request_rate(self.cut_at(scale))
        return request_rate(self.unscaled()) * scale

    def generated_at(self, scale: float) -> pa.Table:
        """A synthetic workload drawn for the stretch's duration at ``scale`` times its
        arrival rate (the spec's seed, so the requests it shares with the point's own are the
        same), cut as the point's but for its rate scale and limit (module docstring)."""
        table = self._generated.get(scale)
        if table is None:
            synth = self.workload.synth
            arrival = {**synth["arrival"], "rate_per_s": synth["arrival"]["rate_per_s"] * scale}
            # The arrival that ends the duration is kept despite rounding; the next is a gap later.
            spec = {**{k: v for k, v in synth.items() if k != "num_requests"}, "arrival": arrival,
                    "duration_s": self.stretch().duration_s * (1 + 1e-6)}
            workload = dataclasses.replace(self.workload, synth=spec, transforms=self._window_cuts())
            if len(self._generated) >= MAX_GENERATED:
                self._generated.clear()
            table = self._generated[scale] = workload.cut(workload.load_source())
        return table

    def cut_at(self, scale: float | None) -> pa.Table:
        """The trace a replay at ``scale`` runs (None: the workload's own cut)."""
        if scale is None:
            return self.workload.cut(self.source)
        stretch = self.stretch()
        if stretch is None:
            transforms = {**self.workload.transforms, "rate_scale": scale}
            return dataclasses.replace(self.workload, transforms=transforms).cut(self.source)
        if self.workload.synth is not None:
            return self.generated_at(scale)
        from kvtwin.traces.transforms import scale_rate, time_window

        unscaled = self.unscaled()
        arrivals = unscaled.column("arrival_time_s").to_numpy()
        lo, hi = stretch.window(arrivals, scale)
        kept = unscaled.filter(pa.array((arrivals >= lo) & (arrivals <= hi * (1 + 1e-12))))
        scaled = scale_rate(kept, scale)
        # From time 0, as a trace's replay starts: the drain and span rules read times from it.
        return time_window(scaled, float(scaled.column("arrival_time_s").to_numpy().min()))

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
        # Scales ``judged_start`` passed over for that.
        self.skipped: list[float] = []

    def __call__(self, scale: float) -> bool:
        if scale not in self.runs:
            self.runs[scale] = self.replays.replay(scale, self.efficiency)
        summary = self.runs[scale][0]
        if SHORT_WINDOW in summary["sustained_reason"].split(","):
            self.short[scale] = needs(summary)
        elif too_few_requests(summary, self.goodput):
            what = "its p99" if self.goodput is None else f"a {self.goodput:g} goodput"
            admitted = summary["num_requests"] - summary["rejected"]
            self.short[scale] = (f"at least {judged_requests(self.goodput):,} admitted requests to judge {what}; "
                                 f"it had {admitted:,}")
        return slo_holds(summary, self.replays.resolved.slo, self.goodput)

    def judged_start(self, start: float) -> float:
        """Where the search starts: the point's own scale, doubled while its steady window
        holds too few arrivals, or the replay too few requests, to judge
        (docs/capacity.md#enough-load). A stretch read from a
        ``limit`` lasts as long at every scale, so a higher rate brings more arrivals into
        it, and a lower one could only bring fewer; at most ``MAX_START_DOUBLINGS`` times.
        A window short next to the requests' service time is not helped by a higher rate
        (the service time grows with the load): the search then starts where it would have,
        as it does when the doublings run out, and ends in a refusal unless a lower rate can
        be judged. A whole trace scaled has as many arrivals at every scale: it starts where
        it is."""
        if self.replays.stretch() is None:
            return start
        scale = start
        for _ in range(MAX_START_DOUBLINGS + 1):
            self(scale)
            if scale not in self.short:
                return scale
            summary = self.runs[scale][0]
            if window_arrivals(summary) >= MIN_STEADY_ARRIVALS and not too_few_requests(summary, self.goodput):
                return start
            self.skipped.append(scale)
            scale *= 2
        return start

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
    planned engine, as an aggregated replica), and with data parallelism its ranks (the
    replay's replicas: docs/semantics.md#data-parallel-lockstep)."""
    if resolved.disaggregation is not None:
        return resolved.disaggregation.num_replicas
    return resolved.deployment.replicas * resolved.engine.data_parallel_size


def gpus_per_replica(resolved: ResolvedScenario) -> int:
    """The GPUs one replica (one engine, a DP rank) takes: its tensor-parallel group times its
    pipeline stages (docs/semantics.md#parallel-layouts)."""
    eng = resolved.engine
    return eng.tensor_parallel_size * eng.pipeline_parallel_size


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
    row["num_gpus"] = gpus_per_replica(resolved) * point_replicas(resolved)
    replays = PointReplays(resolved, planned, resolved.offload_for(planned), _SOURCES.get(workload))
    if task.offered_rate is not None:
        row.update(_load_curve_columns(replays, task.offered_rate))
        return row
    if task.search is None:
        row["summary"] = replays.replay(None)[0]
        return row
    row.update(_searched_columns(replays, task.search))
    return row


def _load_curve_columns(replays: PointReplays, rate_per_s: float) -> dict:
    """The row's summary and ``LOAD_CURVE_COLUMNS`` (but the knee, a property of the whole
    curve) for one offered rate (``load_curve``)."""
    scale = offered_scale(lambda x: request_rate(replays.cut_at(x)), rate_per_s, replays.start_scale)
    if scale is None:
        raise ConfigError("--load-curve", "a workload of at least two requests over a time span (a rate to scale)",
                          "one request, or all at one instant", source=replays.resolved.where)
    summary, trace = replays.replay(scale)
    out: dict = {"summary": summary, "offered_request_rate": request_rate(trace), "load_rate_scale": scale,
                 "achieved_request_rate": summary["request_throughput"]}
    resolved = replays.resolved
    error = step_error(resolved.calibration) if resolved.calibration is not None else None
    if error is not None:
        slow, _ = replays.replay(scale, pessimistic(resolved.efficiency, error))
        out.update(step_error=error, achieved_request_rate_pessimistic=slow["request_throughput"],
                   p99_ttft_ms_pessimistic=slow["p99_ttft_ms"], p99_ttft_client_ms_pessimistic=slow["p99_ttft_client_ms"],
                   p99_tpot_ms_pessimistic=slow["p99_tpot_ms"],
                   sustained_pessimistic=slow["sustained"])
    return out


def _searched_columns(replays: PointReplays, search: RateSearch) -> dict:
    """The row's summary, search record and ``MAX_RATE_COLUMNS`` for one point."""
    resolved = replays.resolved
    probe = SLOProbe(replays, search.goodput)
    start = probe.judged_start(replays.start_scale)
    found = bracket_and_bisect(probe, start, search.tolerance, search.max_replays)
    out: dict = dict.fromkeys(MAX_RATE_COLUMNS)
    out["search"] = {"start_rate_scale": start, "converged": found.converged,
                     "too_short": probe.skipped,
                     "tried": [[x, ok] for x, ok in found.history]}
    out["rate_search_refusal"] = probe.refusal(found)
    trace_rate = replays.trace_rate(replays.start_scale)
    replicas = point_replicas(resolved)
    price = resolved.gpu.price_per_hour
    gpus = gpus_per_replica(resolved) * replicas
    if price is not None:
        out["cost_per_hour"] = price * gpus
    if found.lo is None:
        out["summary"] = probe.runs[found.history[-1][0]][0]
    else:
        summary, trace = probe.runs[found.lo]
        out["summary"] = summary
        rate = replays.trace_rate(found.lo)
        per_replica = rate / replicas
        out.update(max_rate_scale=found.lo, max_request_rate=rate, max_request_rate_per_replica=per_replica,
                   judged_request_rate=request_rate(trace),
                   replicas_needed_trace_rate=replicas_for(trace_rate, per_replica),
                   replicas_needed_target_rate=replicas_for(search.target_rate, per_replica))
        throughput = summary["total_token_throughput"]
        if price is not None and throughput and math.isfinite(throughput) and throughput > 0:
            out["cost_per_million_tokens"] = price * gpus / (throughput * 3600) * 1e6
    out.update(_pessimistic_columns(replays, search, trace_rate))
    return out


def _pessimistic_columns(replays: PointReplays, search: RateSearch, trace_rate: float) -> dict:
    """The same search with every step slower by the calibration's held-out step error."""
    resolved = replays.resolved
    error = step_error(resolved.calibration) if resolved.calibration is not None else None
    if error is None:
        return {}
    probe = SLOProbe(replays, search.goodput, pessimistic(resolved.efficiency, error))
    edge: SearchResult = bracket_and_bisect(probe, probe.judged_start(replays.start_scale), search.tolerance,
                                            search.max_replays)
    out: dict = {"step_error": error}
    if edge.lo is not None:
        rate = replays.trace_rate(edge.lo)
        per_replica = rate / point_replicas(resolved)
        out.update(max_rate_scale_pessimistic=edge.lo, max_request_rate_pessimistic=rate,
                   replicas_needed_trace_rate_pessimistic=replicas_for(trace_rate, per_replica),
                   replicas_needed_target_rate_pessimistic=replicas_for(search.target_rate, per_replica))
    return out
