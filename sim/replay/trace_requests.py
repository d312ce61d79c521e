"""Trace rows → engine requests (the trace schema of ``traces/SCHEMA.md``).

Prefix identity is kept in the trace's own form: chained chunk hash ids become a
``HashIdPrompt`` whose block hashes are made on demand (no tokens are materialised),
explicit token ids a ``TokenPrompt``. A trace without content identity gives every
request a prompt of unique content, so nothing is shared that the trace did not say is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from kvtwin.traces import schema as col
from kvtwin.sim.core.hashing import HashIdPrompt, TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival


def arrivals_from_trace(table: pa.Table) -> Iterator[Arrival]:
    """The trace's requests in row (arrival) order, made one at a time as the replay
    takes them, so that a long trace never holds all its requests at once."""
    columns = set(table.column_names)
    n = table.num_rows

    def column(name: str) -> list:
        return table.column(name).to_pylist() if name in columns else [None] * n

    ids = column(col.REQUEST_ID)
    times = column(col.ARRIVAL_TIME_S)
    prompts = column(col.PROMPT_TOKENS)
    outputs = column(col.OUTPUT_TOKENS)
    sessions = column(col.SESSION_ID)
    priorities = column(col.PRIORITY)
    hashes = column(col.BLOCK_HASHES)
    hash_tokens = column(col.HASH_BLOCK_TOKENS)
    token_ids = column(col.PROMPT_TOKEN_IDS)
    for i in range(n):
        if token_ids[i] is not None:
            prompt = TokenPrompt(token_ids[i])
        elif hashes[i] is not None:
            prompt = HashIdPrompt(hashes[i], hash_tokens[i], prompts[i], unique_id=i)
        else:
            prompt = HashIdPrompt((), 1, prompts[i], unique_id=i)
        request = Request(ids[i], prompt, outputs[i], arrival_time=times[i], priority=priorities[i] or 0)
        yield Arrival(times[i], request, sessions[i])
