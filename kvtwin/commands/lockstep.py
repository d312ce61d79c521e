"""`kvtwin lockstep CASE --out DIR`: run a golden case step by step and check it.

CASE is a case directory or a P/D case file (``tests/golden/pd/*.json``). Writes
``actual_requests.jsonl`` and ``actual_steps.jsonl`` (a P/D case: ``actual_ticks.jsonl``)
in the golden format; when the case has vLLM's expected results (``expected_*.jsonl``, a
P/D case's ``expected_ticks``), compares field by field, prints the first differences and
exits 1 on any mismatch.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kvtwin.console import user_errors
from kvtwin.knob_options import number_option
from kvtwin.sim.core.hashing import HASH_FUNCTIONS

_NON_NEGATIVE = (lambda v: isinstance(v, int) and v >= 0, "a non-negative number of differences")


def lockstep(
    case_dir: Path = typer.Argument(..., help="Golden case directory (config.json + requests.jsonl) or P/D case "
                                    "file."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for actual_requests.jsonl / actual_steps.jsonl "
                             "(P/D: actual_ticks.jsonl)."),
    check: bool = typer.Option(True, "--check/--no-check", help="Compare with vLLM's expected results when present."),
    hash_algo: str = typer.Option(None, "--hash-algo",
                                  help=f"Block hash function ({', '.join(HASH_FUNCTIONS)}); default: the case's."),
    max_diffs: int = number_option("--max-diffs", kind="int", default=10, rule=_NON_NEGATIVE,
                                   help="How many differences to print."),
) -> None:
    """Run a golden case through kvtwin's scheduler with a step clock and a scripted model."""
    # Loaded here, not with the command line: the scheduler and rich's progress bar.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtwin.sim.lockstep.golden import compare_results, expected_results, load_case, write_jsonl
    from kvtwin.sim.lockstep.runner import run_case

    console = Console(stderr=True)
    with user_errors():
        case = load_case(case_dir, hash_algo=hash_algo)
        started = time.perf_counter()
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("step {task.completed}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            task = progress.add_task(case.name, total=None)
            result = run_case(case, on_step=lambda s: progress.update(task, completed=s + 1))
        elapsed_s = time.perf_counter() - started
        out.mkdir(parents=True, exist_ok=True)
        for name, rows in result.files().items():
            write_jsonl(out / name, rows)
        expected = expected_results(case_dir, case) if check else None

    print(f"{case.name}: {result.summary()} ({elapsed_s:.2f} s) -> {out}")
    if expected is None:
        return
    diffs = compare_results(*expected, result.requests, result.steps, limit=0)
    if not diffs:
        what = "tick" if result.unit == "tick" else "request and step"
        print(f"MATCH: every {what} equals {case_dir.name}'s expected results")
        return
    print(f"MISMATCH: {len(diffs)} differences; first {min(max_diffs, len(diffs))}:")
    for line in diffs[:max_diffs]:
        print(f"  {line}")
    raise typer.Exit(code=1)
