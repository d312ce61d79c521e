"""Steps and requests reduced to what a plot draws: time bins over the run, a state's
mean, minimum and maximum per bin (per replica, then combined), the KV usage per group,
CDF quantiles.

Binning first is what lets a run with a million steps render in under a second. The
downsampling is deterministic (fixed bins over the run, no sampling) and keeps the
extremes visible: a state over time is drawn as its mean per bin over the band from its
minimum to its maximum in that bin (``state_bins``), so a one-step spike still reaches
its height; a CDF is drawn through at most ``CDF_POINTS`` quantiles, the 0th and the
100th among them (``cdf_values``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

CDF_POINTS = 2000     # a CDF is drawn through this many quantiles at most


def numbers(values: pa.Array | pa.ChunkedArray, null: float = 0) -> np.ndarray:
    """An integer or floating-point Arrow column or array as NumPy, each null read as
    ``null`` (a chunk of any other type goes through ``to_numpy`` as it is).

    The chunks are read straight from their buffers: ``to_numpy`` and ``fill_null`` do
    the same work but first import pandas where it is installed, which costs a report
    about 0.3 s of its start-up."""
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    parts = []
    for chunk in chunks:
        kind = ("f" if pa.types.is_floating(chunk.type) and chunk.type.bit_width > 16 else
                "i" if pa.types.is_signed_integer(chunk.type) else
                "u" if pa.types.is_unsigned_integer(chunk.type) else None)
        if kind is None:
            parts.append(chunk.to_numpy(zero_copy_only=False))
            continue
        if not len(chunk):
            continue
        dtype = np.dtype(f"{kind}{chunk.type.bit_width // 8}")
        array = np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)
        if chunk.null_count:
            array = np.where(_valid(chunk), array, null)
        parts.append(array)
    return np.concatenate(parts) if parts else np.zeros(0)


def _valid(array: pa.Array) -> np.ndarray:
    """Which of the array's entries are not null, from its validity bitmap."""
    bits = np.unpackbits(np.frombuffer(array.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[array.offset:array.offset + len(array)].astype(bool)


def column_array(table: pa.Table, name: str, dtype=float) -> np.ndarray:
    """A column as a NumPy array: floats keep nulls as NaN, other types read them as 0."""
    column = table.column(name)
    if dtype is float:
        return numbers(column, null=np.nan).astype(float)
    return numbers(column).astype(dtype)


def bin_index(t: np.ndarray, t_end: float, nbins: int) -> np.ndarray:
    width = t_end / nbins if t_end > 0 else 1.0
    return np.clip((t / width).astype(np.int64), 0, nbins - 1)


def state_bins(idx: np.ndarray, values: np.ndarray, nbins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, minimum and maximum per bin of a state sampled at steps (given in step order).

    An empty bin holds the state the last step before it left (mean = min = max = that
    value); before the first step the state is empty (0)."""
    mean, lo, hi, last = np.zeros(nbins), np.zeros(nbins), np.zeros(nbins), np.zeros(nbins)
    filled = np.zeros(nbins, dtype=bool)
    if len(idx):
        values = np.asarray(values, dtype=float)
        counts = np.bincount(idx, minlength=nbins)
        filled = counts > 0
        np.divide(np.bincount(idx, weights=values, minlength=nbins), counts, out=mean, where=filled)
        order = np.argsort(idx, kind="stable")  # stable: the steps of a bin keep their order
        sorted_idx, v = idx[order], values[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_idx[1:] != sorted_idx[:-1]]))
        bins = sorted_idx[starts]
        lo[bins] = np.minimum.reduceat(v, starts)
        hi[bins] = np.maximum.reduceat(v, starts)
        last[bins] = v[np.concatenate([starts[1:], [len(v)]]) - 1]
    # The state an empty bin holds: the last value of the nearest filled bin before it.
    position = np.maximum.accumulate(np.where(filled, np.arange(nbins), -1))
    held = np.concatenate([[0.0], np.where(position >= 0, last[np.maximum(position, 0)], 0.0)[:-1]])
    return tuple(np.where(filled, x, held) for x in (mean, lo, hi))  # type: ignore[return-value]


def combined_state(idx: np.ndarray, values: np.ndarray, nbins: int, replica: np.ndarray | None,
                   how: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``state_bins`` (mean, min, max) per replica, then summed (queues) or averaged (usage)
    over replicas. Summed, the min and max bound the cluster's range: the replicas'
    extremes in a bin need not coincide."""
    if replica is None:
        return state_bins(idx, values, nbins)
    parts = [state_bins(idx[replica == r], values[replica == r], nbins) for r in np.unique(replica)]
    combine = np.sum if how == "sum" else np.mean
    return tuple(combine(np.vstack([p[k] for p in parts]), axis=0) for k in range(3))  # type: ignore[return-value]


def usage_matrix(steps: pa.Table) -> tuple[np.ndarray, int]:
    """``kv_cache_usage_by_group`` as an (n, groups) array (``kv_cache_usage`` if absent)."""
    n = steps.num_rows
    if "kv_cache_usage_by_group" not in steps.column_names:
        return column_array(steps, "kv_cache_usage").reshape(n, 1), 1
    lists = steps.column("kv_cache_usage_by_group").combine_chunks()
    if n == 0:
        return np.zeros((0, 1)), 1
    # Read through the offsets: ``pc.list_value_length`` and ``pc.list_flatten`` would
    # import Arrow's compute module, about 50 ms of a report's start-up.
    offsets = numbers(lists.offsets).astype(np.int64)  # into lists.values, n + 1 of them
    lengths = np.diff(offsets)
    if lists.null_count:
        lengths = np.where(_valid(lists), lengths, 0)
    values = numbers(lists.values).astype(float)
    width = int(lengths.max()) if len(lengths) else 1
    if width > 0 and (lengths == width).all():  # no nulls then: the rows are contiguous
        return values[offsets[0]:offsets[-1]].reshape(n, width), width
    out = np.zeros((n, max(width, 1)))
    for i in range(n):  # ragged lists: only in hand-made tables
        out[i, :lengths[i]] = values[offsets[i]:offsets[i] + lengths[i]]
    return out, max(width, 1)


def replica_ids(table: pa.Table) -> np.ndarray | None:
    """The ``replica`` column when it names more than one replica, else None."""
    if "replica" not in table.column_names or table.num_rows == 0:
        return None
    ids = numbers(table.column("replica"), null=-1)
    return ids if len(np.unique(ids)) > 1 else None


def hit_rate_bins(requests: pa.Table, t_end: float, nbins: int) -> tuple[np.ndarray, np.ndarray]:
    """The prefix-cache hit rate per time bin: prompt tokens found over tokens looked up,
    summed over the requests first scheduled in each bin (NaN where none looked up);
    the bins' middles and the rates, both empty when no request was scheduled."""
    sched = column_array(requests, "first_scheduled_time_s") if requests.num_rows else np.zeros(0)
    seen = np.isfinite(sched)
    if not seen.any():
        return np.zeros(0), np.zeros(0)
    idx = bin_index(sched[seen], t_end, nbins)
    queries = np.bincount(idx, weights=column_array(requests, "prefix_cache_queries", np.int64)[seen],
                          minlength=nbins)
    hits = np.bincount(idx, weights=column_array(requests, "prefix_cache_hits", np.int64)[seen], minlength=nbins)
    rate = np.full(nbins, np.nan)
    np.divide(hits, queries, out=rate, where=queries > 0)
    return (np.arange(nbins) + 0.5) * (t_end / nbins), rate


def cdf_values(values: np.ndarray) -> np.ndarray:
    values = np.sort(values[np.isfinite(values)])
    if len(values) > CDF_POINTS:
        values = np.quantile(values, np.linspace(0, 1, CDF_POINTS))
    return values


def minmax_points(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """A line of at most ``max_points`` points drawn like the whole ``(x, y)``: the points
    are cut into ``max_points // 2`` runs of (nearly) equal length, and each run keeps its
    lowest and its highest point, in their order (NaNs are neither). Deterministic, and
    every extreme of the line stays on it; a line short enough is returned as it is."""
    x, y = np.asarray(x), np.asarray(y, dtype=float)
    if len(y) <= max_points:
        return x, y
    runs = max(1, max_points // 2)
    edges = np.linspace(0, len(y), runs + 1).astype(np.int64)
    low, high = np.where(np.isnan(y), np.inf, y), np.where(np.isnan(y), -np.inf, y)
    keep = set()
    for start, end in zip(edges[:-1], edges[1:]):
        keep.add(start + int(np.argmin(low[start:end])))
        keep.add(start + int(np.argmax(high[start:end])))
    index = np.array(sorted(keep), dtype=np.int64)
    return x[index], y[index]


def select_columns(table: pa.Table, names: Sequence[str]) -> pa.Table:
    """The named columns a table has (a hand-made or older table may lack some)."""
    return table.select([n for n in names if n in table.column_names])
