"""Steps and requests reduced to what a plot draws: time bins over the run, a state's
mean per bin (per replica, then combined), the KV usage per group, CDF quantiles.

Binning first is what lets a run with a million steps render in about a second."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CDF_POINTS = 2000     # a CDF is drawn through this many quantiles at most


def column_array(table: pa.Table, name: str, dtype=float) -> np.ndarray:
    """A column as a NumPy array: floats keep nulls as NaN, other types read them as 0."""
    column = table.column(name)
    if dtype is float:
        return column.to_numpy(zero_copy_only=False).astype(float)
    return column.fill_null(0).to_numpy(zero_copy_only=False).astype(dtype)


def bin_index(t: np.ndarray, t_end: float, nbins: int) -> np.ndarray:
    width = t_end / nbins if t_end > 0 else 1.0
    return np.clip((t / width).astype(np.int64), 0, nbins - 1)


def state_bins(idx: np.ndarray, values: np.ndarray, nbins: int) -> np.ndarray:
    """Mean per bin of a state sampled at steps; an empty bin keeps the previous bin's state."""
    counts = np.bincount(idx, minlength=nbins)
    sums = np.bincount(idx, weights=values, minlength=nbins)
    out = np.full(nbins, np.nan)
    np.divide(sums, counts, out=out, where=counts > 0)
    # Forward fill; before the first step the state is empty (0).
    filled = np.where(np.isnan(out), 0, 1)
    last = np.maximum.accumulate(np.where(filled == 1, np.arange(nbins), -1))
    return np.where(last >= 0, out[np.maximum(last, 0)], 0.0)


def combined_state(idx: np.ndarray, values: np.ndarray, nbins: int, replica: np.ndarray | None,
                   how: str) -> np.ndarray:
    """``state_bins`` per replica, then summed (queues) or averaged (usage) over replicas."""
    if replica is None:
        return state_bins(idx, values, nbins)
    parts = [state_bins(idx[replica == r], values[replica == r], nbins) for r in np.unique(replica)]
    stacked = np.vstack(parts)
    return stacked.sum(axis=0) if how == "sum" else stacked.mean(axis=0)


def usage_matrix(steps: pa.Table) -> tuple[np.ndarray, int]:
    """``kv_cache_usage_by_group`` as an (n, groups) array (``kv_cache_usage`` if absent)."""
    n = steps.num_rows
    if "kv_cache_usage_by_group" not in steps.column_names:
        return column_array(steps, "kv_cache_usage").reshape(n, 1), 1
    lists = steps.column("kv_cache_usage_by_group").combine_chunks()
    if n == 0:
        return np.zeros((0, 1)), 1
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
    width = int(lengths.max()) if len(lengths) else 1
    flat = pc.list_flatten(lists).fill_null(0).to_numpy(zero_copy_only=False).astype(float)
    if width > 0 and (lengths == width).all():
        return flat.reshape(n, width), width
    out = np.zeros((n, max(width, 1)))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(n):  # ragged lists: only in hand-made tables
        out[i, :lengths[i]] = flat[offsets[i]:offsets[i + 1]]
    return out, max(width, 1)


def replica_ids(table: pa.Table) -> np.ndarray | None:
    """The ``replica`` column when it names more than one replica, else None."""
    if "replica" not in table.column_names or table.num_rows == 0:
        return None
    ids = table.column("replica").fill_null(-1).to_numpy(zero_copy_only=False)
    return ids if len(np.unique(ids)) > 1 else None


def cdf_values(values: np.ndarray) -> np.ndarray:
    values = np.sort(values[np.isfinite(values)])
    if len(values) > CDF_POINTS:
        values = np.quantile(values, np.linspace(0, 1, CDF_POINTS))
    return values


def select_columns(table: pa.Table, names: Sequence[str]) -> pa.Table:
    """The named columns a table has (a hand-made or older table may lack some)."""
    return table.select([n for n in names if n in table.column_names])
