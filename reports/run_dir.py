"""Writes a run directory: ``requests.parquet``, ``steps.parquet``, ``summary.parquet``,
``plan.json``. Every parquet file carries the scenario and the kvtwin version in its
schema metadata, and every file is written under a temporary name and renamed when
complete, so an interrupted run never leaves a partial file under a final name.
Column meanings: ``reports/SCHEMA.md``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

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


def write_run(out_dir: Path, *, requests: pa.Table, steps: pa.Table, summary: pa.Table, plan: dict,
              run_metadata: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in (("requests", requests), ("steps", steps), ("summary", summary)):
        path = out_dir / f"{name}.parquet"
        write_parquet(table, path, run_metadata)
        paths.append(path)
    plan_path = out_dir / "plan.json"
    write_json(plan, plan_path)
    paths.append(plan_path)
    return paths


def read_run_metadata(path: Path) -> dict:
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[METADATA_KEY])
