"""What ``kvtwin trace info`` reports: size, rate, length distributions, sessions, prefix reuse.

Percentiles interpolate linearly (numpy's default), as the published trace statistics do.
The prefix-reuse upper bound is what an infinite prefix cache would hit: per request, the
leading run of prompt blocks whose id was already seen in an earlier request, over all
prompt blocks (a partial last block counts as a block).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.expand import table_block_ids

DEFAULT_BLOCK_TOKENS = 16  # for traces whose hashes do not suggest a block size


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p99: float
    max: float


@dataclass(frozen=True)
class SessionStats:
    sessions: int
    requests_in_sessions: int
    multi_turn_sessions: int
    max_turns: int


@dataclass(frozen=True)
class PrefixReuse:
    block_tokens: int
    blocks: int
    reused_blocks: int
    block_fraction: float
    token_fraction: float


@dataclass(frozen=True)
class TraceStats:
    requests: int
    duration_s: float
    rate_per_s: float | None
    input_tokens: Distribution
    output_tokens: Distribution
    sessions: SessionStats | None
    block_tokens: int
    prefix_reuse: PrefixReuse | None
    content_identity: str
    identity_assumption: str | None

    def to_json(self) -> dict:
        """The ``trace info --json`` object."""
        out = dataclasses.asdict(self)
        out["prefix_reuse_upper_bound"] = None if self.prefix_reuse is None else self.prefix_reuse.block_fraction
        return out


def distribution(values: np.ndarray) -> Distribution:
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        nan = float("nan")
        return Distribution(nan, nan, nan, nan)
    p50, p99 = np.percentile(values, [50, 99])
    return Distribution(float(values.mean()), float(p50), float(p99), float(values.max()))


def session_stats(table: pa.Table) -> SessionStats | None:
    sessions = table.column(s.SESSION_ID)
    if sessions.null_count == table.num_rows:
        return None
    counts = pc.value_counts(sessions.drop_null()).field("counts").to_numpy()
    return SessionStats(sessions=len(counts), requests_in_sessions=int(counts.sum()),
                        multi_turn_sessions=int((counts >= 2).sum()), max_turns=int(counts.max()))


def prefix_reuse(block_ids: pa.ListArray, prompt_tokens: np.ndarray, block_tokens: int) -> PrefixReuse:
    """Infinite-cache reuse of ``block_ids`` (chained ids, rows in arrival order)."""
    if isinstance(block_ids, pa.ChunkedArray):
        block_ids = block_ids.combine_chunks()
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    lengths = pc.list_value_length(block_ids).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    ids = pc.list_flatten(block_ids).to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    positions = np.arange(len(ids)) - starts[rows]
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    seen_before = rows[first][inverse] < rows
    # Leading run: index of the first block not seen before, or the whole list.
    stop = np.where(seen_before, lengths[rows], positions)
    runs = np.zeros(len(lengths), dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        runs[nonempty] = np.minimum.reduceat(stop, starts[nonempty])
    # Blocks a prompt has even where its hashes stop short count as not reused.
    blocks = np.maximum(-(-prompt // block_tokens), lengths)
    total_blocks = int(blocks.sum())
    reused = int(runs.sum())
    reused_tokens = np.minimum(runs * block_tokens, prompt).sum()
    return PrefixReuse(block_tokens=block_tokens, blocks=total_blocks, reused_blocks=reused,
                       block_fraction=reused / total_blocks if total_blocks else 0.0,
                       token_fraction=float(reused_tokens / prompt.sum()) if prompt.sum() else 0.0)


def summarize(table: pa.Table, block_tokens: int | None = None) -> TraceStats:
    """All of ``trace info`` for a trace table; ``block_tokens`` defaults to the hash block size."""
    meta = s.trace_meta(table)
    if block_tokens is None:
        block_tokens = s.hash_block_tokens_of(table) or DEFAULT_BLOCK_TOKENS
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    times = table.column(s.ARRIVAL_TIME_S).to_numpy()
    prompt = table.column(s.PROMPT_TOKENS).to_numpy()
    duration_s = float(times.max() - times.min()) if len(times) else 0.0
    ids = table_block_ids(table, block_tokens)
    reuse = None if ids is None else prefix_reuse(ids, prompt, block_tokens)
    return TraceStats(
        requests=table.num_rows,
        duration_s=duration_s,
        rate_per_s=table.num_rows / duration_s if duration_s > 0 else None,
        input_tokens=distribution(prompt),
        output_tokens=distribution(table.column(s.OUTPUT_TOKENS).to_numpy()),
        sessions=session_stats(table),
        block_tokens=block_tokens,
        prefix_reuse=reuse,
        content_identity=meta.content_identity if ids is not None else s.IDENTITY_NONE,
        identity_assumption=meta.identity_assumption,
    )
