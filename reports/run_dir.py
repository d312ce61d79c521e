"""Writes a run directory: ``requests.parquet``, ``steps.parquet``, ``summary.parquet``,
``plan.json``. Every parquet file carries the scenario and the kvtwin version in its
schema metadata. The directory is written as a set: every file goes into a temporary
sibling directory, which then replaces the previous run directory by renames, so an
interrupted run never leaves a new ``requests.parquet`` next to an old ``steps.parquet``.
Column meanings: ``reports/SCHEMA.md``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin import __version__
from kvtwin.reports.paths import check_out_dir

__all__ = ["METADATA_KEY", "check_out_dir", "read_run_metadata", "run_metadata", "write_json", "write_parquet",
           "write_run"]

METADATA_KEY = b"kvtwin.run"


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_parquet(table: pa.Table, path: Path, run_metadata: dict) -> None:
    metadata = dict(table.schema.metadata or {})
    metadata[METADATA_KEY] = json.dumps(run_metadata, sort_keys=True).encode()
    table = table.replace_schema_metadata(metadata)
    # No statistics-dependent or time-dependent writer fields: same input, same bytes.
    _atomic_write_bytes(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def write_json(obj: dict, path: Path) -> None:
    _atomic_write_bytes(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n"))


def run_metadata(scenario_path: Path, overrides: dict, resolved: dict | None = None) -> dict:
    """What every parquet file of a run records about how it was made (``reports/SCHEMA.md``);
    ``resolved`` is what ran (``ResolvedScenario.describe``), where one scenario ran."""
    scenario_path = Path(scenario_path)
    metadata = {
        "kvtwin_version": __version__,
        "scenario": scenario_path.read_text() if scenario_path.exists() else "",
        "scenario_file": scenario_path.name,
        "overrides": dict(overrides),
    }
    if resolved is not None:
        metadata["resolved"] = resolved
    return metadata


def _swap_in(staging: Path, target: Path) -> None:
    """Put ``staging`` where ``target`` is; the old ``target`` stays whole until the new one is in."""
    if not target.exists():
        os.rename(staging, target)
        return
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_run(out_dir: Path, *, requests: pa.Table, steps: pa.Table, summary: pa.Table, plan: dict,
              run_metadata: dict, extra_tables: dict[str, pa.Table] | None = None,
              text_files: dict[str, str] | None = None) -> list[Path]:
    """Write the run directory ``out_dir`` whole, replacing a previous run there; return its files.

    ``extra_tables`` (``NAME`` -> table, written as ``NAME.parquet``) and ``text_files`` (file
    name -> text, e.g. ``report.html``) go into the same directory swap."""
    tables = {"requests": requests, "steps": steps, "summary": summary}
    tables.update(extra_tables or {})
    return write_dir(out_dir, tables=tables, json_files={"plan": plan}, text_files=text_files,
                     run_metadata=run_metadata)


def write_dir(out_dir: Path, *, tables: dict[str, pa.Table], json_files: dict[str, dict] | None = None,
              text_files: dict[str, str] | None = None, run_metadata: dict) -> list[Path]:
    """Write ``NAME.parquet`` per table, ``NAME.json`` and text files (by file name) into
    ``out_dir`` whole, replacing what was there; return the files."""
    # Checked again here, not only by the command: replacing a directory removes what it held.
    check_out_dir(out_dir)
    # A symlinked run directory is replaced at its target, so the link keeps working.
    target = Path(out_dir).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    names = []
    try:
        for name, table in tables.items():
            write_parquet(table, staging / f"{name}.parquet", run_metadata)
            names.append(f"{name}.parquet")
        for name, obj in (json_files or {}).items():
            write_json(obj, staging / f"{name}.json")
            names.append(f"{name}.json")
        for name, text in (text_files or {}).items():
            (staging / name).write_text(text)
            names.append(name)
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [Path(out_dir) / name for name in names]


def read_run_metadata(path: Path) -> dict:
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[METADATA_KEY])
