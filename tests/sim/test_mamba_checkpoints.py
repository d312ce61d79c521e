"""Mamba prefill checkpoints (vLLM 0.33; docs/semantics.md#mamba, the manager and the split).

A Mamba group whose kernel can leave a state mid-prefill (``num_prefill_checkpoint_blocks``
> 0 with a ``prefill_checkpoint_alignment``) keeps that state in one extra block, just
before the running state's: the scheduler then lets the prompt's final chunk run through
the last cacheable boundary instead of stopping there, and the manager keeps, caches and
later releases the checkpoint block. Golden cases: ``mamba_checkpoint*``. Such tables hold
real blocks behind nulls, so retiring skipped blocks scans past nulls (vLLM's
``_remove_blocks_in_range``), which asynchronous scheduling needs too.
"""

import pytest

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.core.spec import (
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
    spec_from_dict,
)

from .builders import block_ids, full, kv_config, kv_manager, request, tokens


def mamba(alignment: int | None = 1, blocks: int = 1, mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=16, shapes=((4, 4),), dtype_bytes=(2,), mamba_cache_mode=mode,
                     num_prefill_checkpoint_blocks=blocks, prefill_checkpoint_alignment=alignment)


def scheduler(*specs, budget: int = 256, threshold: int = 0, caching: bool = True, **drafts) -> Scheduler:
    return Scheduler(kv_config(*specs), SchedulerConfig(max_model_len=4096, max_num_batched_tokens=budget,
                                                        long_prefill_token_threshold=threshold, async_scheduling=False,
                                                        **drafts),
                     CacheConfig(enable_prefix_caching=caching))


# An EAGLE head with k = 3 (caching off: no lookahead hashes, so vLLM keeps its block drop).
EAGLE = dict(num_speculative_tokens=3, num_lookahead_tokens=3)


# -- the spec ---------------------------------------------------------------------------

def test_spec_counts_the_checkpoint_block_only_in_align_mode():
    assert mamba().max_admission_blocks_per_request(256, 4096) == 2 + 1
    assert mamba(mode="none").max_admission_blocks_per_request(256, 4096) == 1
    assert mamba().has_prefill_checkpoint_blocks and not mamba(mode="none").has_prefill_checkpoint_blocks
    loaded = spec_from_dict({"kind": "mamba", "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 64},
                            block_size=16, where="g")
    assert (loaded.num_prefill_checkpoint_blocks, loaded.prefill_checkpoint_alignment) == (1, 64)
    assert spec_from_dict({"kind": "mamba"}, block_size=16, where="g").prefill_checkpoint_alignment is None


@pytest.mark.parametrize("field,value", [("num_prefill_checkpoint_blocks", -1),
                                         ("num_prefill_checkpoint_blocks", True),
                                         ("prefill_checkpoint_alignment", 0),
                                         ("prefill_checkpoint_alignment", 1.5)])
def test_spec_refuses_bad_checkpoint_fields(field, value):
    with pytest.raises(ConfigError) as err:
        spec_from_dict({"kind": "mamba", field: value}, block_size=16, where="kv_cache_groups[1]")
    assert err.value.field == f"kv_cache_groups[1].{field}"


def test_checkpoint_position_and_validity():
    # Hits stop at num_tokens - 1, so a 96-token prompt's last reusable state is at 80.
    assert [get_mamba_prefill_checkpoint_position(n, 16) for n in (1, 16, 17, 96, 97, 100)] == [0, 0, 16, 80, 96, 96]
    valid = lambda start, end, pos, align=1: is_mamba_prefill_checkpoint_valid(start, end, pos, 16, 16, align)
    assert valid(0, 100, 96)
    assert valid(32, 100, 96, align=64) and not valid(0, 100, 96, align=64)  # offset on the kernel's grid
    assert not valid(0, 100, 96, align=None)  # the kernel exports none
    assert not valid(8, 100, 96)  # a chunk must start on a hash block
    assert valid(80, 100, 96) and not valid(0, 96, 96)  # strictly inside the chunk
    assert valid(0, 32, 16) and not valid(16, 32, 16)  # at least one hash block past its start
    # With state blocks wider than hash blocks, the checkpoint's block must come after the
    # one the chunk's initial state is read from.
    assert not is_mamba_prefill_checkpoint_valid(32, 60, 48, 16, 32, 1)
    assert is_mamba_prefill_checkpoint_valid(32, 70, 48, 16, 32, 1)


def test_eagle_block_drop_keeps_the_checkpoint_one_block_back():
    # vLLM 0.33 kv_cache_interface.py l.1169-1186: the last whole block before num_tokens,
    # minus one block, never below 0.
    drop = [get_mamba_prefill_checkpoint_position(n, 16, drop_eagle_block=True) for n in (1, 16, 17, 32, 96, 97, 100)]
    assert drop == [0, 0, 0, 16, 80, 80, 80]


def test_only_a_draft_head_without_lookahead_hashes_drops():
    sync = dict(max_model_len=64, async_scheduling=False)
    assert SchedulerConfig(**sync, **EAGLE).use_eagle_block_drop
    assert not SchedulerConfig(**sync, num_hash_lookahead_tokens=1, **EAGLE).use_eagle_block_drop
    assert not SchedulerConfig(**sync, num_speculative_tokens=3).use_eagle_block_drop  # n-gram
    assert not SchedulerConfig(**sync).use_eagle_block_drop


# -- the scheduler's split --------------------------------------------------------------

def test_final_chunk_runs_through_the_checkpoint_instead_of_stopping_at_it():
    r = request("a", tokens(1000, 100))
    # Without checkpoints the chunk stops at the last cacheable boundary, 96.
    assert scheduler(full(), mamba(blocks=0, alignment=None)).mamba_block_aligned_split(r, 100, 0) == 96
    assert scheduler(full(), mamba(blocks=1, alignment=None)).mamba_block_aligned_split(r, 100, 0) == 96
    assert scheduler(full(), mamba()).mamba_block_aligned_split(r, 100, 0) == 100
    # A 64-token grid: 96 - 0 is off it, 96 - 32 (after a 32-token hit) on it.
    grid = scheduler(full(), mamba(alignment=64))
    assert grid.mamba_block_aligned_split(r, 100, 0) == 96
    assert grid.mamba_block_aligned_split(r, 68, 32) == 68


def test_eagle_block_drop_moves_the_split_and_the_exported_checkpoint():
    r = request("a", tokens(1000, 100))
    spec = mamba(blocks=0, alignment=None)
    spec_k3 = MambaSpec(block_size=16, shapes=((4, 4),), dtype_bytes=(2,), mamba_cache_mode="align",
                        num_speculative_blocks=3)
    assert scheduler(full(), spec_k3, caching=False, num_speculative_tokens=3).mamba_block_aligned_split(
        r, 100, 0) == 96
    # The head's drop stops the prefill one block earlier, at 80.
    assert scheduler(full(), spec_k3, caching=False, **EAGLE).mamba_block_aligned_split(r, 100, 0) == 80
    assert scheduler(full(), spec, caching=False).mamba_block_aligned_split(r, 100, 0) == 96
    # A checkpoint-exporting kernel runs the final chunk through, exporting the state at 80
    # into the block before the running state's.
    ckpt = MambaSpec(block_size=16, shapes=((4, 4),), dtype_bytes=(2,), mamba_cache_mode="align",
                     num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1, num_speculative_blocks=3)
    sched = scheduler(full(), ckpt, caching=False, **EAGLE)
    assert sched.mamba_block_aligned_split(r, 100, 0) == 100
    manager = sched.kv_cache_manager.coordinator.managers[1]
    plain = scheduler(full(), ckpt, caching=False, num_speculative_tokens=3).kv_cache_manager.coordinator.managers[1]
    assert manager.drop_eagle_checkpoint_block and not plain.drop_eagle_checkpoint_block
    assert manager._checkpoint_index("a", None, 0, 100) == plain._checkpoint_index("a", None, 0, 100) == 5
    # A chunk from 80: the plain checkpoint (96) lies inside it, the dropped one (80) does not.
    assert plain._checkpoint_index("a", None, 80, 100) == 5
    assert manager._checkpoint_index("a", None, 80, 100) == -1


def test_chunks_that_do_not_reach_the_prompt_end_stay_block_aligned():
    sched = scheduler(full(), mamba(), budget=250)
    r = request("a", tokens(1000, 600))
    assert sched.mamba_block_aligned_split(r, 250, 0) == 240
    # Every Mamba group must export checkpoints for the split to relax.
    mixed = scheduler(full(), mamba(), mamba(blocks=0, alignment=None))
    assert mixed.mamba_block_aligned_split(request("b", tokens(1000, 100)), 100, 0) == 96


# -- the manager ------------------------------------------------------------------------

def test_checkpoint_block_is_kept_cached_hit_and_released_after_the_step():
    kvm = kv_manager(full(), mamba(), num_blocks=32)
    a = request("a", tokens(1000, 100), max_tokens=4)
    assert kvm.allocate_slots(a, 100) is not None
    assert block_ids(kvm, "a", 0) == [1, 2, 3, 4, 5, 6, 7]
    # Index 5 holds the state after 96 tokens (the checkpoint), index 6 the running one.
    assert block_ids(kvm, "a", 1) == [0, 0, 0, 0, 0, 8, 9]
    kvm.new_step_starts()
    blocks, hit, _ = kvm.get_computed_blocks(request("b", tokens(1000, 100) + tokens(5000, 10)))
    assert hit == 96 and blocks[1][-1].block_id == 8
    # The next step releases it (it stays cached, evictable) and logs the change in place.
    a.num_computed_tokens = 100
    a.append_output_token_ids([60_000])
    kvm.allocate_slots(a, 1)
    assert block_ids(kvm, "a", 1) == [0, 0, 0, 0, 0, 0, 9]
    assert kvm.replaced_block_ids == {"a": [(1, 5, 0)]}
    blocks, hit, _ = kvm.get_computed_blocks(request("c", tokens(1000, 100) + tokens(5000, 10)))
    assert hit == 96 and blocks[1][-1].block_id == 8 and blocks[1][-1].ref_cnt == 0


def test_without_checkpoints_the_same_allocation_leaves_no_state_to_hit():
    kvm = kv_manager(full(), mamba(blocks=0, alignment=None), num_blocks=32)
    kvm.allocate_slots(request("a", tokens(1000, 100)), 100)
    assert block_ids(kvm, "a", 1) == [0, 0, 0, 0, 0, 0, 8]
    kvm.new_step_starts()
    assert kvm.get_computed_blocks(request("b", tokens(1000, 110)))[1] == 0


def test_checkpoint_adds_one_block_to_the_admission_count():
    # 100 tokens: 7 full-attention blocks, and in the Mamba group the running state plus the
    # checkpoint when the kernel exports one.
    for spec, expected in ((mamba(), 7 + 2), (mamba(alignment=None), 7 + 1), (mamba(alignment=64), 7 + 1)):
        kvm = kv_manager(full(), spec, num_blocks=32)
        r = request("a", tokens(1000, 100))
        assert kvm.coordinator.get_num_blocks_to_allocate("a", 100, kvm.empty_blocks, 0, 100,
                                                          apply_admission_cap=True) == expected
        # A pool one block short of that refuses the whole-sequence admission.
        short = kv_manager(full(), spec, num_blocks=expected)
        assert short.allocate_slots(r, 100, full_sequence_must_fit=True) is None


def test_every_qualifying_chunk_publishes_a_checkpoint_and_at_most_three_state_blocks_live():
    kvm = kv_manager(full(), mamba(), num_blocks=128)
    r = request("a", tokens(1000, 600), max_tokens=4)
    kvm.allocate_slots(r, 256)
    # Dense retention: an intermediate chunk too keeps the state one block before its end.
    assert block_ids(kvm, "a", 1) == [0] * 14 + [17, 18]
    r.num_computed_tokens = 256
    kvm.allocate_slots(r, 256)
    table = block_ids(kvm, "a", 1)
    # The previous chunk's checkpoint is released; its running state seeds this chunk.
    assert [(i, b) for i, b in enumerate(table) if b] == [(15, 18), (30, 35), (31, 36)]
    r.num_computed_tokens = 512
    kvm.allocate_slots(r, 88)
    table = block_ids(kvm, "a", 1)
    assert [(i, b) for i, b in enumerate(table) if b] == [(31, 36), (36, 43), (37, 44)]


def test_skipped_state_blocks_behind_null_gaps_are_retired_highest_first():
    # Allocations running ahead of the processed tokens (batches in flight) leave earlier
    # state blocks behind nulls; the next retirement frees them all, not just the last one.
    kvm = kv_manager(full(), mamba(blocks=0, alignment=None), num_blocks=32)
    manager = kvm.coordinator.managers[1]
    # Each call returns the entries it appended: null padding, then the new state block.
    b1, b2, b3 = (manager.allocate_new_blocks("a", n, n)[-1] for n in (48, 96, 144))
    assert [b.block_id for b in manager.req_to_blocks["a"]] == [0, 0, b1.block_id, 0, 0, b2.block_id, 0, 0,
                                                               b3.block_id]
    free_before = kvm.block_pool.get_num_free_blocks()
    manager.remove_skipped_blocks("a", 144)
    assert [b.block_id for b in manager.req_to_blocks["a"]] == [0] * 8 + [b3.block_id]
    assert kvm.block_pool.get_num_free_blocks() == free_before + 2
    assert kvm.replaced_block_ids == {"a": [(1, 5, 0), (1, 2, 0)]}
    # Nothing is left to retire below the watermark: allocating again would change nothing.
    assert manager.is_noop("a", 144, 144, 144, 0)
