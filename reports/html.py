"""``report.html``: a replay or capacity directory as one self-contained HTML file.

This module reads the directory (which kind it is is told by its files), hands the tables
to the report of that kind (``reports.replay_report``, ``reports.capacity_report``) and
writes the page. The page itself (``reports.html_page``): inline CSS, the plots as base64
PNG data URIs (``reports.plots``), no external URL, every string from data HTML-escaped.
Nothing depends on the wall clock, so the same directory gives the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtwin.reports.replay_plots import REQUEST_COLUMNS, STEP_COLUMNS
from kvtwin.reports.replay_report import render_replay_report
from kvtwin.reports.paths import REPLAY_FILES
from kvtwin.reports.run_files import directory_kind, read_json, read_metadata, read_table, what_is_there
from kvtwin.sim.core.errors import ConfigError

__all__ = ["render_report_dir", "report_kind", "write_report"]

REPORT_NAME = "report.html"
report_kind = directory_kind


def render_report_dir(directory: str | os.PathLike) -> str:
    """Render the report of a replay or capacity directory (the kind is told by its files)."""
    directory = Path(directory)
    kind = report_kind(directory)
    if kind == "replay":
        plan = read_json(directory / "plan.json")
        replicas_path = directory / "replicas.parquet"
        return render_replay_report(read_table(directory / "requests.parquet", REQUEST_COLUMNS),
                                    read_table(directory / "steps.parquet", STEP_COLUMNS),
                                    read_table(directory / "summary.parquet"), plan,
                                    read_metadata(directory / "summary.parquet"),
                                    replicas=read_table(replicas_path) if replicas_path.is_file() else None)
    if kind == "capacity":
        # Imported here: a replay report needs neither the capacity report nor pandas.
        from kvtwin.reports.capacity_report import render_capacity_report

        curve_path = directory / "hit_curve.parquet"
        plan_path = directory / "plan.json"
        hit_curve = read_table(curve_path) if curve_path.is_file() else None
        plan = read_json(plan_path) if plan_path.is_file() else None
        sources = ["capacity.parquet"] + [p.name for p in (curve_path, plan_path) if p.is_file()]
        return render_capacity_report(read_table(directory / "capacity.parquet"), hit_curve,
                                      read_metadata(directory / "capacity.parquet"), plan, sources=sources)
    raise ConfigError(str(directory), f"a replay directory ({', '.join(REPLAY_FILES)}) or a capacity directory "
                                      f"(capacity.parquet)", what_is_there(directory))


def write_report(directory: str | os.PathLike) -> Path:
    """Write ``directory/report.html`` (via a temporary file and a rename); return its path."""
    directory = Path(directory)
    text = render_report_dir(directory)
    path = directory / REPORT_NAME
    tmp = directory / f".{REPORT_NAME}.tmp"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
