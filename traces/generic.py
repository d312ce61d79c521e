"""Loader for any CSV, JSONL or parquet request log: columns named as the trace schema's
are read by name, the others through a map from trace columns to the file's columns.

Arrival times are converted from ``time_unit`` to seconds and made relative to the first
request (the first arrival time is kept as ``time_origin``). Token-count columns must hold
integers >= 1; request ids, where given, must not repeat. Parquet and JSONL files may also
carry prefix identity: a list column of block hashes (with the tokens each covers, an option
or a ``hash_block_tokens`` column holding one value; chained or per-block) or a list column
of prompt token ids. For parquet, the "line" in an error is the 1-based row. A JSONL file's
first line names its columns, as a CSV header does.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvtwin.traces import schema as s
from kvtwin.traces.azure import format_utc_ns
from kvtwin.traces.bad_lines import BadLines
from kvtwin.traces.columns import MAP_REQUIRED, MAPPABLE
from kvtwin.traces.errors import TraceError
from kvtwin.traces.fields import DATETIME, FLOAT, INT, INT_LIST, STR, Field, RowCheck, repeats
from kvtwin.traces.hashing import chain_lists
from kvtwin.traces.options import LoadOptions, OptionError, map_pairs
from kvtwin.traces.readers import read_csv, read_jsonl

TIME_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
DATETIME_UNIT = "datetime"
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class ColumnMap:
    """Which source column feeds which trace column, and how to read the time and the hashes."""

    arrival_time_s: str
    prompt_tokens: str
    output_tokens: str
    time_unit: str = "s"
    request_id: str | None = None
    session_id: str | None = None
    turn: str | None = None
    priority: str | None = None
    block_hashes: str | None = None
    hash_block_tokens: int | None = None
    hashes_chained: bool = True
    prompt_token_ids: str | None = None
    # A column holding the tokens per hash (one value), where no number is given.
    hash_block_tokens_column: str | None = None
    # Targets read by their schema name rather than mapped (the file's own column names).
    by_name: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.time_unit not in TIME_UNITS_S and self.time_unit != DATETIME_UNIT:
            raise ValueError(f"time_unit must be one of {sorted(TIME_UNITS_S)} or {DATETIME_UNIT!r}")
        if (self.block_hashes is None) != (self.hash_block_tokens is None and self.hash_block_tokens_column is None):
            raise ValueError("block_hashes and hash_block_tokens go together")
        if self.block_hashes is not None and self.prompt_token_ids is not None:
            raise ValueError("give block_hashes or prompt_token_ids, not both")

    @classmethod
    def from_pairs(cls, pairs: Sequence[str], **options: object) -> ColumnMap:
        """Build from ``TRACE_COLUMN=SOURCE_COLUMN`` strings (the CLI's ``--map``)."""
        try:
            mapping = map_pairs(pairs)
        except OptionError as err:
            raise ValueError(f"--map: expected {err.expected}, got {err.got!r}") from None
        missing = [name for name in MAP_REQUIRED if name not in mapping]
        if missing:
            raise ValueError(f"--map needs {', '.join(missing)}")
        return cls(**mapping, **{k: v for k, v in options.items() if v is not None})


def source_columns(path: str) -> list[str]:
    """The columns of a generic file: a CSV's header, a parquet file's schema, the keys of a
    JSONL file's first record."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        try:
            return list(pq.read_schema(path).names)
        except pa.ArrowException as err:
            raise TraceError(path, "file", "a parquet file", got=str(err).strip()) from None
    if suffix in JSONL_SUFFIXES:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        raise TraceError(path, "line", "one JSON object per line", line=number) from None
                    if not isinstance(record, dict):
                        raise TraceError(path, "line", "a JSON object", line=number, got=type(record).__name__)
                    return list(record)
        return []
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            return [name.strip() for name in next(csv.reader(handle), [])]
    except UnicodeDecodeError:
        raise TraceError(path, "file", "UTF-8 text") from None


def column_map(path: str, options: LoadOptions) -> ColumnMap:
    """The column map of ``options`` completed by the file's columns named as the trace
    schema's: those need no map (a map entry wins over a column of the target's name).
    Whatever is missing is named as ``options``' user sets it."""
    given = dict(options.columns)
    names = source_columns(path)
    by_name = tuple(t for t in MAPPABLE if t not in given and t in names)
    mapping = {**given, **{t: t for t in by_name}}
    missing = [t for t in MAP_REQUIRED if t not in mapping]
    if missing:
        raise TraceError(path, "columns", f"columns named {', '.join(MAP_REQUIRED)} (the trace schema's names) or "
                         f"a column map ({options.map_hint(missing)})", got=", ".join(names[:12]))
    extra: dict[str, object] = {"time_unit": options.time_unit or "s", "hashes_chained": not options.per_block_hashes}
    if s.BLOCK_HASHES in mapping:
        if options.hash_block_tokens is not None:
            extra["hash_block_tokens"] = options.hash_block_tokens
        elif s.HASH_BLOCK_TOKENS in names:
            extra["hash_block_tokens_column"] = s.HASH_BLOCK_TOKENS
        else:
            raise TraceError(path, s.HASH_BLOCK_TOKENS, f"{options.spell('hash_block_tokens')} N (the tokens each "
                             f"block hash of column {mapping[s.BLOCK_HASHES]!r} covers) or a hash_block_tokens column")
    else:
        for name, unused in (("hash_block_tokens", options.hash_block_tokens is not None),
                             ("per_block_hashes", options.per_block_hashes)):
            if unused:
                raise TraceError(path, options.spell(name), "block hashes for it to describe (the file has no "
                                 f"{s.BLOCK_HASHES} column and none is mapped)", got=getattr(options, name))
    try:
        return ColumnMap(**mapping, **extra, by_name=by_name)
    except ValueError as err:
        raise TraceError(path, options.spell("map"), str(err)) from None


def load_generic(path: str | os.PathLike, columns: ColumnMap, *, skip_bad: bool = False) -> pa.Table:
    """Load a CSV, JSONL or parquet file through ``columns`` into the trace schema."""
    path_text = os.fspath(path)
    suffix = Path(path_text).suffix.lower()
    if suffix == ".parquet":
        values, bad = _read_parquet(path_text, columns, skip_bad)
    elif suffix in JSONL_SUFFIXES:
        values, bad = _read_jsonl(path_text, columns, skip_bad)
    else:
        values, bad = _read_csv(path_text, columns, skip_bad)
    raw_times = values.pop(s.ARRIVAL_TIME_S)
    if columns.time_unit == DATETIME_UNIT:
        origin = int(raw_times.min()) if len(raw_times) else 0
        times_s = (raw_times - origin) / 1e9
        origin_text = format_utc_ns(origin)
    else:
        seconds = raw_times.astype(np.float64) * TIME_UNITS_S[columns.time_unit]
        origin_s = float(seconds.min()) if len(seconds) else 0.0
        times_s = seconds - origin_s
        origin_text = f"{origin_s:.15g} s"
    identity = s.IDENTITY_NONE
    if columns.block_hashes is not None:
        identity = s.IDENTITY_HASHES
        if not columns.hashes_chained:
            values[s.BLOCK_HASHES] = chain_lists(values[s.BLOCK_HASHES])
        has_hashes = values[s.BLOCK_HASHES].is_valid().to_numpy(zero_copy_only=False)
        tokens = columns.hash_block_tokens
        if tokens is None:
            tokens = _one_hash_block_size(values.pop(s.HASH_BLOCK_TOKENS), has_hashes)
        # Set exactly where a row has hashes, as the schema wants.
        values[s.HASH_BLOCK_TOKENS] = pa.array(np.full(len(times_s), tokens, dtype=np.int32), mask=~has_hashes)
    elif columns.prompt_token_ids is not None:
        identity = s.IDENTITY_TOKEN_IDS
    if s.REQUEST_ID not in values:
        values[s.REQUEST_ID] = pa.array(np.arange(len(times_s)).astype(str))
    mapped = ", ".join(f"{f.name}={getattr(columns, f.name)}" for f in dataclasses.fields(columns)
                       if getattr(columns, f.name) is not None and f.name not in columns.by_name
                       and f.name != "by_name")
    named = f"; by name: {', '.join(columns.by_name)}" if columns.by_name else ""
    meta = s.TraceMeta(source_format="generic", source_file=Path(path_text).name, content_identity=identity,
                       time_origin=origin_text, notes=(f"columns: {mapped}{named}",))
    return s.build_table({s.ARRIVAL_TIME_S: times_s, **values}, bad.stamp(meta))


def _one_hash_block_size(sizes: pa.Array, has_hashes: np.ndarray) -> int:
    """The size a hash_block_tokens column gives the rows with hashes (``_size_breaks``
    has refused the rows that disagree)."""
    rows = np.flatnonzero(has_hashes)
    return int(sizes[int(rows[0])].as_py()) if len(rows) else 1


def _size_breaks(hashes: pa.Array, sizes: pa.Array) -> np.ndarray:
    """Rows with hashes whose hash_block_tokens is not the first such row's, or not >= 1:
    a trace's hashes all cover the same number of tokens."""
    has = hashes.is_valid().to_numpy(zero_copy_only=False)
    values = sizes.fill_null(0).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(has)
    if len(rows) == 0:
        return np.zeros(len(has), dtype=bool)
    return has & ((values != values[rows[0]]) | (values < 1))


def _read_jsonl(path: str, columns: ColumnMap, skip_bad: bool) -> tuple[dict, BadLines]:
    if columns.time_unit == DATETIME_UNIT:
        raise TraceError(path, "time_unit", "s, ms, us or ns for a JSONL file (date-times are read from CSV and "
                         "parquet)", got=DATETIME_UNIT)
    optional = {s.SESSION_ID: STR, s.TURN: INT, s.PRIORITY: INT, s.BLOCK_HASHES: INT_LIST,
                s.PROMPT_TOKEN_IDS: INT_LIST}
    wanted = {
        s.ARRIVAL_TIME_S: Field(columns.arrival_time_s, FLOAT),
        s.PROMPT_TOKENS: Field(columns.prompt_tokens, INT, minimum=1),
        s.OUTPUT_TOKENS: Field(columns.output_tokens, INT, minimum=1),
        s.REQUEST_ID: Field(columns.request_id, STR) if columns.request_id else None,
        **{target: Field(getattr(columns, target), kind, minimum=0 if target == s.TURN else None, required=False)
           if getattr(columns, target) else None for target, kind in optional.items()},
        s.HASH_BLOCK_TOKENS: Field(columns.hash_block_tokens_column, INT, required=False)
        if columns.hash_block_tokens_column else None,
    }
    wanted = {target: field for target, field in wanted.items() if field is not None}
    # The first line names the columns, as a header does: a schema-named key that only later
    # lines have would otherwise be dropped without a word.
    sources = {field.name for field in wanted.values()}
    strays = [Field(name, optional.get(name, STR), required=False) for name in MAPPABLE
              if name not in wanted and name not in sources]
    if columns.hash_block_tokens_column:
        hashes, sizes = columns.block_hashes, columns.hash_block_tokens_column
        checks_sizes: tuple[RowCheck, ...] = (RowCheck(
            sizes, "one number of tokens >= 1 in every line with block hashes",
            lambda values: _size_breaks(values[hashes], values[sizes]), shows_value=True),)
    else:
        checks_sizes = ()
    checks = _unique_ids(columns, "line") + checks_sizes + tuple(
        RowCheck(field.name, f"no {field.name} (the first line, which names the columns, has none)",
                 lambda values, name=field.name: values[name].is_valid().to_numpy(zero_copy_only=False))
        for field in strays)
    read = read_jsonl(path, list(wanted.values()) + strays, skip_bad=skip_bad, row_checks=checks)
    values = {target: read.values[field.name] for target, field in wanted.items()}
    values[s.ARRIVAL_TIME_S] = values[s.ARRIVAL_TIME_S].to_numpy(zero_copy_only=False)
    return values, read.bad


def _read_csv(path: str, columns: ColumnMap, skip_bad: bool) -> tuple[dict, BadLines]:
    if columns.block_hashes is not None or columns.prompt_token_ids is not None:
        raise TraceError(path, columns.block_hashes or columns.prompt_token_ids,
                         "a parquet or JSONL file (list columns are not read from CSV)")
    time_kind = DATETIME if columns.time_unit == DATETIME_UNIT else FLOAT
    wanted = {
        s.ARRIVAL_TIME_S: Field(columns.arrival_time_s, time_kind),
        s.PROMPT_TOKENS: Field(columns.prompt_tokens, INT, minimum=1),
        s.OUTPUT_TOKENS: Field(columns.output_tokens, INT, minimum=1),
        s.REQUEST_ID: Field(columns.request_id, STR) if columns.request_id else None,
        s.SESSION_ID: Field(columns.session_id, STR, required=False) if columns.session_id else None,
        s.TURN: Field(columns.turn, INT, minimum=0, required=False) if columns.turn else None,
        s.PRIORITY: Field(columns.priority, INT, required=False) if columns.priority else None,
    }
    wanted = {target: field for target, field in wanted.items() if field is not None}
    read = read_csv(path, list(wanted.values()), skip_bad=skip_bad, row_checks=_unique_ids(columns, "line"))
    values = {target: read.values[field.name] for target, field in wanted.items()}
    values[s.ARRIVAL_TIME_S] = values[s.ARRIVAL_TIME_S].to_numpy(zero_copy_only=False)
    return values, read.bad


def _unique_ids(columns: ColumnMap, unit: str) -> tuple[RowCheck, ...]:
    if columns.request_id is None:
        return ()  # ids are then row numbers, unique by construction
    return (RowCheck(columns.request_id, f"a request id not used by an earlier {unit}",
                     lambda values: repeats(values[columns.request_id]), shows_value=True),)


def _read_parquet(path: str, columns: ColumnMap, skip_bad: bool) -> tuple[dict, BadLines]:
    table = s.read_parquet_file(path)
    wanted = {
        s.ARRIVAL_TIME_S: (columns.arrival_time_s, True),
        s.PROMPT_TOKENS: (columns.prompt_tokens, True),
        s.OUTPUT_TOKENS: (columns.output_tokens, True),
        s.REQUEST_ID: (columns.request_id, True),
        s.SESSION_ID: (columns.session_id, False),
        s.TURN: (columns.turn, False),
        s.PRIORITY: (columns.priority, False),
        s.BLOCK_HASHES: (columns.block_hashes, False),
        s.PROMPT_TOKEN_IDS: (columns.prompt_token_ids, False),
        s.HASH_BLOCK_TOKENS: (columns.hash_block_tokens_column, False),
    }
    values: dict[str, pa.Array] = {}
    bad_rows = np.zeros(table.num_rows, dtype=bool)
    problems: list[TraceError] = []
    for target, (source, required) in wanted.items():
        if source is None:
            continue
        if source not in table.column_names:
            raise TraceError(path, source, f"a column named {source!r}", got=", ".join(table.column_names))
        column = table.column(source).combine_chunks()
        column = _cast(path, source, column, target, columns.time_unit)
        broken = _broken_rows(column, target, required)
        for row in np.flatnonzero(broken & ~bad_rows)[:1]:
            problems.append(TraceError(path, source, _expected(target), line=int(row) + 1,
                                       got=column[int(row)].as_py()))
        bad_rows |= broken
        values[target] = column
    if columns.hash_block_tokens_column is not None:
        breaks = np.flatnonzero(_size_breaks(values[s.BLOCK_HASHES], values[s.HASH_BLOCK_TOKENS]) & ~bad_rows)
        for row in breaks[:1]:
            problems.append(TraceError(path, columns.hash_block_tokens_column, "one number of tokens >= 1 in every "
                                       "row with block hashes", line=int(row) + 1,
                                       got=values[s.HASH_BLOCK_TOKENS][int(row)].as_py()))
        bad_rows[breaks] = True
    if columns.request_id is not None:
        ids = values[s.REQUEST_ID]
        repeated = repeats(ids.filter(pa.array(~bad_rows))) if bad_rows.any() else repeats(ids)
        rows = np.flatnonzero(~bad_rows)[repeated] if bad_rows.any() else np.flatnonzero(repeated)
        for row in rows[:1]:
            problems.append(TraceError(path, columns.request_id, "a request id not used by an earlier row",
                                       line=int(row) + 1, got=ids[int(row)].as_py()))
        bad_rows[rows] = True
    bad = BadLines(path, skip_bad)
    if bad_rows.any():
        if not skip_bad:
            raise min(problems, key=lambda e: e.line)
        for row in np.flatnonzero(bad_rows):
            bad.report(TraceError(path, "row", "valid values in every mapped column", line=int(row) + 1))
        keep = pa.array(~bad_rows)
        values = {target: column.filter(keep) for target, column in values.items()}
    values[s.ARRIVAL_TIME_S] = values[s.ARRIVAL_TIME_S].to_numpy(zero_copy_only=False)
    return values, bad


def _cast(path: str, source: str, column: pa.Array, target: str, time_unit: str) -> pa.Array:
    if target == s.ARRIVAL_TIME_S and time_unit == DATETIME_UNIT:
        if not pa.types.is_timestamp(column.type):
            raise TraceError(path, source, "a timestamp column (time_unit datetime)", got=str(column.type))
        return column.cast(pa.timestamp("ns")).cast(pa.int64())
    target_type = pa.float64() if target == s.ARRIVAL_TIME_S else s.TRACE_SCHEMA.field(target).type
    if target == s.REQUEST_ID or target == s.SESSION_ID:
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                or pa.types.is_integer(column.type)):
            raise TraceError(path, source, "a string or integer column", got=str(column.type))
    try:
        return column.cast(target_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise TraceError(path, source, f"a column castable to {target_type}", got=str(column.type)) from None


def _broken_rows(column: pa.Array, target: str, required: bool) -> np.ndarray:
    broken = column.is_null().to_numpy(zero_copy_only=False) if required else np.zeros(len(column), dtype=bool)
    if target in (s.PROMPT_TOKENS, s.OUTPUT_TOKENS):
        broken |= pc.fill_null(pc.less(column, 1), True).to_numpy(zero_copy_only=False)
    elif target == s.ARRIVAL_TIME_S:
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        broken |= ~np.isfinite(values)
    elif target in (s.BLOCK_HASHES, s.PROMPT_TOKEN_IDS):
        broken |= _lists_with_nulls(column)
    return broken


def _lists_with_nulls(column: pa.Array) -> np.ndarray:
    flat_null = pc.is_null(pc.list_flatten(column)).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
    return np.bincount(parents[flat_null], minlength=len(column)) > 0


def _expected(target: str) -> str:
    return {s.PROMPT_TOKENS: "an integer >= 1", s.OUTPUT_TOKENS: "an integer >= 1",
            s.ARRIVAL_TIME_S: "a finite time", s.REQUEST_ID: "a value in every row",
            s.BLOCK_HASHES: "a list without nulls", s.PROMPT_TOKEN_IDS: "a list without nulls"}.get(target, "a value")
