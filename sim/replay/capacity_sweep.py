"""``kvtwin capacity`` as a library: a scenario and its sweep axes checked whole before the
first replay, the points as tasks for a backend, and the LRU hit curve beside the replays.

The sweep grammar is ``kvtwin.sim.scenario.sweep_keys``; a point's run and its rate search
``capacity_points``; the backends ``sweep_backends``; the table ``capacity_table``. A
*combination* of values that cannot run (a plan that does not fit, ``max_num_batched_tokens``
below ``max_num_seqs``) is a failed point: its row says ``status = "failed"`` and why, and
the other points go on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.capacity_points import PointTask
from kvtwin.sim.replay.load_curve import LoadCurve
from kvtwin.sim.replay.rate_search import RateSearch
from kvtwin.sim.replay.reuse_curve import reuse_profile
from kvtwin.sim.scenario.parse import load_scenario_data
from kvtwin.sim.scenario.resolve import ResolvedScenario, resolve_scenario
from kvtwin.sim.scenario.sweep_keys import Axis, Point, apply_values, check_axes, parse_sweeps, sweep_points, \
    with_limit


@dataclass(frozen=True)
class CapacitySweep:
    """A sweep checked whole: the scenario itself, its axes, and one task per point."""

    path: Path
    base: ResolvedScenario
    axes: list[Axis]
    points: list[Point]
    tasks: list[PointTask]
    search: RateSearch | None
    load_curve: LoadCurve | None = None


def prepare_sweep(path: Path, sweeps: Sequence[str], *, limit: int | None = None,
                  search: RateSearch | None = None, load_curve: LoadCurve | None = None) -> CapacitySweep:
    """Check the scenario, the ``--sweep`` specs and each swept value (``ConfigError`` on the
    first bad one) and build the points' tasks; nothing is replayed yet. A ``load_curve``
    makes one point per swept combination and offered rate, the rate varying fastest."""
    data = with_limit(load_scenario_data(path), limit)
    axes = parse_sweeps(sweeps)
    if load_curve is not None:
        if search is not None:
            raise ConfigError("--load-curve", "either --load-curve or --find-max-rate, not both", "both")
        if any(a.key.key == "workload.rate_scale" for a in axes):
            raise ConfigError("--load-curve", "no --sweep workload.rate_scale beside it (the curve sets the rate)",
                              "--sweep workload.rate_scale")
    base = resolve_scenario(path, data=data)  # the scenario itself, checked whole
    base.require_workload().check_source()
    if search is not None and base.slo.ttft_s is None and base.slo.tpot_s is None \
            and not any(a.key.section == "slo" for a in axes):
        raise ConfigError("--find-max-rate", "a scenario with an [slo] table (ttft_s, tpot_s)", source=base.where)
    check_axes(path, data, axes)
    points = sweep_points(axes)
    if load_curve is None:
        tasks = [PointTask(p.index, str(path), apply_values(data, p.values), search) for p in points]
        return CapacitySweep(path, base, axes, points, tasks, search)
    combos = points
    points, tasks = [], []
    for combo in combos:
        for rate in load_curve.rates_per_s:
            points.append(Point(len(points), combo.values))
            tasks.append(PointTask(len(tasks), str(path), apply_values(data, combo.values), offered_rate=rate))
    return CapacitySweep(path, base, axes, points, tasks, search, load_curve)


def hit_curve(base: ResolvedScenario, rows: Sequence[dict]) -> tuple[pa.Table, list[tuple[int, float, float]]]:
    """``hit_curve.parquet`` (LRU hit rate against KV cache size, for the base scenario's
    trace) and, per point that ran, (KV cache blocks, the curve's hit rate, the replay's)."""
    kv_config = base.plan().require_fits()
    block_size = min(g.spec.block_size for g in kv_config.groups)
    profile = reuse_profile(base.require_workload().load(), block_size)
    exact = {r["kv_cache_blocks"]: r["summary"]["prefix_cache_hit_rate"] for r in rows
             if r["status"] == "ok" and "kv_cache_blocks" in r}
    comparison = [(blocks, float(profile.hit_rate(blocks)), hit) for blocks, hit in sorted(exact.items())]
    return profile.table(sorted(exact) or None), comparison
