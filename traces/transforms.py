"""Trace transforms: time window, request limit, rate scaling, session sampling, concatenation.

Each returns a new schema-conforming table and records itself in the trace's provenance
(``TraceMeta.transforms``), so a converted file says how it was cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.hashing import mix64

IDENTITY_MIXED = "mixed"
_PART_SALT = np.uint64(0xC0_4CA7_0000_0000)


# The cuts of a workload (a scenario's [workload] keys, ``trace convert``'s flags), in the
# order they apply.
CUTS = ("start_s", "end_s", "sample_sessions", "sample_seed", "rate_scale", "limit")


class CutError(ValueError):
    """Cuts that cannot apply to a trace: ``keys`` the settings at fault (as in ``CUTS``),
    for the caller to name as its user spelt them."""

    def __init__(self, keys: tuple[str, ...], expected: str, got: object):
        super().__init__(f"{' and '.join(keys)}: expected {expected}, got {got!r}")
        self.keys = keys
        self.expected = expected
        self.got = got


def apply_cuts(table: pa.Table, cuts: Mapping[str, object]) -> pa.Table:
    """``table`` cut as ``cuts`` (keys of ``CUTS``, values already checked one by one) says,
    in ``CUTS`` order: window, session sample, rate, limit. A cut that leaves none of a
    non-empty trace's requests is a ``CutError``: nothing written or replayed from it could
    answer anything."""

    def nonempty(after: pa.Table, *keys: str) -> pa.Table:
        if after.num_rows == 0 and table.num_rows > 0:
            given = tuple(k for k in keys if k in cuts)
            raise CutError(given, f"a cut that leaves at least one of the {table.num_rows:,} requests",
                           cuts[given[0]] if len(given) == 1 else tuple(cuts[k] for k in given))
        return after

    if "start_s" in cuts or "end_s" in cuts:
        start_s, end_s = cuts.get("start_s", 0.0), cuts.get("end_s")
        if end_s is not None and end_s <= start_s:
            raise CutError(("end_s",), f"a time after start_s ({start_s:g} s)", end_s)
        table = nonempty(time_window(table, start_s, end_s), "start_s", "end_s")
    if "sample_sessions" in cuts:
        table = nonempty(sample_sessions(table, cuts["sample_sessions"], cuts.get("sample_seed", 0)),
                         "sample_sessions")
    if "rate_scale" in cuts:
        table = scale_rate(table, cuts["rate_scale"])
    if "limit" in cuts:
        table = nonempty(limit(table, cuts["limit"]), "limit")
    return table


def _record(table: pa.Table, description: str) -> pa.Table:
    return s.with_meta(table, s.trace_meta(table).with_transform(description))


def _set_times(table: pa.Table, times_s: np.ndarray) -> pa.Table:
    index = table.schema.get_field_index(s.ARRIVAL_TIME_S)
    return table.set_column(index, s.TRACE_SCHEMA.field(s.ARRIVAL_TIME_S), pa.array(times_s, s.ARRIVAL_TIME_TYPE))


def time_window(table: pa.Table, start_s: float = 0.0, end_s: float | None = None) -> pa.Table:
    """Requests arriving in [start_s, end_s), with times shifted so that start_s becomes 0."""
    times = table.column(s.ARRIVAL_TIME_S).to_numpy()
    keep = times >= start_s
    if end_s is not None:
        if end_s <= start_s:
            raise ValueError("end_s must be greater than start_s")
        keep &= times < end_s
    window = _set_times(table.filter(pa.array(keep)), times[keep] - start_s)
    end_text = "end" if end_s is None else f"{end_s:g} s"
    return _record(window, f"window [{start_s:g} s, {end_text}) shifted to 0")


def limit(table: pa.Table, max_requests: int) -> pa.Table:
    """The first ``max_requests`` requests by arrival."""
    if max_requests < 0:
        raise ValueError("max_requests must be >= 0")
    return _record(table.slice(0, max_requests), f"first {max_requests} requests")


def scale_rate(table: pa.Table, factor: float) -> pa.Table:
    """Multiply the arrival rate by ``factor``: > 1 compresses arrivals, < 1 stretches them."""
    if not factor > 0:
        raise ValueError("factor must be > 0")
    times = table.column(s.ARRIVAL_TIME_S).to_numpy()
    return _record(_set_times(table, times / factor), f"rate x{factor:g}")


def sample_sessions(table: pa.Table, fraction: float, seed: int) -> pa.Table:
    """Keep round(fraction * n) of the n sessions, chosen with ``seed``; a request without a
    session is a session of its own. Whole sessions are kept or dropped."""
    if not 0 <= fraction <= 1:
        raise ValueError("fraction must be in [0, 1]")
    sessions = table.column(s.SESSION_ID).combine_chunks()
    # Requests without a session become singleton sessions keyed by their request id.
    keys = pc.if_else(sessions.is_null(), pc.binary_join_element_wise("\x00", table.column(s.REQUEST_ID), ""),
                      sessions)
    unique = pc.unique(keys).sort()
    chosen_count = int(round(fraction * len(unique)))
    chosen = np.random.default_rng(seed).permutation(len(unique))[:chosen_count]
    keep = pc.is_in(keys, value_set=unique.take(pa.array(np.sort(chosen), pa.int64())))
    return _record(table.filter(keep), f"{chosen_count} of {len(unique)} sessions (fraction {fraction:g}, "
                                       f"seed {seed})")


def concat(tables: Sequence[pa.Table], gap_s: float = 0.0, share_prefixes: bool = False) -> pa.Table:
    """Play ``tables`` one after the other, each starting ``gap_s`` after the previous one's last
    arrival. Request and session ids get a ``PART:`` prefix. Unless ``share_prefixes``, the
    block hashes of part i > 0 are re-keyed so that different traces never share a prefix by
    accident (token-id prompts cannot be re-keyed and are left as they are)."""
    if not tables:
        raise ValueError("nothing to concatenate")
    parts = []
    offset_s = 0.0
    metas = [s.trace_meta(t) for t in tables]
    for part, table in enumerate(tables):
        times = table.column(s.ARRIVAL_TIME_S).to_numpy()
        shifted = _set_times(table, times + offset_s)
        if len(times):
            offset_s = float(times.max() + offset_s + gap_s)
        shifted = _prefix_ids(shifted, f"{part}:")
        if part and not share_prefixes:
            shifted = _rekey_hashes(shifted, np.uint64(part))
        parts.append(shifted.replace_schema_metadata(None))
    identities = {m.content_identity for m in metas}
    assumptions = {m.identity_assumption for m in metas} - {None}
    meta = s.TraceMeta(
        source_format="concat",
        source_file=" + ".join(m.source_file or m.source_format for m in metas),
        content_identity=identities.pop() if len(identities) == 1 else IDENTITY_MIXED,
        identity_assumption=assumptions.pop() if len(assumptions) == 1 else None,
        arrivals="; ".join(m.arrivals for m in metas),
        skipped_bad_lines=sum(m.skipped_bad_lines for m in metas),
        notes=tuple(f"part {i}: {note}" for i, m in enumerate(metas) for note in m.notes),
        transforms=(f"concatenated {len(tables)} traces, gap {gap_s:g} s"
                    + (", prefixes shared across parts" if share_prefixes else ""),),
    )
    return s.with_meta(pa.concat_tables(parts), meta)


def _prefix_ids(table: pa.Table, prefix: str) -> pa.Table:
    for name in (s.REQUEST_ID, s.SESSION_ID):
        index = table.schema.get_field_index(name)
        column = pc.binary_join_element_wise(prefix, table.column(name), "")
        table = table.set_column(index, s.TRACE_SCHEMA.field(name), column)
    return table


def _rekey_hashes(table: pa.Table, part: np.uint64) -> pa.Table:
    hashes = table.column(s.BLOCK_HASHES).combine_chunks()
    if hashes.null_count == len(hashes):
        return table
    values = pc.list_flatten(hashes).to_numpy(zero_copy_only=False)
    # A fixed function of (part, id): equal ids stay equal within the part, so chains survive.
    rekeyed = mix64(mix64(_PART_SALT, part), values.astype(np.uint64))
    offsets = hashes.offsets.to_numpy()
    offsets = offsets - offsets[0]
    column = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(rekeyed, s.BLOCK_HASH_TYPE),
                                      mask=hashes.is_null())
    index = table.schema.get_field_index(s.BLOCK_HASHES)
    return table.set_column(index, s.TRACE_SCHEMA.field(s.BLOCK_HASHES), column)

