"""docs/semantics.md#coordinator-choice (``allocate_new_computed_blocks``): a new request first holds every
group's prefix-hit blocks, and only then do the groups take fresh blocks for the tokens an
offload connector supplies (vLLM issue #33775), so one group's allocation cannot evict
another group's hit. Also: those fresh blocks stay uncached until the load lands."""

from kvtwin.sim.core.spec import SlidingWindowSpec
from tests.sim.builders import BS, block_ids, full, kv_manager, request, tokens


def test_every_groups_hit_is_held_before_any_group_takes_blocks_for_loaded_tokens():
    kvm = kv_manager(full(), full(), num_blocks=7)  # six usable blocks, two groups
    pool = kvm.block_pool
    shared = tokens(1000, 2 * BS)
    a = request("a", shared)
    assert kvm.allocate_slots(a, 2 * BS) is not None  # group 0: blocks 1, 2; group 1: 3, 4
    y = request("y", tokens(5000, BS))
    assert kvm.allocate_slots(y, BS) is not None  # 5, 6
    kvm.free(a)
    kvm.free(y)
    # The free queue now starts with a's blocks, group 0's ahead of group 1's hit blocks.
    assert pool.free_block_queue.block_ids() == [2, 1, 4, 3, 5, 6]

    b = request("b", shared + tokens(9000, 2 * BS))
    hit_blocks, hit_tokens, _ = kvm.get_computed_blocks(b)
    assert hit_tokens == 2 * BS
    # An asynchronous load of one more block per group: no tokens computed yet.
    new = kvm.allocate_slots(b, 0, hit_tokens, hit_blocks, num_external_computed_tokens=BS,
                             delay_cache_blocks=True)
    assert new is not None
    group0, group1 = block_ids(kvm, "b", 0), block_ids(kvm, "b", 1)
    assert group0[:2] == [1, 2] and group1[:2] == [3, 4]  # both hits kept
    assert {group0[2], group1[2]} == {5, 6}  # the loaded block of each group is a fresh one
    assert all(pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4))
    # Not cached before the load has landed.
    assert pool.blocks[group0[2]].block_hash is None and pool.blocks[group1[2]].block_hash is None
    kvm.cache_blocks(b, 3 * BS)
    assert pool.blocks[group0[2]].block_hash is not None


def test_loaded_tokens_the_window_no_longer_reads_get_no_block():
    """A sliding window skips the start of a long load: those positions are null, and only
    the window's blocks are allocated (vLLM's ``allocate_external_computed_blocks``)."""
    kvm = kv_manager(full(), SlidingWindowSpec(block_size=BS, sliding_window=2 * BS), num_blocks=64)
    b = request("b", tokens(1, 9 * BS))
    new = kvm.allocate_slots(b, 0, num_external_computed_tokens=8 * BS, delay_cache_blocks=True)
    assert new is not None
    assert len([i for i in block_ids(kvm, "b", 0) if i]) == 8
    window = block_ids(kvm, "b", 1)
    # Skipped: tokens before computed - (window - 1); the blocks that cover them are null.
    skipped_blocks = (8 * BS - (2 * BS - 1)) // BS
    assert window[:skipped_blocks] == [0] * skipped_blocks
    assert all(i for i in window[skipped_blocks:]) and len(window) == 8
