"""docs/semantics.md#coordinators: coordinator choice and the hybrid fixed-point hit."""

from kvtwin.sim.core.coordinator import HybridKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache, UnitaryKVCacheCoordinator
from kvtwin.sim.core.spec import MambaSpec, SlidingWindowSpec

from .builders import full, kv_manager, request, tokens


def mamba():
    return MambaSpec(block_size=16, shapes=((4,),), dtype_bytes=(2,), mamba_cache_mode="align")


def test_coordinator_choice():
    assert isinstance(kv_manager(full(), caching=False).coordinator, KVCacheCoordinatorNoPrefixCache)
    assert isinstance(kv_manager(full()).coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(kv_manager(full(), mamba()).coordinator, HybridKVCacheCoordinator)


def test_groups_share_one_pool_and_each_block_costs_one_per_group():
    kvm = kv_manager(full(), SlidingWindowSpec(block_size=16, sliding_window=1024), num_blocks=64)
    kvm.allocate_slots(request("a", tokens(0, 64)), 64)
    assert kvm.block_pool.get_num_free_blocks() == 63 - 8
    ids = kvm.get_block_ids("a")
    assert not set(ids[0]) & set(ids[1])


def test_identical_specs_are_looked_up_together_and_full_attention_first():
    window = SlidingWindowSpec(block_size=16, sliding_window=64)
    kvm = kv_manager(window, full(), window, num_blocks=64)
    coordinator = kvm.coordinator
    assert [g.group_ids for g in coordinator.attention_groups] == [[1], [0, 2]]
    assert coordinator.is_simple_hybrid  # two attention groups, full attention first


def test_hybrid_hit_is_shortened_by_the_sliding_window_and_full_lists_truncated():
    kvm = kv_manager(full(), SlidingWindowSpec(block_size=16, sliding_window=48), num_blocks=64)
    a = request("a", tokens(0, 97))
    kvm.allocate_slots(a, 97)
    # Evict the sliding window's cached block 5 only: the full group still has it.
    pool = kvm.block_pool
    swa_block = kvm.coordinator.managers[1].req_to_blocks["a"][5]
    pool._maybe_evict_cached_block(swa_block)
    blocks, hit, boundary = kvm.get_computed_blocks(request("b", tokens(0, 97)))
    # Full attention alone would hit 96; the window needs 3 contiguous blocks ending at
    # the hit, so the last run ending before block 5 ends at block 4 → 80 tokens.
    assert hit == 80
    assert len(blocks[0]) == 5 and len(blocks[1]) == 5
    assert boundary == 96  # the longest single-group hit: an uncached common prefix of 16


def test_three_group_fixed_point_is_accepted_by_every_group():
    kvm = kv_manager(full(), SlidingWindowSpec(block_size=16, sliding_window=32), mamba(), num_blocks=128)
    a = request("a", tokens(0, 100), max_tokens=4)
    kvm.allocate_slots(a, 64)
    a.num_computed_tokens = 64
    kvm.allocate_slots(a, 36)
    kvm.new_step_starts()
    coordinator = kvm.coordinator
    b = request("b", tokens(0, 100))
    _, hit, _ = coordinator.find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)
    # Mamba cached a state only at the chunk end (64); every group accepts that length.
    assert hit == 64
    again_blocks, again, _ = coordinator.find_longest_cache_hit(b.block_hashes, hit)
    assert again == hit


def test_connector_lookup_takes_the_full_attention_hit_where_mamba_lags():
    """vLLM's ``get_computed_blocks_for_connector`` (a connector that brings the Mamba
    state, as NIXL does): per-group hits, the full-attention one reported and flagged as
    diverged; the ordinary lookup keeps the hit both groups agree on."""
    kvm = kv_manager(full(), mamba(), num_blocks=128)
    a = request("a", tokens(0, 100), max_tokens=4)
    kvm.allocate_slots(a, 64)
    a.num_computed_tokens = 64
    kvm.allocate_slots(a, 36)
    kvm.new_step_starts()
    b = request("b", tokens(0, 100))
    _, agreed, _ = kvm.get_computed_blocks(b)
    per_group_blocks, hits = kvm.coordinator.find_longest_cache_hit_per_group(b.block_hashes, b.num_tokens - 1)
    assert agreed == 64 and hits == [96, 64]
    blocks, hit, boundary, diverged = kvm.get_computed_blocks_for_connector(b)
    assert (hit, boundary, diverged) == (96, 0, True)
    assert blocks.blocks == per_group_blocks.blocks and len(blocks[0]) == 6


def test_connector_lookup_is_the_ordinary_one_without_mamba():
    for kvm in (kv_manager(full()), kv_manager(full(), SlidingWindowSpec(block_size=16, sliding_window=32))):
        a = request("a", tokens(0, 100))
        kvm.allocate_slots(a, 100)
        b = request("b", tokens(0, 100))
        blocks, hit, boundary = kvm.get_computed_blocks(b)
        got_blocks, *rest = kvm.get_computed_blocks_for_connector(b)
        assert got_blocks.blocks == blocks.blocks and rest == [hit, boundary, False] and hit == 96
