"""docs/semantics.md#single-type-managers and #allocate-slots: single-type managers as driven through allocate_slots."""

from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

from .builders import block_ids, full, kv_manager, request, tokens


def swa(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=16, sliding_window=window)


def mamba() -> MambaSpec:
    return MambaSpec(block_size=16, shapes=((4, 4),), dtype_bytes=(2,), mamba_cache_mode="align")


def _decode_to(kvm, r, total_tokens):
    while r.num_tokens < total_tokens:
        kvm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        r.append_output_token_ids([60_000 + r.num_output_tokens])


def test_sliding_window_nulls_blocks_that_left_the_window():
    # [run] window 32, 70-token prompt in blocks [1..5].
    kvm = kv_manager(swa(32), num_blocks=32)
    r = request("a", tokens(1000, 70), max_tokens=20)
    kvm.allocate_slots(r, 70)
    r.num_computed_tokens = 70
    r.append_output_token_ids([60_000])
    assert block_ids(kvm, "a") == [1, 2, 3, 4, 5]
    kvm.allocate_slots(r, 1)  # first decode: processed = 70
    assert block_ids(kvm, "a")[:5] == [0, 0, 3, 4, 5]
    r.num_computed_tokens += 1
    r.append_output_token_ids([60_001])
    _decode_to(kvm, r, 81)  # the allocation at processed = 79 drops block 3
    assert block_ids(kvm, "a")[:5] == [0, 0, 0, 4, 5]


def test_sliding_window_hit_needs_a_contiguous_window_and_nulls_before_it():
    kvm = kv_manager(full(), swa(32), num_blocks=64)
    a = request("a", tokens(1000, 97))
    kvm.allocate_slots(a, 97)
    blocks, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 97)))
    assert hit == 96
    swa_blocks = blocks[1]
    # cdiv(32 - 1, 16) = 2 contiguous blocks found right to left; the rest are null.
    assert [b.block_id == 0 for b in swa_blocks] == [True, True, True, True, False, False]


def test_sliding_window_prefix_shorter_than_window_is_a_hit_from_block_zero():
    kvm = kv_manager(swa(128), num_blocks=64)
    a = request("a", tokens(1000, 40))
    kvm.allocate_slots(a, 40)
    _, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 40)))
    assert hit == 32


def test_chunked_local_blocks_before_the_current_chunk_are_free_hits():
    kvm = kv_manager(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64), num_blocks=64)
    blocks, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 150)))
    # max hit 149 → chunk start 128: blocks 0..7 are null "hits"; block 8 misses.
    assert hit == 128 and all(b.is_null for b in blocks[0])


def test_chunked_local_drops_blocks_of_finished_chunks():
    kvm = kv_manager(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32), num_blocks=64)
    r = request("a", tokens(1000, 60), max_tokens=20)
    kvm.allocate_slots(r, 60)
    r.num_computed_tokens = 60
    r.append_output_token_ids([60_000])
    kvm.allocate_slots(r, 1)  # processed 60: everything before token 32 is dead
    assert block_ids(kvm, "a")[:2] == [0, 0]


def test_mamba_align_keeps_only_the_boundary_state_block():
    # [run] full + mamba, 50-token prompt; chunk 1 = 48 tokens, chunk 2 = 2 tokens.
    kvm = kv_manager(full(), mamba(), num_blocks=32)
    r = request("a", tokens(1000, 50), max_tokens=4)
    kvm.allocate_slots(r, 48)
    assert block_ids(kvm, "a", 0) == [1, 2, 3]
    assert block_ids(kvm, "a", 1) == [0, 0, 4]
    r.num_computed_tokens = 48
    kvm.allocate_slots(r, 2)
    assert block_ids(kvm, "a", 1) == [0, 0, 4, 6]
    r.num_computed_tokens = 50
    r.append_output_token_ids([60_000])
    kvm.allocate_slots(r, 1)
    assert block_ids(kvm, "a", 1) == [0, 0, 0, 6]


def test_mamba_hit_is_the_last_cached_state_block():
    kvm = kv_manager(full(), mamba(), num_blocks=32)
    a = request("a", tokens(1000, 50), max_tokens=4)
    kvm.allocate_slots(a, 48)
    kvm.new_step_starts()
    blocks, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 50)))
    assert hit == 48
    assert [b.is_null for b in blocks[1]] == [True, True, False]


def test_mamba_state_cached_this_step_cannot_be_hit_in_the_same_step():
    kvm = kv_manager(full(), mamba(), num_blocks=32)
    a = request("a", tokens(1000, 50), max_tokens=4)
    kvm.allocate_slots(a, 48)
    b = request("b", tokens(1000, 50))
    blocks, hit, _ = kvm.get_computed_blocks(b)
    assert hit == 48
    assert kvm.allocate_slots(b, 2, hit, blocks) is None
    kvm.new_step_starts()
    assert kvm.allocate_slots(b, 2, hit, blocks) is not None


def test_free_hit_blocks_count_as_blocks_to_allocate():
    kvm = kv_manager(full(), num_blocks=6)  # 5 usable
    a = request("a", tokens(1000, 64))
    kvm.allocate_slots(a, 64)
    kvm.free(a)  # 4 cached blocks, all evictable
    b = request("b", tokens(1000, 64) + tokens(9000, 20))
    blocks, hit, _ = kvm.get_computed_blocks(b)
    assert hit == 64
    manager = kvm.coordinator.managers[0]
    # 84 tokens → 6 blocks: 4 evictable hits + 2 new, more than the 5 free.
    assert manager.get_num_blocks_to_allocate("b", 84, blocks[0], 64, 84) == 6
    assert kvm.allocate_slots(b, 20, hit, blocks) is None


def test_sliding_window_admission_cap_bounds_the_whole_sequence_check():
    spec = swa(128)
    # min(128 - 1 + 256, 4096) = 383 tokens → cdiv(383, 16) + 1 = 25 blocks.
    assert spec.max_admission_blocks_per_request(256, 4096) == 25
    kvm = kv_manager(spec, num_blocks=30, in_flight=256)
    r = request("a", tokens(1000, 2000))
    # The whole 2000-token sequence would need 125 blocks, but a window group never holds
    # more than its cap, so the request is admitted with its first chunk.
    assert kvm.allocate_slots(r, 256, full_sequence_must_fit=True) is not None


def test_sliding_window_retains_the_extra_tail_below_the_window():
    """docs/semantics.md#sliding-window: with extra_retained_tokens = 2 (3-module MTP) the
    window's blocks leave 2 tokens later than without, and the admission cap counts them."""
    spec = SlidingWindowSpec(block_size=16, sliding_window=32, extra_retained_tokens=2)
    assert spec.num_retained_tokens == 33
    # min(32 - 1 + 2 + 48, 4096) = 81 tokens → cdiv(81, 16) + 1 = 7 blocks (6 without the tail).
    assert spec.max_admission_blocks_per_request(48, 4096) == 7
    assert swa(32).max_admission_blocks_per_request(48, 4096) == 6
    kvm = kv_manager(spec, num_blocks=32)
    manager = kvm.coordinator.managers[0]
    assert manager.get_num_skipped_tokens(70) == 37 and manager.get_num_skipped_tokens(33) == 0
    r = request("a", tokens(1000, 70), max_tokens=20)
    kvm.allocate_slots(r, 70)
    r.num_computed_tokens = 70
    r.append_output_token_ids([60_000])
    kvm.allocate_slots(r, 1)  # processed = 70: 37 skipped tokens, 2 whole blocks
    assert block_ids(kvm, "a")[:5] == [0, 0, 3, 4, 5]
    r.num_computed_tokens += 1
    r.append_output_token_ids([60_001])
    _decode_to(kvm, r, 82)  # processed = 80 skips 47 tokens: still 2 blocks
    assert block_ids(kvm, "a")[:3] == [0, 0, 3]
    _decode_to(kvm, r, 83)  # processed = 81 skips 48: block 3 leaves (at 79 without the tail)
    assert block_ids(kvm, "a")[:3] == [0, 0, 0]


def test_sliding_window_skip_horizon_matches_the_skipped_tokens():
    """The decode fast path's horizon (``_skip_horizon``) is exactly the first computed count
    at which ``remove_skipped_blocks`` would drop another block, with or without a retained tail."""
    for window in (1, 8, 16, 17, 32, 33):
        for extra in (0, 1, 2, 4, 15, 16):
            kvm = kv_manager(SlidingWindowSpec(block_size=16, sliding_window=window, extra_retained_tokens=extra),
                             num_blocks=64)
            manager = kvm.coordinator.managers[0]
            r = request("a", tokens(1000, 200), max_tokens=4)
            kvm.allocate_slots(r, 200)
            table = manager.req_to_blocks["a"]
            for computed in range(0, 200):
                manager.remove_skipped_blocks("a", computed)
                horizon = manager._skip_horizon("a", table)
                assert manager._nothing_to_skip(table, computed)
                assert all(manager._nothing_to_skip(table, n) for n in range(computed, min(horizon, 201)))
                if horizon <= 200:
                    assert not manager._nothing_to_skip(table, horizon), (window, extra, computed, horizon)
