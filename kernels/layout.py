"""Cache layouts and batch metadata shared by every backend.

The K/V cache of one attention layer is vLLM's flash layout: two tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``; block 0 is the null block, which
block tables use for positions that are never read (skipped by a sliding window, dropped
by chunked local attention, not yet needed by a Mamba group). A token at position ``p``
of a request lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

The recurrent state of one linear-attention layer lives in two tensors indexed by the same
kind of block id: ``conv_state [num_blocks, conv_width - 1, conv_dim]`` and
``ssm_state [num_blocks, num_heads, key_dim, value_dim]``.

A batch is described as in vLLM: ``query_start_loc`` (``[num_seqs + 1]``, cumulative query
tokens), ``seq_lens`` (``[num_seqs]``, tokens in the sequence *including* this step's
queries) and ``block_tables`` (``[num_seqs, max_blocks]``). The helpers here only build
and reshape such metadata; they hold no kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_BLOCK = 0


def state_shapes(num_blocks: int, conv_width: int, num_heads: int, key_dim: int,
                 value_dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
    """Shapes of the conv state and the recurrent (ssm) state of one layer."""
    conv_dim = num_heads * (2 * key_dim + value_dim)
    return (num_blocks, conv_width - 1, conv_dim), (num_blocks, num_heads, key_dim, value_dim)


def slot_mapping(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Slot of every query token of the batch (int64, one per token), from its position."""
    positions, seq_ids = query_positions(seq_lens, query_start_loc)
    blocks = block_tables.to(torch.int64)[seq_ids, positions // block_size]
    return blocks * block_size + positions % block_size


def query_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position in its sequence and sequence index of every query token (both int64)."""
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    seq_ids = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), query_lens)
    first_query = torch.repeat_interleave(seq_lens.to(torch.int64) - query_lens, query_lens)
    offset_in_query = torch.arange(int(query_lens.sum()), device=query_lens.device) - torch.repeat_interleave(
        query_start_loc[:-1].to(torch.int64), query_lens)
    return first_query + offset_in_query, seq_ids


@dataclass(frozen=True)
class VirtualBatch:
    """A batch re-cut so that no sequence crosses a local-attention chunk (see below)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


def local_virtual_batches(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          chunk_size: int, block_size: int) -> VirtualBatch:
    """Chunked local attention expressed as plain causal attention.

    Each sequence's queries are split at chunk boundaries; the piece in chunk ``c`` becomes
    its own "virtual" sequence whose keys start at the chunk start, with the block table
    shifted accordingly. Queries keep their order, so ``q`` and the output need no
    reshuffle. This is how a kernel with no chunk mask (flash attention) serves chunked
    local layers; it requires chunks made of whole blocks.
    """
    if chunk_size % block_size:
        raise ValueError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
    blocks_per_chunk = chunk_size // block_size
    tables, lens, starts = [], [], [0]
    max_query_len = 0
    for s, (q0, q1, seq_len) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(),
                                               seq_lens.tolist())):
        pos = seq_len - (q1 - q0)
        while pos < seq_len:
            chunk_start = pos // chunk_size * chunk_size
            piece_end = min(seq_len, chunk_start + chunk_size)
            first_block = chunk_start // block_size
            row = block_tables[s, first_block:first_block + blocks_per_chunk]
            tables.append(torch.nn.functional.pad(row, (0, blocks_per_chunk - row.numel()), value=NULL_BLOCK))
            lens.append(piece_end - chunk_start)
            starts.append(starts[-1] + piece_end - pos)
            max_query_len = max(max_query_len, piece_end - pos)
            pos = piece_end
    device = block_tables.device
    table = (torch.stack(tables) if tables
             else torch.zeros((0, blocks_per_chunk), dtype=block_tables.dtype, device=device))
    return VirtualBatch(
        block_tables=table.contiguous(),
        seq_lens=torch.tensor(lens, dtype=seq_lens.dtype, device=device),
        query_start_loc=torch.tensor(starts, dtype=query_start_loc.dtype, device=device),
        max_query_len=max_query_len,
        max_seq_len=max(lens, default=0),
    )


def check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
    """Shape checks every backend makes first, so a wrong call fails the same way everywhere."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and of the cache ({k_cache.shape[3]}) differ")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"batch metadata disagree: seq_lens {tuple(seq_lens.shape)}, query_start_loc "
                         f"{tuple(query_start_loc.shape)}, block_tables {tuple(block_tables.shape)}")
