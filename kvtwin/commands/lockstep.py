"""`kvtwin lockstep CASE_DIR --out DIR`: run a golden case step by step and check it.

Writes ``actual_requests.jsonl`` and ``actual_steps.jsonl`` in the golden format; when the
case has ``expected_*.jsonl`` files (cases produced by vLLM itself), compares field by
field, prints the first differences and exits 1 on any mismatch.
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
    case_dir: Path = typer.Argument(..., help="Golden case directory: config.json + requests.jsonl."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for actual_requests.jsonl / actual_steps.jsonl."),
    check: bool = typer.Option(True, "--check/--no-check", help="Compare with expected_*.jsonl when present."),
    hash_algo: str = typer.Option(None, "--hash-algo",
                                  help=f"Block hash function ({', '.join(HASH_FUNCTIONS)}); default: the case's."),
    max_diffs: int = number_option("--max-diffs", kind="int", default=10, rule=_NON_NEGATIVE,
                                   help="How many differences to print."),
) -> None:
    """Run a golden case through kvtwin's scheduler with a step clock and a scripted model."""
    # Loaded here, not with the command line: the scheduler and rich's progress bar.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtwin.sim.lockstep.golden import compare_results, load_case, read_jsonl, write_jsonl
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
        write_jsonl(out / "actual_requests.jsonl", result.requests)
        write_jsonl(out / "actual_steps.jsonl", result.steps)

    hits = sum(a["hit_tokens"] for r in result.requests for a in r["admissions"])
    preemptions = sum(r["num_preemptions"] for r in result.requests)
    print(f"{case.name}: {len(result.requests)} requests, {len(result.steps)} steps, {hits} hit tokens, "
          f"{preemptions} preemptions ({elapsed_s:.2f} s) -> {out}")

    expected_requests = case_dir / "expected_requests.jsonl"
    expected_steps = case_dir / "expected_steps.jsonl"
    if not check or not (expected_requests.exists() and expected_steps.exists()):
        return
    diffs = compare_results(read_jsonl(expected_requests), read_jsonl(expected_steps), result.requests,
                            result.steps, limit=0)
    if not diffs:
        print(f"MATCH: every request and step equals {case_dir.name}'s expected results")
        return
    print(f"MISMATCH: {len(diffs)} differences; first {min(max_diffs, len(diffs))}:")
    for line in diffs[:max_diffs]:
        print(f"  {line}")
    raise typer.Exit(code=1)
