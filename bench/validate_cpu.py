"""Checks 1 and 2 of ``kvtwin validate`` on CPU across the layouts the tests cover.

For each toy layout of ``tests/executor/toys.py`` (full, sliding window, chunked local,
MLA, Mamba-2 with prefill checkpoints, Mamba-1, and sliding + full + Mamba-2), with a pool
tight enough to evict and preempt: the groups, the pool, what the run did (hits,
evictions, preemptions), the worst relative logit error against recomputing, both
verdicts and the wall time. Prints a table and writes ``bench/out/validate_cpu.parquet``
(``$OUT`` if set).

    python bench/validate_cpu.py [--requests 30] [--sync]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.executor.toys, the layouts the tests use

from kvtwin.executor.validate import ValidateOptions  # noqa: E402
from tests.executor.toys import KINDS, scenario, validate_with_runs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    args = parser.parse_args()
    rows = []
    options = ValidateOptions(checks=("prefix_hits_are_real", "predicted_hits_are_executed"))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            resolved = scenario(kind, Path(tmp), num_requests=args.requests, async_scheduling=not args.sync)
            plan = resolved.plan()
            started = time.perf_counter()
            validation, runs = validate_with_runs(resolved, options)
            wall_s = time.perf_counter() - started
            summary = runs["on"].result.summary.to_pylist()[0]
            errors = [r["observed"] for r in validation.rows
                      if r["metric"] == "max_relative_logit_error" and r["observed"] is not None]
            rows.append({
                "layout": kind,
                "groups": " ".join(f"{g.spec.kind}/{g.spec.block_size}" for g in plan.groups),
                "num_blocks": plan.num_blocks,
                "requests": summary["num_requests"],
                "hit_rate": summary["prefix_cache_hit_rate"],
                "evictions": summary["num_evictions"],
                "preemptions": summary["num_preemptions"],
                "worst_logit_error": max(errors, default=float("nan")),
                "check_1": validation.verdicts[0].status,
                "check_2": validation.verdicts[1].status,
                "wall_s": wall_s,
            })
    table = Table(title=f"validate checks 1-2 on CPU ({'sync' if args.sync else 'async'} scheduling)")
    for name in rows[0]:
        table.add_column(name, justify="left" if name in ("layout", "groups", "check_1", "check_2") else "right")
    for row in rows:
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    Console(width=200).print(table)
    out = Path(os.environ.get("OUT", ROOT / "bench" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "validate_cpu.parquet")
    print(f"wrote {out / 'validate_cpu.parquet'}")
    if any(r["check_1"] != "pass" or r["check_2"] != "pass" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
