"""`kvtwin replay`: what a trace does to a serving config, in simulated time.

Reads a scenario (``scenarios/default.toml`` when none is given), applies command-line
overrides, plans the KV cache layout, replays the workload through the KV-cache core and
scheduler with the cost model as the clock, prints a summary table, and writes the run
directory (``reports/SCHEMA.md``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtwin import __version__
from kvtwin.console import user_errors
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.parse import Workload, load_scenario
from kvtwin.reports.run_dir import write_run
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import EngineConfig, plan as make_plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.traces.bundled import resolve


def replay(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="[SCENARIO.toml]",
                                                   help="Scenario file (default: scenarios/default.toml)."),
    trace: Optional[str] = typer.Option(None, "--trace", help="Replay this trace instead (a file or bundled:NAME)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model preset."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU preset."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel GPUs."),
    rate_scale: Optional[float] = typer.Option(None, "--rate-scale",
                                               help="Multiply the arrival rate (2 = twice as fast)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Replay only the first N requests."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Longest request (tokens)."),
    prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                                  help="Override the scenario's prefix caching."),
    time_limit_s: Optional[float] = typer.Option(None, "--time-limit-s", help="Stop at this simulated time."),
    out: Path = typer.Option(Path("runs/replay"), "--out", "-o", help="Run directory to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Replay a trace against vLLM's KV cache manager and scheduler in simulated time."""
    console = Console(stderr=True)
    with user_errors():
        path = scenario_path or DEFAULT_SCENARIO
        scenario = load_scenario(path)
        engine_fields = dict(scenario.engine_fields)
        overrides = {"tensor_parallel_size": tp, "max_model_len": max_model_len,
                     "enable_prefix_caching": prefix_caching}
        engine_fields.update({k: v for k, v in overrides.items() if v is not None})
        chosen_model = get_model(model) if model else scenario.model
        chosen_gpu = get_gpu(gpu) if gpu else scenario.gpu
        if chosen_model is None:
            raise ConfigError("model", "a [model] table in the scenario or --model", source=str(path))
        if chosen_gpu is None:
            raise ConfigError("hardware", "a [hardware] table in the scenario or --gpu", source=str(path))
        workload = scenario.workload
        if trace is not None:
            workload = Workload(trace=resolve(trace), transforms=workload.transforms if workload else {})
        if workload is None:
            raise ConfigError("workload", "a [workload] table in the scenario or --trace", source=str(path))
        transform = dict(workload.transforms)
        if rate_scale is not None:
            transform["rate_scale"] = rate_scale
        if limit is not None:
            transform["limit"] = limit
        workload = dataclasses.replace(workload, transforms=transform)

        planned = make_plan(chosen_model, chosen_gpu, EngineConfig(**engine_fields))
        if not planned.fits:
            raise ConfigError("model", f"a layout that fits: {chosen_model.name} on {chosen_gpu.name} leaves no "
                                       f"room for one max_model_len request (see kvtwin plan)", source=str(path))
        table = workload.load()
        last_arrival_s = float(table.column("arrival_time_s")[-1].as_py()) if table.num_rows else 0.0
        started = time.perf_counter()
        with Progress(TextColumn("[bold]replay"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=True, disable=quiet) as progress:
            task = progress.add_task("replay", total=max(last_arrival_s, 1e-9), info="")

            def on_progress(clock):
                progress.update(task, completed=min(clock.now_s, last_arrival_s),
                                info=f"t={clock.now_s:,.0f}s  {clock.arrived}/{table.num_rows} arrived  "
                                     f"{clock.finished} done  {clock.steps:,} steps")

            result = run_replay(planned, table, scheduler=scenario.scheduler, efficiency=scenario.efficiency,
                                slo=scenario.slo, time_limit_s=time_limit_s or scenario.time_limit_s,
                                on_progress=on_progress)
        wall_s = time.perf_counter() - started
        run_metadata = {
            "kvtwin_version": __version__,
            "scenario": path.read_text() if path.exists() else "",
            "scenario_file": path.name,
            "overrides": {"trace": trace, "model": model, "gpu": gpu, "rate_scale": rate_scale, "limit": limit,
                          **{k: v for k, v in overrides.items()}, "time_limit_s": time_limit_s},
        }
        paths = write_run(out, requests=result.requests, steps=result.steps, summary=result.summary,
                          plan=planned.to_json(), run_metadata=run_metadata)
    print_summary(result.summary.to_pylist()[0], title=f"{chosen_model.name} on {engine_fields.get('tensor_parallel_size', 1)}x "
                                                       f"{chosen_gpu.name}, {table.num_rows:,} requests")
    summary = result.summary.to_pylist()[0]
    last_arrival_s = float(table.column("arrival_time_s")[-1].as_py()) if table.num_rows else 0.0
    if summary["completed"] and summary["duration_s"] > 1.5 * max(last_arrival_s, 1.0):
        # The engine finished long after the last arrival: requests queued faster than it served.
        print(f"saturated: the last request arrived at {last_arrival_s:,.0f} s but the engine needed until "
              f"{summary['duration_s']:,.0f} s; try more GPUs (--tp), another --gpu or --model, or --rate-scale < 1")
    print(f"simulated {result.end_time_s:,.1f} s in {wall_s:,.1f} s wall; wrote {', '.join(p.name for p in paths)} "
          f"to {out}")


def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def print_summary(row: dict, title: str) -> None:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99", justify="right")
    for name, key in (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"),
                      ("E2E latency (ms)", "e2el_ms")):
        table.add_row(name, _fmt(row[f"mean_{key}"]), _fmt(row[f"median_{key}"]), _fmt(row[f"p90_{key}"]),
                      _fmt(row[f"p99_{key}"]))
    Console().print(table)
    facts = Table(show_header=False)
    facts.add_column("figure")
    facts.add_column("value", justify="right")
    for name, value in (
        ("requests completed / rejected / unfinished",
         f"{row['completed']:,} / {row['rejected']:,} / {row['unfinished']:,}"),
        ("simulated duration (s)", _fmt(row["duration_s"])),
        ("request throughput (req/s)", _fmt(row["request_throughput"], 3)),
        ("output / total token throughput (tok/s)",
         f"{_fmt(row['output_throughput'])} / {_fmt(row['total_token_throughput'])}"),
        ("prefix cache hit rate (tokens)", _fmt(row["prefix_cache_hit_rate"] * 100, 2) + " %"
         if not math.isnan(row["prefix_cache_hit_rate"]) else "-"),
        ("preemptions / recomputed tokens", f"{row['num_preemptions']:,} / {row['recomputed_tokens']:,}"),
        ("evicted cached blocks", _fmt(row["num_evictions"])),
        ("KV cache usage peak / mean", f"{row['kv_cache_usage_peak'] * 100:.1f} % / "
                                       f"{row['kv_cache_usage_mean'] * 100:.1f} %"),
        ("SLO attainment / goodput (req/s)", f"{_fmt(row['slo_attainment'] * 100, 1)} % / "
                                             f"{_fmt(row['request_goodput'], 3)}"
         if not math.isnan(row["slo_ttft_ms"]) or not math.isnan(row["slo_tpot_ms"]) else "no SLO set"),
    ):
        facts.add_row(name, value)
    Console().print(facts)
