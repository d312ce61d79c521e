"""Triton kernel: scatter new tokens' K/V into their cache slots (``write_kv``).

One program per token copies that token's ``[num_kv_heads, head_dim]`` K and V rows to
slot ``slot_mapping[t]``; negative slots are skipped. Same contract as
``kernels.reference.write_kv``. On CPU it runs only under ``TRITON_INTERPRET=1`` set
before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_s, stride_kc_h,
    stride_vc_b, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # int64 row offsets: a whole cache easily exceeds 2**31 elements.
    key = tl.load(key_ptr + token.to(tl.int64) * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * stride_value_t + heads * stride_value_h + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + heads * stride_kc_h + dims
    v_dst = v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + heads * stride_vc_h + dims
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """See ``kernels.reference.write_kv``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("write_kv needs the head_dim axis contiguous")
    write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )
