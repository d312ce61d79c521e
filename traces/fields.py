"""Source-field specs for the file readers: what a field must hold and how one value is checked.

The readers try a vectorised pyarrow parse first; when it fails or any check does not pass
they re-read line by line with the converters here, which name the exact line and field.
"""

from __future__ import annotations

import calendar
import datetime
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

INT = "int"
FLOAT = "float"
STR = "str"
INT_LIST = "int_list"
DATETIME = "datetime"

ARROW_TYPES = {
    INT: pa.int64(),
    FLOAT: pa.float64(),
    STR: pa.string(),
    INT_LIST: pa.list_(pa.int64()),
    DATETIME: pa.int64(),  # nanoseconds since 1970-01-01, the timestamp read as UTC
}

_INT64_MAX = 2**63 - 1
_DATETIME = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?$")


@dataclass(frozen=True)
class Field:
    """One source field: its name in the file, its kind, a lower bound, whether it may be absent."""

    name: str
    kind: str
    minimum: float | None = None
    required: bool = True

    def expected(self) -> str:
        what = {INT: "an integer", FLOAT: "a number", STR: "a string",
                INT_LIST: "a list of integers >= 0", DATETIME: "a date-time YYYY-MM-DD HH:MM:SS[.fraction]"}[self.kind]
        if self.minimum is not None:
            what += f" >= {self.minimum:g}"
        return what


@dataclass(frozen=True)
class RowCheck:
    """A whole-row rule on parsed columns: ``bad(columns)`` is a mask of rows breaking it."""

    field: str
    expected: str
    bad: Callable[[dict[str, pa.Array]], np.ndarray]
    shows_value: bool = False  # the error quotes the row's value of ``field`` (short values only)


def repeats(column: pa.Array) -> np.ndarray:
    """Mask of the rows whose value an earlier row already holds (nulls repeat nothing)."""
    codes = column.dictionary_encode().indices.fill_null(-1).to_numpy(zero_copy_only=False)
    _, first = np.unique(codes, return_index=True)
    mask = np.ones(len(codes), dtype=bool)
    mask[first] = False
    return mask & (codes >= 0)


class BadValue(Exception):
    """A value that does not fit its field (carries what was seen)."""

    def __init__(self, got: object):
        super().__init__(repr(got))
        self.got = got


def convert_json(field: Field, value: object) -> object:
    """Check one decoded JSON value against ``field``; returns the value to store."""
    if field.kind == INT:
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _INT64_MAX:
            raise BadValue(value)
        return _at_least(field, value)
    if field.kind == FLOAT:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadValue(value)
        return _at_least(field, float(value))
    if field.kind == STR:
        if not isinstance(value, str):
            raise BadValue(value)
        return value
    if field.kind == INT_LIST:
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _INT64_MAX for v in value):
            raise BadValue(_shorten(value))
        return value
    raise ValueError(f"field kind {field.kind!r} is not read from JSON")


def convert_text(field: Field, text: str) -> object:
    """Check one CSV cell against ``field``; returns the value to store (None for empty)."""
    text = text.strip()
    if text == "":
        return None
    try:
        if field.kind == INT:
            return _at_least(field, int(text))
        if field.kind == FLOAT:
            number = float(text)
            if not math.isfinite(number):
                raise ValueError
            return _at_least(field, number)
        if field.kind == STR:
            return text
        if field.kind == DATETIME:
            return _datetime_ns(text)
    except ValueError:
        raise BadValue(text) from None
    raise ValueError(f"field kind {field.kind!r} is not read from CSV")


def _at_least(field: Field, value: float) -> float:
    if field.minimum is not None and value < field.minimum:
        raise BadValue(value)
    return value


def _datetime_ns(text: str) -> int:
    match = _DATETIME.match(text)
    if match is None:
        raise ValueError(text)
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    datetime.datetime(year, month, day, hour, minute, second)  # raises ValueError on e.g. Feb 30
    fraction = match.group(7) or ""
    nanos = int(fraction.ljust(9, "0")) if fraction else 0
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    return seconds * 1_000_000_000 + nanos


def _shorten(value: object) -> object:
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."


def fast_path_problems(fields: list[Field], columns: dict[str, pa.Array]) -> bool:
    """Whether vectorised columns hold anything the line-by-line converters would reject."""
    for field in fields:
        column = columns.get(field.name)
        if column is None:
            if field.required:
                return True
            continue
        if field.required and column.null_count:
            return True
        if field.kind == INT_LIST:
            flat = column.flatten()
            if flat.null_count or (len(flat) and np.min(flat.to_numpy(zero_copy_only=False)) < 0):
                return True
        elif field.kind == FLOAT:
            values = column.drop_null().to_numpy()
            if len(values) and not np.all(np.isfinite(values)):
                return True
        if field.minimum is not None and field.kind in (INT, FLOAT):
            values = column.drop_null().to_numpy()
            if len(values) and values.min() < field.minimum:
                return True
    return False
