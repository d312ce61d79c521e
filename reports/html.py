"""``report.html``: a replay or capacity directory as one self-contained HTML file.

This module reads the directory (which kind it is is told by its files), hands the tables
to the report of that kind (``reports.replay_report``, ``reports.capacity_report``) and
writes the page. The page itself (``reports.html_page``): inline CSS, the plots as base64
PNG data URIs (``reports.plots``), no external URL, every string from data HTML-escaped.
Nothing depends on the wall clock, so the same directory gives the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin.reports.replay_plots import REQUEST_COLUMNS, STEP_COLUMNS
from kvtwin.reports.replay_report import REPLAY_FILES, render_replay_report
from kvtwin.reports.paths import CAPACITY_FILES
from kvtwin.reports.run_dir import METADATA_KEY
from kvtwin.sim.core.errors import ConfigError

__all__ = ["render_report_dir", "report_kind", "write_report"]

REPORT_NAME = "report.html"


def report_kind(directory: Path) -> str | None:
    directory = Path(directory)
    if all((directory / name).is_file() for name in REPLAY_FILES):
        return "replay"
    if all((directory / name).is_file() for name in CAPACITY_FILES):
        return "capacity"
    return None


def _metadata(path: Path) -> dict:
    metadata = pq.read_schema(path).metadata or {}
    try:
        return json.loads(metadata[METADATA_KEY])
    except (KeyError, ValueError):
        return {}


def _read(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    # One file, read as such: ``pq.read_table`` would import Arrow's dataset layer
    # (about 0.3 s of a report's start-up) to read it.
    try:
        with pq.ParquetFile(path) as parquet:
            if columns is None:
                return parquet.read()
            present = set(parquet.schema_arrow.names)
            return parquet.read(columns=[c for c in columns if c in present])
    except pa.ArrowException as err:
        raise ConfigError(str(path), "a parquet file kvtwin wrote", str(err).splitlines()[0][:200]) from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(str(path), "a JSON object (kvtwin plan --json)", str(err)) from None


def render_report_dir(directory: str | os.PathLike) -> str:
    """Render the report of a replay or capacity directory (the kind is told by its files)."""
    directory = Path(directory)
    kind = report_kind(directory)
    if kind == "replay":
        plan = _read_json(directory / "plan.json")
        return render_replay_report(_read(directory / "requests.parquet", REQUEST_COLUMNS),
                                    _read(directory / "steps.parquet", STEP_COLUMNS),
                                    _read(directory / "summary.parquet"), plan,
                                    _metadata(directory / "summary.parquet"))
    if kind == "capacity":
        # Imported here: a replay report needs neither the capacity report nor pandas.
        from kvtwin.reports.capacity_report import render_capacity_report

        curve_path = directory / "hit_curve.parquet"
        plan_path = directory / "plan.json"
        hit_curve = _read(curve_path) if curve_path.is_file() else None
        plan = _read_json(plan_path) if plan_path.is_file() else None
        sources = ["capacity.parquet"] + [p.name for p in (curve_path, plan_path) if p.is_file()]
        return render_capacity_report(_read(directory / "capacity.parquet"), hit_curve,
                                      _metadata(directory / "capacity.parquet"), plan, sources=sources)
    if not directory.exists():
        got = "no such directory"
    elif not directory.is_dir():
        got = "a file"
    else:
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        got = ("an empty directory" if not names else
               "a directory holding " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    raise ConfigError(str(directory), f"a replay directory ({', '.join(REPLAY_FILES)}) or a capacity directory "
                                      f"(capacity.parquet)", got)


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
