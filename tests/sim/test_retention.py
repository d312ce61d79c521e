"""docs/semantics.md#prefix-cache-retention: which sliding-window and Mamba blocks enter the
prefix cache under vLLM 0.33's ``prefix_cache_retention_interval`` (0 by default, N, or
dense). The golden cases ``retention_*`` pin the whole behaviour against vLLM; these tests
pin each rule on its own, the masks against an independent statement of them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.retention import (mamba_mask, parse_retention_setting, reachable_boundaries,
                                       sliding_window_mask)
from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec, cdiv

from .builders import EchoModel, full, kv_config, new_request, tokens

BS = 16


# -- the masks, against the rule in words -------------------------------------------------------

def _kept_positions(end_block: int, grid: int, interval: int | None, boundaries) -> set[int]:
    """Token positions a hit may end at that the mode keeps, up to the table's end (and one
    segment past it, whose window reaches back into the table)."""
    limit = (end_block + 64) * BS
    if interval is None:
        return set(range(grid, limit, grid))
    kept = {b // grid * grid for b in boundaries}
    if interval:
        kept |= set(range(interval, limit, interval))
    return kept


def _window_oracle(start, end, grid, window, interval, boundaries, final_end=None):
    need = cdiv(window - 1, BS)
    kept = _kept_positions(end, grid, interval, boundaries)
    blocks = set()
    for position in kept:
        last = position // BS
        blocks |= set(range(last - need, last))
    if final_end is not None and interval is None:
        # The prompt's last, partial segment keeps its own tail (the connector's horizon).
        per_segment = grid // BS
        tail = final_end % per_segment
        if tail:
            blocks |= set(range(final_end - min(tail, need), final_end))
    return [i in blocks for i in range(start, end)]


def _state_oracle(start, end, grid, interval, boundaries):
    kept = _kept_positions(end, grid, interval, boundaries)
    if interval is not None and 0 < interval <= BS:
        return None
    return [(i + 1) * BS in kept for i in range(start, end)]


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 20), length=st.integers(0, 20), grid_blocks=st.sampled_from([1, 1, 2, 4]),
       window=st.integers(1, 200), interval_blocks=st.sampled_from([None, 0, 0, 1, 2, 3, 4, 8, 16]),
       boundaries=st.lists(st.integers(0, 700), max_size=2), final=st.none() | st.integers(0, 45))
def test_sliding_window_mask_keeps_each_kept_boundarys_window(start, length, grid_blocks, window, interval_blocks,
                                                              boundaries, final):
    grid = grid_blocks * BS
    interval = None if interval_blocks is None else interval_blocks * grid
    end = start + length
    final_end = final if interval is None else None
    mask = sliding_window_mask(start, end, grid, window, BS, interval, boundaries, final_end)
    expected = _window_oracle(start, end, grid, window, interval, boundaries, final_end)
    assert (mask if mask is not None else [True] * length) == expected


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 30), length=st.integers(0, 30), grid_blocks=st.sampled_from([1, 1, 2]),
       interval_blocks=st.sampled_from([None, 0, 0, 1, 2, 3, 4, 8]),
       boundaries=st.lists(st.integers(0, 900), max_size=2))
def test_mamba_mask_keeps_the_state_at_each_kept_boundary(start, length, grid_blocks, interval_blocks, boundaries):
    grid = grid_blocks * BS
    interval = None if interval_blocks is None else interval_blocks * grid
    mask = mamba_mask(start, start + length, grid, BS, interval, boundaries)
    expected = _state_oracle(start, start + length, grid, interval, boundaries)
    if interval is None or expected is None:
        assert mask is None
    else:
        assert mask == expected


def test_the_boundaries_are_the_prompts_last_token_and_the_junction():
    assert reachable_boundaries(100, 0) == (99,)
    assert reachable_boundaries(100, 64) == (99, 64)


@pytest.mark.parametrize("text, value", [(0, 0), ("0", 0), ("512", 512), ("dense", None), (" Dense ", None),
                                         (1_024, 1024), ("1_024", 1024)])
def test_a_setting_is_a_number_of_tokens_or_dense(text, value):
    assert parse_retention_setting(text) == value


@pytest.mark.parametrize("bad", [-16, "sparse", "", 1.5, True, None])
def test_a_bad_setting_names_what_is_expected(bad):
    with pytest.raises(ConfigError, match="prefix_cache_retention_interval: expected 0 .*or dense"):
        parse_retention_setting(bad)


# -- vLLM's validation --------------------------------------------------------------------------

def _config(*specs, interval, num_blocks=64):
    return dataclasses.replace(kv_config(*specs, num_blocks=num_blocks), prefix_cache_retention_interval=interval)


def _manager(*specs, interval, num_blocks=64, caching=True):
    return KVCacheManager(_config(*specs, interval=interval, num_blocks=num_blocks), 4096, 256,
                          enable_caching=caching)


def test_a_positive_interval_needs_a_group_it_can_thin():
    with pytest.raises(ConfigError, match="0 or dense for a model without sliding-window or Mamba"):
        _manager(full(), ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=64), interval=64)
    _manager(full(), interval=0)  # the engine default is accepted everywhere


def test_a_positive_interval_lands_on_the_hit_grid():
    with pytest.raises(ConfigError, match="a multiple of the scheduler block size \\(16\\)"):
        _manager(full(), SlidingWindowSpec(block_size=BS, sliding_window=64), interval=40)
    _manager(full(), SlidingWindowSpec(block_size=BS, sliding_window=64), interval=48)


# -- what it does to hits, end to end -----------------------------------------------------------

def _engine(*specs, interval, num_blocks=200):
    # A 32-token budget: prefill chunks end every 32 tokens, where a Mamba state is written.
    return EngineCore(_config(*specs, interval=interval, num_blocks=num_blocks),
                      SchedulerConfig(max_model_len=4096, max_num_batched_tokens=32, async_scheduling=False),
                      CacheConfig(prefix_cache_retention_interval=interval))


def _hit(eng, request):
    """Run ``request`` alone to completion; the hit of its admission."""
    eng.add_request(request)
    model = EchoModel()
    hit = None
    while eng.has_unfinished_requests():
        for new in eng.step(model).output.scheduled_new_reqs:
            if new.req_id == request.request_id:
                hit = new.hit_tokens
    return hit


SYSTEM = tokens(0, 100)  # a shared prefix that is not block-aligned


@pytest.mark.parametrize("spec", [SlidingWindowSpec(block_size=BS, sliding_window=32),
                                  MambaSpec(block_size=BS, mamba_cache_mode="align")],
                         ids=["sliding_window", "mamba"])
def test_a_resend_hits_at_the_replay_boundary_but_a_shorter_sibling_only_when_dense(spec):
    for interval in (0, None):
        eng = _engine(full(), spec, interval=interval)
        _hit(eng, new_request("a", SYSTEM, max_tokens=2))
        # The resend stops at the prompt's last token: 96, kept in every mode.
        assert _hit(eng, new_request("resend", SYSTEM, max_tokens=2)) == 96
        # A sibling sharing 64 tokens needs the window (the state) ending at 64: only dense
        # retention kept it; interval 0 kept 96 and nothing at 64.
        sibling = _hit(eng, new_request("sibling", SYSTEM[:64] + tokens(5000, 40), max_tokens=2))
        assert sibling == (64 if interval is None else 0), interval


@pytest.mark.parametrize("spec", [SlidingWindowSpec(block_size=BS, sliding_window=32),
                                  MambaSpec(block_size=BS, mamba_cache_mode="align")],
                         ids=["sliding_window", "mamba"])
def test_a_second_sharer_pins_the_junction_for_the_third(spec):
    eng = _engine(full(), spec, interval=0)
    _hit(eng, new_request("a", SYSTEM, max_tokens=2))
    # Full attention holds 64 shared tokens, the thinned group none there: the admission
    # finds the junction at 64 and keeps the blocks a hit there needs.
    assert _hit(eng, new_request("b", SYSTEM[:64] + tokens(5000, 40), max_tokens=2)) == 0
    assert _hit(eng, new_request("c", SYSTEM[:64] + tokens(9000, 40), max_tokens=2)) == 64


def test_a_periodic_interval_keeps_a_checkpoint_every_interval_tokens():
    spec = SlidingWindowSpec(block_size=BS, sliding_window=32)
    eng = _engine(full(), spec, interval=64)
    _hit(eng, new_request("a", tokens(0, 300), max_tokens=2))
    assert _hit(eng, new_request("at_128", tokens(0, 140) + tokens(7000, 30), max_tokens=2)) == 128
    assert _hit(eng, new_request("at_96", tokens(0, 100) + tokens(8000, 30), max_tokens=2)) == 64


def test_uncached_blocks_of_a_thinned_group_carry_no_hash_and_count_as_uncached():
    spec = SlidingWindowSpec(block_size=BS, sliding_window=32)
    counts = {}
    for interval in (0, None):
        eng = _engine(full(), spec, interval=interval)
        _hit(eng, new_request("a", SYSTEM, max_tokens=2))
        pool = eng.scheduler.kv_cache_manager.block_pool
        counts[interval] = [len(m) for m in pool.cached_block_hash_to_block]
    # Full attention caches its 6 full prompt blocks either way (the 7th, holding the
    # last prompt and the first output token, too); the window keeps 2 blocks at 96.
    assert counts[None] == [6, 6]
    assert counts[0] == [6, 2]


def test_chunked_local_and_full_attention_ignore_the_interval():
    local = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=64)
    for interval in (0, None):
        eng = _engine(full(), local, interval=interval)
        _hit(eng, new_request("a", SYSTEM, max_tokens=2))
        assert [len(m) for m in eng.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block] == [6, 6]


def test_a_mamba_checkpoint_is_reserved_only_by_the_chunk_that_ends_the_prefill():
    """Under interval 0 a chunk short of the prefill end reserves no checkpoint block."""
    spec = MambaSpec(block_size=BS, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                     prefill_checkpoint_alignment=1)
    needed = {}
    for interval in (0, None, 64):
        kvm = _manager(full(), spec, interval=interval)
        coordinator = kvm.coordinator
        # A first chunk [0, 40) of a 100-token prompt exports the state at 32 when reserved.
        needed[interval] = coordinator.get_num_blocks_to_allocate(
            "r", 40, kvm.empty_blocks, 0, 40, False, 100)
        # The chunk reaching the prefill end reserves one in every mode.
        assert coordinator.get_num_blocks_to_allocate("s", 100, kvm.empty_blocks, 60, 100, False, 100) == \
            coordinator.get_num_blocks_to_allocate("s", 100, kvm.empty_blocks, 60, 100, False, 0)
    assert needed[None] == needed[64] == needed[0] + 1
