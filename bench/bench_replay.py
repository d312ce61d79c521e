"""Speed and memory of a full replay: the default scenario (Llama-3.1-8B on one H100) over
the whole bundled Mooncake conversation trace (12,031 requests, mean prompt 12k tokens).

Prints wall time, simulated requests per wall second, engine steps per second and peak
RSS, and writes one parquet row to ``bench/out/bench_replay.parquet``. The replay's wall
time is also given as a ratio to a fixed pure-Python loop timed in the same run
(``bench/reference_loop.py``, before and after the replay): compare that ratio across
changes, since the machines are shared and wall seconds drift.

    python bench/bench_replay.py [--scenario scenarios/default.toml] [--limit N]
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from kvtwin import __version__
from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.scenario.parse import load_scenario
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.traces import transforms

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reference_loop import reference_seconds  # noqa: E402  (a sibling script, not a package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", type=Path, default=SCENARIOS_DIR / "mooncake-llama8b-h100-overload.toml")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_replay.parquet")
    args = parser.parse_args()

    reference_before_s = reference_seconds()
    started = time.perf_counter()
    scenario = load_scenario(args.scenario)
    trace = scenario.workload.load()
    if args.limit:
        trace = transforms.limit(trace, args.limit)
    planned = plan(scenario.model, scenario.gpu, scenario.engine)
    loaded = time.perf_counter()
    result = run_replay(planned, trace, efficiency=scenario.efficiency,
                        slo=scenario.slo)
    finished = time.perf_counter()
    reference_s = min(reference_before_s, reference_seconds())
    summary = result.summary.to_pylist()[0]
    replay_s = finished - loaded
    row = {
        "scenario": args.scenario.name,
        "requests": trace.num_rows,
        "steps": result.steps.num_rows,
        "simulated_s": result.end_time_s,
        "load_and_plan_s": loaded - started,
        "replay_wall_s": replay_s,
        "total_wall_s": finished - started,
        "reference_loop_s": reference_s,
        "replay_vs_reference": replay_s / reference_s,
        "requests_per_wall_s": trace.num_rows / replay_s,
        "steps_per_wall_s": result.steps.num_rows / replay_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"],
        "num_evictions": summary["num_evictions"],
    }
    table = Table(title=f"kvtwin replay bench ({platform.python_implementation()} {platform.python_version()})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in row.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int)
                      else str(value))
    Console(width=120).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = pa.Table.from_pylist([row]).replace_schema_metadata({"kvtwin_version": __version__,
                                                               "machine": platform.machine()})
    tmp = args.out.with_name(args.out.name + ".tmp")
    pq.write_table(out, tmp)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
