"""Session helpers: turn numbering, and prefix identity derived from sessions by assumption.

Traces such as BurstGPT name a request's session but say nothing about its content. Under
the *session-history assumption* each turn re-sends the session's history: the prompt of
turn k+1 begins with the prompt and the output of turn k. ``assume_session_history`` turns
that assumption into block hashes, so that a simulator can replay it; the trace's metadata
records that the identity is assumed, and ``trace info`` says so. Nothing else is assumed:
different sessions share nothing, requests without a session share nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.hashing import chain_flat, mix64

_FRESH_SALT = np.uint64(0x5E5510A5517A7E00)


def number_turns(session_ids: pa.Array, times_s: np.ndarray) -> pa.Array:
    """1-based turn of each row within its session in arrival order (null without a session)."""
    if isinstance(session_ids, pa.ChunkedArray):
        session_ids = session_ids.combine_chunks()
    codes = pc.dictionary_encode(session_ids).indices.fill_null(-1).to_numpy(zero_copy_only=False)
    order = np.lexsort((np.arange(len(codes)), np.asarray(times_s), codes))
    sorted_codes = codes[order]
    starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
    group_start = np.repeat(starts, np.diff(np.r_[starts, len(codes)]))
    turns = np.empty(len(codes), dtype=np.int32)
    turns[order] = np.arange(len(codes)) - group_start + 1
    return pa.array(turns, mask=codes < 0)


def assume_session_history(table: pa.Table, block_tokens: int = 16) -> pa.Table:
    """Block hashes for a trace without content identity, under the session-history assumption.

    Turn k+1 of a session shares its first min(P_k + O_k, P_{k+1}) tokens with the history of
    turn k (P prompt, O output tokens); the full blocks of that shared prefix get the same
    chained ids, every other block a fresh one. Turns whose prompt is shorter than the history
    they should re-send break the assumption; they are counted in a note.
    """
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    meta = s.trace_meta(table)
    has_identity = table.column(s.BLOCK_HASHES).null_count < table.num_rows or \
        table.column(s.PROMPT_TOKEN_IDS).null_count < table.num_rows
    if has_identity:
        raise ValueError("the trace already has content identity; the session assumption is for traces without")
    sessions = table.column(s.SESSION_ID).to_pylist()
    prompts = table.column(s.PROMPT_TOKENS).to_numpy()
    outputs = table.column(s.OUTPUT_TOKENS).to_numpy()
    history: dict[str, tuple[list[int], int]] = {}  # session -> (history block contents, history tokens)
    contents: list[int] = []
    lengths = np.empty(table.num_rows, dtype=np.int64)
    fresh = 0
    short_turns = 0
    for row, session in enumerate(sessions):
        prompt, output = int(prompts[row]), int(outputs[row])
        previous_blocks, previous_tokens = history.get(session, ([], 0)) if session is not None else ([], 0)
        if session in history and prompt < previous_tokens:
            short_turns += 1
        shared_blocks = min(previous_tokens, prompt) // block_tokens
        num_blocks = -(-prompt // block_tokens)
        blocks = previous_blocks[:shared_blocks] + list(range(fresh, fresh + num_blocks - shared_blocks))
        fresh += num_blocks - shared_blocks
        contents.extend(blocks)
        lengths[row] = num_blocks
        if session is not None:
            # Blocks past the prompt's last full block hold output (and then new text): fresh.
            full = prompt // block_tokens
            grown = (prompt + output) // block_tokens
            history[session] = (blocks[:full] + list(range(fresh, fresh + grown - full)), prompt + output)
            fresh += grown - full
    # Fresh "contents" are a counter: mix them with a salt so they look like any other hash.
    values = mix64(_FRESH_SALT, np.asarray(contents, dtype=np.uint64))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    positions = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    chained = chain_flat(values, offsets, positions)
    hashes = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(chained, pa.uint64()))
    table = table.set_column(table.schema.get_field_index(s.BLOCK_HASHES), s.TRACE_SCHEMA.field(s.BLOCK_HASHES),
                             hashes)
    table = table.set_column(table.schema.get_field_index(s.HASH_BLOCK_TOKENS),
                             s.TRACE_SCHEMA.field(s.HASH_BLOCK_TOKENS),
                             pa.array(np.full(table.num_rows, block_tokens, dtype=np.int32)))
    note = (f"prefix identity ASSUMED, not observed: each turn re-sends its session's history "
            f"({block_tokens}-token blocks)")
    if short_turns:
        note += f"; {short_turns} turn(s) are shorter than the history they should re-send"
    meta = dataclasses.replace(meta, content_identity=s.IDENTITY_HASHES,
                               identity_assumption=s.ASSUMPTION_SESSION_HISTORY).with_note(note)
    return s.with_meta(table, meta)
