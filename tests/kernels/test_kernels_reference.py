"""The torch reference against a dense attention computed without paging, and the paging
rules of the reference (slot mapping, chunked-local re-cutting, state checkpoints)."""

import pytest

torch = pytest.importorskip("torch")

from kvtwin.kernels import cases, layout, reference  # noqa: E402


def dense_attention(case: cases.AttentionCase) -> torch.Tensor:
    """Attention from the per-sequence K/V with no cache, no block table: SDPA with an
    explicit boolean mask built from positions."""
    group = case.q.shape[1] // case.dense_k[0].shape[1]
    out = torch.zeros_like(case.q)
    starts = case.query_start_loc.tolist()
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        q_pos = torch.arange(seq_len - (q1 - q0), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if case.sliding_window:
            mask &= q_pos - k_pos < case.sliding_window
        if case.chunk_size:
            mask &= q_pos // case.chunk_size == k_pos // case.chunk_size
        q = case.q[q0:q1].float().transpose(0, 1)  # [heads, q, d]
        k = case.dense_k[s].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = case.dense_v[s].float().repeat_interleave(group, dim=1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
        out[q0:q1] = o.transpose(0, 1).to(case.q.dtype)
    return out


MIXED = ([7, 1, 1, 33, 0], [40, 53, 17, 33, 12])  # chunk with context, decodes, fresh prompt, idle


@pytest.mark.parametrize("window,chunk", [(None, None), (19, None), (1, None), (None, 32), (None, 16)])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_matches_dense_attention(window, chunk, group):
    case = cases.attention_case(*MIXED, num_kv_heads=2, group=group, head_dim=16, block_size=8,
                                sliding_window=window, chunk_size=chunk, seed=group)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    got = reference.paged_attention(**case.attention_args())
    assert not got.isnan().any(), "NaN from the null block or an unwritten slot reached the output"
    torch.testing.assert_close(got, dense_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,chunk", [(None, None), (37, None), (None, 64)])
def test_reference_slices_long_queries_exactly(window, chunk, monkeypatch):
    """A prefill longer than a query slice (and slices that start mid-window or mid-chunk)
    gives what one slice would."""
    monkeypatch.setattr(reference, "QUERY_SLICE", 50)
    case = cases.attention_case([130, 1], [150, 90], num_kv_heads=2, group=2, head_dim=16, block_size=8,
                                sliding_window=window, chunk_size=chunk, seed=5)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    got = reference.paged_attention(**case.attention_args())
    torch.testing.assert_close(got, dense_attention(case), atol=1e-5, rtol=1e-5)


def test_reference_reads_the_block_table():
    """Swapping two blocks of a sequence's table changes its output (and only its)."""
    case = cases.attention_case([4, 4], [40, 40], block_size=8, seed=3)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    before = reference.paged_attention(**case.attention_args())
    case.block_tables[0, [0, 1]] = case.block_tables[0, [1, 0]]
    after = reference.paged_attention(**case.attention_args())
    assert not torch.allclose(before[:4], after[:4])
    torch.testing.assert_close(before[4:], after[4:])


def test_write_kv_scatters_to_slots_and_skips_negative():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.zeros((4, 4, 2, 8))
    v_cache = torch.zeros((4, 4, 2, 8))
    key, value = torch.randn((3, 2, 8), generator=gen), torch.randn((3, 2, 8), generator=gen)
    reference.write_kv(key, value, k_cache, v_cache, torch.tensor([13, -1, 4]))
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[1, 0], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 2  # token 1 went nowhere


def test_slot_mapping_follows_positions():
    tables = torch.tensor([[5, 2, 7], [3, 0, 0]], dtype=torch.int32)
    slots = layout.slot_mapping(tables, torch.tensor([10, 2]), torch.tensor([0, 3, 5]), block_size=4)
    # Sequence 0: positions 7, 8, 9 -> block 2 offset 3, block 7 offsets 0, 1; sequence 1: 0, 1.
    assert slots.tolist() == [2 * 4 + 3, 7 * 4, 7 * 4 + 1, 3 * 4, 3 * 4 + 1]


@pytest.mark.parametrize("chunk", [16, 32])
def test_local_virtual_batches_equal_the_chunk_mask(chunk):
    case = cases.attention_case(*MIXED, block_size=8, chunk_size=chunk, seed=5)
    reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    want = reference.paged_attention(**case.attention_args())
    batch = layout.local_virtual_batches(case.block_tables, case.seq_lens, case.query_start_loc, chunk, 8)
    assert batch.query_start_loc[-1] == case.q.shape[0]
    got = reference.paged_attention(case.q, case.k_cache, case.v_cache, batch.block_tables, batch.seq_lens,
                                    batch.query_start_loc, case.scale)
    torch.testing.assert_close(got, want)


def test_local_virtual_batches_need_whole_blocks():
    with pytest.raises(ValueError, match="multiple of block_size"):
        layout.local_virtual_batches(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([5]),
                                     torch.tensor([0, 5]), chunk_size=12, block_size=8)


# ---------------------------------------------------------------------------------------
# state_update: paging of the recurrent state
# ---------------------------------------------------------------------------------------

DIMS = dict(num_heads=2, key_dim=4, value_dim=3, conv_width=4)


def fresh_state(num_blocks: int, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    conv_dim = DIMS["num_heads"] * (2 * DIMS["key_dim"] + DIMS["value_dim"])
    conv = torch.full((num_blocks, width - 1, conv_dim), float("nan"))
    ssm = torch.full((num_blocks, DIMS["num_heads"], DIMS["key_dim"], DIMS["value_dim"]), float("nan"))
    return conv, ssm


def one_sequence_inputs(n: int, seed: int = 0):
    return cases.state_inputs(n, num_heads=2, key_dim=4, value_dim=3, conv_width=4, dtype=torch.float32,
                              gen=torch.Generator().manual_seed(seed))


def run(x, w, g, b, conv, ssm, table, computed, block_size=4):
    n = computed + x.shape[0]
    return reference.state_update(x, w, g, b, conv, ssm, torch.tensor([table], dtype=torch.int32),
                                  torch.tensor([n]), torch.tensor([0, x.shape[0]]), block_size)


def test_state_resumes_across_chunks_in_align_layout():
    """10 tokens in one call equal chunks of 4, 4, 1, 1 tokens where each chunk resumes from
    the block the previous one wrote, with vLLM align-mode tables (nulls before the last
    state block)."""
    x, w, g, b = one_sequence_inputs(10)
    conv, ssm = fresh_state(8)
    whole = run(x, w, g, b, conv, ssm, [0, 0, 5], computed=0)

    conv, ssm = fresh_state(8)
    parts = [run(x[0:4], w, g[0:4], b[0:4], conv, ssm, [3, 0, 0], computed=0),      # state@4 -> block 3
             run(x[4:8], w, g[4:8], b[4:8], conv, ssm, [3, 6, 0], computed=4),      # reads 3, state@8 -> 6
             run(x[8:9], w, g[8:9], b[8:9], conv, ssm, [0, 6, 2], computed=8),      # reads 6, state@9 -> 2
             run(x[9:10], w, g[9:10], b[9:10], conv, ssm, [0, 0, 2], computed=9)]   # in place in 2
    torch.testing.assert_close(torch.cat(parts), whole)
    assert not ssm[[1, 4, 7]].isfinite().any(), "blocks the tables never named must stay untouched"
    assert ssm[[3, 6, 2]].isfinite().all()


def test_state_checkpoints_every_named_boundary_and_resumes_from_one():
    """A prompt written with a checkpoint at every block boundary lets a second prompt that
    shares its first 8 tokens start from the checkpoint at 8 (a prefix-cache hit)."""
    x, w, g, b = one_sequence_inputs(11, seed=1)
    conv, ssm = fresh_state(8)
    run(x, w, g, b, conv, ssm, [1, 2, 3], computed=0)  # boundaries 4, 8 and the end (11)
    assert ssm[[1, 2, 3]].isfinite().all()

    tail_x, _, tail_g, tail_b = one_sequence_inputs(5, seed=2)
    second = run(tail_x, w, tail_g, tail_b, conv, ssm, [0, 2, 4, 6], computed=8)  # hit of 8 tokens

    conv2, ssm2 = fresh_state(8)
    scratch = run(torch.cat([x[:8], tail_x]), w, torch.cat([g[:8], tail_g]), torch.cat([b[:8], tail_b]),
                  conv2, ssm2, [0, 0, 0, 5], computed=0)
    torch.testing.assert_close(second, scratch[8:])
    torch.testing.assert_close(ssm[6], ssm2[5])  # the state after all 13 tokens


def test_state_null_entries_are_not_written():
    x, w, g, b = one_sequence_inputs(6)
    conv, ssm = fresh_state(4)
    run(x, w, g, b, conv, ssm, [0, 0], computed=0)  # the table names no block at all
    assert not ssm.isfinite().any() and not conv.isfinite().any()


def test_state_conv_history_is_the_last_inputs():
    x, w, g, b = one_sequence_inputs(6)
    conv, ssm = fresh_state(4)
    run(x, w, g, b, conv, ssm, [0, 2], computed=0)
    torch.testing.assert_close(conv[2], x[3:6])
