"""Wall time of two things a person waits on, measured here rather than asserted in tests
(a loaded machine must not fail a correct change):

* the executor's measured clock on the toy sliding-window scenario with 0.5 requests/s: it
  runs simulated time, so its wall time should be a fraction of the span of arrivals it
  covers (the ratio column);
* ``render_replay_report`` on a synthetic long run (500,000 steps, 20,000 requests).

Each figure is also given as a ratio to the reference loop timed in the same run. Prints a
table and writes ``bench/out/wall_clocks.parquet`` (``$OUT`` if set).

    python bench/bench_wall_clocks.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.* for the toy scenario and the synthetic run
sys.path.insert(0, str(ROOT / "bench"))

from reference_loop import reference_seconds  # noqa: E402
from kvtwin.executor.device_replay import ExecutorOptions, run_executor  # noqa: E402
from kvtwin.reports.replay_report import render_replay_report  # noqa: E402
from kvtwin.traces import schema as col  # noqa: E402
from tests.executor.toys import scenario  # noqa: E402
from tests.reports.test_report import _synthetic_replay  # noqa: E402


def _measured_clock() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        resolved = scenario("swa", Path(tmp), pool=2.0, num_requests=5, rate=0.5, seed=1)
        trace = resolved.workload.load()
        span_s = pc.max(trace.column(col.ARRIVAL_TIME_S)).as_py()
        started = time.perf_counter()
        run_executor(resolved.plan(), trace, ExecutorOptions(clock="measured"))
        wall_s = time.perf_counter() - started
    return {"what": "executor, measured clock (5 requests)", "wall_s": wall_s, "span_s": span_s}


def _long_report() -> dict:
    requests, steps, summary, plan, metadata = _synthetic_replay(n_steps=500_000, n_requests=20_000)
    started = time.perf_counter()
    render_replay_report(requests, steps, summary, plan, metadata)
    return {"what": "report.html of 500,000 steps", "wall_s": time.perf_counter() - started, "span_s": None}


def main() -> None:
    reference_s = reference_seconds()
    rows = [_measured_clock(), _long_report()]
    for row in rows:
        row["reference_loop_s"] = reference_s
        row["ratio_to_reference"] = row["wall_s"] / reference_s
        row["fraction_of_span"] = row["wall_s"] / row["span_s"] if row["span_s"] else None
    table = Table(title=f"wall clocks (reference loop {reference_s:.2f} s)")
    for name in ("what", "wall s", "x reference", "of the arrivals' span"):
        table.add_column(name, justify="left" if name == "what" else "right")
    for row in rows:
        share = row["fraction_of_span"]
        table.add_row(row["what"], f"{row['wall_s']:.2f}", f"{row['ratio_to_reference']:.1f}",
                      "-" if share is None else f"{share:.2f}")
    Console().print(table)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "wall_clocks.parquet")
    print(f"wrote {out / 'wall_clocks.parquet'}")


if __name__ == "__main__":
    main()
