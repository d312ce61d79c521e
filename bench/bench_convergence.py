"""Convergence of the rate search: the largest sustainable rate found with ``--limit N`` for
growing N, next to the answer on the whole trace.

A limited search must not answer from a burst (docs/capacity.md#enough-load): a ``--limit``
is read as a duration, a window too short to judge is refused, and whatever rate it does
accept is judged on a sustained load (docs/capacity.md#sustained-load). So once the
criterion accepts a point, its answer should not exceed the whole trace's: the property
checked here is, per scenario and per answer column (the central rate and the slow edge),

    answer(N) <= answer(whole trace) x (1 + tolerance)

for every N whose search gave a rate (a refusal, a null, is not an answer and is not
checked; a lower bound is a rate and is). The tolerance is the search's own: each answer
lies within it below its threshold, so two searches of the same threshold may differ by
that much and no more. A trace whose first minutes are busier or quieter than the whole
can still break it honestly; the table shows by how much.

The reference is the search without ``--limit``: for a scenario that sets its own
``workload.limit`` (the bundled Mooncake offload scenario: 3,000 requests) that is the
scenario's cut, itself a limited search that errs low, not the whole trace.

Each search is ``kvtwin capacity SCENARIO --find-max-rate [--limit N]``, one point, run
through the library (``capacity_sweep.prepare_sweep``, ``capacity_points.run_point``) so
the bench also records the replays each search spent and its wall time. Searches run in
parallel (``--jobs``), the whole-trace ones first: they take minutes. Progress goes to
stderr; the table to stdout; the rows to ``bench/out/bench_convergence.parquet``.

    python bench/bench_convergence.py [--scenarios A.toml,B.toml] [--limits 100,200,...]
        [--tolerance 0.05] [--jobs 2] [--no-whole] [--check] [--out FILE]

``--check`` exits 1 when the property fails, or cannot be judged (a whole-trace search
that failed or found no rate); ``--no-whole`` skips the whole-trace searches (a smoke
run: nothing to check against, so not with ``--check``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SCENARIOS = (ROOT / "scenarios" / "azure-conv-llama8b.toml",
                     ROOT / "scenarios" / "mooncake-llama8b-h100-overload.toml")
DEFAULT_LIMITS = (100, 200, 400, 800, 1600, 3200)
# The search's own default (kvtwin.sim.replay.rate_search.DEFAULT_RATE_TOLERANCE); written out
# so that --help and the pure check below load no simulator.
DEFAULT_TOLERANCE = 0.05
# The answer columns checked against the whole trace, and what the table calls them.
ANSWERS = (("max_request_rate", "max req/s"), ("max_request_rate_pessimistic", "slow edge req/s"))
# A search of the whole trace can run for minutes with nothing to report: say it is alive.
HEARTBEAT_S = 30.0


@dataclass(frozen=True)
class Search:
    """One rate search: a scenario, and its ``--limit`` (None: the whole trace)."""

    scenario: str
    limit: int | None
    tolerance: float


def run_search(search: Search) -> dict:
    """One search's row (runs in a worker; never raises for a point that fails)."""
    from kvtwin.sim.replay.capacity_points import run_point
    from kvtwin.sim.replay.capacity_sweep import prepare_sweep
    from kvtwin.sim.replay.rate_search import RateSearch

    started = time.perf_counter()
    sweep = prepare_sweep(Path(search.scenario), [], limit=search.limit,
                          search=RateSearch(tolerance=search.tolerance))
    point = run_point(sweep.tasks[0])
    wall_s = time.perf_counter() - started
    record = point.get("search") or {}
    summary = point.get("summary") or {}
    row = {"scenario": Path(search.scenario).stem, "limit": search.limit, "status": point["status"],
           "error": point["error"], "wall_s": wall_s,
           "replays": len(record.get("tried", [])), "converged": record.get("converged"),
           # The requests the answer was judged on (a refusal's summary is its last, smallest try).
           "num_requests": summary.get("num_requests") if point.get("max_rate_scale") is not None else None,
           "max_rate_scale": point.get("max_rate_scale"),
           "rate_search_refusal": point.get("rate_search_refusal")}
    for column, _ in ANSWERS:
        row[column] = point.get(column)
    return row


def _is_rate(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def convergence(rows: Sequence[dict], tolerance: float) -> list[dict]:
    """Per limited row and answer column that has a rate: the whole trace's answer, the bound
    it must stay under and whether it does (module docstring).

    ``holds`` is None when the row cannot be judged: its scenario has no whole-trace row, or
    that row failed or found no rate for the column (``reason`` says which)."""
    whole = {r["scenario"]: r for r in rows if r["limit"] is None}
    verdicts = []
    for row in rows:
        if row["limit"] is None or row["status"] != "ok":
            continue
        for column, _ in ANSWERS:
            answer = row.get(column)
            if not _is_rate(answer):
                continue  # a refusal, or no slow edge: nothing the criterion accepted
            reference = whole.get(row["scenario"])
            verdict = {"scenario": row["scenario"], "limit": row["limit"], "column": column, "answer": answer,
                       "whole": None, "bound": None, "holds": None, "reason": None}
            if reference is None:
                verdict["reason"] = "no whole-trace search"
            elif reference["status"] != "ok":
                verdict["reason"] = f"the whole-trace search failed: {reference['error']}"
            elif not _is_rate(reference.get(column)):
                verdict["reason"] = f"the whole-trace search has no {column}"
            else:
                bound = reference[column] * (1 + tolerance)
                verdict.update(whole=reference[column], bound=bound, holds=answer <= bound)
            verdicts.append(verdict)
    return verdicts


def check_failures(rows: Sequence[dict], verdicts: Sequence[dict]) -> list[str]:
    """What makes ``--check`` fail, one line each: an answer over its bound, an answer that
    could not be judged, or a search that failed."""
    lines = [f"{r['scenario']} {_limit_text(r['limit'])}: the search failed: {r['error']}"
             for r in rows if r["status"] != "ok"]
    for v in verdicts:
        where = f"{v['scenario']} --limit {v['limit']} {v['column']}"
        if v["holds"] is None:
            lines.append(f"{where} = {v['answer']:.4g} not judged: {v['reason']}")
        elif not v["holds"]:
            lines.append(f"{where} = {v['answer']:.4g} exceeds the whole trace's {v['whole']:.4g} by "
                         f"{v['answer'] / v['whole'] - 1:+.1%} (bound {v['bound']:.4g})")
    return lines


def _limit_text(limit: int | None) -> str:
    return "whole trace" if limit is None else f"--limit {limit}"


def _limits(text: str) -> tuple[int, ...]:
    try:
        limits = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request counts, got {text!r}") from None
    if not limits or min(limits) < 2:
        raise argparse.ArgumentTypeError(f"expected request counts of at least 2, got {text!r}")
    return limits


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative tolerance in (0, 1), got {text!r}")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of jobs, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(str(p) for p in DEFAULT_SCENARIOS),
                        help="comma-separated scenario files or bundled names (default: the Azure and Mooncake ones)")
    parser.add_argument("--limits", type=_limits, default=DEFAULT_LIMITS,
                        help="comma-separated --limit values (default: %(default)s)")
    parser.add_argument("--tolerance", type=_tolerance, default=DEFAULT_TOLERANCE,
                        help="the search's relative tolerance, and the check's (default: %(default)s)")
    parser.add_argument("--jobs", type=_positive, default=2, help="searches at once (default: %(default)s)")
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-trace searches (a smoke run)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the property fails or cannot be judged")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "bench_convergence.parquet")
    return parser


def _searches(args) -> list[Search]:
    """The searches, the scenarios checked whole first; whole-trace searches lead (the longest)."""
    from kvtwin.sim.replay.capacity_sweep import prepare_sweep
    from kvtwin.sim.replay.rate_search import RateSearch
    from kvtwin.sim.scenario.bundled import find_scenario

    paths = [find_scenario(name.strip(), "--scenarios") for name in args.scenarios.split(",") if name.strip()]
    for path in paths:
        prepare_sweep(path, [], limit=min(args.limits), search=RateSearch(tolerance=args.tolerance))
    whole = [] if args.no_whole else [Search(str(p), None, args.tolerance) for p in paths]
    return whole + [Search(str(p), n, args.tolerance) for p in paths for n in args.limits]


def _run(searches: Sequence[Search], jobs: int) -> list[dict]:
    started = time.perf_counter()
    rows: list[dict] = []
    workers = min(jobs, len(searches))
    print(f"{len(searches)} rate searches on {workers} jobs", file=sys.stderr)

    def done(row: dict) -> None:
        rows.append(row)
        answer = row["max_request_rate"]
        said = (f"{answer:.4g} req/s" if _is_rate(answer) else
                "no rate" if row["status"] == "ok" else f"failed: {row['error']}")
        print(f"[{time.perf_counter() - started:,.0f} s] {row['scenario']} {_limit_text(row['limit'])}: {said} "
              f"({row['replays']} replays, {row['wall_s']:,.1f} s)", file=sys.stderr)

    if workers <= 1:
        # In this process: also what a test that loads this file as a module can run.
        for search in searches:
            done(run_search(search))
    else:
        _run_pool(searches, workers, done, started)
    scenarios = list(dict.fromkeys(Path(s.scenario).stem for s in searches))
    # Scenario by scenario, growing N, the whole trace last: the order the table reads.
    return sorted(rows, key=lambda r: (scenarios.index(r["scenario"]),
                                       math.inf if r["limit"] is None else r["limit"]))


def _run_pool(searches: Sequence[Search], workers: int, done, started: float) -> None:
    # forkserver, as kvtwin's own pool: never fork a process that may hold a thread's lock.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending = {pool.submit(run_search, s) for s in searches}
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=HEARTBEAT_S,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                done(future.result())
            if not finished:
                print(f"[{time.perf_counter() - started:,.0f} s] {len(pending)} searches still running",
                      file=sys.stderr)


def _cell(value, digits: str = ".4g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, digits) if isinstance(value, float) else str(value)


def _print(rows: Sequence[dict], verdicts: Sequence[dict], tolerance: float) -> None:
    from rich.console import Console
    from rich.table import Table

    judged = {(v["scenario"], v["limit"], v["column"]): v for v in verdicts}
    table = Table(title=f"rate search convergence (tolerance {tolerance:g}; {platform.python_implementation()} "
                        f"{platform.python_version()})")
    for name in ("scenario", "limit", "requests @answer", "rate scale", *(title for _, title in ANSWERS),
                 "<= whole x (1+tol)", "replays", "converged", "wall s"):
        table.add_column(name, justify="left" if name == "scenario" else "right")
    for row in rows:
        checks = [judged.get((row["scenario"], row["limit"], column)) for column, _ in ANSWERS]
        # Central, then slow edge, each where it has a rate.
        check = ", ".join("not judged" if v["holds"] is None else "yes" if v["holds"]
                          else f"NO ({v['answer'] / v['whole'] - 1:+.1%})" for v in checks if v is not None) or "-"
        if row["limit"] is None:
            check = "(reference)"
        table.add_row(row["scenario"], "whole" if row["limit"] is None else f"{row['limit']:,}",
                      _cell(row["num_requests"]), _cell(row["max_rate_scale"]),
                      *(_cell(row[column]) for column, _ in ANSWERS), check, str(row["replays"]),
                      _cell(row["converged"]), f"{row['wall_s']:,.1f}")
    console = Console()
    (console if console.is_terminal else Console(width=200)).print(table)
    for row in rows:
        if row["status"] != "ok":
            print(f"{row['scenario']} {_limit_text(row['limit'])}: failed: {row['error']}")
        elif row["rate_search_refusal"]:
            print(f"{row['scenario']} {_limit_text(row['limit'])}: {row['rate_search_refusal']}")
    judged_count = sum(v["holds"] is not None for v in verdicts)
    held = sum(bool(v["holds"]) for v in verdicts)
    print(f"convergence: {held} of {judged_count} judged answers within the whole trace's x (1 + {tolerance:g}); "
          f"{len(verdicts) - judged_count} not judged")


def _write(rows: Sequence[dict], verdicts: Sequence[dict], tolerance: float, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvtwin import __version__

    judged = {(v["scenario"], v["limit"], v["column"]): v for v in verdicts}
    records = []
    for row in rows:
        record = {**row, "tolerance": tolerance}
        for column, _ in ANSWERS:
            verdict = judged.get((row["scenario"], row["limit"], column))
            record[f"{column}_whole"] = verdict["whole"] if verdict else None
            record[f"{column}_within_tolerance"] = verdict["holds"] if verdict else None
        records.append(record)
    table = pa.Table.from_pylist(records).replace_schema_metadata(
        {"kvtwin_version": __version__, "machine": platform.machine()})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(out)
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.check and args.no_whole:
        parser.error("--check needs the whole-trace answers to check against; drop --no-whole")
    from kvtwin.sim.core.errors import ConfigError
    from kvtwin.traces.errors import TraceError

    try:
        searches = _searches(args)
    except (ConfigError, TraceError) as err:
        print(f"kvtwin: error: {err}", file=sys.stderr)
        return 2
    rows = _run(searches, args.jobs)
    verdicts = convergence(rows, args.tolerance)
    _print(rows, verdicts, args.tolerance)
    _write(rows, verdicts, args.tolerance, args.out)
    if not args.check:
        return 0
    failures = check_failures(rows, verdicts)
    for line in failures:
        print(f"check failed: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
