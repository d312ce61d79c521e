"""Page-size unification and grouping rules on hand-built specs (docs/semantics.md#grouping-and-page-size)."""

from __future__ import annotations

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.grouping import group_layers
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import model_from_mapping
from kvtwin.sim.planner.page_size import PageSizeNotUnifiable, hybrid_attention_block_size, unify_page_sizes
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.core.spec import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec


def test_smaller_page_that_divides_scales_its_block_size():
    specs = {"l0": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
             "l1": SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=512)}
    unified = unify_page_sizes(specs)
    assert unified["l1"].block_size == 32 and unified["l1"].page_size_padded is None
    assert unified["l1"].page_size_bytes == unified["l0"].page_size_bytes == 65536
    grouping = group_layers(specs, hybrid_kv_cache=True)
    assert [g.spec.block_size for g in grouping.groups] == [16, 32]


def test_non_dividing_attention_page_is_padded():
    specs = {"l0": FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=128),
             "l1": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=128, sliding_window=512)}
    unified = unify_page_sizes(specs)
    assert unified["l1"].block_size == 16
    assert unified["l1"].page_size_padded == 16 * 3 * 256 * 2
    assert unified["l1"].real_page_size_bytes == 16 * 2 * 256 * 2


def test_state_page_is_padded_never_rescaled():
    state = MambaSpec(block_size=16, shapes=((3, 100),), dtype_bytes=(2,))
    specs = {"l0": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128), "l1": state}
    unified = unify_page_sizes(specs)
    assert unified["l1"].block_size == 16 and unified["l1"].page_size_padded == 65536


def test_mla_page_cannot_be_padded():
    specs = {"l0": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576),
             "l1": SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=512)}
    with pytest.raises(PageSizeNotUnifiable):
        unify_page_sizes(specs)


def _mla_swa_model(pattern: str) -> object:
    return model_from_mapping({
        "name": "mla-plus-local", "num_layers": 8, "layer_pattern": pattern, "hidden_size": 2048,
        "num_attention_heads": 16, "num_kv_heads": 8, "head_dim": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "sliding_window": 1024, "attention_chunk_size": 1024,
        "max_position_embeddings": 32768, "params_total": 2e9})


def test_mla_with_sliding_window_falls_back_to_full_allocation():
    p = plan(_mla_swa_model("AS"), get_gpu("a100-80gb"),
             EngineConfig(max_model_len=32768, kv_cache_memory_bytes=1 << 34))
    assert p.grouping.strategy == "full_allocation_fallback"
    assert len(p.groups) == 1
    mla_page, swa_page = 16 * 576 * 2, 16 * 8 * 256 * 2
    assert p.bytes_per_block == 4 * mla_page + 4 * swa_page
    assert p.blocks_per_request == 32768 // 16  # the sliding layers pay for every token


def test_mla_with_chunked_local_cannot_be_planned():
    with pytest.raises(ConfigError, match="unify"):
        plan(_mla_swa_model("AC"), get_gpu("a100-80gb"),
             EngineConfig(max_model_len=32768, kv_cache_memory_bytes=1 << 34, hybrid_kv_cache=True))


def test_mixed_head_sizes_of_one_type_share_one_group():
    specs = {"l0": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
             "l1": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64)}
    grouping = group_layers(specs, hybrid_kv_cache=True)
    assert grouping.strategy == "uniform_type" and len(grouping.groups) == 1
    assert grouping.groups[0].bytes_per_block == 16 * 8 * 256 * 2 + 16 * 8 * 128 * 2


@pytest.mark.parametrize("state,per_token,expected", [
    (1_097_728, 2048, 544),   # Qwen3-Next
    (311_296, 4096, 80),      # Jamba
    (2_147_840, 4096, 528),   # Granite-4.0-H-Small
    (4_255_744, 4096, 1040),  # Nemotron-H-8B, fp32 SSM
    (2_097_152, 4096, 512),   # MiniMax lightning, bf16
    (4_194_304, 4096, 1024),  # MiniMax lightning, fp32
    (1_594_368, 1024, 1568),  # Falcon-H1-7B
])
def test_hybrid_block_size_matches_models_md_table(state, per_token, expected):
    hb = hybrid_attention_block_size(block_size=16, attention_bytes_per_token=per_token, mamba_page_bytes=state,
                                     kernel_alignment_tokens=16)
    assert hb.block_size == expected
    assert hb.attention_page_bytes == expected * per_token >= state


def test_user_block_size_is_a_floor_and_the_alignment_step():
    hb = hybrid_attention_block_size(block_size=32, attention_bytes_per_token=4096, mamba_page_bytes=311_296,
                                     kernel_alignment_tokens=16)
    assert hb.block_size == 32 * 3  # 32 x cdiv(311296, 32 x 4096)
    big = hybrid_attention_block_size(block_size=1024, attention_bytes_per_token=4096, mamba_page_bytes=311_296,
                                      kernel_alignment_tokens=16)
    assert big.block_size == 1024
