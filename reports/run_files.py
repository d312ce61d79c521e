"""A run directory read back: which kind it is (told by its files), its parquet tables, its
plan and the metadata its files carry, and in words what a directory that is neither
holds. pyarrow only: reading a run for ``kvtwin diff`` loads no plotting library."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin.reports.paths import CAPACITY_FILES, REPLAY_FILES
from kvtwin.reports.run_dir import METADATA_KEY
from kvtwin.sim.core.errors import ConfigError

__all__ = ["directory_kind", "read_json", "read_metadata", "read_table", "what_is_there"]


def directory_kind(directory: Path) -> str | None:
    """``replay``, ``capacity``, or None: neither's files are all there."""
    directory = Path(directory)
    if all((directory / name).is_file() for name in REPLAY_FILES):
        return "replay"
    if all((directory / name).is_file() for name in CAPACITY_FILES):
        return "capacity"
    return None


def what_is_there(directory: Path) -> str:
    """What stands at ``directory``, for an error that says it is not what was expected."""
    directory = Path(directory)
    if not directory.exists():
        return "no such directory"
    if not directory.is_dir():
        return "a file"
    kind = directory_kind(directory)
    if kind is not None:
        return f"a {kind} directory"
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    if not names:
        return "an empty directory"
    return "a directory holding " + ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def read_metadata(path: Path) -> dict:
    """The ``kvtwin.run`` metadata a parquet file of a run carries ({} when none)."""
    metadata = pq.read_schema(path).metadata or {}
    try:
        return json.loads(metadata[METADATA_KEY])
    except (KeyError, ValueError):
        return {}


def read_table(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """One parquet file (the ``columns`` of them it has), read as such: ``pq.read_table``
    would import Arrow's dataset layer (about 0.3 s of a report's start-up) to read it."""
    try:
        with pq.ParquetFile(path) as parquet:
            if columns is None:
                return parquet.read()
            present = set(parquet.schema_arrow.names)
            return parquet.read(columns=[c for c in columns if c in present])
    except pa.ArrowException as err:
        raise ConfigError(str(path), "a parquet file kvtwin wrote", str(err).splitlines()[0][:200]) from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:
        raise ConfigError(str(path), "a JSON object (kvtwin plan --json)", str(err)) from None
