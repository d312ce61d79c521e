"""`kvtwin replay`: what a trace does to a serving config, in simulated time.

Reads a scenario (``scenarios/default.toml`` when none is given), applies command-line
overrides, plans the KV cache layout, replays the workload through the KV-cache core and
scheduler with the cost model as the clock, prints a summary table, and writes the run
directory (``reports/SCHEMA.md``) with its ``report.html`` (unless ``--no-report``).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import List, Optional

import typer

from kvtwin.commands.presets import GPU_CHOICES, MODEL_CHOICES
from kvtwin.knob_options import knob_flags
from kvtwin.console import PLAIN_PROGRESS_EVERY_S, interrupt_note, progress_display, report_trace_notes, user_errors
from kvtwin.reports import summary_text
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.bundled import find_scenario
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.trace_options import given_options, reading_option


@knob_flags("engine.tensor_parallel_size", "engine.replicas", "engine.router", "engine.all2all_backend",
            "workload.rate_scale", "workload.limit", "engine.max_model_len",
            "engine.enable_prefix_caching", "engine.prefix_cache_retention_interval", "run.time_limit_s",
            "offload.cpu_bytes", "offload.policy",
            "offload.disk_bytes", "offload.disk_bandwidth_bytes_per_s", "offload.disk_latency_s",
            "speculative.method", "speculative.num_speculative_tokens", "speculative.acceptance")
def replay(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="SCENARIO.toml",
                                                   help="Scenario file, or a bundled scenario's name (kvtwin "
                                                        "scenarios; default: default)."),
    trace: Optional[str] = typer.Option(None, "--trace", help="Replay this trace instead (a file or bundled:NAME)."),
    fmt: Optional[str] = reading_option("format"),
    maps: Optional[List[str]] = reading_option("map", metavar="COLUMN=SOURCE"),
    time_unit: Optional[str] = reading_option("time_unit"),
    hash_block_tokens: Optional[int] = reading_option("hash_block_tokens"),
    per_block: bool = reading_option("per_block_hashes", False),
    arrivals: Optional[str] = reading_option("arrivals"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=f"Model preset: {MODEL_CHOICES}."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help=f"GPU preset: {GPU_CHOICES}."),
    knobs: Optional[dict] = None,
    out: Path = typer.Option(Path("runs/replay"), "--out", "-o", help="Run directory to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
    no_report: bool = typer.Option(False, "--no-report", help="Do not write report.html into the run directory."),
) -> None:
    """Replay a trace against vLLM's KV cache manager and scheduler in simulated time."""
    # Loaded here, not with the command line: the simulator pulls in pyarrow, numpy and SimPy.
    from kvtwin.reports.run_dir import check_out_dir, run_metadata, write_run

    seen = {"now_s": None, "replaying": False, "out_existed": out.exists()}
    with user_errors(), interrupt_note(lambda: _interrupted_before_writing(seen, out)):
        # Before anything slow: a bad --out must not cost a whole simulation.
        check_out_dir(out)
        path = find_scenario(scenario_path) or DEFAULT_SCENARIO
        reading = given_options(fmt=fmt, maps=maps, time_unit=time_unit, hash_block_tokens=hash_block_tokens,
                                per_block=per_block, arrivals=arrivals)
        overrides = Overrides.from_knobs(knobs or {}, model=model, gpu=gpu, trace=trace, trace_options=reading)
        resolved = resolve_scenario(path, overrides)
        chosen_model, chosen_gpu = resolved.model, resolved.gpu
        workload = resolved.require_workload()
        planned = resolved.plan()
        planned.require_fits()  # before the trace is read
        resolved.require_host_memory(planned)  # and before any block pool is built
        # The simulator (SimPy, the recorder: most of a second) loads once the input is good.
        from kvtwin.sim.calibration.band import band_lines
        from kvtwin.sim.replay.run import run_replay

        offload = resolved.offload_for(planned)
        table = workload.load()
        report_trace_notes(table)
        started = time.perf_counter()
        seen["replaying"] = True
        with _progress(table.num_rows, quiet, started, seen) as on_progress:
            result = run_replay(planned, table, deployment=resolved.deployment, efficiency=resolved.efficiency,
                                slo=resolved.slo, time_limit_s=resolved.time_limit_s, on_progress=on_progress,
                                offload=offload, disaggregation=resolved.disaggregation,
                                speculative=resolved.speculative, calibration=resolved.calibration)
        wall_s = time.perf_counter() - started
        metadata = run_metadata(path, overrides.given(), resolved.describe())
        plan_json = planned.to_json()
        text_files = None
        if not no_report:
            # Rendered from the tables in memory and written in the same directory swap.
            from kvtwin.reports.replay_report import render_replay_report

            text_files = {"report.html": render_replay_report(result.requests, result.steps, result.summary,
                                                              plan_json, metadata, replicas=result.replicas)}
        paths = write_run(out, requests=result.requests, steps=result.steps, summary=result.summary,
                          plan=plan_json, run_metadata=metadata, extra_tables={"replicas": result.replicas},
                          text_files=text_files)
    with interrupt_note(lambda: f"interrupted while printing the summary; {out} was written whole"):
        summary = result.summary.to_pylist()[0]
        print_summary(summary, title=f"{summary_text.run_headline(metadata['resolved'])}, {table.num_rows:,} requests")
        print(summary_text.plan_line(planned) + (" per replica" if resolved.deployment.replicas > 1 else ""))
        for line in band_lines(summary, resolved.calibration):
            print(line)
        for line in (summary_text.replicas_line(summary, result.replicas), summary_text.offload_line(summary),
                     summary_text.spec_line(summary), summary_text.rejections_line(summary),
                     summary_text.not_arrived_line(summary),
                     summary_text.saturation_hint(summary)):
            if line:
                print(line)
        print(f"simulated {summary_text.format_duration_s(result.end_time_s)} in {wall_s:,.1f} s wall; wrote "
              f"{', '.join(p.name for p in paths)} to {out}")
        print(summary_text.slo_verdict(summary))




def _interrupted_before_writing(seen: dict, out: Path) -> str:
    if seen["now_s"] is not None:
        where = f"at t={seen['now_s']:,.0f} s simulated"
    else:
        where = "early in the replay" if seen["replaying"] else "before the replay started"
    left = f"{out} left as it was" if seen["out_existed"] else f"{out} not created"
    return f"interrupted {where}; nothing written, {left}"


def _progress_text(clock, total: int) -> str:
    done = clock.finished + clock.rejected
    return (f"{done:,}/{total:,} requests done ({clock.rejected:,} rejected), {clock.arrived:,} arrived, "
            f"t={clock.now_s:,.0f} s simulated, {clock.steps:,} steps")


@contextlib.contextmanager
def _progress(total: int, quiet: bool, started: float, seen: dict):
    """Yield the replay's ``on_progress``. The bar counts requests done (finished or
    rejected), not simulated time: time runs past the last arrival for as long as the
    queue takes to drain."""
    state = {"clock": None}

    def info() -> str:
        clock = state["clock"]
        return f"done, t={clock.now_s:,.0f} s" + (f", {clock.rejected:,} rejected" if clock.rejected else "")

    with progress_display("replay", total, quiet=quiet, started=started,
                          done=lambda: state["clock"].finished + state["clock"].rejected,
                          line=lambda: _progress_text(state["clock"], total), info=info,
                          every_s=lambda: PLAIN_PROGRESS_EVERY_S) as update:
        def on_progress(clock):
            seen["now_s"] = clock.now_s
            state["clock"] = clock
            update()

        yield on_progress


def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def print_summary(row: dict, title: str) -> None:
    from rich.console import Console  # rich's tables load only when there is a summary to print
    from rich.table import Table

    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("mean", justify="right")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99", justify="right")
    for name, key in summary_text.latency_rows(row):
        table.add_row(name, *(summary_text.format_duration_ms(row.get(f"{stat}_{key}"))
                              for stat in ("mean", "median", "p90", "p99")))
    Console().print(table)
    facts = Table(show_header=False)
    facts.add_column("figure")
    facts.add_column("value", justify="right")
    has_slo = not math.isnan(row["slo_ttft_ms"]) or not math.isnan(row["slo_tpot_ms"])
    for name, value in (
        ("completed / rejected / unfinished",
         f"{row['completed']:,} / {row['rejected']:,} / {row['unfinished']:,}"),
        ("simulated duration", summary_text.format_duration_s(row["duration_s"])),
        ("request throughput (req/s)", _fmt(row["request_throughput"], 3)),
        ("output / all tokens per s",
         f"{_fmt(row['output_throughput'])} / {_fmt(row['total_token_throughput'])}"),
        ("prefix cache hit rate (tokens)" if row.get("hit_rate_total") is None
         else "prefix hits, all tiers (tokens)", summary_text.prefix_line(row)),
        ("preemptions / recomputed tokens", f"{row['num_preemptions']:,} / {row['recomputed_tokens']:,}"),
        ("evicted cached blocks", _fmt(row["num_evictions"])),
        ("KV cache usage peak / mean", f"{summary_text.format_percent(row['kv_cache_usage_peak'])} / "
                                       f"{summary_text.format_percent(row['kv_cache_usage_mean'])}"),
        ("SLO: TTFT (as a client sees it) / TPOT at most",
         f"{summary_text.format_duration_ms(row['slo_ttft_ms'])} / "
         f"{summary_text.format_duration_ms(row['slo_tpot_ms'])}" if has_slo else "no SLO set"),
        ("SLO attainment (all requests) / rejected",
         f"{summary_text.format_percent(row['slo_attainment'])} / "
         f"{summary_text.format_percent(row['rejected_share'])}" if has_slo else "-"),
        ("goodput (req/s within the SLO)", _fmt(row["request_goodput"], 3) if has_slo else "-"),
    ):
        facts.add_row(name, value)
    Console().print(facts)
