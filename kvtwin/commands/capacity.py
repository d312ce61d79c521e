"""`kvtwin capacity`: a scenario swept over settings, and the largest rate each point holds.

Parses the flags, checks them all before the first replay (the sweep keys and each value
through the scenario rules, the out directory, the backend), runs the points
(``kvtwin.sim.replay.capacity_sweep``), prints one row per point and writes ``capacity.parquet``
(and ``hit_curve.parquet`` with ``--hit-curve``, ``kvtwin.sim.replay.reuse_curve``) into
the capacity directory, whole.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import List, Optional

import typer

from kvtwin.console import PLAIN_PROGRESS_EVERY_S, interrupt_note, progress_display, user_errors
from kvtwin.knob_options import number_option
from kvtwin.reports import summary_text
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.bundled import find_scenario
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.rate_search import DEFAULT_MAX_REPLAYS, DEFAULT_RATE_TOLERANCE, RateSearch


def capacity(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="SCENARIO.toml",
                                                   help="Scenario file, or a bundled scenario's name (kvtwin "
                                                        "scenarios; default: default)."),
    sweeps: List[str] = typer.Option([], "--sweep", metavar="KEY=V1,V2,...",
                                     help="Sweep a scenario key (engine.<field>, hardware.gpu, model.preset, "
                                          "workload.rate_scale, workload.limit, slo.ttft_s, slo.tpot_s, "
                                          "cost_model.<field>, offload.<field>); repeatable: the points are "
                                          "the product."),
    find_max_rate: bool = typer.Option(False, "--find-max-rate",
                                       help="Per point, search the largest workload.rate_scale that holds the SLO."),
    load_curve: Optional[str] = typer.Option(None, "--load-curve", metavar="R1,R2,...|LO:HI:N",
                                             help="Per point, replay at each offered rate (requests/s; LO:HI:N "
                                                  "spaces N rates geometrically): throughput, latencies and the "
                                                  "knee (docs/capacity.md#load-curve)."),
    target_rate: Optional[float] = number_option("--target-rate", kind="float", default=None,
                                                 help="Requests/s to size replicas for (with --find-max-rate)."),
    rate_tolerance: float = number_option("--rate-tolerance", kind="float", default=DEFAULT_RATE_TOLERANCE,
                                          help="Relative tolerance of the rate search."),
    goodput: Optional[float] = number_option("--goodput", kind="float", default=None,
                                             help="SLO holds when this fraction of the requests admitted "
                                                  "(not rejected) meets it (default: p99 TTFT and p99 TPOT "
                                                  "within the SLO)."),
    max_replays: int = number_option("--max-replays", kind="int", default=DEFAULT_MAX_REPLAYS,
                                     help="Most replays per point in the rate search."),
    hit_curve: bool = typer.Option(False, "--hit-curve",
                                   help="Also write hit_curve.parquet: LRU hit rate against KV cache size."),
    jobs: Optional[int] = number_option("--jobs", "-j", kind="int", default=None,
                                        help="Points run at once (default: CPUs)."),
    backend: str = typer.Option("process", "--backend", help="process (a local pool) or ray."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Join this Ray cluster."),
    limit: Optional[int] = number_option("--limit", kind="int", default=None,
                                         help="Replay only the first N requests per point; with --find-max-rate, the "
                                              "time they span, at every rate tried (docs/capacity.md)."),
    out: Path = typer.Option(Path("runs/capacity"), "--out", "-o", help="Capacity directory to write."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
    no_report: bool = typer.Option(False, "--no-report", help="Do not write report.html into the directory."),
) -> None:
    """Sweep a scenario over settings; with --find-max-rate, the largest rate each point holds."""
    # The sweep machinery loads here, not with the command line: other commands never need it.
    from kvtwin.reports.run_dir import check_out_dir, run_metadata, write_dir
    from kvtwin.sim.replay.capacity_sweep import hit_curve as make_hit_curve, prepare_sweep
    from kvtwin.sim.replay.capacity_table import capacity_table
    from kvtwin.sim.replay.sweep_backends import check_backend, default_jobs, import_ray, run_points

    out_existed = out.exists()
    with user_errors(), interrupt_note(lambda: f"interrupted; nothing written, "
                                               f"{out} {'left as it was' if out_existed else 'not created'}"):
        check_out_dir(out)
        check_backend(backend, jobs, ray_address)
        search = _rate_search(find_max_rate, target_rate, rate_tolerance, goodput, max_replays)
        curve = None
        if load_curve is not None:
            from kvtwin.sim.replay.load_curve import parse_load_curve  # its columns' types load pyarrow

            curve = parse_load_curve(load_curve)
        if backend == "ray":
            import_ray()  # before any work: say now that it is missing
        path = find_scenario(scenario_path) or DEFAULT_SCENARIO
        sweep = prepare_sweep(path, sweeps, limit=limit, search=search, load_curve=curve)
        workers = jobs if jobs is not None else default_jobs(len(sweep.tasks))
        started = time.perf_counter()
        with _progress(len(sweep.tasks), quiet, started) as on_done:
            rows = run_points(sweep.tasks, jobs=workers, backend=backend, ray_address=ray_address, on_done=on_done)
        table = capacity_table(rows, sweep.points, sweep.axes, find_max_rate=search is not None,
                               load_curve=curve is not None)
        tables = {"capacity": table}
        comparison = []
        if hit_curve:
            tables["hit_curve"], comparison = make_hit_curve(sweep.base, rows)
        wall_s = time.perf_counter() - started
        metadata = run_metadata(path, _given(sweeps, limit, search, curve))
        text_files = None if no_report else {"report.html": _report(table, tables.get("hit_curve"), metadata, sweep)}
        paths = write_dir(out, tables=tables, text_files=text_files, run_metadata=metadata)
    with interrupt_note(lambda: f"interrupted while printing; {out} was written whole"):
        _print_results(table, sweep, comparison)
        failed = sum(1 for r in rows if r["status"] != "ok")
        print(f"{len(rows)} points ({failed} failed) in {wall_s:,.1f} s wall; wrote "
              f"{', '.join(p.name for p in paths)} to {out}")


def _given(sweeps, limit: int | None, search, curve) -> dict:
    """The command line's settings, as the run metadata records them."""
    given = {"sweep": list(sweeps), "find_max_rate": search is not None, "limit": limit}
    if curve is not None:
        given["load_curve"] = list(curve.rates_per_s)
    if search is not None:
        given.update(rate_tolerance=search.tolerance, goodput=search.goodput, max_replays=search.max_replays,
                     target_rate=search.target_rate)
    return given


def _print_results(table, sweep, comparison) -> None:
    """The points' table, the load curve's knees, the clocks and the hit curve's comparison."""
    from kvtwin.sim.calibration.band import CLOCK_COLUMNS, points_clocks

    searched = sweep.search is not None
    print_points(table, sweep.axes, searched)
    if sweep.load_curve is not None:
        from kvtwin.sim.replay.load_curve import knee_lines

        for line in knee_lines(table.to_pylist(), [a.key.key for a in sweep.axes]):
            print(line)
    for _, line in points_clocks(table.select(["point", *CLOCK_COLUMNS]).to_pylist(), slow_edge=searched):
        print(line)
    for blocks, predicted, hit in comparison:
        print(f"hit curve at {blocks:,} blocks: {summary_text.format_percent(predicted)} "
              f"(replay: {summary_text.format_percent(hit)})")


def _rate_search(find_max_rate: bool, target_rate: float | None, tolerance: float, goodput: float | None,
                 max_replays: int) -> RateSearch | None:
    """The ``--find-max-rate`` settings, checked (None: no search, and none of its flags)."""
    if not find_max_rate:
        if target_rate is not None or goodput is not None:
            raise ConfigError("--target-rate" if target_rate is not None else "--goodput", "--find-max-rate with it",
                              target_rate if target_rate is not None else goodput)
        return None
    search = RateSearch(tolerance=tolerance, goodput=goodput, max_replays=max_replays, target_rate=target_rate)
    search.check()
    return search


def _report(table, hit_table, metadata: dict, sweep) -> str:
    """``report.html``, rendered from the tables in memory and written in the same directory swap."""
    from kvtwin.reports.capacity_report import render_capacity_report

    planned = sweep.base.plan()
    return render_capacity_report(table, hit_table, metadata, planned.to_json() if planned.fits else None)


@contextlib.contextmanager
def _progress(total: int, quiet: bool, started: float):
    """Yield ``on_done(row)``: a bar over points on a terminal, a line every few seconds in a log."""
    count = {"done": 0, "failed": 0}

    def line() -> str:
        return f"{count['done']:,}/{total:,} points done ({count['failed']:,} failed)"

    def info() -> str:
        return f"points, {count['failed']:,} failed" if count["failed"] else "points"

    with progress_display("capacity", total, quiet=quiet, started=started, done=lambda: count["done"], line=line,
                          info=info, every_s=lambda: PLAIN_PROGRESS_EVERY_S) as update:
        def on_done(row: dict) -> None:
            count["done"] += 1
            count["failed"] += row["status"] != "ok"
            update(final=count["done"] == total)

        yield on_done


def _cell(value) -> str:
    from kvtwin.sim.replay.load_curve import format_value  # pyarrow: not for `capacity --help`

    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format_value(value)


# What a heading means where its name alone could be read two ways (reports/SCHEMA.md,
# capacity.parquet): a throughput beside a sustainable rate, replicas needed beside the
# swept engine.replicas.
_LEGEND = {
    "served req/s": "requests completed per second of the replay shown, over its whole run (the drain after "
                    "its last arrival included){searched}",
    "max sustained req/s": "the largest arrival rate that held the SLO with the load sustained "
                           "(docs/capacity.md#sustained-load): the trace's requests/s at max rate scale",
    "replicas needed": "engine replicas of this point's shape (tensor_parallel_size GPUs each; prefill and "
                       "decode together for xPyD) to serve the trace's own rate at the max sustained rate per "
                       "replica; not the swept engine.replicas",
    "replicas needed @target": "the same for --target-rate",
    "max sustained req/s (slow edge)": "the same search with every step slower by the calibration's held-out "
                                       "step error (step err)",
    "replicas needed (slow edge)": "replicas needed at the slow edge's rate per replica",
}


def column_legend(titles, find_max_rate: bool) -> list[str]:
    """One line per shown heading of ``_LEGEND``, in the table's order."""
    searched = "; with --find-max-rate, of the replay at the max rate" if find_max_rate else ""
    return [f"{title}: {_LEGEND[title].format(searched=searched)}" for title in titles if title in _LEGEND]


def print_points(table, axes, find_max_rate: bool) -> None:
    from rich.console import Console  # rich's tables load only when there is a table to print
    from rich.table import Table

    shown = Table(show_header=True)
    names = ["point", *(a.key.key for a in axes), "status"]
    # The TTFT the SLO judges: the client's where the table has it (docs/capacity.md#client-side-latency).
    client = "p99_ttft_client_ms" in table.column_names
    figures = [("p99 TTFT (client)", "p99_ttft_client_ms") if client else ("p99 TTFT", "p99_ttft_ms"),
               ("p99 TPOT", "p99_tpot_ms"), ("SLO met", "slo_attainment"),
               ("hit rate", "prefix_cache_hit_rate"), ("served req/s", "request_throughput")]
    if "hit_rate_total" in table.column_names:
        # Offloading: what the tiers add to the GPU's hits (of prompt tokens; "-" without tiers).
        figures[4:4] = [("+CPU", "hit_rate_cpu"), ("+disk", "hit_rate_disk"), ("total hit", "hit_rate_total")]
    if "pd_link" in table.column_names:
        # Disaggregated points beside aggregated ones: their GPUs and the read's share of TTFT.
        figures[:0] = [("GPUs", "num_gpus")]
        figures.append(("xfer/TTFT", "pd_transfer_share_of_ttft"))
    if any(share for share in table.column("rejected_share").to_pylist() if share is not None and share == share):
        # Beside the attainment it lowers.
        figures.insert(figures.index(("SLO met", "slo_attainment")) + 1, ("rejected", "rejected_share"))
    if "offered_request_rate" in table.column_names:
        # A load curve: the columns of a `vllm bench serve` sweep, offered beside achieved.
        side = "_client" if client else ""
        figures = [("offered req/s", "offered_request_rate"), ("achieved req/s", "achieved_request_rate"),
                   (f"median TTFT{' (client)' if client else ''}", f"median_ttft{side}_ms"),
                   (f"p99 TTFT{' (client)' if client else ''}", f"p99_ttft{side}_ms"),
                   ("median TPOT", "median_tpot_ms"),
                   ("p99 TPOT", "p99_tpot_ms"), ("SLO met", "slo_attainment"), ("sustained", "sustained")]
        if table.column("p99_ttft_ms_pessimistic").null_count < table.num_rows:
            figures += [(f"p99 TTFT ({'client, ' if client else ''}slow edge)", f"p99_ttft{side}_ms_pessimistic"),
                        ("achieved (slow edge)", "achieved_request_rate_pessimistic")]
    if find_max_rate:
        figures += [("max rate scale", "max_rate_scale"), ("max sustained req/s", "max_request_rate"),
                    ("replicas needed", "replicas_needed_trace_rate"), ("$/M tok", "cost_per_million_tokens")]
        if table.column("replicas_needed_target_rate").null_count < table.num_rows:
            figures.append(("replicas needed @target", "replicas_needed_target_rate"))
        if table.column("max_request_rate_pessimistic").null_count < table.num_rows:
            # The pessimistic edge: every step slower by the calibration's held-out error.
            figures += [("step err", "step_error"), ("max sustained req/s (slow edge)", "max_request_rate_pessimistic"),
                        ("replicas needed (slow edge)", "replicas_needed_trace_rate_pessimistic")]
    for name in names:
        shown.add_column(name, no_wrap=True)
    for title, _ in figures:
        shown.add_column(title, justify="right")
    for row in table.to_pylist():
        cells = [_cell(row[n]) for n in names]
        for _, column in figures:
            value = row[column]
            if column == "sustained" and "short_window" in (row.get("sustained_reason") or ""):
                cells.append("too short")  # not judged, not failed (docs/capacity.md#load-curve)
            elif column.endswith(("_ms", "_ms_pessimistic")):
                cells.append(summary_text.format_duration_ms(value) if value is not None else "-")
            elif column in ("slo_attainment", "rejected_share", "prefix_cache_hit_rate", "step_error",
                            "pd_transfer_share_of_ttft") or column.startswith("hit_rate_"):
                cells.append(summary_text.format_percent(value) if value is not None else "-")
            else:
                cells.append(_cell(value))
        shown.add_row(*cells)
    console = Console()
    # A log or a pipe gets the whole table on one line per row, however many columns it has,
    # not one folded to 80 columns.
    if not console.is_terminal:
        console = Console(width=max(240, Console(width=10_000).measure(shown).maximum))
    console.print(shown)
    for line in column_legend([title for title, _ in figures], find_max_rate):
        print(line)
    for row in table.to_pylist():
        if row["status"] != "ok":
            print(f"point {row['point']} failed: {row['error']}")
        elif find_max_rate and row.get("rate_search_refusal"):
            # A rate judged on too short a window is never printed as sustainable: say why.
            print(f"point {row['point']}: {row['rate_search_refusal']}")
