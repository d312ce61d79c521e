"""Loader for Mooncake JSONL traces (FAST'25 release).

One request per line: ``timestamp`` (ms from the trace start), ``input_length``,
``output_length`` (tokens) and ``hash_ids``, chained ids of 512-token prompt blocks (the
last block usually partial). The ids are stored as they are; they are checked to be chained
and chained here if they are not.

The published traces' timestamps fall in ~3 s buckets. ``arrivals="auto"`` (the default)
spreads each bucket's requests uniformly over the bucket with a seeded draw
(``arrivals.spread_within_buckets``) when the timestamps are bucketed
(``arrivals.bucketing`` says what that means) and keeps them, with a note, when they are
not (a Mooncake-format log of real millisecond arrivals); ``arrivals="spread"`` spreads
whatever the timestamps, ``arrivals="burst"`` keeps the recorded times, so every bucket
arrives at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.arrivals import bucketing, spread_within_buckets
from kvtwin.traces.fields import FLOAT, INT, INT_LIST, Field, RowCheck
from kvtwin.traces.hashing import chain_lists, list_positions
from kvtwin.traces.options import ARRIVAL_MODES, AUTO, BURST, DEFAULT_SPREAD_SEED, SPREAD
from kvtwin.traces.readers import read_jsonl

MOONCAKE_BLOCK_TOKENS = 512

FIELDS = (
    Field("timestamp", FLOAT, minimum=0),
    Field("input_length", INT, minimum=1),
    Field("output_length", INT, minimum=1),
    Field("hash_ids", INT_LIST),
)


def _too_many_hashes(columns: dict[str, pa.Array]) -> np.ndarray:
    lengths = pc.list_value_length(columns["hash_ids"]).to_numpy(zero_copy_only=False)
    inputs = columns["input_length"].to_numpy(zero_copy_only=False)
    return lengths > -(-inputs // MOONCAKE_BLOCK_TOKENS)


CHECKS = (RowCheck("hash_ids", f"at most ceil(input_length / {MOONCAKE_BLOCK_TOKENS}) ids", _too_many_hashes),)


def load_mooncake(path: str | os.PathLike, *, arrivals: str = AUTO, seed: int = DEFAULT_SPREAD_SEED,
                  bucket_s: float | None = None, skip_bad: bool = False,
                  spread_hint: str = f"--arrivals {SPREAD}") -> pa.Table:
    """Load a Mooncake JSONL trace into the trace schema (see the module docstring).
    ``spread_hint`` is how the caller's user forces spreading, for the note that says the
    timestamps were kept."""
    if arrivals not in ARRIVAL_MODES:
        raise ValueError(f"arrivals must be one of {ARRIVAL_MODES}, not {arrivals!r}")
    columns = read_jsonl(path, FIELDS, skip_bad=skip_bad, row_checks=CHECKS)
    values = columns.values
    times_s = values["timestamp"].to_numpy(zero_copy_only=False) / 1000.0
    notes: tuple[str, ...] = ()
    buckets = bucketing(times_s)
    if arrivals == SPREAD or (arrivals == AUTO and buckets.width_s is not None):
        order = np.argsort(times_s, kind="stable")
        spread, width_s = spread_within_buckets(times_s[order], seed, bucket_s if bucket_s is not None
                                                else buckets.width_s)
        times_s = np.empty_like(spread)
        times_s[order] = spread
        arrivals_text = f"spread uniformly within {width_s:g} s buckets (seed {seed})"
    elif buckets.width_s is not None:
        arrivals_text = f"as recorded (bursts: the requests of a {buckets.width_s:g} s bucket arrive together)"
    else:
        arrivals_text = "as recorded (the timestamps are not bucketed)"
        if arrivals == AUTO and columns.num_rows:
            notes = (f"arrival times kept as recorded: the timestamps are not bucketed ({buckets.reason}); "
                     f"{spread_hint} spreads them over the median gap anyway",)
    hashes = values["hash_ids"]
    if not ids_are_chained(hashes):
        hashes = chain_lists(hashes)
        notes += ("hash_ids were not chained (an id seen after different predecessors); chained them",)
    meta = s.TraceMeta(source_format="mooncake", source_file=Path(path).name,
                       content_identity=s.IDENTITY_HASHES, arrivals=arrivals_text, notes=notes)
    table = s.build_table({
        s.REQUEST_ID: pa.array(np.arange(columns.num_rows).astype(str)),
        s.ARRIVAL_TIME_S: times_s,
        s.PROMPT_TOKENS: values["input_length"],
        s.OUTPUT_TOKENS: values["output_length"],
        s.BLOCK_HASHES: hashes,
        s.HASH_BLOCK_TOKENS: np.full(columns.num_rows, MOONCAKE_BLOCK_TOKENS, dtype=np.int32),
    }, columns.bad.stamp(meta))
    return table


def ids_are_chained(lists: pa.ListArray) -> bool:
    """Whether every id always follows the same predecessor (so it names a whole prefix)."""
    offsets, positions = list_positions(lists)
    ids = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(ids) == 0:
        return True
    # Predecessor of each id within its list; -1 marks a list's first block.
    parents = np.concatenate(([-1], ids[:-1]))
    parents[positions == 0] = -1
    order = np.argsort(ids, kind="stable")
    ids, parents = ids[order], parents[order]
    same = ids[1:] == ids[:-1]
    return bool(np.all(parents[1:][same] == parents[:-1][same]))
