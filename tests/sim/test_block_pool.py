"""docs/semantics.md#block-pool: the block pool, free-queue order, lazy eviction."""

import pytest

from kvtwin.sim.core.block_pool import BlockPool

from .builders import block_ids, full, kv_manager, request, tokens


def test_block_zero_is_the_null_block_and_never_free():
    pool = BlockPool(8, 1, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    assert 0 not in pool.free_block_queue.block_ids()
    assert pool.get_usage() == 0.0


def test_forty_token_prompt_frees_partial_block_to_front_and_chain_tail_last():
    # [run] full attention, 40-token prompt in blocks [1, 2, 3] (3 is partial).
    kvm = kv_manager(full(), num_blocks=12)
    r = request("a", tokens(1000, 40))
    assert kvm.allocate_slots(r, 40) is not None
    assert block_ids(kvm, "a") == [1, 2, 3]
    kvm.free(r)
    assert kvm.block_pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 1]


def test_eviction_is_lazy_a_freed_cached_block_is_hittable_until_reused():
    kvm = kv_manager(full(), num_blocks=6)
    a = request("a", tokens(1000, 33))
    kvm.allocate_slots(a, 33)
    kvm.free(a)
    assert kvm.block_pool.num_cached_blocks() == 2
    again = request("b", tokens(1000, 33))
    _, hit, _ = kvm.get_computed_blocks(again)
    assert hit == 32
    # Reusing every free block forces the cached ones out of the map.
    c = request("c", tokens(5000, 80))
    assert kvm.allocate_slots(c, 80) is not None
    assert kvm.block_pool.num_cached_blocks() == 5  # only c's own full blocks remain
    _, hit, _ = kvm.get_computed_blocks(request("d", tokens(1000, 33)))
    assert hit == 0


def test_touch_revives_an_evictable_block_from_the_middle_of_the_queue():
    kvm = kv_manager(full(), num_blocks=10)
    a = request("a", tokens(1000, 33))
    kvm.allocate_slots(a, 33)
    kvm.free(a)
    free_before = kvm.block_pool.get_num_free_blocks()
    b = request("b", tokens(1000, 40))
    hit_blocks, hit, _ = kvm.get_computed_blocks(b)
    assert kvm.block_pool.get_num_free_blocks() == free_before  # lookup takes no reference
    kvm.allocate_slots(b, 40 - hit, hit, hit_blocks)
    assert [blk.ref_cnt for blk in hit_blocks[0]] == [1, 1]
    assert not set(block_ids(kvm, "b")[:2]) & set(kvm.block_pool.free_block_queue.block_ids())


def test_two_physical_blocks_with_one_key_count_once_and_lookup_returns_the_first():
    kvm = kv_manager(full(), num_blocks=10)
    a, b = request("a", tokens(1000, 17)), request("b", tokens(1000, 17))
    kvm.allocate_slots(a, 17)
    kvm.allocate_slots(b, 17)  # no lookup: an identical block computed twice
    first, second = block_ids(kvm, "a")[0], block_ids(kvm, "b")[0]
    assert first != second
    assert kvm.block_pool.num_cached_blocks() == 1
    found = kvm.block_pool.get_cached_block(a.block_hashes[0], [0])
    assert found[0].block_id == first


def test_get_new_blocks_refuses_more_than_free():
    pool = BlockPool(4, 1, enable_caching=True)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(4)


def test_reset_prefix_cache_only_when_nothing_is_held():
    kvm = kv_manager(full(), num_blocks=8)
    r = request("a", tokens(0, 32))
    kvm.allocate_slots(r, 32)
    assert not kvm.reset_prefix_cache()
    kvm.free(r)
    assert kvm.reset_prefix_cache()
    assert kvm.block_pool.num_cached_blocks() == 0
