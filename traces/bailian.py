"""Loader for Bailian-style JSONL traces (Alibaba Qwen-Bailian usage traces).

One request per line: ``chat_id``, ``parent_chat_id`` (-1 for a conversation's first
request), ``timestamp`` (s from the trace start), ``input_length``, ``output_length``,
``type``, ``turn`` and ``hash_ids``, one id per 16-token block hashed *per block*: an id says
what a block holds, not what comes before it. Equal ids only mean reusable KV when the whole
prefix is equal, so the ids are chained here (``hashing.chain_lists``) before they are stored.

A request's session is the first request of its conversation: parent links are followed to
the oldest ancestor present in the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.fields import FLOAT, INT, INT_LIST, STR, Field, RowCheck
from kvtwin.traces.hashing import chain_lists
from kvtwin.traces.readers import read_jsonl

BAILIAN_BLOCK_TOKENS = 16
NO_PARENT = -1

FIELDS = (
    Field("chat_id", INT),
    Field("parent_chat_id", INT, minimum=NO_PARENT, required=False),
    Field("timestamp", FLOAT, minimum=0),
    Field("input_length", INT, minimum=1),
    Field("output_length", INT, minimum=0),
    Field("turn", INT, minimum=0, required=False),
    Field("type", STR, required=False),
    Field("hash_ids", INT_LIST),
)


def _too_many_hashes(columns: dict[str, pa.Array]) -> np.ndarray:
    lengths = pc.list_value_length(columns["hash_ids"]).to_numpy(zero_copy_only=False)
    inputs = columns["input_length"].to_numpy(zero_copy_only=False)
    return lengths > -(-inputs // BAILIAN_BLOCK_TOKENS)


def _repeated_chat_id(columns: dict[str, pa.Array]) -> np.ndarray:
    ids = columns["chat_id"].to_numpy(zero_copy_only=False)
    _, first = np.unique(ids, return_index=True)
    repeated = np.ones(len(ids), dtype=bool)
    repeated[first] = False
    return repeated


CHECKS = (
    RowCheck("hash_ids", f"at most ceil(input_length / {BAILIAN_BLOCK_TOKENS}) ids", _too_many_hashes),
    RowCheck("chat_id", "a chat_id not used by an earlier line", _repeated_chat_id),
)


def load_bailian(path: str | os.PathLike, *, skip_bad: bool = False) -> pa.Table:
    """Load a Bailian-style JSONL trace into the trace schema (see the module docstring)."""
    columns = read_jsonl(path, FIELDS, skip_bad=skip_bad, row_checks=CHECKS)
    values = columns.values
    meta = columns.bad.stamp(s.TraceMeta(source_format="bailian", source_file=Path(path).name,
                                         content_identity=s.IDENTITY_HASHES))
    outputs = values["output_length"].to_numpy(zero_copy_only=False)
    failed = outputs == 0
    if failed.any():
        # A request that generated nothing failed upstream; it is data, not a malformed line.
        meta = meta.with_note(f"dropped {int(failed.sum())} request(s) with output_length 0 (failed requests)")
        keep = pa.array(~failed)
        values = {name: column.filter(keep) for name, column in values.items()}
    chat_ids = values["chat_id"].to_numpy(zero_copy_only=False)
    parents = values["parent_chat_id"].fill_null(NO_PARENT).to_numpy(zero_copy_only=False)
    return s.build_table({
        s.REQUEST_ID: pa.array(chat_ids.astype(str)),
        s.ARRIVAL_TIME_S: values["timestamp"],
        s.PROMPT_TOKENS: values["input_length"],
        s.OUTPUT_TOKENS: values["output_length"],
        s.SESSION_ID: pa.array(session_roots(chat_ids, parents).astype(str)),
        s.TURN: values["turn"],
        s.BLOCK_HASHES: chain_lists(values["hash_ids"]),
        s.HASH_BLOCK_TOKENS: np.full(len(chat_ids), BAILIAN_BLOCK_TOKENS, dtype=np.int32),
    }, meta)


def session_roots(chat_ids: np.ndarray, parent_ids: np.ndarray) -> np.ndarray:
    """The conversation root of each chat: its oldest ancestor present in the file (or the
    missing parent itself, so that siblings of an absent parent still share a session)."""
    root_of: dict[int, int] = {}
    roots = np.empty(len(chat_ids), dtype=np.int64)
    for i, (chat, parent) in enumerate(zip(chat_ids.tolist(), parent_ids.tolist())):
        root = chat if parent == NO_PARENT else root_of.get(parent, parent)
        root_of[chat] = root
        roots[i] = root
    return roots
