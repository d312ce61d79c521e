"""Triton kernel: paged attention over variable-length queries (``paged_attention``).

One kernel serves decodes and prefill chunks in the same batch. A program owns a tile of
``BLOCK_Q`` query tokens of one sequence and one kv head; its ``BLOCK_M`` rows are those
tokens times the ``GROUP`` query heads sharing that kv head (grouped-query attention
reads each K/V tile once for the whole group). It streams keys ``BLOCK_N`` positions at a
time, gathering rows through the block table (a tile may span several cache blocks), with
an online softmax.

Keys no query of the tile can see (before the sliding window or the local chunk) are not
visited at all; inside a visited tile, loads of positions outside ``[lo, hi)`` are masked
so the null block and unwritten slots (which may hold NaN) never enter a ``tl.dot``.

The grid needs no host-side knowledge of query lengths: sequence ``s`` owns program ids
``query_start_loc[s] // BLOCK_Q + s`` onwards, which is monotone in ``s``, so a program finds
its sequence by binary search and exits if its tile is past the sequence's queries.

Split keys (flash-decoding): a decode batch with few sequences has too few programs to
keep every SM streaming K/V, so the key range of each tile can be cut into ``NUM_SPLITS``
pieces run by separate programs; each writes its unnormalised partial output with its
running max and sum, and ``combine_splits_kernel`` merges them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtwin.kernels.layout import check_attention_args


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2e, num_seqs, num_tokens, sliding_window, chunk_size,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Which sequence owns this tile: the last s with query_start_loc[s] // BLOCK_Q + s <= tile.
    lo_seq = 0
    hi_seq = num_seqs
    while lo_seq + 1 < hi_seq:
        mid = (lo_seq + hi_seq) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if mid_first_tile <= tile:
            lo_seq = mid
        else:
            hi_seq = mid
    seq = lo_seq
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_query_pos = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_idx = local_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query_idx < query_len)
    query_pos = first_query_pos + query_idx
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    token = (q_start + query_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    # Key range any row of the tile can see: [lo, hi).
    tile_first_pos = first_query_pos + local_tile * BLOCK_Q
    hi = tl.minimum(tile_first_pos + BLOCK_Q, seq_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(lo, tile_first_pos - sliding_window + 1)
    if USE_CHUNK:
        lo = tl.maximum(lo, tile_first_pos // chunk_size * chunk_size)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    first = lo // BLOCK_N * BLOCK_N
    last = hi
    if NUM_SPLITS > 1:
        # Whole key tiles per split, so splits never share a tile.
        per_split = tl.cdiv(tl.cdiv(hi - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        first = first + split * per_split
        last = tl.minimum(hi, first + per_split)
    for start in range(first, last, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        col_ok = (key_pos >= lo) & (key_pos < hi)
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        load_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_b + in_block[:, None] * stride_kc_s
                    + kv_head * stride_kc_h + dims[None, :], mask=load_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_b + in_block[:, None] * stride_vc_s
                    + kv_head * stride_vc_h + dims[None, :], mask=load_mask, other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = row_ok[:, None] & col_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        if USE_CHUNK:
            visible = visible & (key_pos[None, :] // chunk_size == query_pos[:, None] // chunk_size)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # Partials: [split, token, head] (+ [HEAD_DIM_P] for the output), contiguous.
        row = (split * num_tokens + token) * (GROUP * tl.num_programs(1)) + head
        tl.store(part_max_ptr + row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, num_tokens, stride_o_t, stride_o_h,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
):
    """Merge the split partials of one (token, head): rescale each to the common max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_P)
    row = (splits * num_tokens + token) * NUM_HEADS + head
    m = tl.load(part_max_ptr + row, mask=split_ok, other=-1.0e30)
    l = tl.load(part_sum_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + dims[None, :], mask=split_ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(weight * l, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def tile_config(num_tokens: int, num_seqs: int, group: int, head_dim: int, element_bytes: int,
                interpreted: bool) -> dict[str, int]:
    """Tile sizes: decode-only batches take small query tiles (one token a sequence),
    batches with prefill chunks larger ones; fp32 tiles are halved to stay in registers.
    Under the interpreter each loop iteration costs milliseconds, so key tiles are large
    there."""
    decode_only = num_tokens <= num_seqs
    rows = 16 if decode_only else (64 if element_bytes <= 2 else 32)
    block_n = 64 if element_bytes <= 2 and head_dim <= 128 else 32
    return {
        "block_q": max(1, rows // group),
        "block_n": 64 if interpreted else block_n,
        "num_warps": 4,
        "num_stages": 3 if decode_only else 2,
    }


def launch_shape(block_q: int, group: int) -> int:
    """Rows of a program's tile: ``block_q`` tokens × ``group`` heads, padded to a power
    of two and to tl.dot's minimum of 16."""
    return max(16, triton.next_power_of_2(block_q * group))


def default_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key splits for a decode batch too small to fill the GPU: about two programs per SM.
    One on CPU (the interpreter) and for batches with prefill chunks."""
    if device.type != "cuda" or num_tokens > num_seqs:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(16, -(-2 * sms // programs)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, chunk_size: int | None = None,
                    block_q: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """See ``kernels.reference.paged_attention``; the tile and split arguments are for
    benchmarks and tests (default: chosen from the batch)."""
    check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs the head_dim axis contiguous")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    config = tile_config(num_tokens, num_seqs, group, head_dim, k_cache.element_size(),
                         interpreted=q.device.type == "cpu")
    block_q = block_q or config["block_q"]
    block_n = block_n or config["block_n"]
    splits = num_splits or default_splits(num_tokens, num_seqs, num_kv_heads, q.device)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_acc = torch.empty((splits, num_tokens, num_heads, head_dim_p), dtype=torch.float32, device=q.device)
        part_max = torch.empty((splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # not touched
    # Each sequence can waste at most one partial tile, hence "+ num_seqs".
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, block_tables, seq_lens, query_start_loc,
        scale * 1.4426950408889634, num_seqs, num_tokens, sliding_window or 0, chunk_size or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_Q=block_q, BLOCK_M=launch_shape(block_q, group), BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_CHUNK=chunk_size is not None,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", NUM_SPLITS=splits,
        num_warps=num_warps or config["num_warps"], num_stages=num_stages or config["num_stages"],
    )
    if splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_max, part_sum, out, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=splits, SPLITS_P=max(2, triton.next_power_of_2(splits)),
        )
    return out
