"""DeepSeek-V3.2 (sparse MLA with its indexer cache) against vLLM 0.33's own planning code
(tests/planner/golden_v32, made by scripts/oracle/gen_v32_plan_golden.py), and the preset's
size against the model card. docs/semantics.md#sparse-mla-indexer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model, model_from_mapping
from kvtwin.sim.planner.plan import plan

GOLDEN = sorted((Path(__file__).parent / "golden_v32").glob("*.json"))


def test_the_golden_cases_are_here():
    cases = [json.loads(p.read_text()) for p in GOLDEN]
    assert {c["case"] for c in cases} >= {"deepseek-v3.2__tp8_bf16_40g", "deepseek-v3.2__tp8_fp8_40g",
                                          "deepseek-v3.2__dp8_ep_fp8_20g"}
    # Both cache dtypes, and vLLM's own reading of them: one group, the latent and the indexer
    # keys of every layer in it, prefix-cacheable, on the layer-outer layout.
    assert {c["mla_cache_dtype_str"] for c in cases} == {"auto", "fp8_ds_mla"}
    for c in cases:
        assert c["num_groups"] == 1 and c["groups"][0]["spec_class"] == "UniformTypeKVCacheSpecs"
        assert c["groups"][0]["prefix_cacheable"] is True
        assert c["kv_cache_layout"] == "LBNHC"
        assert c["groups"][0]["layers"] == [[i, kind] for i in range(61) for kind in ("mla", "indexer")]


def _flags(golden: dict) -> list:
    flags = []
    if "tensor_parallel_size" in golden:
        flags += ["--tp", golden["tensor_parallel_size"]]
    if "data_parallel_size" in golden:
        flags += ["--dp", golden["data_parallel_size"]]
    if golden.get("enable_expert_parallel"):
        flags += ["--enable-expert-parallel"]
    return flags


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_v32_plan_matches_vllm(run_plan, path):
    golden = json.loads(path.read_text())
    ours = run_plan("--model", golden["model"], "--gpu", "h200", *_flags(golden),
                    "--kv-cache-dtype", golden["kv_cache_dtype"],
                    "--kv-cache-memory-bytes", golden["kv_cache_memory_bytes"],
                    "--max-model-len", golden["max_model_len"],
                    "--max-num-batched-tokens", golden["max_num_batched_tokens"],
                    "--max-num-seqs", golden["max_num_seqs"], "--no-async-scheduling", "--json").json()
    assert ours["block_size"] == golden["block_size"]
    assert ours["num_groups"] == golden["num_groups"]
    (group,) = ours["groups"]
    assert group["kind"] == "mla"
    assert group["layer_indices"] == [i for i, _ in golden["groups"][0]["layers"]]
    assert group["layer_page_bytes"] == [golden["mla_page_bytes"], golden["indexer_page_bytes"]] * 61
    assert ours["bytes_per_block"] == golden["bytes_per_block"]
    assert ours["num_blocks"] == golden["num_blocks"]
    assert ours["kv_cache_tokens"] == golden["kv_cache_tokens"]
    assert ours["max_concurrency"] == golden["max_concurrency"]


def test_page_bytes_from_the_record_layouts():
    """Independently of vLLM's code: a 64-token block of 61 layers holds 61 latents (576 bf16
    values, or the 656-byte fp8_ds_mla record: 512 fp8 + 4 fp32 scales + 64 bf16 rope) and 61
    indexer keys (128 fp8 values + one fp32 scale)."""
    def bytes_per_block(dtype):
        return plan(get_model("deepseek-v3.2"), get_gpu("h200"),
                    EngineConfig(max_model_len=8192, kv_cache_dtype=dtype, kv_cache_memory_bytes=1 << 34,
                                 tensor_parallel_size=8)).bytes_per_block
    indexer = 64 * (128 + 4)
    assert bytes_per_block("auto") == 61 * (64 * 576 * 2 + indexer)
    assert bytes_per_block("fp8") == 61 * (64 * (512 + 4 * 4 + 64 * 2) + indexer)
    # DeepSeek-V3 without the indexer, for comparison: no indexer pages, its own block size.
    v3 = plan(get_model("deepseek-v3"), get_gpu("h200"),
              EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 34, tensor_parallel_size=8))
    assert v3.bytes_per_block == 61 * v3.layers.attention_block_size * 576 * 2


@pytest.mark.parametrize("block_size,expected", [(None, 64), (128, 128), (256, 256)])
def test_block_size_is_a_multiple_of_the_indexer_block(block_size, expected):
    kw = {} if block_size is None else {"block_size": block_size}
    p = plan(get_model("deepseek-v3.2"), get_gpu("h200"),
             EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 34, **kw))
    assert p.layers.attention_block_size == expected
    assert p.bytes_per_block == 61 * expected * (576 * 2 + 132)


@pytest.mark.parametrize("block_size", [16, 32, 96])
def test_a_block_the_indexer_cannot_tile_is_refused(block_size):
    with pytest.raises(ConfigError) as err:
        plan(get_model("deepseek-v3.2"), get_gpu("h200"),
             EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 34, block_size=block_size))
    assert err.value.field == "block_size" and "64" in str(err.value)


def _mla_layer_params(hidden, heads, q_lora, kv_lora, rope, nope, v):
    return (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * hidden)


def test_preset_totals_the_model_card_plus_the_indexer():
    hidden, moe, dense = 7168, 2048, 18432
    # The indexer: queries 1536 -> 64 x 128, a 128-wide key and 64 head weights from the
    # hidden state, the key's LayerNorm weight and bias.
    indexer = 1536 * 64 * 128 + hidden * 128 + hidden * 64 + 2 * 128
    assert indexer == 13_959_424
    attention = 61 * (_mla_layer_params(hidden, 128, 1536, 512, 64, 128, 128) + indexer)
    mlp = 3 * 3 * hidden * dense + 58 * (256 + 1) * 3 * hidden * moe
    total = attention + mlp + 2 * 129280 * hidden
    assert total == pytest.approx(671e9 + 61 * indexer, rel=0.03)
    m, v3 = get_model("deepseek-v3.2"), get_model("deepseek-v3")
    assert m.params_total == pytest.approx(total, rel=0.03)
    # The card's 671B is DeepSeek-V3's; V3.2 adds exactly its indexers.
    assert m.params_total - v3.params_total == pytest.approx(61 * indexer, rel=1e-3)
    assert m.params_active - v3.params_active == pytest.approx(61 * indexer, rel=1e-3)
    assert (m.index_head_dim, m.index_n_heads, m.index_topk, m.architecture) == \
        (128, 64, 2048, "DeepseekV32ForCausalLM")
    assert m.indexer_bytes_per_token == 132


_BASE = dict(num_layers=4, layer_pattern="A", hidden_size=1024, num_attention_heads=8, num_kv_heads=8,
             head_dim=192, head_dim_v=128, kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=4096,
             params_total=1e9, index_head_dim=128, index_n_heads=8, index_topk=256)


@pytest.mark.parametrize("change,field", [
    (dict(index_head_dim=100), "index_head_dim"),
    (dict(index_n_heads=0), "index_n_heads"),
    (dict(index_topk=None), "index_topk"),
    (dict(layer_pattern="F", kv_lora_rank=None, qk_rope_head_dim=None), "index_topk"),
])
def test_bad_indexer_fields_name_the_field(change, field):
    entry = {k: v for k, v in {**_BASE, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        model_from_mapping(entry)
    assert err.value.field == f"model.{field}"


def test_cli_refuses_a_block_the_indexer_cannot_tile_in_one_line(run_plan):
    out = run_plan("--model", "deepseek-v3.2", "--gpu", "h200", "--tp", 8, "--block-size", 16,
                   "--max-model-len", 8192)
    assert out.exit_code == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: block_size:") and "multiple of 64" in lines[0]
