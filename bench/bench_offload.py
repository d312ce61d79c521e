"""What the offload connector costs the core: the same workload with the CPU tier off and on.

A generated chat workload (long Zipf-popular system prompts, bench_core's generator) on a
GPU pool too small to keep the prefixes, stepped by the lockstep runner (the engine every
clock drives) with no tier, and with a CPU tier (lru and arc) that holds them; loads and
stores finish one step after they are issued. Reports wall time, steps per second, the
GPU and CPU hit tokens, and each run's wall time over a fixed pure-Python reference loop
timed in the same process (``bench/reference_loop.py``), which is the figure to compare
across machines. Writes one parquet row per run to ``bench/out/bench_offload.parquet``.

    python bench/bench_offload.py [--requests 600] [--cpu-chunks 40000] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import shared_prefix_workload  # noqa: E402  (sibling scripts, not a package)
from reference_loop import reference_seconds  # noqa: E402

from kvtwin.sim.lockstep.golden import CaseOffload  # noqa: E402
from kvtwin.sim.lockstep.runner import run_case  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def measure(case, label: str, reference_s: float) -> dict:
    start = time.perf_counter()
    result = run_case(case)
    wall_s = time.perf_counter() - start
    admissions = [a for r in result.requests for a in r["admissions"]]
    external = sum(a.get("external_tokens", 0) for a in admissions)
    return {
        "workload": case.name, "tier": label, "requests": len(case.requests), "steps": len(result.steps),
        "gpu_hit_tokens": sum(a["hit_tokens"] for a in admissions) - external, "cpu_hit_tokens": external,
        "cpu_evictions": sum(s.get("offload", {}).get("evicted", 0) for s in result.steps),
        "wall_s": wall_s, "steps_per_s": len(result.steps) / wall_s, "reference_loop_s": reference_s,
        "run_vs_reference": wall_s / reference_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--cpu-chunks", type=int, default=40000)
    parser.add_argument("--gpu-blocks", type=int, default=3000, help="GPU blocks per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_offload.parquet")
    args = parser.parse_args()
    rows = []
    console = Console(width=160)
    reference_s = reference_seconds()
    for hybrid in (False, True):
        case = shared_prefix_workload(args.requests, args.seed, hybrid, "builtin")
        groups = len(case.kv_cache_config.groups)
        case = dataclasses.replace(case, kv_cache_config=dataclasses.replace(
            case.kv_cache_config, num_blocks=args.gpu_blocks * groups))
        variants = [("off", case)] + [(f"cpu {policy}", dataclasses.replace(
            case, offload=CaseOffload(args.cpu_chunks, policy, 1, 1))) for policy in ("lru", "arc")]
        for label, variant in variants:
            with console.status(f"running {variant.name} ({label})"):
                rows.append(measure(variant, label, reference_s))
    reference_s = min(reference_s, reference_seconds())
    for row in rows:
        row["reference_loop_s"] = reference_s
        row["run_vs_reference"] = row["wall_s"] / reference_s
    table = Table(title="offload off vs on (lockstep runner)")
    columns = ("workload", "tier", "steps", "gpu_hit_tokens", "cpu_hit_tokens", "cpu_evictions", "wall_s",
               "steps_per_s", "run_vs_reference")
    for column in columns:
        table.add_column(column, justify="left" if column in ("workload", "tier") else "right")
    for row in rows:
        table.add_row(*(f"{row[c]:,.2f}" if isinstance(row[c], float) else f"{row[c]:,}" if isinstance(row[c], int)
                        else row[c] for c in columns))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.out)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
