"""One entry point for reading any trace: detect the format, dispatch to its loader.

Detection looks at the file, not just its name: a parquet file with kvtwin metadata is a
trace already; a JSONL file is Bailian-style when its first record has ``chat_id`` and
Mooncake when it has ``hash_ids``; a CSV file is Azure by its exact header and BurstGPT when
it has ``Request tokens`` and ``Response tokens``. Anything else is generic: its columns
named as the trace schema's are read by name, the others need a column map (which, given,
makes any file generic).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pyarrow as pa

from kvtwin.traces import schema as s
from kvtwin.traces.azure import load_azure
from kvtwin.traces.bailian import load_bailian
from kvtwin.traces.bundled import resolve
from kvtwin.traces.burstgpt import load_burstgpt
from kvtwin.traces.errors import TraceError
from kvtwin.traces.generic import JSONL_SUFFIXES, column_map, load_generic
from kvtwin.traces.mooncake import load_mooncake
from kvtwin.traces.options import FORMATS, GENERIC, SPREAD, LoadOptions
from kvtwin.traces.sessions import assume_session_history

AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def detect_format(path: str | os.PathLike, options: LoadOptions = LoadOptions()) -> str:
    """The format of the trace at ``path`` (raises TraceError when it is not recognised)."""
    path = os.fspath(path)
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        return "parquet" if s.is_trace_parquet(path) else GENERIC
    if suffix in JSONL_SUFFIXES:
        return _jsonl_format(path)
    if suffix in (".csv", ".txt"):
        return _csv_format(path)
    raise TraceError(path, "format", f"a .parquet, .jsonl or .csv trace (or {options.spell('format')})")


def _jsonl_format(path: str) -> str:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    raise TraceError(path, "line", "one JSON object per line", line=number) from None
                keys = set(record) if isinstance(record, dict) else set()
                if "chat_id" in keys:
                    return "bailian"
                if "hash_ids" in keys or "input_length" in keys:
                    return "mooncake"
                return GENERIC
    raise TraceError(path, "file", "at least one request")


def _csv_format(path: str) -> str:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as handle:
        header = [name.strip() for name in next(csv.reader(handle), [])]
    if header == AZURE_HEADER:
        return "azure"
    if "Request tokens" in header and "Response tokens" in header:
        return "burstgpt"
    return GENERIC


def source_format(path: str | os.PathLike, options: LoadOptions = LoadOptions()) -> str:
    """The format the trace at ``path`` is read in: the one ``options`` name, generic where
    they map columns, else the file's own."""
    path = os.fspath(resolve(path))
    if not os.path.exists(path):
        raise FileNotFoundError(2, "no such file", path)
    fmt = options.format or (GENERIC if options.generic else detect_format(path, options))
    if fmt not in FORMATS:
        raise TraceError(path, options.spell("format"), f"one of {', '.join(FORMATS)}", got=fmt)
    return fmt


def check_source(path: str | os.PathLike, options: LoadOptions = LoadOptions()) -> None:
    """What can be told of the trace at ``path`` without reading its requests: that it
    exists, its format and, for a generic file, its column map (so that a run of many
    replays fails on a bad source before the first)."""
    path = os.fspath(resolve(path))
    if source_format(path, options) == GENERIC:
        column_map(path, options)


def load_trace(path: str | os.PathLike, options: LoadOptions = LoadOptions()) -> pa.Table:
    """Read the trace at ``path`` into the trace schema."""
    path = os.fspath(resolve(path))
    fmt = source_format(path, options)
    if fmt == GENERIC:
        table = load_generic(path, column_map(path, options), skip_bad=options.skip_bad)
    elif fmt == "parquet":
        table = s.read_parquet(path)
    elif fmt == "mooncake":
        table = load_mooncake(path, arrivals=options.arrivals, seed=options.seed, skip_bad=options.skip_bad,
                              spread_hint=options.setting("arrivals", SPREAD))
    elif fmt == "bailian":
        table = load_bailian(path, skip_bad=options.skip_bad)
    elif fmt == "azure":
        table = load_azure(path, skip_bad=options.skip_bad)
    else:
        table = load_burstgpt(path, skip_bad=options.skip_bad)
    if options.assume_session_history is not None:
        try:
            table = assume_session_history(table, options.assume_session_history)
        except ValueError as err:
            raise TraceError(path, "assume_session_history", "a trace without content identity",
                             got=str(err)) from None
    return table


def require_requests(table: pa.Table, path: str | os.PathLike) -> pa.Table:
    """``table``, read from ``path``, if it holds a request: a trace without one is bad
    input wherever it is to be replayed or written."""
    if table.num_rows == 0:
        raise TraceError(os.fspath(path), "requests", "at least one request (the trace has none)")
    return table
