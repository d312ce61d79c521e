"""From block hashes to what a consumer needs: ids at another block size, or pseudo token ids.

A chained hash h_j names the prompt prefix through block j. The prefix that ends at token e
is therefore named by (h_j, e - j*H) with j the block holding token e-1 and H the tokens a
hash covers. That gives, without materialising any token:

- ``reblock``: chained ids for blocks of any size b (the simulator's block size);
- ``expand_request``: deterministic pseudo token ids (for the executor, which needs real
  tokens): token t of a request is a function of (h_{t // H}, t mod H), so requests with an
  equal hash prefix get equal tokens over it, and differing blocks differ.

Sharing finer than H cannot be known from H-token hashes: a block that differs anywhere
differs everywhere after reblocking or expansion.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces import schema as s
from kvtwin.traces.hashing import hash_token_blocks, mix64

_BEYOND_SALT = np.uint64(0xB170_0D00_5EED_0001)
_NO_IDENTITY_SALT = np.uint64(0xB170_0D00_5EED_0002)


def reblock(block_hashes: pa.ListArray, hash_block_tokens: np.ndarray | int, prompt_tokens: np.ndarray,
            block_tokens: int) -> pa.ListArray:
    """Chained ids of ``block_tokens``-token blocks from chained ``hash_block_tokens``-token hashes.

    A request gets ceil(P / b) ids when its hashes cover its prompt, else only the blocks they
    fully cover. A block's id names its nominal end (k+1)*b, capped at the hashes' coverage,
    so a partial last block has the id of the full block it begins. With b equal to the hash
    block size the hashes are returned unchanged.
    """
    if isinstance(block_hashes, pa.ChunkedArray):
        block_hashes = block_hashes.combine_chunks()
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    sizes = np.broadcast_to(np.asarray(hash_block_tokens, dtype=np.int64), prompt.shape)
    if sizes.size and np.all(sizes == block_tokens):
        return block_hashes.cast(s.BLOCK_HASHES_TYPE)
    offsets = block_hashes.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    flat = block_hashes.values.slice(int(block_hashes.offsets[0].as_py()), int(offsets[-1]))
    flat = flat.to_numpy(zero_copy_only=False).astype(np.uint64)
    coverage = np.diff(offsets) * sizes
    counts = np.where(coverage >= prompt, -(-prompt // block_tokens), coverage // block_tokens)
    counts = np.maximum(counts, 0)
    rows = np.repeat(np.arange(len(prompt)), counts)
    new_offsets = np.concatenate(([0], np.cumsum(counts)))
    index = np.arange(new_offsets[-1]) - new_offsets[rows]
    ends = np.minimum((index + 1) * block_tokens, coverage[rows])
    hash_index = (ends - 1) // sizes[rows]
    within = ends - hash_index * sizes[rows]
    ids = mix64(flat[offsets[rows] + hash_index], within.astype(np.uint64))
    return pa.ListArray.from_arrays(pa.array(new_offsets, pa.int32()), pa.array(ids, s.BLOCK_HASH_TYPE),
                                    mask=block_hashes.is_null())


def table_block_ids(table: pa.Table, block_tokens: int) -> pa.ListArray | None:
    """Chained ids of ``block_tokens``-token prompt blocks for every row, or None without identity.

    Rows with hashes are reblocked; rows with explicit token ids are hashed block by block.
    """
    hashes = table.column(s.BLOCK_HASHES).combine_chunks()
    tokens = table.column(s.PROMPT_TOKEN_IDS).combine_chunks()
    prompt = table.column(s.PROMPT_TOKENS).to_numpy()
    if hashes.null_count < len(hashes):
        sizes = table.column(s.HASH_BLOCK_TOKENS).fill_null(block_tokens).to_numpy()
        from_hashes = reblock(hashes.fill_null(pa.scalar([], s.BLOCK_HASHES_TYPE)), sizes, prompt, block_tokens)
        if tokens.null_count == len(tokens):
            return from_hashes
        from_tokens = hash_token_blocks(tokens.fill_null(pa.scalar([], s.PROMPT_TOKEN_IDS_TYPE)), block_tokens)
        return pc.if_else(hashes.is_valid(), from_hashes, from_tokens)
    if tokens.null_count < len(tokens):
        return hash_token_blocks(tokens.fill_null(pa.scalar([], s.PROMPT_TOKEN_IDS_TYPE)), block_tokens)
    return None


def expand_request(block_hashes: np.ndarray, hash_block_tokens: int, prompt_tokens: int, vocab_size: int,
                   request_salt: int = 0) -> np.ndarray:
    """Pseudo token ids (int32, in [0, vocab_size)) for one request's prompt.

    Tokens past the hashes' coverage are unknown content: they are drawn from
    ``request_salt``, so give each request its own salt (e.g. its row) to keep them unshared.
    """
    positions = np.arange(prompt_tokens, dtype=np.int64)
    hashes = np.asarray(block_hashes, dtype=np.uint64)
    coverage = len(hashes) * hash_block_tokens
    block = np.minimum(positions // hash_block_tokens, max(len(hashes) - 1, 0))
    values = np.empty(prompt_tokens, dtype=np.uint64)
    covered = positions < coverage
    if covered.any():
        values[covered] = mix64(hashes[block[covered]], (positions[covered] % hash_block_tokens).astype(np.uint64))
    if not covered.all():
        seed = mix64(_BEYOND_SALT, np.uint64(request_salt))
        values[~covered] = mix64(seed, positions[~covered].astype(np.uint64))
    return (values % np.uint64(vocab_size)).astype(np.int32)


def expand_token_ids(table: pa.Table, vocab_size: int) -> pa.ListArray:
    """Prompt token ids for every row: given ids, expanded hashes, or per-request unique ids.

    This materialises every prompt token; meant for the executor's (short) runs, not for a
    whole long trace.
    """
    prompt = table.column(s.PROMPT_TOKENS).to_numpy()
    given = table.column(s.PROMPT_TOKEN_IDS).combine_chunks()
    hashes = table.column(s.BLOCK_HASHES).combine_chunks()
    sizes = table.column(s.HASH_BLOCK_TOKENS).combine_chunks()
    pieces = []
    for row in range(table.num_rows):
        if given[row].is_valid:
            pieces.append(np.asarray(given[row].values.to_numpy(zero_copy_only=False), dtype=np.int32))
        elif hashes[row].is_valid:
            pieces.append(expand_request(hashes[row].values.to_numpy(zero_copy_only=False), sizes[row].as_py(),
                                         int(prompt[row]), vocab_size, request_salt=row))
        else:
            seed = mix64(_NO_IDENTITY_SALT, np.uint64(row))
            values = mix64(seed, np.arange(int(prompt[row]), dtype=np.uint64))
            pieces.append((values % np.uint64(vocab_size)).astype(np.int32))
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in pieces]))).astype(np.int64)
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError("too many prompt tokens to expand at once; expand fewer rows (a slice of the table)")
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, s.TOKEN_ID_TYPE))
