"""Benchmark: how fast and how big loading the bundled Mooncake trace is.

Measures, for ``traces/data/mooncake_conversation_trace.jsonl``:
- a cold load in a fresh interpreter (imports, first load, peak RSS of that process);
- warm loads in this process (median and best of several);
- the Arrow memory the loaded table holds;
- reading the same trace back from parquet, and computing ``trace info``'s statistics.

Prints a table and writes one row to ``bench/out/bench_traces.parquet``. Run:
``.venv/bin/python bench/bench_traces.py``. Timings, not assertions: nothing here fails on speed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from kvtwin import __version__
from kvtwin.traces import schema
from kvtwin.traces.bundled import MOONCAKE_CONVERSATION, bundled_path
from kvtwin.traces.load import load_trace
from kvtwin.traces.stats import summarize

REPEATS = 7
OUT = Path(__file__).parent / "out" / "bench_traces.parquet"

_COLD = """
import json, resource, time
t0 = time.perf_counter()
from kvtwin.traces.load import load_trace
t1 = time.perf_counter()
table = load_trace({path!r})
t2 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "first_load_s": t2 - t1, "rows": table.num_rows,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def _cold(path: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _COLD.format(path=str(path))], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout)


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    path = bundled_path(MOONCAKE_CONVERSATION)
    cold = _cold(path)
    before = pa.total_allocated_bytes()
    table = load_trace(path)
    table_bytes = table.nbytes
    arrow_bytes = pa.total_allocated_bytes() - before
    warm = _timed(lambda: load_trace(path), REPEATS)
    with tempfile.TemporaryDirectory() as tmp:
        parquet_path = schema.write_parquet(table, Path(tmp) / "mooncake.parquet")
        parquet_bytes = parquet_path.stat().st_size
        parquet = _timed(lambda: schema.read_parquet(parquet_path), REPEATS)
    info = _timed(lambda: summarize(table), 3)
    row = {
        "kvtwin_version": __version__,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "cpu_count": os.cpu_count(),
        "trace": MOONCAKE_CONVERSATION,
        "source_bytes": path.stat().st_size,
        "requests": table.num_rows,
        "cold_import_s": cold["import_s"],
        "cold_first_load_s": cold["first_load_s"],
        "cold_peak_rss_bytes": cold["peak_rss_bytes"],
        "warm_load_median_s": statistics.median(warm),
        "warm_load_best_s": min(warm),
        "table_bytes": table_bytes,
        "arrow_allocated_bytes": arrow_bytes,
        "parquet_bytes": parquet_bytes,
        "parquet_read_median_s": statistics.median(parquet),
        "trace_info_median_s": statistics.median(info),
    }
    _print(row)
    _write(row)


def _print(row: dict) -> None:
    table = Table("measure", "value", title=f"kvtwin trace loading: {row['trace']} ({row['requests']:,} requests)")
    mib = 1 << 20
    table.add_row("source file", f"{row['source_bytes'] / mib:.2f} MiB")
    table.add_row("cold: import kvtwin.traces", f"{row['cold_import_s'] * 1e3:.0f} ms")
    table.add_row("cold: first load", f"{row['cold_first_load_s'] * 1e3:.0f} ms")
    table.add_row("cold: peak RSS of the process", f"{row['cold_peak_rss_bytes'] / mib:.0f} MiB")
    table.add_row(f"warm load, median of {REPEATS}", f"{row['warm_load_median_s'] * 1e3:.0f} ms")
    table.add_row("warm load, best", f"{row['warm_load_best_s'] * 1e3:.0f} ms")
    table.add_row("loaded table (Arrow buffers)", f"{row['table_bytes'] / mib:.2f} MiB")
    table.add_row("Arrow memory allocated by a load", f"{row['arrow_allocated_bytes'] / mib:.2f} MiB")
    table.add_row("as parquet (zstd)", f"{row['parquet_bytes'] / mib:.2f} MiB")
    table.add_row("read parquet back, median", f"{row['parquet_read_median_s'] * 1e3:.0f} ms")
    table.add_row("trace info statistics, median", f"{row['trace_info_median_s'] * 1e3:.0f} ms")
    Console().print(table)


def _write(row: dict) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_name(f".{OUT.name}.tmp")
    pq.write_table(pa.Table.from_pylist([row]), tmp)
    os.replace(tmp, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
