"""Speed and memory of full replays, against the targets kvtwin holds itself to.

Each workload replays a whole bundled trace in a fresh process (so its peak RSS is its
own) and is reported with its wall time, that time as a ratio to a fixed pure-Python loop
timed in the same run (``reference_loop.py``, before and after: compare ratios across
machines and changes, since these machines are shared and wall seconds drift), engine
steps per second, peak RSS, and its target:

* ``mooncake``: the Mooncake conversation trace (12,031 requests) on one H100
  (``scenarios/mooncake-llama8b-h100-overload.toml``, 118k steps): at most 10 s and 400 MiB;
* ``azure-conv``: the Azure 2023 conversation trace (19,366 requests) with Llama-3.1-8B on
  an A100 80GB: at most 5 s, i.e. at least 7x faster than Vidur's 37.3 s on the same trace
  and machine kind (its plots off);
* ``default``: what ``kvtwin replay`` runs with no arguments (two replicas behind a router,
  1.6M steps): no target, reported so that its cost is seen;
* ``pd-2p1d``: disaggregated prefill/decode, two prefill and one decode replica on H100s
  over RDMA (``scenarios/mooncake-llama8b-h100-pd.toml``): no target, the cost of the P/D
  path (its connectors, the reads, the hand-overs).
* ``spec-eagle3``: the Mooncake trace with EAGLE-3 drafting (k = 3, prefix caching off;
  ``scenarios/mooncake-llama8b-h100-eagle3.toml``): no target. Decode windows stay closed
  with drafts on (``sim/core/decode_window.py`` counts one token per decode), so every
  batch is scheduled one by one: compare its steps per second with ``mooncake``'s (on the
  2-core development machine, compiled: 54k steps in 8.2 s, 6.6k steps/s, against
  ``mooncake``'s 118k steps in 7.2 s, 16.5k steps/s with decode windows).
* ``gemma3-swa``: Gemma-3-27B on two H100s, synthetic chat sessions
  (``scenarios/replay-gemma3-27b.toml``): no target, the cost of a hybrid layout of
  sliding-window and full-attention groups (decode windows price its windowed layers by
  class);
* ``qwen3-next``: Qwen3-Next-80B-A3B on four H200s, synthetic agent loops
  (``scenarios/replay-qwen3-next.toml``): no target, the cost of Mamba ("align") and
  full-attention groups in one pool.

  Both are lightly loaded (a few requests per batch), so the KV cache manager's own work
  weighs most. Instructions (callgrind, interpreted core, ``--limit 300``, start-up of
  about 4.0G subtracted): Gemma-3 11.46G scheduled batch by batch before hybrid windows,
  10.05G with windows, 8.78G with windows and the sliding-window managers' resumed
  leading-null count; Qwen3-Next 7.64G before, 7.29G with windows, 5.68G with the Mamba
  no-op horizon alone and 4.35G with both.
* ``offload`` and ``offload-none``: the whole Mooncake trace (not the scenario's first
  3,000 requests) on the bundled offload scenario (``scenarios/mooncake-llama8b-b200-offload.toml``,
  one replica on two B200s), with its 1 TB CPU tier and without one. The target is the
  ratio: an offload replay at most 1.5x the same replay without offload (``vs baseline``).
  Measured at 4.2x (2026-12-03). ``bench/experiments/README.md`` shows why no Python tier
  reaches the target: a minimal tier that still answers exactly costs 2.5x.

Writes one parquet row per workload to ``bench/out/bench_replay.parquet``.
``--no-decode-windows`` times the replays with every batch scheduled one by one (the same
results; ``sim/core/decode_window.py``), for before/after figures.

    python bench/bench_replay.py [--only NAME ...] [--scenario FILE [--gpu G] [--limit N]]
                                 [--no-decode-windows]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from kvtwin import CORE_BUILD, __version__
from kvtwin.scenarios import SCENARIOS_DIR

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from reference_loop import reference_seconds  # noqa: E402  (a sibling script, not a package)

VIDUR_AZURE_CONV_S = 37.3  # Vidur on the Azure conversation trace, same machine kind
WHOLE_TRACE = 1_000_000  # a limit above any bundled trace's length
BENCH_SCENARIOS = ROOT / "bench" / "data" / "scenarios"  # the bench's own deployments (absolute)


@dataclass(frozen=True)
class Workload:
    name: str
    scenario: str
    gpu: str | None = None
    target_wall_s: float | None = None
    target_rss_mib: float | None = None
    compare_s: float | None = None  # another tool's time on the same work
    limit: int | None = None  # requests to replay (None: the scenario's own limit)
    offload_cpu_bytes: int | None = None  # the CPU tier's size (None: the scenario's)
    baseline: str | None = None  # the workload this one's wall time is compared with
    target_vs_baseline: float | None = None


WORKLOADS = (
    Workload("mooncake", "mooncake-llama8b-h100-overload.toml", target_wall_s=10.0, target_rss_mib=400.0),
    Workload("azure-conv", "azure-conv-llama8b.toml", gpu="a100-80gb", target_wall_s=5.0,
             compare_s=VIDUR_AZURE_CONV_S),
    Workload("default", "default.toml"),
    Workload("pd-2p1d", "mooncake-llama8b-h100-pd.toml"),
    Workload("spec-eagle3", "mooncake-llama8b-h100-eagle3.toml"),
    Workload("gemma3-swa", "replay-gemma3-27b.toml"),
    Workload("qwen3-next", "replay-qwen3-next.toml"),
    Workload("offload-none", "mooncake-llama8b-b200-offload.toml", limit=WHOLE_TRACE, offload_cpu_bytes=0),
    Workload("offload", "mooncake-llama8b-b200-offload.toml", limit=WHOLE_TRACE, baseline="offload-none",
             target_vs_baseline=1.5),
    # Issue 41: a DP 16 + EP replay of the Mooncake hour (16 ranks stepping together) beside
    # one TP 8 engine's on the same trace (bench/data/scenarios).
    Workload("dsv3-tp8", str(BENCH_SCENARIOS / "mooncake-deepseek-v3-h200-tp8.toml"), limit=WHOLE_TRACE),
    Workload("dsv3-dp16-ep", str(BENCH_SCENARIOS / "mooncake-deepseek-v3-h200-dp16-ep.toml"), limit=WHOLE_TRACE,
             baseline="dsv3-tp8"),
)


def measure_one(scenario: Path, gpu: str | None, limit: int | None, decode_windows: bool = True,
                offload_cpu_bytes: int | None = None) -> dict:
    """Replay in this process; the figures as a dict (run by the parent in a child)."""
    from kvtwin.sim.replay.run import run_replay
    from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

    started = time.perf_counter()
    offload = {} if offload_cpu_bytes is None else {"cpu_bytes": offload_cpu_bytes}
    resolved = resolve_scenario(scenario, Overrides(gpu=gpu, limit=limit, offload=offload))
    planned = resolved.plan()
    trace = resolved.require_workload().load()
    loaded = time.perf_counter()
    result = run_replay(planned, trace, deployment=resolved.deployment, efficiency=resolved.efficiency,
                        slo=resolved.slo, time_limit_s=resolved.time_limit_s, offload=resolved.offload_for(planned),
                        decode_windows=decode_windows, disaggregation=resolved.disaggregation,
                        speculative=resolved.speculative)
    finished = time.perf_counter()
    summary = result.summary.to_pylist()[0]
    return {"requests": trace.num_rows, "steps": result.steps.num_rows, "simulated_s": result.end_time_s,
            "load_and_plan_s": loaded - started, "replay_wall_s": finished - loaded,
            "total_wall_s": finished - started,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"]}


def _in_child(scenario: Path, gpu: str | None, limit: int | None, decode_windows: bool,
              offload_cpu_bytes: int | None = None) -> dict:
    command = [sys.executable, __file__, "--child", str(scenario)]
    if not decode_windows:
        command.append("--no-decode-windows")
    if offload_cpu_bytes is not None:
        command += ["--offload-cpu-bytes", str(offload_cpu_bytes)]
    if gpu:
        command += ["--gpu", gpu]
    if limit:
        command += ["--limit", str(limit)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_replay: {scenario.name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"{'met' if value <= target else 'MISSED'} (<= {target:g})"


def _vs_baseline(row: dict) -> str:
    ratio = row["vs_baseline"]
    if ratio is None:
        return ""
    target = row["target_vs_baseline"]
    verdict = "" if target is None else f" {'met' if ratio <= target else 'MISSED'} (<= {target:g}x)"
    return f"{ratio:.1f}x {row['baseline']}{verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[w.name for w in WORKLOADS], help="run only these workloads")
    parser.add_argument("--scenario", type=Path, help="time this scenario instead of the workloads above")
    parser.add_argument("--gpu", help="with --scenario: the GPU preset")
    parser.add_argument("--limit", type=int, help="with --scenario: replay only the first N requests")
    parser.add_argument("--no-decode-windows", action="store_true",
                        help="schedule every batch one by one (the same results, for before/after timings)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--offload-cpu-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_replay.parquet")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_one(args.child, args.gpu, args.limit, not args.no_decode_windows,
                                     args.offload_cpu_bytes)))
        return

    if args.scenario:
        workloads = [Workload(args.scenario.stem, str(args.scenario.resolve()), gpu=args.gpu)]
    else:
        workloads = [w for w in WORKLOADS if not args.only or w.name in args.only]
    reference_before_s = reference_seconds()
    measured = [(w, _in_child(SCENARIOS_DIR / w.scenario, w.gpu, args.limit if args.scenario else w.limit,
                              not args.no_decode_windows, w.offload_cpu_bytes))
                for w in workloads]
    wall_s = {w.name: m["replay_wall_s"] for w, m in measured}
    reference_s = min(reference_before_s, reference_seconds())

    table = Table(title=f"kvtwin replay bench ({platform.python_implementation()} {platform.python_version()}, "
                        f"{CORE_BUILD.describe()}, {'no ' if args.no_decode_windows else ''}decode windows, "
                        f"reference loop {reference_s:.3f} s)")
    for column in ("workload", "requests", "steps", "replay wall s", "x reference", "steps/s", "peak RSS MiB",
                   "wall target", "RSS target", "vs other tool", "vs baseline"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    rows = []
    for w, m in measured:
        row = {"workload": w.name, "scenario": Path(w.scenario).name, "gpu": w.gpu or "", **m,
               "reference_loop_s": reference_s, "replay_vs_reference": m["replay_wall_s"] / reference_s,
               "steps_per_wall_s": m["steps"] / m["replay_wall_s"],
               "target_wall_s": w.target_wall_s, "target_rss_mib": w.target_rss_mib,
               "speedup_vs_other": w.compare_s / m["replay_wall_s"] if w.compare_s else None,
               "core": CORE_BUILD.describe(), "decode_windows": not args.no_decode_windows,
               "baseline": w.baseline,
               "vs_baseline": m["replay_wall_s"] / wall_s[w.baseline] if w.baseline in wall_s else None,
               "target_vs_baseline": w.target_vs_baseline}
        rows.append(row)
        table.add_row(w.name, f"{m['requests']:,}", f"{m['steps']:,}", f"{m['replay_wall_s']:.2f}",
                      f"{row['replay_vs_reference']:.1f}", f"{row['steps_per_wall_s']:,.0f}",
                      f"{m['peak_rss_mib']:,.0f}", _verdict(m["replay_wall_s"], w.target_wall_s),
                      _verdict(m["peak_rss_mib"], w.target_rss_mib),
                      f"{row['speedup_vs_other']:.1f}x (Vidur {w.compare_s:g} s)" if w.compare_s else "",
                      _vs_baseline(row))
    Console(width=200).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = pa.Table.from_pylist(rows).replace_schema_metadata({"kvtwin_version": __version__,
                                                             "machine": platform.machine()})
    tmp = args.out.with_name(args.out.name + ".tmp")
    pq.write_table(out, tmp)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
