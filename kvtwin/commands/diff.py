"""`kvtwin diff RUN_A RUN_B`: two replay run directories side by side.

Prints the settings that differ and every figure of the two runs with its change
(``kvtwin.reports.diff``); with ``--out DIR`` also writes ``diff.parquet`` and
``diff.html`` (the plots overlaid) into DIR, whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtwin.console import user_errors


def diff(
    run_a: Path = typer.Argument(..., metavar="RUN_A", help="A replay run directory (kvtwin replay --out)."),
    run_b: Path = typer.Argument(..., metavar="RUN_B", help="The replay run directory to compare with it."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Also write diff.parquet and diff.html (plots overlaid) here."),
) -> None:
    """Compare two replay runs: every figure side by side with its change, and what differs."""
    # Loaded here: reading parquet needs pyarrow, which `kvtwin --help` never loads.
    from kvtwin import __version__
    from kvtwin.reports import diff as runs_diff

    with user_errors():
        if out is not None:
            from kvtwin.reports.run_dir import check_out_dir, write_dir

            check_out_dir(out)
            runs_diff.check_diff_out(out)
        a, b = runs_diff.read_run(run_a, "RUN_A"), runs_diff.read_run(run_b, "RUN_B")
        changes = runs_diff.compare(a, b)
        settings = runs_diff.differing_settings(a, b)
        paths = []
        if out is not None:
            metadata = {"kvtwin_version": __version__, "run_a": str(run_a), "run_b": str(run_b),
                        "settings_differ": [list(s) for s in settings]}
            paths = write_dir(out, tables={"diff": runs_diff.diff_table(changes)},
                              text_files={"diff.html": runs_diff.render_diff_html(a, b, changes, settings)},
                              run_metadata=metadata)
    _print(a, b, changes, settings)
    if paths:
        print(f"wrote {', '.join(p.name for p in paths)} to {out}")


def _print(a, b, changes, settings) -> None:
    from rich.console import Console  # rich's tables load only when there is a table to print
    from rich.table import Table

    from kvtwin.reports.diff import format_change, format_relative, format_value, settings_line

    print(f"A: {a.directory}: {a.headline}")
    print(f"B: {b.directory}: {b.headline}")
    print(settings_line(settings))
    table = Table(show_header=True)
    table.add_column("figure")
    for name in ("A", "B", "change", "relative"):
        table.add_column(name, justify="right")
    for c in changes:
        table.add_row(c.label, format_value(c.unit, c.a), format_value(c.unit, c.b), format_change(c.unit, c.change),
                      format_relative(c.relative_change))
    console = Console()
    # A log or a pipe gets the whole table, not one folded to 80 columns.
    (console if console.is_terminal else Console(width=160)).print(table)
