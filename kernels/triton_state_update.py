"""Triton kernel: the gated linear recurrence with paged state (``state_update``).

Same contract as ``kernels.reference.state_update``. One program per (sequence, head,
slice of the value dim) walks the sequence's tokens in order, keeping its
``[key_dim, BLOCK_V]`` part of the head's state and the last conv inputs of its channels in
registers, and writes them to the block the table names at each block boundary and after
the last token. Slicing the value dim keeps a large state (128 × 128 fp32) in registers
without spilling; every slice recomputes the head's q and k (cheap), and only the first
writes their conv history, so no two programs write the same memory. Every slice reads
the q/k history, so it comes from a snapshot the launcher gathers first: read in place
from the conv state, slice 0's write could land before another slice's read.

The convolution history is carried as three rolling rows (a register tile cannot be
indexed by a runtime position), so the conv width is at most ``MAX_CONV_WIDTH`` = 4 —
Mamba-2's and gated DeltaNet's width. Tokens are processed one at a time: right for
decodes; prefill is correct but not chunk-parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CONV_WIDTH = 4


@triton.jit
def _masked_by(mask, flag):
    """``mask & flag`` for a vector ``mask`` and a scalar ``flag``, both int1. Written as a
    comparison because Triton 3.9's interpreter widens a broadcast int1 scalar to int32,
    and a load or store then refuses the combined mask; compiled code is the same."""
    return mask & ((mask.to(tl.int32) * 0 + flag.to(tl.int32)) != 0)


@triton.jit
def _history_row(history_ptr, seq_offset, stride_h_r, channels, mask, row: tl.constexpr, W: tl.constexpr):
    """Input ``4 - row`` tokens back (row 1..3 of the padded 4-tap window); zeros for taps
    the real width ``W`` does not have."""
    if row >= 5 - W:
        return tl.load(history_ptr + seq_offset + (W - 5 + row) * stride_h_r + channels,
                       mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros(channels.shape, dtype=tl.float32)


@triton.jit
def _tap(weight_ptr, stride_w_c, channels, mask, tap: tl.constexpr, W: tl.constexpr):
    """Weight of tap ``tap`` (0 = three tokens back, 3 = current token) in the padded window."""
    if tap >= 4 - W:
        return tl.load(weight_ptr + channels * stride_w_c + (tap - 4 + W), mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros(channels.shape, dtype=tl.float32)


@triton.jit
def _save_history(conv_ptr, block, stride_cs_b, stride_cs_r, channels, mask, r1, r2, r3, W: tl.constexpr):
    dst = conv_ptr + block * stride_cs_b + channels
    if W >= 4:
        tl.store(dst + (W - 4) * stride_cs_r, r1.to(conv_ptr.dtype.element_ty), mask=mask)
    if W >= 3:
        tl.store(dst + (W - 3) * stride_cs_r, r2.to(conv_ptr.dtype.element_ty), mask=mask)
    if W >= 2:
        tl.store(dst + (W - 2) * stride_cs_r, r3.to(conv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def state_update_kernel(
    x_ptr, weight_ptr, log_decay_ptr, beta_ptr, conv_ptr, ssm_ptr, y_ptr, history_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    stride_x_t, stride_w_c, stride_g_t, stride_b_t,
    stride_cs_b, stride_cs_r, stride_h_s, stride_h_r, stride_ss_b, stride_ss_h, stride_ss_k,
    stride_y_t, stride_y_h, stride_bt, block_size,
    NUM_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    KEY_P: tl.constexpr, BLOCK_V: tl.constexpr, W: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v_slice = tl.program_id(2)
    q0 = tl.load(query_start_loc_ptr + seq)
    q1 = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    computed = seq_len - (q1 - q0)
    table_row = block_tables_ptr + seq * stride_bt

    kk = tl.arange(0, KEY_P)
    vv = v_slice * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < KEY_DIM
    v_ok = vv < VALUE_DIM
    q_ch = head * KEY_DIM + kk
    k_ch = NUM_HEADS * KEY_DIM + head * KEY_DIM + kk
    v_ch = 2 * NUM_HEADS * KEY_DIM + head * VALUE_DIM + vv

    # Start from the state after `computed` tokens, or from zeros for a fresh sequence; the
    # conv history of that state is the launcher's snapshot, row `seq`.
    has_init = computed > 0
    src = tl.load(table_row + (tl.maximum(computed, 1) - 1) // block_size).to(tl.int64)
    km = _masked_by(k_ok, has_init)
    owns_qk = v_slice == 0
    vm = _masked_by(v_ok, has_init)
    q_r1 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, q_ch, km, 1, W)
    q_r2 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, q_ch, km, 2, W)
    q_r3 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, q_ch, km, 3, W)
    k_r1 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, k_ch, km, 1, W)
    k_r2 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, k_ch, km, 2, W)
    k_r3 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, k_ch, km, 3, W)
    v_r1 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, v_ch, vm, 1, W)
    v_r2 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, v_ch, vm, 2, W)
    v_r3 = _history_row(history_ptr, seq * stride_h_s, stride_h_r, v_ch, vm, 3, W)
    state_offsets = head * stride_ss_h + kk[:, None] * stride_ss_k + vv[None, :]
    state_mask = k_ok[:, None] & v_ok[None, :]
    state = tl.load(ssm_ptr + src * stride_ss_b + state_offsets, mask=_masked_by(state_mask, has_init),
                    other=0.0).to(tl.float32)

    wq0 = _tap(weight_ptr, stride_w_c, q_ch, k_ok, 0, W)
    wq1 = _tap(weight_ptr, stride_w_c, q_ch, k_ok, 1, W)
    wq2 = _tap(weight_ptr, stride_w_c, q_ch, k_ok, 2, W)
    wq3 = _tap(weight_ptr, stride_w_c, q_ch, k_ok, 3, W)
    wk0 = _tap(weight_ptr, stride_w_c, k_ch, k_ok, 0, W)
    wk1 = _tap(weight_ptr, stride_w_c, k_ch, k_ok, 1, W)
    wk2 = _tap(weight_ptr, stride_w_c, k_ch, k_ok, 2, W)
    wk3 = _tap(weight_ptr, stride_w_c, k_ch, k_ok, 3, W)
    wv0 = _tap(weight_ptr, stride_w_c, v_ch, v_ok, 0, W)
    wv1 = _tap(weight_ptr, stride_w_c, v_ch, v_ok, 1, W)
    wv2 = _tap(weight_ptr, stride_w_c, v_ch, v_ok, 2, W)
    wv3 = _tap(weight_ptr, stride_w_c, v_ch, v_ok, 3, W)

    for i in range(0, q1 - q0):
        t = q0.to(tl.int64) + i  # int64: token × row stride can pass 2**31
        row = x_ptr + t * stride_x_t
        xq = tl.load(row + q_ch, mask=k_ok, other=0.0).to(tl.float32)
        xk = tl.load(row + k_ch, mask=k_ok, other=0.0).to(tl.float32)
        xv = tl.load(row + v_ch, mask=v_ok, other=0.0).to(tl.float32)
        q = _silu(wq0 * q_r1 + wq1 * q_r2 + wq2 * q_r3 + wq3 * xq)
        k = _silu(wk0 * k_r1 + wk1 * k_r2 + wk2 * k_r3 + wk3 * xk)
        v = _silu(wv0 * v_r1 + wv1 * v_r2 + wv2 * v_r3 + wv3 * xv)
        q_r1, q_r2, q_r3 = q_r2, q_r3, xq
        k_r1, k_r2, k_r3 = k_r2, k_r3, xk
        v_r1, v_r2, v_r3 = v_r2, v_r3, xv

        decay = tl.exp(tl.load(log_decay_ptr + t * stride_g_t + head).to(tl.float32))
        gate = tl.load(beta_ptr + t * stride_b_t + head).to(tl.float32)
        state = decay * state + gate * (k[:, None] * v[None, :])
        y = tl.sum(q[:, None] * state, axis=0)
        tl.store(y_ptr + t * stride_y_t + head * stride_y_h + vv,
                 y.to(y_ptr.dtype.element_ty), mask=v_ok)

        # Checkpoint at a block boundary and after the last token, unless the table says null.
        done = computed + i + 1
        dst = tl.load(table_row + (done - 1) // block_size).to(tl.int64)
        save = ((done % block_size == 0) | (done == seq_len)) & (dst != 0)
        tl.store(ssm_ptr + dst * stride_ss_b + state_offsets, state.to(ssm_ptr.dtype.element_ty),
                 mask=_masked_by(state_mask, save))
        _save_history(conv_ptr, dst, stride_cs_b, stride_cs_r, q_ch, _masked_by(k_ok, save & owns_qk), q_r1, q_r2, q_r3, W)
        _save_history(conv_ptr, dst, stride_cs_b, stride_cs_r, k_ch, _masked_by(k_ok, save & owns_qk), k_r1, k_r2, k_r3, W)
        _save_history(conv_ptr, dst, stride_cs_b, stride_cs_r, v_ch, _masked_by(v_ok, save), v_r1, v_r2, v_r3, W)


def value_block(key_dim: int, value_dim: int, interpreted: bool) -> int:
    """Width of a program's value slice: about 4096 state elements (32 fp32 registers a
    thread at 4 warps) on a GPU; the whole value dim under the interpreter, where fewer
    programs run faster."""
    whole = triton.next_power_of_2(value_dim)
    if interpreted:
        return whole
    return min(whole, max(16, 4096 // triton.next_power_of_2(key_dim)))


def state_update(x: torch.Tensor, conv_weight: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
                 block_v: int | None = None) -> torch.Tensor:
    """See ``kernels.reference.state_update``; ``block_v`` (the value slice of a program,
    a power of two) is for tests."""
    num_heads, key_dim, value_dim = ssm_state.shape[1:]
    width = conv_weight.shape[1]
    if not 1 <= width <= MAX_CONV_WIDTH:
        raise ValueError(f"the Triton state_update supports conv widths 1..{MAX_CONV_WIDTH}, got {width}")
    if x.shape[1] != num_heads * (2 * key_dim + value_dim) or conv_state.shape[1:] != (width - 1, x.shape[1]):
        raise ValueError(f"state_update shapes disagree: x {tuple(x.shape)}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)}, ssm_state {tuple(ssm_state.shape)}")
    for t in (x, conv_weight, log_decay, beta, conv_state, ssm_state):
        if t.stride(-1) != 1:
            raise ValueError("state_update needs the last axis of every tensor contiguous")
    if ssm_state.stride(2) != ssm_state.shape[3]:
        raise ValueError("ssm_state must be contiguous in its last two axes")
    y = torch.empty((x.shape[0], num_heads, value_dim), dtype=x.dtype, device=x.device)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or x.shape[0] == 0:
        return y
    # Snapshot of each sequence's starting conv history (see the module docstring).
    computed = seq_lens.to(torch.int64) - (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    src = block_tables.to(torch.int64).gather(1, ((computed.clamp(min=1) - 1) // block_size)[:, None])[:, 0]
    history = conv_state[src].contiguous()
    # A conv state of width 1 has no rows; give the kernel valid row strides anyway.
    stride_cs_r = conv_state.stride(1) if width > 1 else 0
    stride_h_r = history.stride(1) if width > 1 else 0
    block_v = block_v or value_block(key_dim, value_dim, interpreted=x.device.type == "cpu")
    state_update_kernel[(num_seqs, num_heads, triton.cdiv(value_dim, block_v))](
        x, conv_weight, log_decay, beta, conv_state, ssm_state, y, history,
        block_tables, seq_lens, query_start_loc,
        x.stride(0), conv_weight.stride(0), log_decay.stride(0), beta.stride(0),
        conv_state.stride(0), stride_cs_r, history.stride(0), stride_h_r,
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y.stride(0), y.stride(1), block_tables.stride(0), block_size,
        NUM_HEADS=num_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        KEY_P=triton.next_power_of_2(key_dim), BLOCK_V=block_v, W=width, num_warps=4,
    )
    return y
