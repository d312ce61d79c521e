"""docs/semantics.md#kv-cache-manager: get_computed_blocks and allocate_slots in vLLM's order."""

import pytest

from kvtwin.sim.core.request import RequestStatus
from kvtwin.sim.core.spec import SlidingWindowSpec

from .builders import block_ids, full, kv_manager, request, tokens


@pytest.mark.parametrize("prompt_len, expected_hit", [(16, 0), (17, 16), (32, 16), (64, 48), (65, 64), (371, 368)])
def test_hit_is_capped_at_num_tokens_minus_one_in_whole_blocks(prompt_len, expected_hit):
    kvm = kv_manager(full(), num_blocks=64)
    first = request("a", tokens(1000, prompt_len))
    kvm.allocate_slots(first, prompt_len)
    _, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, prompt_len)))
    assert hit == expected_hit


def test_no_hits_with_caching_off():
    kvm = kv_manager(full(), num_blocks=64, caching=False)
    kvm.allocate_slots(request("a", tokens(1000, 64)), 64)
    blocks, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 64)))
    assert hit == 0 and blocks == kvm.empty_blocks
    assert kvm.block_pool.num_cached_blocks() == 0


def test_blocks_completed_by_this_steps_tokens_are_cached_at_schedule_time():
    kvm = kv_manager(full(), num_blocks=64)
    r = request("a", tokens(1000, 100))
    kvm.allocate_slots(r, 40)  # a chunk: blocks 0 and 1 full before any forward pass
    assert kvm.block_pool.num_cached_blocks() == 2
    # A twin arriving in the same step already hits them.
    _, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 100)))
    assert hit == 32


def test_whole_sequence_must_fit_for_waiting_requests():
    kvm = kv_manager(full(), num_blocks=8)  # 7 usable blocks
    r = request("a", tokens(1000, 200))  # 13 blocks in all
    assert kvm.allocate_slots(r, 32, full_sequence_must_fit=True) is None
    assert kvm.allocate_slots(r, 32, full_sequence_must_fit=False) is not None


def test_watermark_applies_to_waiting_requests_when_others_are_scheduled():
    kvm = kv_manager(full(), num_blocks=20, watermark=0.5)  # 10 blocks of headroom
    r = request("a", tokens(1000, 160))  # 10 blocks; 19 free
    assert r.status is RequestStatus.WAITING
    assert kvm.allocate_slots(r, 160, has_scheduled_reqs=True) is None
    assert kvm.allocate_slots(r, 160, has_scheduled_reqs=False) is not None


def test_skipped_blocks_are_released_before_the_capacity_check_even_when_it_fails():
    kvm = kv_manager(SlidingWindowSpec(block_size=16, sliding_window=32), num_blocks=7)
    r = request("a", tokens(1000, 96), max_tokens=8)
    kvm.allocate_slots(r, 96)  # all 6 usable blocks
    r.num_computed_tokens = 96
    assert kvm.block_pool.get_num_free_blocks() == 0
    huge = 200  # needs far more than the window releases
    assert kvm.allocate_slots(r, huge) is None
    # Blocks 0..3 left the window (96 - 32 + 1 = 65 tokens → 4 blocks) and were freed anyway.
    assert block_ids(kvm, "a")[:4] == [0, 0, 0, 0]
    assert kvm.block_pool.get_num_free_blocks() == 4


def test_allocate_returns_only_new_blocks_and_hits_are_adopted():
    kvm = kv_manager(full(), num_blocks=32)
    kvm.allocate_slots(request("a", tokens(1000, 48)), 48)
    b = request("b", tokens(1000, 48) + tokens(7000, 20))
    blocks, hit, _ = kvm.get_computed_blocks(b)
    new = kvm.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert hit == 48 and len(new[0]) == 2
    assert block_ids(kvm, "b")[:3] == block_ids(kvm, "a")


def test_zero_new_tokens_is_an_error():
    kvm = kv_manager(full())
    with pytest.raises(ValueError):
        kvm.allocate_slots(request("a", tokens(0, 4)), 0)
