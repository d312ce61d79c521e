"""``kvtwin trace``: what is in a trace (info), one schema (convert), synthetic workloads (synth)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from kvtwin.console import report_trace_notes, user_errors
from kvtwin.knob_options import number_option
from kvtwin.reports.paths import check_out_file
from kvtwin.sim.core.config import is_int
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario import validators
from kvtwin.trace_options import (ArrivalsOpt, FormatOpt, HashBlockOpt, MapOpt, PerBlockOpt, SeedOpt, SkipBadOpt,
                                  TimeUnitOpt, checked_options, given_options)
from kvtwin.traces import bundled
from kvtwin.traces.options import LoadOptions

# The readers, statistics and writers load pyarrow and NumPy: each subcommand imports
# what it uses, so the command line's help and `trace list` load neither.
if TYPE_CHECKING:
    from kvtwin.traces.schema import TraceMeta
    from kvtwin.traces.stats import TraceStats

# Plain help text: rich markup would swallow bracketed words.
trace_app = typer.Typer(help="Inspect, convert and synthesise request traces.", no_args_is_help=True,
                        rich_markup_mode=None)

_POSITIVE_TOKENS: validators.Rule = (lambda v: is_int(v) and v >= 1, "a positive number of tokens")
AssumeOpt = Annotated[Optional[int], number_option(
    "--assume-session-history", kind="int", rule=_POSITIVE_TOKENS, metavar="BLOCK_TOKENS",
    help="For traces without content identity: ASSUME each turn re-sends its session's history and "
         "derive block hashes of this many tokens from it.")]


def _options(assume: int | None, **flags) -> LoadOptions:
    options = checked_options(given_options(**flags))
    return dataclasses.replace(options, assume_session_history=assume)


@trace_app.command("info")
def info(
    path: Annotated[str, typer.Argument(help="Trace file (or bundled:NAME).")],
    block_tokens: Annotated[Optional[int], number_option("--block-tokens", kind="int", rule=_POSITIVE_TOKENS, help=(
        "Block size for the prefix-reuse bound (default: the trace's hash block size, else 16)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    fmt: FormatOpt = None, skip_bad: SkipBadOpt = False, arrivals: ArrivalsOpt = None, seed: SeedOpt = None,
    assume: AssumeOpt = None, maps: MapOpt = None, time_unit: TimeUnitOpt = None,
    hash_block_tokens: HashBlockOpt = None, per_block: PerBlockOpt = False,
) -> None:
    """Requests, duration, rate, length percentiles, sessions and the prefix-reuse upper bound."""
    from kvtwin.traces import schema
    from kvtwin.traces.load import load_trace
    from kvtwin.traces.stats import summarize

    with user_errors():
        options = _options(assume, fmt=fmt, skip_bad=skip_bad, arrivals=arrivals, seed=seed, maps=maps,
                           time_unit=time_unit, hash_block_tokens=hash_block_tokens, per_block=per_block)
        table = load_trace(path, options)
        stats = summarize(table, block_tokens)
        meta = schema.trace_meta(table)
        report_trace_notes(table)
        if as_json:
            out = stats.to_json()
            out.update(path=path, format=meta.source_format, arrivals=meta.arrivals,
                       skipped_bad_lines=meta.skipped_bad_lines, bad_line_reasons=list(meta.bad_line_reasons),
                       notes=list(meta.notes), transforms=list(meta.transforms))
            print(json.dumps(_finite(out), indent=2))
            return
        _print_info(path, stats, meta)


def _finite(value):
    """JSON has no NaN: empty traces report null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _print_info(path: str, stats: TraceStats, meta: TraceMeta) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    console.print(f"[bold]{path}[/bold] ({meta.source_format})", highlight=False)
    rate = "n/a" if stats.rate_per_s is None else f"{stats.rate_per_s:.3g} req/s"
    console.print(f"{stats.requests:,} requests over {stats.duration_s:,.1f} s, {rate}; arrivals {meta.arrivals}",
                  highlight=False)
    lengths = Table("tokens", "mean", "p50", "p99", "max")
    for name, dist in (("input", stats.input_tokens), ("output", stats.output_tokens)):
        lengths.add_row(name, *(f"{getattr(dist, k):,.1f}" for k in ("mean", "p50", "p99", "max")))
    console.print(lengths)
    if stats.sessions is None:
        console.print("sessions: none in this trace")
    else:
        ss = stats.sessions
        console.print(f"sessions: {ss.sessions:,} ({ss.multi_turn_sessions:,} with 2+ turns, longest {ss.max_turns} "
                      f"turns; {ss.requests_in_sessions:,} requests in sessions)", highlight=False)
    if stats.prefix_reuse is None:
        console.print("prefix reuse: [bold]unknown[/bold]: this trace has no content identity (no hashes, no token "
                      "ids). --assume-session-history N derives one from sessions, as an explicit assumption.")
        return
    reuse = stats.prefix_reuse
    assumed = " [bold]under the session-history ASSUMPTION[/bold]" if stats.identity_assumption else ""
    console.print(f"prefix reuse upper bound (infinite cache, {reuse.block_tokens}-token blocks){assumed}: "
                  f"{reuse.block_fraction:.4f} of {reuse.blocks:,} blocks, {reuse.token_fraction:.4f} of input tokens",
                  highlight=False)


@trace_app.command("convert")
def convert(
    inputs: Annotated[list[str], typer.Argument(help="Trace file(s); several are played one after another.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")],
    fmt: FormatOpt = None, skip_bad: SkipBadOpt = False, arrivals: ArrivalsOpt = None, seed: SeedOpt = None,
    assume: AssumeOpt = None, maps: MapOpt = None, time_unit: TimeUnitOpt = None,
    hash_block_tokens: HashBlockOpt = None, per_block: PerBlockOpt = False,
    start_s: Annotated[Optional[float], typer.Option("--start-s", help="Keep arrivals from here (s); "
                                                                       "times shift to start at 0.")] = None,
    end_s: Annotated[Optional[float], typer.Option("--end-s", help="Keep arrivals before this (s).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Keep the first N requests.")] = None,
    rate_scale: Annotated[Optional[float], typer.Option("--rate-scale", help=(
        "Multiply the arrival rate (2 = twice as fast)."))] = None,
    sample_sessions: Annotated[Optional[float], typer.Option("--sample-sessions", help=(
        "Keep this fraction of sessions (whole sessions, chosen with --sample-seed)."))] = None,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="Seed for --sample-sessions.")] = None,
    gap_s: Annotated[float, number_option("--gap-s", kind="float", rule=validators.NON_NEGATIVE_SECONDS,
                                          help="Pause between concatenated traces (s).")] = 0.0,
) -> None:
    """Read traces in any supported format and write one kvtwin trace parquet file."""
    from kvtwin.sim.scenario.knobs import knob
    from kvtwin.traces import schema, transforms
    from kvtwin.traces.load import load_trace, require_requests

    cuts = {key: value for key, value in (("start_s", start_s), ("end_s", end_s), ("sample_sessions", sample_sessions),
                                          ("sample_seed", sample_seed), ("rate_scale", rate_scale), ("limit", limit))
            if value is not None}
    with user_errors():
        check_out_file(output, "--output")
        options = _options(assume, fmt=fmt, skip_bad=skip_bad, arrivals=arrivals, seed=seed, maps=maps,
                           time_unit=time_unit, hash_block_tokens=hash_block_tokens, per_block=per_block)
        for key, value in cuts.items():
            # A scenario's cuts and these flags are checked by the same rules.
            knob(f"workload.{key}").check(value, _CUT_FLAGS[key])
        if end_s is not None and end_s <= (start_s or 0.0):
            raise ConfigError("--end-s", f"a time after --start-s ({start_s or 0.0:g} s)", end_s)
        tables = [require_requests(load_trace(path, options), path) for path in inputs]
        for table in tables:
            report_trace_notes(table)
        table = tables[0] if len(tables) == 1 else transforms.concat(tables, gap_s=gap_s)
        try:
            table = transforms.apply_cuts(table, cuts)
        except transforms.CutError as err:
            raise ConfigError(" and ".join(_CUT_FLAGS[k] for k in err.keys), err.expected, err.got) from None
        schema.write_parquet(table, output)
        print(f"wrote {output}: {table.num_rows:,} requests", file=sys.stderr)


_CUT_FLAGS = {"start_s": "--start-s", "end_s": "--end-s", "sample_sessions": "--sample-sessions",
              "sample_seed": "--sample-seed", "rate_scale": "--rate-scale", "limit": "--limit"}


@trace_app.command("synth")
def synth(
    spec: Annotated[Path, typer.Argument(help="Workload spec (TOML; see traces/SYNTH.md).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")],
) -> None:
    """Generate a seeded synthetic workload from a TOML spec."""
    from kvtwin.traces import schema
    from kvtwin.traces.synth import synthesize
    from kvtwin.traces.synth_spec import read_spec

    with user_errors():
        check_out_file(output, "--output")
        parsed = read_spec(spec)
        table = synthesize(parsed, base_dir=spec.parent, source_file=spec.name, where=str(spec))
        schema.write_parquet(table, output)
        print(f"wrote {output}: {table.num_rows:,} requests ({parsed.kind}, seed {parsed.seed})", file=sys.stderr)


@trace_app.command("list")
def list_bundled(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list.")] = False) -> None:
    """The traces shipped with kvtwin (use them as bundled:NAME), with rows and what they hold."""
    traces = bundled.bundled_traces()
    if as_json:
        print(json.dumps([{"name": f"{bundled.PREFIX}{t.name}", "rows": t.rows, "size_bytes": t.size_bytes,
                           "description": t.description} for t in traces], indent=1))
        return
    width = max(len(bundled.PREFIX + t.name) for t in traces)
    for t in traces:
        print(f"{bundled.PREFIX + t.name:<{width}}  {t.rows:>7,} rows  {t.size_bytes / 1e6:>5.1f} MB  {t.description}")
