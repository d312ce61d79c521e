"""Read named fields out of JSONL and CSV files into Arrow columns, with exact bad-line reports.

Each reader first parses the whole file with pyarrow (fast, vectorised). Only if that fails,
or a parsed value breaks a field rule or a row check, does it re-read the file line by line:
that slower pass finds every bad line with its number, raises the earliest one, or, with
``skip_bad``, drops and counts them all.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from kvtwin.traces.bad_lines import BadLines
from kvtwin.traces.errors import TraceError
from kvtwin.traces.fields import (ARROW_TYPES, DATETIME, STR, BadValue, Field, RowCheck, convert_json, convert_text,
                           fast_path_problems)

_JSON_BLOCK_BYTES = 16 << 20  # a block must hold the longest line; Bailian lines can be long


@dataclass
class Columns:
    """Parsed fields (one Arrow array each, absent optional fields all-null) and the bad lines."""

    values: dict[str, pa.Array]
    num_rows: int
    bad: BadLines


def read_jsonl(path: str | os.PathLike, fields: Sequence[Field], *, skip_bad: bool = False,
               row_checks: Sequence[RowCheck] = ()) -> Columns:
    """Read ``fields`` from a JSON-lines file (one object per line; blank lines ignored)."""
    path = os.fspath(path)
    fields = list(fields)
    schema = pa.schema([(f.name, ARROW_TYPES[f.kind]) for f in fields])
    try:
        table = pjson.read_json(path, read_options=pjson.ReadOptions(block_size=_JSON_BLOCK_BYTES),
                                parse_options=pjson.ParseOptions(explicit_schema=schema,
                                                                 unexpected_field_behavior="ignore"))
        values = {f.name: table.column(f.name).combine_chunks() for f in fields}
        if _clean(fields, values, row_checks):
            return Columns(values, table.num_rows, BadLines(path, skip_bad))
    except pa.ArrowInvalid:
        pass  # the line-by-line pass below says exactly what is wrong
    return _finish(path, fields, *_jsonl_rows(path, fields), skip_bad, row_checks)


def read_csv(path: str | os.PathLike, fields: Sequence[Field], *, skip_bad: bool = False,
             row_checks: Sequence[RowCheck] = ()) -> Columns:
    """Read ``fields`` by column name from a CSV file with a header line."""
    path = os.fspath(path)
    header = _csv_header(path)
    fields = list(fields)
    for field in fields:
        if field.required and field.name not in header:
            raise TraceError(path, field.name, f"a column named {field.name!r} in the header",
                             line=1, got=",".join(header))
    present = [f for f in fields if f.name in header]
    types = {f.name: (pa.timestamp("ns") if f.kind == DATETIME else ARROW_TYPES[f.kind]) for f in present}
    try:
        table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(
            include_columns=[f.name for f in present], column_types=types, strings_can_be_null=False))
        values = {}
        for field in fields:
            if field.name not in header:
                values[field.name] = pa.nulls(table.num_rows, ARROW_TYPES[field.kind])
                continue
            column = table.column(field.name).combine_chunks()
            if field.kind == DATETIME:
                column = column.cast(pa.int64())
            elif field.kind == STR:
                column = pc.utf8_trim_whitespace(column)
                column = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
            values[field.name] = column
        if _clean(fields, values, row_checks):
            return Columns(values, table.num_rows, BadLines(path, skip_bad))
    except pa.ArrowInvalid:
        pass
    return _finish(path, fields, *_csv_rows(path, fields, header), skip_bad, row_checks)


def _clean(fields: list[Field], values: dict[str, pa.Array], row_checks: Sequence[RowCheck]) -> bool:
    if fast_path_problems(fields, values):
        return False
    return not any(np.any(check.bad(values)) for check in row_checks)


def _jsonl_rows(path: str, fields: list[Field]) -> tuple[list[dict], list[int], list[TraceError]]:
    rows: list[dict] = []
    lines: list[int] = []
    errors: list[TraceError] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw, object_pairs_hook=_reject_duplicate_keys)
            except ValueError as err:
                errors.append(TraceError(path, "line", "one JSON object per line", line=number,
                                         got=_clip(raw.decode("utf-8", "replace").strip(), str(err))))
                continue
            if not isinstance(record, dict):
                errors.append(TraceError(path, "line", "a JSON object", line=number, got=type(record).__name__))
                continue
            row = _convert_row(path, number, fields, record, convert_json, errors)
            if row is not None:
                rows.append(row)
                lines.append(number)
    return rows, lines, errors


def _csv_header(path: str) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            first = next(csv.reader(handle), None)
    except UnicodeDecodeError:
        raise TraceError(path, "file", "UTF-8 text") from None
    if not first:
        raise TraceError(path, "header", "a first line naming the columns", line=1)
    return [name.strip() for name in first]


def _csv_rows(path: str, fields: list[Field], header: list[str]) -> tuple[list[dict], list[int], list[TraceError]]:
    rows: list[dict] = []
    lines: list[int] = []
    errors: list[TraceError] = []
    position = {name: i for i, name in enumerate(header)}
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as handle:
        reader = csv.reader(handle)
        next(reader)
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            number = reader.line_num
            if len(cells) != len(header):
                errors.append(TraceError(path, "row", f"{len(header)} comma-separated fields", line=number,
                                         got=len(cells)))
                continue
            record = {f.name: cells[position[f.name]] for f in fields if f.name in position}
            row = _convert_row(path, number, fields, record, convert_text, errors)
            if row is not None:
                rows.append(row)
                lines.append(number)
    return rows, lines, errors


def _convert_row(path, number, fields, record, convert, errors) -> dict | None:
    row = {}
    for field in fields:
        value = record.get(field.name)
        try:
            value = None if value is None else convert(field, value)
        except BadValue as bad:
            errors.append(TraceError(path, field.name, field.expected(), line=number, got=bad.got))
            return None
        if value is None and field.required:
            errors.append(TraceError(path, field.name, f"{field.expected()} (it is missing)", line=number))
            return None
        row[field.name] = value
    return row


def _finish(path: str, fields: list[Field], rows: list[dict], lines: list[int], errors: list[TraceError],
            skip_bad: bool, row_checks: Sequence[RowCheck]) -> Columns:
    values = {f.name: pa.array([row[f.name] for row in rows], type=ARROW_TYPES[f.kind]) for f in fields}
    line_numbers = np.asarray(lines, dtype=np.int64)
    keep = np.ones(len(rows), dtype=bool)
    for check in row_checks:
        for index in np.flatnonzero(check.bad(values) & keep):
            got = values[check.field][int(index)].as_py() if check.shows_value else None
            errors.append(TraceError(path, check.field, check.expected, line=int(line_numbers[index]), got=got))
            keep[index] = False
    bad = BadLines(path, skip_bad)
    for err in sorted(errors, key=lambda e: e.line or 0):
        bad.report(err)  # raises the earliest unless skipping
    if not keep.all():
        mask = pa.array(keep)
        values = {name: column.filter(mask) for name, column in values.items()}
    return Columns(values, int(keep.sum()), bad)


class _DuplicateKey(ValueError):
    pass


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        names = [k for k, _ in pairs]
        raise _DuplicateKey(f"duplicate key {next(k for k in names if names.count(k) > 1)!r}")
    return record


def _clip(text: str, reason: str) -> str:
    text = text if len(text) <= 50 else text[:47] + "..."
    return f"{text} ({reason})"
