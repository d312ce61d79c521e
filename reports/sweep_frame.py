"""``capacity.parquet`` read as sweep points: which columns are sweep keys, which of them
vary, how a point's settings read ("replicas=2, kv_cache=4 GiB"), and one line per
combination of the other keys.

The table stays an Arrow table (no pandas: pyarrow imports pandas, when it is installed,
the first time it converts an array, half a second of every command). The report used to
read it through pandas, and its pages are kept byte for byte: the helpers here say which
of pandas' conventions the report's order and text depend on, each where it is reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.reports.html_tables import fmt_cell
from kvtwin.reports.summary_text import missing

RATE_KEY = "workload.rate_scale"
KV_KEY = "engine.kv_cache_memory_bytes"
ROUTER_KEY = "engine.router"
OFFLOAD_KEY = "offload.cpu_bytes"


def sweep_table(capacity: pa.Table) -> pa.Table:
    """The capacity table as the report reads it: a dictionary column as its values, and an
    integer column with a missing value as float64 (NaN where missing). The second is what
    pandas made of such a column; the report's text follows it (a missing point reads
    ``nan``, a sweep value ``2.0`` sorts as such), so it stays."""
    columns = []
    for column in capacity.columns:
        if pa.types.is_dictionary(column.type):
            column = pc.cast(column, column.type.value_type)
        if pa.types.is_integer(column.type) and column.null_count:
            column = pc.cast(column, pa.float64(), safe=False)  # as pandas: 2**53 + 1 reads 2**53
        columns.append(column)
    return pa.Table.from_arrays(columns, names=capacity.column_names)


def column_values(table: pa.Table, name: str) -> list:
    """The column as Python values; a missing float or string is NaN (pandas' marker, which
    a label such as ``point nan`` shows), a missing bool or untyped value None."""
    column = table.column(name)
    values = column.to_pylist()
    if column.null_count and (pa.types.is_floating(column.type) or pa.types.is_string(column.type)
                              or pa.types.is_large_string(column.type)):
        values = [math.nan if v is None else v for v in values]
    return values


def texts(table: pa.Table, name: str) -> list[str | None]:
    """The column as text, None where missing (a null or a NaN): pandas' ``astype(str)``
    (pandas 3), which named groups and told ``ok`` points. ``str`` of a float is its
    shortest repr (``1.0``, ``1e+16``), the same text pandas gave."""
    return [None if missing(v) else str(v) for v in table.column(name).to_pylist()]


def _number(value) -> float:
    """A value as pandas' ``to_numeric(errors="coerce")`` read it: a number, or a string
    holding one; anything else NaN."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str) and "_" not in value:  # float() takes "1_000", pandas does not
        try:
            return float(value)
        except ValueError:
            pass
    return math.nan


def numbers(table: pa.Table, name: str) -> np.ndarray:
    """The column as float64, NaN where missing or not a number."""
    column = table.column(name)
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or pa.types.is_null(kind):
        return np.asarray(pc.cast(column, pa.float64(), safe=False).to_numpy(zero_copy_only=False), dtype=float)
    return np.array([_number(v) for v in column.to_pylist()], dtype=float)


def rows_where(table: pa.Table, mask) -> pa.Table:
    return table.filter(pa.array(np.asarray(mask, dtype=bool), pa.bool_()))


def records(table: pa.Table) -> list[dict]:
    """One dict per row, the values as ``column_values`` gives them."""
    columns = [column_values(table, name) for name in table.column_names]
    return [dict(zip(table.column_names, row)) for row in zip(*columns)]


def with_column(table: pa.Table, name: str, values: np.ndarray) -> pa.Table:
    """``table`` with the column ``name`` set to ``values`` (replaced in place, else added last)."""
    column = pa.array(values)
    if name in table.column_names:
        return table.set_column(table.column_names.index(name), name, column)
    return table.append_column(name, column)


def sweep_keys(frame: pa.Table) -> list[str]:
    """Sweep keys are the dotted columns (``engine.replicas``); summary columns have no dot."""
    return [c for c in frame.column_names if "." in c]


def varying(frame: pa.Table, keys: Sequence[str]) -> list[str]:
    """The keys with more than one value among the points; a missing value is none (as
    pandas' ``nunique`` counted)."""
    return [k for k in keys if len({t for t in texts(frame, k) if t is not None}) > 1]


def key_value(key: str, value) -> str:
    """A sweep value as people read it: byte sizes in GiB."""
    if key.endswith("_bytes") and isinstance(value, (int, float, np.integer, np.floating)) and not missing(value):
        return f"{float(value) / 2**30:,.4g} GiB"
    return fmt_cell(value)


def combo_label(row: Mapping, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1].removesuffix('_memory_bytes')}={key_value(k, row[k])}" for k in keys)


def finite_mask(frame: pa.Table, column: str) -> np.ndarray:
    return np.isfinite(numbers(frame, column))


def finite(frame: pa.Table, column: str) -> pa.Table:
    """The points whose ``column`` is a finite number."""
    return rows_where(frame, finite_mask(frame, column))


def _groups(data: pa.Table, others: Sequence[str]) -> list[pa.Table]:
    """The points per combination of the ``others`` keys, as pandas' ``groupby`` on their
    text gave them: combinations in sorted order of the texts, a point missing any of the
    keys in none, each group's points in table order."""
    if not others:
        return [data] if data.num_rows else []
    keys = list(zip(*(texts(data, k) for k in others)))
    rows_of: dict[tuple, list[int]] = {}
    for index, key in enumerate(keys):
        if None not in key:
            rows_of.setdefault(key, []).append(index)
    return [data.take(pa.array(rows_of[key], pa.int64())) for key in sorted(rows_of)]


def sort_order(values: np.ndarray) -> np.ndarray:
    """The indices that sort ``values``, as pandas' ``sort_values`` found them: NumPy's
    default (quicksort, not stable) over the numbers, then the NaNs in table order. Points
    tied on x stay in the order pandas drew them."""
    nan = np.isnan(values) if values.dtype.kind == "f" else np.zeros(len(values), dtype=bool)
    present = np.flatnonzero(~nan)
    return np.concatenate([present[values[present].argsort(kind="quicksort")], np.flatnonzero(nan)]).astype(np.int64)


def _native_numbers(table: pa.Table, name: str) -> np.ndarray:
    """The column as pandas held it in NumPy: integers and floats keep their dtype (NumPy's
    quicksort orders ties differently per dtype), NaN where a float is missing."""
    column = table.column(name)
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return column.to_numpy(zero_copy_only=False)
    return numbers(table, name)


def lines_by_combo(ok: pa.Table, x: str, y: str, others: Sequence[str]):
    """(label, xs, ys) per combination of the ``others`` keys, sorted along ``x``."""
    series = []
    for part in _groups(finite(ok, y), others):
        part = part.take(pa.array(sort_order(_native_numbers(part, x))))
        label = combo_label(records(part.slice(0, 1))[0], others) if others else ""
        series.append((label, numbers(part, x), numbers(part, y)))
    return series
