"""Speed of ``kvtwin capacity``: a 12-point sweep with 1 and 2 jobs, and the one-pass hit-rate
curve against the exact sweep over KV cache sizes.

The sweep is 12 points of ``engine.kv_cache_memory_bytes`` over the first N requests of the
bundled Mooncake conversation trace (the default scenario: Llama-3.1-8B on 2x B200). Each
run's wall time is also given as a ratio to ``bench/reference_loop.py`` timed in the same run
(compare ratios across changes: wall seconds drift on shared machines). The curve is one
LRU stack-distance pass over the same requests, read at each point's usable KV blocks and
compared with the replayed ``prefix_cache_hit_rate``.

Prints two tables and writes one row (the figures, then each point's) to ``bench/out/bench_capacity.parquet``.

    python bench/bench_capacity.py [--limit 1000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from kvtwin import __version__
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.replay.capacity_points import PointTask
from kvtwin.sim.replay.capacity_table import capacity_table
from kvtwin.sim.replay.sweep_backends import run_points
from kvtwin.sim.scenario.sweep_keys import apply_values, check_axes, parse_sweeps, sweep_points, with_limit
from kvtwin.sim.replay.reuse_curve import reuse_profile
from kvtwin.sim.scenario.parse import load_scenario_data
from kvtwin.sim.scenario.resolve import resolve_scenario

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reference_loop import reference_seconds  # noqa: E402  (a sibling script, not a package)

# Per-GPU KV cache bytes, 9 to 96 GiB (Llama-3.1-8B at TP 2: 1 MiB per 16-token block; one request
# of the scenario's max_model_len = 131072 tokens needs 8 GiB).
SIZES_GIB = (9, 10, 11, 12, 14, 16, 20, 24, 32, 48, 64, 96)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO)
    parser.add_argument("--limit", type=int, default=1000, help="requests per point")
    parser.add_argument("--jobs", type=int, default=2, help="the parallel run's jobs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_capacity.parquet")
    args = parser.parse_args()

    reference_before_s = reference_seconds()
    data = with_limit(load_scenario_data(args.scenario), args.limit)
    axes = parse_sweeps(["engine.kv_cache_memory_bytes=" + ",".join(str(g << 30) for g in SIZES_GIB)])
    check_axes(args.scenario, data, axes)
    points = sweep_points(axes)
    tasks = [PointTask(p.index, str(args.scenario), apply_values(data, p.values)) for p in points]

    timings = {}
    tables = {}
    for jobs in (1, args.jobs):
        started = time.perf_counter()
        rows = run_points(tasks, jobs=jobs)
        timings[jobs] = time.perf_counter() - started
        tables[jobs] = (rows, capacity_table(rows, points, axes))
    identical = tables[1][1].equals(tables[args.jobs][1])

    base = resolve_scenario(args.scenario, data=data)
    trace = base.require_workload().load()
    block_size = min(g.spec.block_size for g in base.plan().require_fits().groups)
    started = time.perf_counter()
    profile = reuse_profile(trace, block_size)
    curve_s = time.perf_counter() - started
    reference_s = min(reference_before_s, reference_seconds())

    figures = []
    rows = tables[1][0]
    for row in rows:
        if row["status"] != "ok":
            continue
        blocks = row["kv_cache_blocks"]
        exact = row["summary"]["prefix_cache_hit_rate"]
        predicted = float(profile.hit_rate(blocks))
        figures.append({"kv_cache_blocks": blocks, "exact_hit_rate": exact, "curve_hit_rate": predicted,
                        "error": predicted - exact, "evictions": row["summary"]["num_evictions"]})
    mean_abs_error = sum(abs(f["error"]) for f in figures) / max(len(figures), 1)
    max_abs_error = max((abs(f["error"]) for f in figures), default=float("nan"))

    summary = {
        "scenario": args.scenario.name, "requests_per_point": trace.num_rows, "points": len(points),
        "sweep_1_job_s": timings[1], f"sweep_{args.jobs}_jobs_s": timings[args.jobs],
        "speedup": timings[1] / timings[args.jobs], "identical_tables": identical,
        # The machines are shared: a load above the cores says the timings include others' work.
        "load_average_1min": os.getloadavg()[0],
        "reference_loop_s": reference_s, "sweep_1_job_vs_reference": timings[1] / reference_s,
        f"sweep_{args.jobs}_jobs_vs_reference": timings[args.jobs] / reference_s,
        "curve_one_pass_s": curve_s, "curve_vs_exact_sweep": curve_s / timings[1],
        "curve_accesses": profile.num_accesses,
        "curve_mean_abs_error": mean_abs_error, "curve_max_abs_error": max_abs_error,
    }
    table = Table(title=f"kvtwin capacity bench ({platform.python_implementation()} {platform.python_version()})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"
                      if isinstance(value, int) and not isinstance(value, bool) else str(value))
    console = Console(width=120)
    console.print(table)
    points_table = Table(title="one-pass LRU curve vs the exact replays (prefix cache hit rate)")
    for name in ("kv_cache_blocks", "exact_hit_rate", "curve_hit_rate", "error", "evictions"):
        points_table.add_column(name, justify="right")
    for f in figures:
        points_table.add_row(f"{f['kv_cache_blocks']:,}", f"{f['exact_hit_rate']:.4f}", f"{f['curve_hit_rate']:.4f}",
                             f"{f['error']:+.4f}", f"{f['evictions']:,}")
    console.print(points_table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = pa.Table.from_pylist([{**summary, **{f"point_{i}_{k}": v for i, f in enumerate(figures)
                                              for k, v in f.items()}}])
    out = out.replace_schema_metadata({"kvtwin_version": __version__, "machine": platform.machine()})
    tmp = args.out.with_name(args.out.name + ".tmp")
    pq.write_table(out, tmp)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
