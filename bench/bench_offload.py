"""What KV offloading costs to simulate: the same runs with the CPU tier off and on.

Two parts. (1) The replay: the bundled offload scenario
(``scenarios/mooncake-llama8b-b200-offload.toml``, its first ``--limit`` Mooncake
requests) replayed with no tier and with its CPU tier under lru and arc (the SimPy clock,
the cost model, PCIe transfers). (2) The core alone: a generated chat workload (long
Zipf-popular system prompts, bench_core's generator) on a GPU pool too small to keep the
prefixes, stepped by the lockstep runner with no tier and with a CPU tier (lru and arc);
loads and stores finish one step after they are issued. Reports wall time, steps per
second, GPU and CPU hits, and each run's wall time over a fixed pure-Python reference loop
timed in the same process (``bench/reference_loop.py``): compare that ratio across
machines. Writes one parquet row per run to ``bench/out/bench_offload.parquet``.

    python bench/bench_offload.py [--limit 1000] [--requests 600] [--cpu-chunks 40000] [--seed 0]
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

from kvtwin.scenarios import SCENARIOS_DIR  # noqa: E402
from kvtwin.sim.lockstep.golden import CaseOffload  # noqa: E402
from kvtwin.sim.lockstep.runner import run_case  # noqa: E402
from kvtwin.sim.replay.run import run_replay  # noqa: E402
from kvtwin.sim.scenario.resolve import resolve_scenario  # noqa: E402
from kvtwin.traces import transforms  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = SCENARIOS_DIR / "mooncake-llama8b-b200-offload.toml"


def measure_replay(limit: int, policy: str | None, reference_s: float) -> dict:
    """The offload scenario's first ``limit`` requests; ``policy`` None: no tier."""
    scenario = resolve_scenario(SCENARIO)
    trace = transforms.limit(scenario.workload.load(), limit)
    planned = scenario.plan()
    config = scenario.offload if policy is None else dataclasses.replace(scenario.offload, policy=policy)
    offload = None if policy is None else config.resolve(planned)
    start = time.perf_counter()
    result = run_replay(planned, trace, deployment=scenario.deployment, efficiency=scenario.efficiency,
                        slo=scenario.slo, offload=offload)
    wall_s = time.perf_counter() - start
    summary = result.summary.to_pylist()[0]
    prompt = sum(result.requests.column("prompt_tokens").to_pylist())
    gpu = summary.get("gpu_hit_tokens")
    if gpu is None:  # no tier: the first admissions' prefix-cache hits
        gpu = sum(h for h in result.requests.column("prefix_hit_tokens").to_pylist() if h)
    return {
        "workload": f"replay {SCENARIO.stem} ({trace.num_rows} requests)",
        "tier": "off" if policy is None else f"cpu {policy} ({config.cpu_bytes / 1e9:,.0f} GB)",
        "requests": trace.num_rows, "steps": result.steps.num_rows, "gpu_hit_tokens": int(gpu),
        "cpu_hit_tokens": int(summary.get("cpu_hit_tokens") or 0),
        "cpu_evictions": int(summary.get("offload_cpu_evicted_keys") or 0),
        "hit_rate_total": (gpu + (summary.get("cpu_hit_tokens") or 0)) / prompt,
        "p99_ttft_ms": summary["p99_ttft_ms"], "wall_s": wall_s, "steps_per_s": result.steps.num_rows / wall_s,
        "reference_loop_s": reference_s, "run_vs_reference": wall_s / reference_s,
    }


def measure_core(case, label: str, reference_s: float) -> dict:
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
    parser.add_argument("--limit", type=int, default=1000, help="Mooncake requests in the replay part")
    parser.add_argument("--requests", type=int, default=600, help="generated requests in the core part")
    parser.add_argument("--cpu-chunks", type=int, default=40000)
    parser.add_argument("--gpu-blocks", type=int, default=3000, help="GPU blocks per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_offload.parquet")
    args = parser.parse_args()
    rows = []
    console = Console(width=160)
    reference_s = reference_seconds()
    for policy in (None, "lru", "arc"):
        with console.status(f"replaying {SCENARIO.name} ({policy or 'no tier'})"):
            rows.append(measure_replay(args.limit, policy, reference_s))
    for hybrid in (False, True):
        case = shared_prefix_workload(args.requests, args.seed, hybrid, "builtin")
        groups = len(case.kv_cache_config.groups)
        case = dataclasses.replace(case, kv_cache_config=dataclasses.replace(
            case.kv_cache_config, num_blocks=args.gpu_blocks * groups))
        variants = [("off", case)] + [(f"cpu {policy}", dataclasses.replace(
            case, offload=CaseOffload(args.cpu_chunks, policy, 1, 1))) for policy in ("lru", "arc")]
        for label, variant in variants:
            with console.status(f"running {variant.name} ({label})"):
                rows.append(measure_core(variant, label, reference_s))
    reference_s = min(reference_s, reference_seconds())
    for row in rows:
        row["reference_loop_s"] = reference_s
        row["run_vs_reference"] = row["wall_s"] / reference_s
    table = Table(title="offload off vs on (lockstep runner)")
    columns = ("workload", "tier", "steps", "gpu_hit_tokens", "cpu_hit_tokens", "cpu_evictions", "wall_s",
               "steps_per_s", "run_vs_reference")
    for row in rows:
        row.setdefault("hit_rate_total", None)
        row.setdefault("p99_ttft_ms", None)
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
