"""The Triton kernels, run by Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1),
against the torch reference. fp32 and fp16 only: bf16 ``tl.dot`` is wrong in the
interpreter. Shapes are small and tiles large: each interpreted loop iteration costs
milliseconds."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvtwin.kernels import cases, reference  # noqa: E402
from kvtwin.kernels import triton_attention, triton_state_update, triton_write_kv  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def written(case: cases.AttentionCase) -> cases.AttentionCase:
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    return case


# ---------------------------------------------------------------------------------------
# write_kv
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(dtype):
    case = cases.attention_case([3, 1, 9], [20, 33, 9], num_kv_heads=3, head_dim=24, block_size=8, dtype=dtype)
    slots = case.slot_mapping.clone()
    slots[[1, 5]] = -1  # padding tokens: never stored
    want, got = case.clone_caches(), case.clone_caches()
    reference.write_kv(case.key, case.value, want.k_cache, want.v_cache, slots)
    triton_write_kv.write_kv(case.key, case.value, got.k_cache, got.v_cache, slots)
    assert torch.equal(got.k_cache.nan_to_num(7.0), want.k_cache.nan_to_num(7.0))
    assert torch.equal(got.v_cache.nan_to_num(7.0), want.v_cache.nan_to_num(7.0))


def test_write_kv_reads_strided_key_and_value():
    """K and V as views of a fused QKV projection (non-contiguous token stride)."""
    case = cases.attention_case([5], [5], num_kv_heads=2, head_dim=16, block_size=4)
    fused = torch.cat([case.key, case.value], dim=1)  # [tokens, 2 * kv_heads, d]
    key, value = fused[:, :2], fused[:, 2:]
    got = case.clone_caches()
    triton_write_kv.write_kv(key, value, got.k_cache, got.v_cache, case.slot_mapping)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    assert torch.equal(got.k_cache.nan_to_num(7.0), case.k_cache.nan_to_num(7.0))
    assert torch.equal(got.v_cache.nan_to_num(7.0), case.v_cache.nan_to_num(7.0))


# ---------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------

ATTENTION_CASES = {
    # name: (query_lens, seq_lens, extra arguments)
    "decode": ([1, 1, 1], [70, 5, 33], {}),
    "mixed_prefill_chunks": ([7, 1, 21, 0, 16], [40, 53, 21, 12, 90], {}),
    "sliding_window": ([6, 1, 18], [75, 66, 18], dict(sliding_window=20)),
    "sliding_window_of_one": ([3, 1], [30, 9], dict(sliding_window=1)),
    "chunked_local": ([9, 1, 30], [70, 65, 30], dict(chunk_size=32)),
    "mha_odd_head_dim": ([4, 1], [23, 17], dict(group=1, head_dim=24)),
    "gqa_group_8": ([3, 1], [29, 40], dict(group=8, num_kv_heads=1)),
    "gqa_group_3": ([5, 1], [37, 12], dict(group=3)),
}


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(name):
    query_lens, seq_lens, extra = ATTENTION_CASES[name]
    case = written(cases.attention_case(query_lens, seq_lens, block_size=8, head_dim=extra.pop("head_dim", 16),
                                        seed=len(name), **extra))
    want = reference.paged_attention(**case.attention_args())
    got = triton_attention.paged_attention(**case.attention_args())
    assert not got.isnan().any(), "NaN from the null block or an unwritten slot leaked into the output"
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_paged_attention_fp16_with_small_tiles():
    """fp16 caches, and tiles smaller than a block and than the query: many programs per
    sequence and key tiles that straddle the sliding window's edge."""
    case = written(cases.attention_case([17, 1], [45, 30], block_size=16, head_dim=32, dtype=torch.float16,
                                        sliding_window=24, seed=11))
    want = reference.paged_attention(**case.attention_args())
    got = triton_attention.paged_attention(**case.attention_args(), block_q=4, block_n=16)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


@pytest.mark.parametrize("name", ["decode", "mixed_prefill_chunks", "sliding_window", "chunked_local"])
def test_paged_attention_split_keys_match_reference(name):
    """Flash-decoding: each tile's keys cut into 3 splits (some empty), merged afterwards."""
    query_lens, seq_lens, extra = ATTENTION_CASES[name]
    case = written(cases.attention_case(query_lens, seq_lens, block_size=8, head_dim=16, seed=7, **extra))
    got = triton_attention.paged_attention(**case.attention_args(), block_n=16, num_splits=3)
    torch.testing.assert_close(got, reference.paged_attention(**case.attention_args()), **TOL[torch.float32])


def test_paged_attention_masks_nan_inside_a_visited_tile():
    """Window 9 with block size 4 nulls blocks right next to visible keys, inside the same
    64-key tile, and the slots past the sequence end hold NaN: only masked loads keep the
    NaN out of ``p @ V``."""
    case = written(cases.attention_case([1, 2], [31, 26], block_size=4, sliding_window=9, seed=2))
    assert (case.block_tables == 0).sum() >= 8
    got = triton_attention.paged_attention(**case.attention_args())
    assert not got.isnan().any()
    torch.testing.assert_close(got, reference.paged_attention(**case.attention_args()), **TOL[torch.float32])


def test_paged_attention_on_empty_batch():
    case = cases.attention_case([0], [5], block_size=4)
    got = triton_attention.paged_attention(**case.attention_args())
    assert got.shape == (0, 4, 32)


# ---------------------------------------------------------------------------------------
# state_update
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,dtype", [(4, torch.float32), (2, torch.float16), (1, torch.float32)])
def test_state_update_matches_reference_with_checkpoints(width, dtype):
    """Resuming sequences (one in place, mid-block), a fresh prompt, an idle sequence;
    checkpoints at every boundary crossed; NaN in every block the tables do not name."""
    case = cases.state_case([6, 1, 9, 0], [13, 11, 9, 4], num_heads=2, key_dim=8, value_dim=4, conv_width=width,
                            block_size=4, dtype=dtype, checkpoint_every_block=True, seed=width)
    want, got = case.clone_states(), case.clone_states()
    y_want = reference.state_update(**want.args())
    y_got = triton_state_update.state_update(**got.args())
    tol = TOL[dtype]
    torch.testing.assert_close(y_got, y_want, **tol)
    torch.testing.assert_close(got.ssm_state, want.ssm_state, equal_nan=True, **tol)
    torch.testing.assert_close(got.conv_state, want.conv_state, equal_nan=True, **tol)


def test_state_update_value_slices_match_reference():
    """The GPU layout: each head's value dim split over programs (4 slices of 4), one of
    them resuming and checkpointing in place."""
    case = cases.state_case([1, 5], [10, 12], num_heads=2, key_dim=8, value_dim=16, conv_width=4, block_size=4,
                            checkpoint_every_block=True, seed=9)
    want, got = case.clone_states(), case.clone_states()
    y_want = reference.state_update(**want.args())
    torch.testing.assert_close(triton_state_update.state_update(**got.args(), block_v=4), y_want)
    torch.testing.assert_close(got.ssm_state, want.ssm_state, equal_nan=True)
    torch.testing.assert_close(got.conv_state, want.conv_state, equal_nan=True)


def test_state_update_align_mode_skips_null_entries():
    """Align-mode tables: the step crosses block boundaries whose entries are null, so
    only the final state is written."""
    case = cases.state_case([9, 2], [12, 7], num_heads=1, key_dim=4, value_dim=8, conv_width=3, block_size=4,
                            seed=4)
    want, got = case.clone_states(), case.clone_states()
    torch.testing.assert_close(triton_state_update.state_update(**got.args()),
                               reference.state_update(**want.args()))
    torch.testing.assert_close(got.ssm_state, want.ssm_state, equal_nan=True)
    torch.testing.assert_close(got.conv_state, want.conv_state, equal_nan=True)


def test_state_update_rejects_wide_convolutions():
    case = cases.state_case([2], [2], conv_width=5)
    with pytest.raises(ValueError, match="conv widths"):
        triton_state_update.state_update(**case.args())
