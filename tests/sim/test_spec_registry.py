"""Each attention kind has one home: its spec class. Every place that acts per kind (the
manager, the planner's layer builder, the layer-pattern letter, the cost model's terms, the
plan's JSON, grouping) must find an entry for every kind, so a new kind cannot be half added.
"""

from __future__ import annotations

import pytest

from kvtwin.sim.core.managers import MANAGER_CLASSES, manager_class_for
from kvtwin.sim.core.spec import (
    SPEC_CLASSES,
    SPEC_KINDS,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvtwin.sim.planner.models import LAYER_KINDS
from kvtwin.sim.planner.plan import LAYER_SPEC_BUILDERS

EXAMPLES = {
    FullAttentionSpec: FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
    MLAAttentionSpec: MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, head_size_v=512),
    SlidingWindowSpec: SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=128),
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                                         attention_chunk_size=64),
    MambaSpec: MambaSpec(block_size=16, shapes=((3, 64), (8, 16, 16)), dtype_bytes=(2, 4), mamba_cache_mode="align"),
}


def test_every_kind_has_a_name_a_letter_and_an_example():
    assert set(EXAMPLES) == set(SPEC_CLASSES)
    assert len(SPEC_KINDS) == len(SPEC_CLASSES)
    letters = [cls.pattern_letter for cls in SPEC_CLASSES]
    assert len(set(letters)) == len(letters) and all(len(x) == 1 for x in letters)
    assert {LAYER_KINDS[x] for x in letters} == set(SPEC_KINDS)


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.kind)
def test_every_kind_has_a_manager_and_a_planner_builder(cls):
    assert manager_class_for(EXAMPLES[cls]) is not None
    assert cls.kind in LAYER_SPEC_BUILDERS
    assert any(issubclass(cls, base) for base in MANAGER_CLASSES)


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.kind)
def test_every_kind_says_what_a_step_reads(cls):
    spec = EXAMPLES[cls]
    attends = spec.attention_width_per_head > 0
    # Exactly one of: a cache that grows per token (attention), a fixed state (recurrent).
    assert (spec.kv_bytes_per_token > 0) == attends != (spec.state_bytes > 0)
    assert (spec.attended_keys(0, 10) > 0) == attends
    assert spec.decode_attended_keys([10, 20]) == spec.attended_keys(9, 10) + spec.attended_keys(19, 20)


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.kind)
def test_every_kind_describes_itself_for_the_plan(cls):
    spec = EXAMPLES[cls]
    described = spec.describe()
    assert described and all(not isinstance(v, tuple) for v in described.values())  # JSON-ready
    assert spec.real_page_size_bytes > 0 and spec.page_size_bytes == spec.real_page_size_bytes


def test_local_kinds_promote_to_full_attention_and_keep_their_window():
    for cls in SPEC_CLASSES:
        promoted = EXAMPLES[cls].as_full_attention(32)
        if cls in (SlidingWindowSpec, ChunkedLocalAttentionSpec):
            assert type(promoted) is FullAttentionSpec and promoted.block_size == 32
            assert promoted.merge_key() == FullAttentionSpec(block_size=32, num_kv_heads=8, head_size=128)
            # Memory as full attention, compute still windowed.
            assert promoted.attended_keys(0, 1000) == EXAMPLES[cls].attended_keys(0, 1000)
        else:
            assert promoted is None
    assert EXAMPLES[MambaSpec].slot_type() is None
    assert len({EXAMPLES[c].slot_type() for c in SPEC_CLASSES if c is not MambaSpec}) == 3  # MLA slots like full


def test_only_kinds_that_free_blocks_early_cap_admission():
    assert {cls for cls in SPEC_CLASSES if cls.caps_admission} == {SlidingWindowSpec, ChunkedLocalAttentionSpec}


def test_kv_heads_are_sharded_only_for_softmax_attention():
    assert {cls for cls in SPEC_CLASSES if cls.has_kv_heads} == {
        FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec}
