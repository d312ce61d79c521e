"""``kvtwin capacity``: sweeps of a scenario, and the largest arrival rate a deployment holds.

A sweep is one or more ``--sweep KEY=V1,V2,...`` axes over a scenario; its points are the
cartesian product of the axes (the first axis varies slowest), numbered from 0 in that
order. KEY is a dotted scenario path:

* ``engine.<field>`` — any ``EngineConfig`` field (``engine.max_num_seqs``,
  ``engine.kv_cache_memory_bytes``, ...); ``none`` resets an optional field to vLLM's default;
* ``hardware.gpu`` — a GPU preset (field overrides in the scenario's ``[hardware]`` table,
  such as ``price_per_hour``, stay; an inline GPU is replaced by the preset), or
  ``hardware.<field>`` for one GPU field;
* ``model.preset`` — a model preset (the scenario's ``[model]`` table is replaced by it);
* ``workload.rate_scale``, ``workload.limit`` (and the other cuts: ``start_s``, ``end_s``,
  ``sample_sessions``, ``sample_seed``);
* ``slo.ttft_s``, ``slo.tpot_s``; ``cost_model.<field>`` (``Efficiency``);
* ``offload.<field>`` — the offload tiers (``offload.cpu_bytes``, ``offload.policy``,
  ``offload.disk_bytes``, ...; ``OffloadConfig``): ``offload.cpu_bytes=0,...`` puts the
  run without offloading next to the sized tiers.

Values are parsed as the field's type (integers, numbers, ``true``/``false``, strings). A
point is applied by editing the scenario file's TOML mapping at the dotted key and reading
the result through the normal scenario path (``resolve_scenario(..., data=...)``), so every
value meets the same checks as in a scenario file. Each value is checked that way on its own
before anything runs: a bad key or value is one ``ConfigError`` naming ``--sweep KEY``. A
*combination* that cannot run (a plan that does not fit, ``max_num_batched_tokens`` below
``max_num_seqs``) is a failed point: its row says ``status = "failed"`` and why, and the
other points go on.

**Maximum sustainable rate** (``--find-max-rate``), per point: the largest
``workload.rate_scale`` at which the scenario's ``[slo]`` holds. The SLO *holds* for a replay
when at least one request completed and

* without ``goodput``: the p99 TTFT of completed requests is at most ``slo.ttft_s`` and their
  p99 TPOT at most ``slo.tpot_s`` (each where set), and no request was left unfinished (by a
  ``time_limit_s``);
* with ``goodput = G``: at least the fraction G of the requests that were admitted
  (completed or unfinished) completed within both bounds (``slo_attainment`` counted over
  them, unfinished ones as misses).

Rejected requests (refused at admission, e.g. longer than ``max_model_len``) do not depend on
the rate and are left out of both. The search assumes the SLO holds below some rate and fails
above it. It replays the point at its own rate scale (1 unless the scenario or the sweep sets
``workload.rate_scale``), doubles the scale while the SLO holds (or halves it while it fails)
until a failing and a holding scale bracket the threshold, then bisects (geometric midpoint)
until ``hi / lo - 1 <= tolerance`` (default 0.05) or ``max_replays`` replays were spent.
The answer is ``lo``, the largest scale seen to hold: it is within ``tolerance`` below the
threshold when the search converged. Where no scale down to 1/1024 of the start holds (or
the replays ran out first), ``max_rate_scale`` and the figures derived from it are null and
the summary is the last replay's. A point's summary columns are then those of the
replay at ``lo``. Each point's search (scale, holds) is recorded in ``capacity.parquet``'s
schema metadata under ``kvtwin.capacity``.

Derived columns: ``max_request_rate`` (requests/s of the trace at ``lo``: (n - 1) over the
span of arrivals), ``max_request_rate_per_replica`` (divided by the point's
``engine.replicas``, 1 where the engine has no such field), ``replicas_needed_trace_rate``
(ceil of the point's own trace rate over the per-replica rate), ``replicas_needed_target_rate``
(the same for ``target_rate``), ``cost_per_hour`` (the GPU's ``price_per_hour`` times
``tensor_parallel_size x replicas`` GPUs of the point's deployment) and
``cost_per_million_tokens`` (that cost over the summary's ``total_token_throughput`` at ``lo``).

Points run in this process (``jobs = 1``), on a local process pool, or as Ray tasks; every
backend returns the same rows, sorted by point, so ``capacity.parquet`` is byte-identical.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.offload import OffloadConfig
from kvtwin.sim.replay.calibration_data import pessimistic, step_error
from kvtwin.sim.replay.cost_model import SCALAR_EFFICIENCY_FIELDS
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.summaries import OFFLOAD_SUMMARY_COLUMNS, SLO, summarize
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.parse import TRANSFORM_KEYS, Workload, scenario_from_data
from kvtwin.sim.scenario.resolve import resolve_scenario
from kvtwin.traces.errors import TraceError

FLAG = "--sweep"
DEFAULT_RATE_TOLERANCE = 0.05
DEFAULT_MAX_REPLAYS = 24
# Halving below this fraction of the starting scale gives up: nothing holds.
MIN_SCALE_FRACTION = 1.0 / 1024
CAPACITY_METADATA_KEY = b"kvtwin.capacity"

MAX_RATE_COLUMNS: dict[str, pa.DataType] = {
    "max_rate_scale": pa.float64(),
    "max_request_rate": pa.float64(),
    "max_request_rate_per_replica": pa.float64(),
    "replicas_needed_trace_rate": pa.int64(),
    "replicas_needed_target_rate": pa.int64(),
    "cost_per_hour": pa.float64(),
    "cost_per_million_tokens": pa.float64(),
    # The same search with every step slower by the calibration's held-out step error
    # (calibration_data.pessimistic); null for an uncalibrated clock.
    "step_error": pa.float64(),
    "max_rate_scale_pessimistic": pa.float64(),
    "max_request_rate_pessimistic": pa.float64(),
    "replicas_needed_trace_rate_pessimistic": pa.int64(),
    "replicas_needed_target_rate_pessimistic": pa.int64(),
}
_ARROW_TYPES = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


# -- keys and values ------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepKey:
    key: str  # as given: "engine.max_num_seqs"
    section: str  # "engine"
    name: str  # "max_num_seqs"
    kind: str  # int, float, bool, str
    optional: bool = False  # "none" allowed (back to the default)

    @property
    def arrow_type(self) -> pa.DataType:
        return _ARROW_TYPES[self.kind]


def _kind_of(annotation: object) -> tuple[str, bool]:
    text = str(annotation)
    optional = "None" in text
    for kind in ("bool", "int", "float", "str"):
        if kind in text:
            return kind, optional
    return "str", optional


def _fields_of(cls) -> dict[str, tuple[str, bool]]:
    return {f.name: _kind_of(f.type) for f in dataclasses.fields(cls)}


_WORKLOAD_KINDS = {"start_s": "float", "end_s": "float", "limit": "int", "rate_scale": "float",
                   "sample_sessions": "float", "sample_seed": "int"}
assert set(_WORKLOAD_KINDS) == set(TRANSFORM_KEYS)


def _section_fields() -> dict[str, dict[str, tuple[str, bool]]]:
    hardware = {k: v for k, v in _fields_of(GPUSpec).items() if k != "name"}
    hardware["gpu"] = ("str", False)
    return {
        "engine": _fields_of(EngineConfig),
        "hardware": hardware,
        "model": {"preset": ("str", False)},
        "workload": {k: (v, False) for k, v in _WORKLOAD_KINDS.items()},
        "slo": {"ttft_s": ("float", False), "tpot_s": ("float", False)},
        "cost_model": {k: ("float", False) for k in SCALAR_EFFICIENCY_FIELDS},
        "offload": _fields_of(OffloadConfig),
    }


def sweep_key(key: str) -> SweepKey:
    """The sweep axis ``key`` names, or a ``ConfigError`` listing what may be swept."""
    sections = _section_fields()
    section, _, name = key.partition(".")
    if section not in sections or not name:
        raise ConfigError(FLAG, "KEY=V1,V2,... with KEY one of engine.<field>, hardware.gpu, model.preset, "
                                "workload.rate_scale, workload.limit, slo.ttft_s, slo.tpot_s, cost_model.<field>, "
                                "offload.<field>",
                          key)
    fields = sections[section]
    if name not in fields:
        raise ConfigError(f"{FLAG} {key}", f"a field of [{section}] to sweep ({', '.join(sorted(fields))})", name)
    kind, optional = fields[name]
    return SweepKey(key, section, name, kind, optional)


def parse_value(axis: SweepKey, raw: str) -> object:
    """``raw`` as the axis's type; ``None`` for ``none`` on an optional field."""
    text = raw.strip()
    where = f"{FLAG} {axis.key}"
    if axis.optional and text.lower() == "none":
        return None
    expected = _EXPECTED[axis.kind] + (" (or none for the default)" if axis.optional else "")
    if axis.kind == "bool":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ConfigError(where, expected, raw)
    if axis.kind == "int":
        try:
            return int(text.replace("_", ""))
        except ValueError:
            raise ConfigError(where, expected, raw) from None
    if axis.kind == "float":
        try:
            value = float(text.replace("_", ""))
        except ValueError:
            raise ConfigError(where, expected, raw) from None
        if not math.isfinite(value):
            raise ConfigError(where, "a finite number", raw)
        return value
    if not text:
        raise ConfigError(where, expected, raw)
    return text


@dataclass(frozen=True)
class Axis:
    key: SweepKey
    values: tuple


def parse_sweeps(specs: Sequence[str]) -> list[Axis]:
    """``--sweep KEY=V1,V2,...`` flags (repeatable) as axes, in the order given."""
    axes: list[Axis] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep:
            raise ConfigError(FLAG, "KEY=V1,V2,...", spec)
        axis = sweep_key(key.strip())
        if any(a.key.key == axis.key for a in axes):
            raise ConfigError(f"{FLAG} {axis.key}", "each key swept once (list all its values in one flag)", spec)
        raw = [v for v in values.split(",")]
        if not values.strip() or any(not v.strip() for v in raw):
            raise ConfigError(f"{FLAG} {axis.key}", "a comma-separated list of values", values)
        parsed = tuple(parse_value(axis, v) for v in raw)
        if len(set(parsed)) != len(parsed):
            raise ConfigError(f"{FLAG} {axis.key}", "distinct values", values)
        axes.append(Axis(axis, parsed))
    return axes


@dataclass(frozen=True)
class Point:
    index: int
    values: dict  # sweep key -> value


def sweep_points(axes: Sequence[Axis]) -> list[Point]:
    """The cartesian product of the axes, first axis slowest; no axis gives one point."""
    combos = itertools.product(*(a.values for a in axes))
    return [Point(i, {a.key.key: v for a, v in zip(axes, combo)}) for i, combo in enumerate(combos)]


def apply_values(data: dict, values: dict) -> dict:
    """A copy of a scenario's TOML mapping with each dotted key set (``sweep_key`` rules)."""
    out = copy.deepcopy(data)
    for key, value in values.items():
        axis = sweep_key(key)
        if axis.section == "hardware" and axis.name == "gpu":
            table = out.get("hardware")
            if isinstance(table, dict) and ("gpu" in table or not table):
                table["gpu"] = value
            else:
                out["hardware"] = {"gpu": value}
            continue
        if axis.section == "model":
            out["model"] = {"preset": value}
            continue
        if axis.section == "workload" and not isinstance(out.get("workload"), dict):
            raise ConfigError(f"{FLAG} {key}", "a scenario with a [workload] table")
        table = out.setdefault(axis.section, {})
        if not isinstance(table, dict):
            raise ConfigError(axis.section, "a table", table)
        if value is None:
            table.pop(axis.name, None)
        else:
            table[axis.name] = value
    return out


def with_limit(data: dict, limit: int | None) -> dict:
    """``--limit N``: the scenario's ``[workload] limit`` for every point (a swept
    ``workload.limit`` still wins)."""
    if limit is None:
        return data
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ConfigError("--limit", "a positive number of requests", limit)
    return apply_values(data, {"workload.limit": limit})


def check_axes(path: Path, data: dict, axes: Sequence[Axis]) -> None:
    """Read the scenario with each swept value alone, so a value the scenario rules refuse is
    a flag error now, not a failed point later."""
    for axis in axes:
        for value in axis.values:
            try:
                scenario_from_data(apply_values(data, {axis.key.key: value}), path)
            except ConfigError as err:
                if err.field.startswith(FLAG):
                    raise
                raise ConfigError(f"{FLAG} {axis.key.key}", err.expected,
                                  value if value is not None else "none") from None


# -- the SLO criterion and the rate search --------------------------------------------------


@dataclass(frozen=True)
class RateSearch:
    """``--find-max-rate`` settings (module docstring)."""

    tolerance: float = DEFAULT_RATE_TOLERANCE
    goodput: float | None = None
    max_replays: int = DEFAULT_MAX_REPLAYS
    target_rate: float | None = None

    def check(self) -> None:
        if not (isinstance(self.tolerance, (int, float)) and 0 < self.tolerance < 1):
            raise ConfigError("--rate-tolerance", "a relative tolerance in (0, 1)", self.tolerance)
        if self.goodput is not None and not (isinstance(self.goodput, (int, float)) and 0 < self.goodput <= 1):
            raise ConfigError("--goodput", "a fraction of requests in (0, 1]", self.goodput)
        if not (isinstance(self.max_replays, int) and self.max_replays >= 2):
            raise ConfigError("--max-replays", "at least 2 replays", self.max_replays)
        if self.target_rate is not None and not (isinstance(self.target_rate, (int, float))
                                                 and self.target_rate > 0):
            raise ConfigError("--target-rate", "a positive rate in requests per second", self.target_rate)


def slo_holds(summary: dict, slo: SLO, goodput: float | None = None) -> bool:
    """Whether a replay's summary meets the SLO criterion of the module docstring."""
    completed = summary["completed"]
    if completed == 0:
        return False
    if goodput is not None:
        met = summary["slo_attainment"] * completed
        admitted = completed + summary["unfinished"]
        return met >= goodput * admitted - 1e-9
    if summary["unfinished"]:
        return False
    ttft, tpot = summary["p99_ttft_ms"], summary["p99_tpot_ms"]
    return ((slo.ttft_s is None or ttft <= slo.ttft_s * 1000)
            and (slo.tpot_s is None or math.isnan(tpot) or tpot <= slo.tpot_s * 1000))


@dataclass
class SearchResult:
    lo: float | None  # the largest scale seen to hold
    hi: float | None  # the smallest scale seen to fail
    history: list  # (scale, holds) in the order tried
    converged: bool


def bracket_and_bisect(holds: Callable[[float], bool], start: float, tolerance: float = DEFAULT_RATE_TOLERANCE,
                       max_replays: int = DEFAULT_MAX_REPLAYS) -> SearchResult:
    """The largest ``x`` with ``holds(x)`` for a monotone predicate (true below a threshold),
    within ``tolerance`` relative, starting from ``start`` (module docstring)."""
    history: list = []

    def test(x: float) -> bool:
        ok = bool(holds(x))
        history.append((x, ok))
        return ok

    lo = hi = None
    x = start
    if test(x):
        lo = x
        while len(history) < max_replays:
            x *= 2
            if test(x):
                lo = x
            else:
                hi = x
                break
    else:
        hi = x
        while len(history) < max_replays and x / 2 >= start * MIN_SCALE_FRACTION:
            x /= 2
            if test(x):
                lo = x
                break
            hi = x
    if lo is None or hi is None:
        return SearchResult(lo, hi, history, False)
    while hi / lo - 1 > tolerance and len(history) < max_replays:
        mid = math.sqrt(lo * hi)
        if test(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, hi, history, hi / lo - 1 <= tolerance)


def request_rate(trace: pa.Table) -> float:
    """Requests per second of a trace: (n - 1) over the span of its arrivals."""
    n = trace.num_rows
    if n < 2:
        return math.nan
    arrivals = trace.column("arrival_time_s").to_numpy()
    span = float(arrivals.max() - arrivals.min())
    return (n - 1) / span if span > 0 else math.nan


# -- running points ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PointTask:
    """One point, as shipped to a worker (plain data: picklable for any backend)."""

    index: int
    scenario_path: str
    data: dict  # the scenario's TOML mapping with the point applied
    search: RateSearch | None = None


# Sources read in this process, by what they are: a worker running many points (or many
# rates of one point) reads the trace once.
_SOURCES: dict[str, pa.Table] = {}


def _source(workload: Workload) -> pa.Table:
    key = repr((str(workload.trace), workload.load_options, json.dumps(workload.synth, sort_keys=True, default=str),
                str(workload.base_dir)))
    table = _SOURCES.get(key)
    if table is None:
        if len(_SOURCES) >= 4:
            _SOURCES.clear()
        table = _SOURCES[key] = workload.load_source()
    return table


def replicas_for(rate: float | None, per_replica: float) -> int | None:
    """Replicas that serve ``rate`` when one serves ``per_replica`` (None: either unknown)."""
    if rate is None or not math.isfinite(rate) or not (per_replica > 0 and math.isfinite(per_replica)):
        return None
    return max(1, math.ceil(rate / per_replica - 1e-9))


def run_point(task: PointTask) -> dict:
    """Run one point; never raises for bad input: a failure is the row's ``error``."""
    row: dict = {"point": task.index, "status": "ok", "error": None, "summary": None}
    try:
        resolved = resolve_scenario(Path(task.scenario_path), data=task.data)
        workload = resolved.require_workload()
        planned = resolved.plan()
        kv_config = planned.require_fits()
        row["kv_cache_blocks"] = kv_config.num_blocks - 1  # less the null block
        offload = resolved.offload_for(planned)
        source = _source(workload)

        def replay(scale: float | None, efficiency=resolved.efficiency):
            w = workload if scale is None else dataclasses.replace(
                workload, transforms={**workload.transforms, "rate_scale": scale})
            trace = w.cut(source)
            result = run_replay(planned, trace, efficiency=efficiency, slo=resolved.slo,
                                time_limit_s=resolved.time_limit_s, offload=offload)
            return result.summary.to_pylist()[0], trace

        if task.search is None:
            row["summary"] = replay(None)[0]
            return row
        search = task.search
        start = float(workload.transforms.get("rate_scale", 1.0))
        runs: dict[float, tuple[dict, pa.Table]] = {}

        def holds(scale: float) -> bool:
            runs[scale] = replay(scale)
            return slo_holds(runs[scale][0], resolved.slo, search.goodput)

        found = bracket_and_bisect(holds, start, search.tolerance, search.max_replays)
        row["search"] = {"start_rate_scale": start, "converged": found.converged,
                         "tried": [[x, ok] for x, ok in found.history]}
        trace_rate = request_rate(runs[start][1])
        replicas = resolved.engine.replicas
        gpus = resolved.engine.tensor_parallel_size * replicas
        price = resolved.gpu.price_per_hour
        extra = dict.fromkeys(MAX_RATE_COLUMNS)
        if found.lo is None:
            row["summary"] = runs[found.history[-1][0]][0]
        else:
            summary, trace = runs[found.lo]
            row["summary"] = summary
            rate = request_rate(trace)
            per_replica = rate / replicas
            extra.update(max_rate_scale=found.lo, max_request_rate=rate, max_request_rate_per_replica=per_replica,
                         replicas_needed_trace_rate=replicas_for(trace_rate, per_replica),
                         replicas_needed_target_rate=replicas_for(search.target_rate, per_replica))
            if price is not None:
                extra["cost_per_hour"] = price * gpus
                throughput = summary["total_token_throughput"]
                if throughput and math.isfinite(throughput) and throughput > 0:
                    extra["cost_per_million_tokens"] = price * gpus / (throughput * 3600) * 1e6
        if found.lo is None and price is not None:
            extra["cost_per_hour"] = price * gpus
        error = step_error(resolved.calibration) if resolved.calibration is not None else None
        if error is not None:
            slowed = pessimistic(resolved.efficiency, error)
            slow_runs: dict[float, tuple[dict, pa.Table]] = {}

            def holds_slowed(scale: float) -> bool:
                slow_runs[scale] = replay(scale, slowed)
                return slo_holds(slow_runs[scale][0], resolved.slo, search.goodput)

            edge = bracket_and_bisect(holds_slowed, start, search.tolerance, search.max_replays)
            extra["step_error"] = error
            if edge.lo is not None:
                rate = request_rate(slow_runs[edge.lo][1])
                extra.update(max_rate_scale_pessimistic=edge.lo, max_request_rate_pessimistic=rate,
                             replicas_needed_trace_rate_pessimistic=replicas_for(trace_rate, rate / replicas),
                             replicas_needed_target_rate_pessimistic=replicas_for(search.target_rate,
                                                                                  rate / replicas))
        row.update(extra)
        return row
    except (ConfigError, TraceError) as err:
        return {"point": task.index, "status": "failed", "error": str(err), "summary": None}
    except Exception as err:  # a sweep of hours must not die on one point: say what broke
        return {"point": task.index, "status": "failed", "error": f"{type(err).__name__}: {err}", "summary": None}


def default_jobs(num_points: int) -> int:
    return max(1, min(os.cpu_count() or 1, num_points))


def run_points(tasks: Sequence[PointTask], *, jobs: int = 1, backend: str = "process",
               ray_address: str | None = None, on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every task; rows sorted by point, the same whatever the backend and ``jobs``."""
    rows: list[dict] = []

    def done(row: dict) -> None:
        rows.append(row)
        if on_done is not None:
            on_done(row)

    if backend == "ray":
        _run_ray(tasks, ray_address, done)
    elif backend == "process":
        if jobs <= 1 or len(tasks) <= 1:
            for task in tasks:
                done(run_point(task))
        else:
            import concurrent.futures
            import multiprocessing

            context = _pool_context(multiprocessing)
            with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                                                        mp_context=context) as pool:
                futures = [pool.submit(run_point, task) for task in tasks]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        done(future.result())
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
    else:
        raise ConfigError("--backend", "process or ray", backend)
    return sorted(rows, key=lambda r: r["point"])


def _pool_context(multiprocessing):
    """Workers forked from a server that has imported kvtwin once (no fork of this process,
    whose progress-bar thread may hold a lock); plain spawn where there is no forkserver."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
        return context
    return multiprocessing.get_context("spawn")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--backend", "ray installed in this environment (pip install 'ray[default]'), "
                                       "or --backend process", "ray") from None
    return ray


def _run_ray(tasks: Sequence[PointTask], address: str | None, done: Callable[[dict], None]) -> None:
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(run_point)
        pending = [remote.remote(task) for task in tasks]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done(ray.get(ref))
    finally:
        if started_here:
            ray.shutdown()


# -- the table ---------------------------------------------------------------------------------

_SUMMARY_SCHEMA: pa.Schema | None = None


def summary_schema() -> pa.Schema:
    """The columns of ``summary.parquet`` (from an empty run, so failed points get typed nulls)."""
    global _SUMMARY_SCHEMA
    if _SUMMARY_SCHEMA is None:
        recorder = MetricsRecorder(1)
        _SUMMARY_SCHEMA = summarize(recorder.requests_table(), recorder.steps_table(), array("d"), SLO(),
                                    0.0).schema
    return _SUMMARY_SCHEMA


def capacity_table(rows: Sequence[dict], points: Sequence[Point], axes: Sequence[Axis], *,
                   find_max_rate: bool = False) -> pa.Table:
    """``capacity.parquet``: point, status, error, one column per sweep key, the summary
    columns, and with ``find_max_rate`` the rate and cost columns (module docstring)."""
    by_point = {p.index: p for p in points}
    rows = sorted(rows, key=lambda r: r["point"])
    columns: dict[str, pa.Array] = {
        "point": pa.array([r["point"] for r in rows], pa.int64()),
        "status": pa.array([r["status"] for r in rows], pa.string()),
        "error": pa.array([r["error"] for r in rows], pa.string()),
    }
    for axis in axes:
        columns[axis.key.key] = pa.array([by_point[r["point"]].values[axis.key.key] for r in rows],
                                         axis.key.arrow_type)
    for field in summary_schema():
        if field.name in columns:
            continue
        values = [(r["summary"] or {}).get(field.name) if r["summary"] is not None else None for r in rows]
        columns[field.name] = pa.array(values, field.type)
    # The offload columns, when a point ran with offloading (null in the points without).
    if any(r["summary"] is not None and "hit_rate_total" in r["summary"] for r in rows):
        for name, kind in OFFLOAD_SUMMARY_COLUMNS.items():
            if name in columns:
                continue
            values = [(r["summary"] or {}).get(name) for r in rows]
            columns[name] = pa.array(values, kind)
    if find_max_rate:
        for name, kind in MAX_RATE_COLUMNS.items():
            values = [r.get(name) if r["status"] == "ok" else None for r in rows]
            columns[name] = pa.array([None if isinstance(v, float) and math.isnan(v) else v for v in values], kind)
    table = pa.table(columns)
    searches = {str(r["point"]): r["search"] for r in rows if r.get("search") is not None}
    if searches:
        table = table.replace_schema_metadata({CAPACITY_METADATA_KEY: json.dumps(searches, sort_keys=True).encode()})
    return table
