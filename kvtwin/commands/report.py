"""`kvtwin report DIR`: a replay or capacity directory as one self-contained ``report.html``.

The kind is told by the files present (``reports.html.report_kind``): a replay directory
holds ``requests.parquet``, ``steps.parquet``, ``summary.parquet`` and ``plan.json``; a
capacity directory ``capacity.parquet`` (and optionally ``hit_curve.parquet``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvtwin.console import user_errors


def report(
    directory: Path = typer.Argument(..., metavar="DIR", help="A replay or capacity directory."),
) -> None:
    """Write DIR/report.html: the plan, key metrics and plots of a replay or capacity run."""
    with user_errors():
        # Imported here: matplotlib is only needed once a report is drawn.
        from kvtwin.reports.html import write_report

        path = write_report(directory)
    print(f"wrote {path}")
