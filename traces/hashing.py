"""64-bit prefix hashing, vectorised with numpy: chaining per-block ids into prefix ids.

A *chained* id identifies a whole prefix: id_i = mix(id_{i-1}, block_i). Equal ids at
position i then mean equal prefixes 0..i, which is what a prefix cache needs. All
arithmetic is on uint64 and wraps modulo 2**64 by design.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# The parent of a sequence's first block, so that a chained first id differs from a raw id.
ROOT = np.uint64(0x6B767477696E2101)


def mix64(parent: np.ndarray | np.uint64, value: np.ndarray | np.uint64) -> np.ndarray:
    """A 64-bit hash of the pair (parent, value): splitmix64's finaliser over a combination."""
    parent = np.asarray(parent, dtype=np.uint64)
    value = np.asarray(value, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = parent * _GOLDEN + value + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def list_positions(lists: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, position of each flat value within its list) of a list array."""
    offsets = lists.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    starts = np.repeat(offsets[:-1], lengths)
    return offsets, np.arange(offsets[-1], dtype=np.int64) - starts


def chain_flat(values: np.ndarray, offsets: np.ndarray, positions: np.ndarray,
               root: np.uint64 = ROOT) -> np.ndarray:
    """Chain per-block ids into prefix ids, list by list (lists given by flat values + offsets).

    Loops over positions, not rows: each pass hashes every list's block at that position
    against its predecessor, so the cost is (longest list) numpy passes over the data.
    """
    values = np.asarray(values).astype(np.uint64, copy=False)
    out = np.empty(len(values), dtype=np.uint64)
    if len(values) == 0:
        return out
    order = np.argsort(positions, kind="stable")
    counts = np.bincount(positions)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    for pos in range(len(counts)):
        idx = order[bounds[pos]:bounds[pos + 1]]
        parents = root if pos == 0 else out[idx - 1]
        out[idx] = mix64(parents, values[idx])
    return out


def chain_lists(lists: pa.ListArray, root: np.uint64 = ROOT) -> pa.ListArray:
    """A list<uint64> array whose ids are the chained prefix ids of ``lists``' per-block ids."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    offsets, positions = list_positions(lists)
    flat = pc.list_flatten(lists).to_numpy(zero_copy_only=False)
    chained = chain_flat(flat, offsets, positions, root)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(chained, pa.uint64()),
                                    mask=lists.is_null())


def hash_token_blocks(token_lists: pa.ListArray, block_tokens: int) -> pa.ListArray:
    """Chained block ids of explicit token ids: one id per block, the last block may be partial.

    A block's content id is a polynomial hash of its tokens (and its length, so that a partial
    block differs from a full one that starts the same); ids are then chained along each list.
    """
    if isinstance(token_lists, pa.ChunkedArray):
        token_lists = token_lists.combine_chunks()
    tok_offsets, tok_positions = list_positions(token_lists)
    tokens = pc.list_flatten(token_lists).to_numpy(zero_copy_only=False).astype(np.uint64)
    lengths = np.diff(tok_offsets)
    blocks_per_list = -(-lengths // block_tokens)
    block_offsets = np.concatenate(([0], np.cumsum(blocks_per_list)))
    # Flat index of the block each token belongs to.
    row_of_token = np.repeat(np.arange(len(lengths)), lengths)
    block_of_token = block_offsets[row_of_token] + tok_positions // block_tokens
    within = (tok_positions % block_tokens).astype(np.uint64)
    with np.errstate(over="ignore"):
        weighted = mix64(within, tokens)
    # Wrapping uint64 sum of per-position token hashes: order-aware because `within` is mixed in.
    # Tokens are stored block after block, so each block is one contiguous run to reduce.
    block_len = np.bincount(block_of_token, minlength=block_offsets[-1])
    starts = np.concatenate(([0], np.cumsum(block_len)[:-1]))
    content = np.add.reduceat(weighted, starts) if len(weighted) else np.zeros(0, np.uint64)
    block_len = block_len.astype(np.uint64)
    content = mix64(content, block_len)
    block_positions = np.arange(block_offsets[-1]) - np.repeat(block_offsets[:-1], blocks_per_list)
    chained = chain_flat(content, block_offsets, block_positions)
    return pa.ListArray.from_arrays(pa.array(block_offsets, pa.int32()), pa.array(chained, pa.uint64()),
                                    mask=token_lists.is_null())
