"""The one trace schema: column names and Arrow types, provenance metadata, parquet I/O.

Every loader and generator produces a ``pyarrow.Table`` with exactly the columns of
``TRACE_SCHEMA`` (in that order) and a JSON provenance record under the schema metadata
key ``kvtwin.trace``. ``SCHEMA.md`` next to this file documents the columns for users.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# The names are re-exported: ``schema.REQUEST_ID`` and the rest are what the loaders use.
from kvtwin.traces.columns import (ARRIVAL_TIME_S, BLOCK_HASHES, HASH_BLOCK_TOKENS, OUTPUT_TOKENS, PRIORITY,
                                  PROMPT_TOKEN_IDS, PROMPT_TOKENS, REQUEST_ID, SESSION_ID, TURN)
from kvtwin.traces.errors import TraceError

SCHEMA_VERSION = 1
METADATA_KEY = b"kvtwin.trace"

REQUEST_ID_TYPE = pa.string()
ARRIVAL_TIME_TYPE = pa.float64()
TOKENS_TYPE = pa.int32()
SESSION_ID_TYPE = pa.string()
TURN_TYPE = pa.int32()
PRIORITY_TYPE = pa.int32()
BLOCK_HASH_TYPE = pa.uint64()
BLOCK_HASHES_TYPE = pa.list_(BLOCK_HASH_TYPE)
HASH_BLOCK_TOKENS_TYPE = pa.int32()
TOKEN_ID_TYPE = pa.int32()
PROMPT_TOKEN_IDS_TYPE = pa.list_(TOKEN_ID_TYPE)

TRACE_SCHEMA = pa.schema([
    pa.field(REQUEST_ID, REQUEST_ID_TYPE, nullable=False),
    pa.field(ARRIVAL_TIME_S, ARRIVAL_TIME_TYPE, nullable=False),
    pa.field(PROMPT_TOKENS, TOKENS_TYPE, nullable=False),
    pa.field(OUTPUT_TOKENS, TOKENS_TYPE, nullable=False),
    pa.field(SESSION_ID, SESSION_ID_TYPE),
    pa.field(TURN, TURN_TYPE),
    pa.field(PRIORITY, PRIORITY_TYPE),
    pa.field(BLOCK_HASHES, BLOCK_HASHES_TYPE),
    pa.field(HASH_BLOCK_TOKENS, HASH_BLOCK_TOKENS_TYPE),
    pa.field(PROMPT_TOKEN_IDS, PROMPT_TOKEN_IDS_TYPE),
])
REQUIRED_COLUMNS = (REQUEST_ID, ARRIVAL_TIME_S, PROMPT_TOKENS, OUTPUT_TOKENS)

# What identifies a request's prompt content, recorded in TraceMeta.content_identity.
IDENTITY_HASHES = "block_hashes"
IDENTITY_TOKEN_IDS = "prompt_token_ids"
IDENTITY_NONE = "none"
# TraceMeta.identity_assumption when hashes were derived from sessions, not content.
ASSUMPTION_SESSION_HISTORY = "session_history"


@dataclass(frozen=True)
class TraceMeta:
    """Provenance of a trace table, stored as JSON in the parquet schema metadata."""

    source_format: str
    source_file: str = ""
    content_identity: str = IDENTITY_NONE
    identity_assumption: str | None = None
    arrivals: str = "as recorded"
    time_origin: str | None = None
    skipped_bad_lines: int = 0
    bad_line_reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    transforms: tuple[str, ...] = ()
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TraceMeta:
        raw = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in names}
        return cls(**kwargs)

    def with_note(self, note: str) -> TraceMeta:
        return dataclasses.replace(self, notes=self.notes + (note,))

    def with_transform(self, description: str) -> TraceMeta:
        return dataclasses.replace(self, transforms=self.transforms + (description,))


def trace_meta(table: pa.Table) -> TraceMeta:
    """The provenance record of ``table`` (a bare one if the table carries none)."""
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return TraceMeta(source_format="unknown")
    return TraceMeta.from_json(raw.decode())


def with_meta(table: pa.Table, meta: TraceMeta) -> pa.Table:
    """``table`` with its provenance replaced by ``meta``."""
    return table.replace_schema_metadata({METADATA_KEY: meta.to_json().encode()})


def build_table(columns: dict[str, object], meta: TraceMeta) -> pa.Table:
    """Assemble a schema-conforming table from whichever columns are given.

    Missing optional columns become all-null; given ones are cast to the schema type.
    Rows are ordered by arrival time (stable, so ties keep their source order).
    """
    unknown = set(columns) - set(TRACE_SCHEMA.names)
    if unknown:
        raise ValueError(f"not trace columns: {sorted(unknown)}")
    num_rows = len(columns[ARRIVAL_TIME_S])
    arrays = []
    for field in TRACE_SCHEMA:
        value = columns.get(field.name)
        if value is None:
            arrays.append(pa.nulls(num_rows, field.type))
        else:
            arrays.append(_as_array(value, field.type))
    table = pa.Table.from_arrays(arrays, schema=TRACE_SCHEMA)
    times = table.column(ARRIVAL_TIME_S).to_numpy()
    if num_rows > 1 and np.any(np.diff(times) < 0):
        table = table.take(pa.array(np.argsort(times, kind="stable")))
    return with_meta(table, meta)


def _as_array(value: object, type_: pa.DataType) -> pa.Array:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        return value if value.type == type_ else value.cast(type_)
    return pa.array(value, type=type_)


def hash_block_tokens_of(table: pa.Table) -> int | None:
    """The one hash block size of a trace's ``block_hashes`` (None when it has none)."""
    column = table.column(HASH_BLOCK_TOKENS).drop_null()
    if len(column) == 0:
        return None
    sizes = pc.unique(column).to_pylist()
    if len(sizes) > 1:
        raise ValueError(f"trace mixes hash block sizes {sorted(sizes)}")
    return int(sizes[0])


def validate(table: pa.Table, path: str = "<table>") -> None:
    """Check the invariants every consumer relies on; raise TraceError on the first breach."""
    if table.schema.remove_metadata() != TRACE_SCHEMA:
        expected = ", ".join(f"{f.name}: {f.type}" for f in TRACE_SCHEMA)
        got = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
        raise TraceError(path, "schema", f"the kvtwin trace schema ({expected})", got=got)
    for name in REQUIRED_COLUMNS:
        if table.column(name).null_count:
            raise TraceError(path, name, "a value in every row", line=_first_row(table.column(name).is_null()))
    times = table.column(ARRIVAL_TIME_S).to_numpy()
    if len(times) and (not np.all(np.isfinite(times)) or times.min() < 0):
        raise TraceError(path, ARRIVAL_TIME_S, "finite seconds >= 0", line=_first_row(~(np.isfinite(times) & (times >= 0))))
    if np.any(np.diff(times) < 0):
        raise TraceError(path, ARRIVAL_TIME_S, "rows in arrival order", line=_first_row(np.diff(times) < 0) + 1)
    for name in (PROMPT_TOKENS, OUTPUT_TOKENS):
        counts = table.column(name).to_numpy()
        if len(counts) and counts.min() < 1:
            raise TraceError(path, name, "an integer >= 1", line=_first_row(counts < 1))
    if pc.count_distinct(table.column(REQUEST_ID)).as_py() != table.num_rows:
        ids = table.column(REQUEST_ID).combine_chunks()
        codes = ids.dictionary_encode().indices.to_numpy(zero_copy_only=False)
        _, first = np.unique(codes, return_index=True)
        row = int(np.setdiff1d(np.arange(len(codes)), first)[0])
        raise TraceError(path, REQUEST_ID, "unique request ids", line=row + 1, got=ids[row].as_py())
    _validate_identity(table, path)


def _validate_identity(table: pa.Table, path: str) -> None:
    prompt = table.column(PROMPT_TOKENS).to_numpy()
    hashes = table.column(BLOCK_HASHES)
    has_hashes = hashes.is_valid().to_numpy(zero_copy_only=False)
    block = table.column(HASH_BLOCK_TOKENS)
    has_block = block.is_valid().to_numpy(zero_copy_only=False)
    if np.any(has_hashes != has_block):
        raise TraceError(path, HASH_BLOCK_TOKENS, f"a value exactly where {BLOCK_HASHES} is set",
                         line=_first_row(has_hashes != has_block))
    if has_hashes.any():
        sizes = block.fill_null(1).to_numpy()
        if sizes.min() < 1:
            raise TraceError(path, HASH_BLOCK_TOKENS, "an integer >= 1", line=_first_row(sizes < 1))
        lengths = pc.list_value_length(hashes).fill_null(0).to_numpy()
        too_many = lengths > -(-prompt // sizes)
        if too_many.any():
            raise TraceError(path, BLOCK_HASHES, "at most ceil(prompt_tokens / hash_block_tokens) hashes",
                             line=_first_row(too_many))
    ids = table.column(PROMPT_TOKEN_IDS)
    if ids.null_count != table.num_rows:
        has_ids = ids.is_valid().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(ids).fill_null(0).to_numpy()
        wrong = has_ids & (lengths != prompt)
        if wrong.any():
            raise TraceError(path, PROMPT_TOKEN_IDS, "exactly prompt_tokens ids", line=_first_row(wrong))


def _first_row(mask: object) -> int:
    """1-based row number of the first true entry (used as the 'line' of a table row)."""
    if isinstance(mask, (pa.Array, pa.ChunkedArray)):
        mask = mask.to_numpy(zero_copy_only=False)
    return int(np.flatnonzero(np.asarray(mask))[0]) + 1


def write_parquet(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write ``table`` to ``path`` via a temp file in the same folder and an atomic rename."""
    path = Path(path)
    validate(table, str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_temp_file(path)
    except OSError as err:
        raise _unwritable(path, err) from None
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _unwritable(path, err) from None
        raise
    return path


def _new_temp_file(path: Path) -> Path:
    """An empty file beside ``path`` that the rename will turn into it. Created with mode
    0o666, so the umask decides its mode as for any new file (mkstemp's 0o600 would leave
    every trace readable by its owner only)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(17, "no free temporary name", str(path.parent))


def _unwritable(path: Path, err: OSError) -> TraceError:
    # Named after the path the user gave, not the temp file the error happened on.
    return TraceError(str(path), "output", "a file path kvtwin can write", got=err.strerror or str(err))


def read_parquet(path: str | os.PathLike) -> pa.Table:
    """Read a trace parquet file written by ``write_parquet`` and check it."""
    table = read_parquet_file(path)
    if METADATA_KEY not in (table.schema.metadata or {}):
        raise TraceError(str(path), "schema metadata", f"a {METADATA_KEY.decode()} provenance record "
                         "(a parquet file not written by kvtwin: load it with the generic loader and a column map)")
    validate(table, str(path))
    return table


def is_trace_parquet(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a parquet file carrying kvtwin trace metadata."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except pa.ArrowException as err:
        raise _not_parquet(path, err) from None
    return METADATA_KEY in metadata


def read_parquet_file(path: str | os.PathLike) -> pa.Table:
    """Every column of the parquet file at ``path``; a file that is not parquet (whatever its
    name says) is a TraceError naming it, not Arrow's exception."""
    try:
        # One file: read without Arrow's dataset layer and its import.
        with pq.ParquetFile(path) as parquet:
            return parquet.read()
    except pa.ArrowException as err:
        raise _not_parquet(path, err) from None


def _not_parquet(path: str | os.PathLike, err: Exception) -> TraceError:
    return TraceError(os.fspath(path), "file", "a parquet file", got=str(err).strip())
