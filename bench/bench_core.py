"""Speed of the KV-cache core and scheduler through the lockstep runner.

Replays every golden case and a generated workload of 2,000 requests with long shared
prefixes (full attention, and a hybrid full + sliding window + Mamba variant; each with
synchronous and asynchronous scheduling, the latter stepped by ``EngineCore.step_async``) and reports
steps per second and microseconds per ``allocate_slots`` call. The scheduler skips the call
for decode steps the KV cache manager already knows change nothing, so the per-call figure
averages the calls that do work; steps per second is the end-to-end figure (the fastest of
``--repeats`` runs, without the call timer, which runs once more on its own).

With the oracle venv present (``scripts/oracle/README.md``), vLLM 0.33's own scheduler and KV cache
manager replay the same golden cases in the same run (``scripts/oracle/time_vllm_cases.py``,
start-up not timed) and the table gives each case's speed ratio and the whole loop's
(target: kvtwin at least 4x faster). Offload cases need our connector harness and are not
compared. Prints a table and writes one parquet row per workload to
``bench/out/bench_core.parquet``.

    python bench/bench_core.py [--requests 2000] [--hash-algo builtin|sha256] [--seed 0]
                               [--repeats 3] [--vllm-python PATH] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from kvtwin import CORE_BUILD, __version__
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.lockstep.golden import CaseRequest, GoldenCase, load_case
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.lockstep.runner import run_case
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "cases"
ORACLE = ROOT.parent / "shared" / "oracle"
ORACLE_PYTHON = Path.home() / ".cache" / "kvtwin-oracle-venv" / "bin" / "python"
CORE_TARGET_VS_VLLM = 4.0


def shared_prefix_workload(num_requests: int, seed: int, hybrid: bool, hash_algo: str,
                           async_scheduling: bool = False) -> GoldenCase:
    """Chat traffic behind a few long system prompts (Zipf-popular), arriving a few per step."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(1024, 4096))] for _ in range(16)]
    weights = [1 / (i + 1) for i in range(len(system_prompts))]
    requests = []
    step = 0
    for i in range(num_requests):
        step += rng.choice((0, 0, 1, 1, 2))
        prefix = rng.choices(system_prompts, weights)[0]
        suffix = [rng.randrange(1000, 40000) for _ in range(rng.randrange(32, 512))]
        outputs = tuple(50000 + rng.randrange(10000) for _ in range(rng.randrange(16, 256)))
        requests.append(CaseRequest(f"g{i:05d}", step, tuple(prefix + suffix), outputs, 0))
    block = 16
    specs = [FullAttentionSpec(block_size=block)]
    if hybrid:
        specs += [SlidingWindowSpec(block_size=block, sliding_window=1024),
                  MambaSpec(block_size=block, shapes=((64, 64),), dtype_bytes=(2,), mamba_cache_mode="align")]
    groups = tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs))
    kv = KVCacheConfig(num_blocks=6000 * len(specs), groups=groups, hash_block_size=block)
    sched = SchedulerConfig(max_model_len=8192, max_num_seqs=128, max_num_batched_tokens=8192,
                            async_scheduling=async_scheduling)
    name = f"generated-{num_requests}-{'hybrid' if hybrid else 'full'}{'-async' if async_scheduling else ''}"
    return GoldenCase(name, kv, sched, CacheConfig(True, hash_algo), tuple(requests))


class AllocateTimer:
    """Counts allocate_slots calls and their total time by wrapping the method."""

    def __init__(self) -> None:
        self.calls = 0
        self.total_ns = 0
        self._original = KVCacheManager.allocate_slots

    def __enter__(self) -> "AllocateTimer":
        original, timer = self._original, self

        def timed(manager, *args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return original(manager, *args, **kwargs)
            finally:
                timer.total_ns += time.perf_counter_ns() - start
                timer.calls += 1

        KVCacheManager.allocate_slots = timed
        return self

    def __exit__(self, *exc) -> None:
        KVCacheManager.allocate_slots = self._original


def measure(case: GoldenCase, repeats: int) -> dict:
    elapsed_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_case(case)
        elapsed_s = min(elapsed_s, time.perf_counter() - start)
    with AllocateTimer() as timer:
        run_case(case)
    steps = len(result.steps)
    tokens = sum(sum(s["scheduled"].values()) for s in result.steps)
    return {
        "workload": case.name,
        "groups": "+".join(g.spec.kind for g in case.kv_cache_config.groups),
        "hash_algo": case.cache_config.prefix_caching_hash_algo,
        "requests": len(case.requests),
        "steps": steps,
        "scheduled_tokens": tokens,
        "hit_tokens": sum(a["hit_tokens"] for r in result.requests for a in r["admissions"]),
        "preemptions": sum(r["num_preemptions"] for r in result.requests),
        "wall_s": elapsed_s,
        "steps_per_s": steps / elapsed_s,
        "allocate_slots_calls": timer.calls,
        # None with the compiled core: its scheduler calls allocate_slots natively, past the timer.
        "us_per_allocate_slots": timer.total_ns / 1e3 / timer.calls if timer.calls else None,
    }


def vllm_seconds(python: Path, case_dirs: list[Path], repeats: int) -> dict[str, float]:
    """vLLM's own time per golden case (fastest of ``repeats``), in its oracle venv."""
    done = subprocess.run([str(python), str(ROOT / "scripts" / "oracle" / "time_vllm_cases.py"), "--oracle",
                           str(ORACLE), "--repeats", str(repeats), *map(str, case_dirs)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"bench_core: timing vLLM failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hash-algo", default=None,
                        help="hash every workload with this (default: each golden case its own, as vLLM does; "
                             "builtin for the generated ones)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", type=Path, default=ORACLE_PYTHON,
                        help="the oracle venv's python (vLLM 0.33)")
    parser.add_argument("--no-vllm", action="store_true", help="do not time vLLM")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_core.parquet")
    args = parser.parse_args()

    case_dirs = [d for d in sorted(GOLDEN.iterdir()) if d.is_dir()]
    cases = [load_case(d, hash_algo=args.hash_algo) for d in case_dirs]
    cases += [shared_prefix_workload(args.requests, args.seed, hybrid, args.hash_algo or "builtin", async_scheduling)
              for async_scheduling in (False, True) for hybrid in (False, True)]
    rows = []
    console = Console(width=150)
    with console.status("running") as status:
        for case in cases:
            status.update(f"running {case.name}")
            rows.append(measure(case, args.repeats))
        vllm: dict[str, float] = {}
        if not args.no_vllm and args.vllm_python.exists() and args.hash_algo is None:
            status.update("timing vLLM 0.33 on the golden cases")
            vllm = vllm_seconds(args.vllm_python, case_dirs, args.repeats)
    for row in rows:
        row["vllm_wall_s"] = vllm.get(row["workload"])
        row["speedup_vs_vllm"] = row["vllm_wall_s"] / row["wall_s"] if row["vllm_wall_s"] else None

    table = Table(title=f"kvtwin core, lockstep runner ({platform.python_implementation()} "
                        f"{platform.python_version()}, hash {args.hash_algo or 'as each case says'}, {CORE_BUILD.describe()})")
    for column in ("workload", "groups", "requests", "steps", "hit_tokens", "preemptions", "wall_s", "steps_per_s",
                   "us_per_allocate_slots", "vllm_wall_s", "x vllm"):
        table.add_column(column, justify="left" if column in ("workload", "groups") else "right")
    for row in rows:
        table.add_row(row["workload"], row["groups"], str(row["requests"]), str(row["steps"]), str(row["hit_tokens"]),
                      str(row["preemptions"]), f"{row['wall_s']:.3f}", f"{row['steps_per_s']:,.0f}",
                      f"{row['us_per_allocate_slots']:.1f}" if row["us_per_allocate_slots"] is not None else "n/a",
                      f"{row['vllm_wall_s']:.3f}" if row["vllm_wall_s"] else "",
                      f"{row['speedup_vs_vllm']:.1f}" if row["speedup_vs_vllm"] else "")
    console.print(table)
    compared = [row for row in rows if row["vllm_wall_s"]]
    if compared:
        ours_s = sum(row["wall_s"] for row in compared)
        theirs_s = sum(row["vllm_wall_s"] for row in compared)
        ratio = theirs_s / ours_s
        console.print(f"golden-case loop ({len(compared)} cases): kvtwin {ours_s:.2f} s, vLLM 0.33 {theirs_s:.2f} s: "
                      f"kvtwin {ratio:.1f}x faster (target >= {CORE_TARGET_VS_VLLM:g}x: "
                      f"{'met' if ratio >= CORE_TARGET_VS_VLLM else 'MISSED'})")
    else:
        console.print("vLLM not timed (no oracle venv at --vllm-python, --no-vllm, or --hash-algo given)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tbl = pa.Table.from_pylist(rows).replace_schema_metadata(
        {"kvtwin_version": __version__, "python": platform.python_version(), "machine": platform.machine()})
    tmp = args.out.with_name(args.out.name + ".tmp")
    pq.write_table(tbl, tmp)
    tmp.replace(args.out)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
