"""Model and GPU presets: exact names, facts from the models' published configs and the datasheets, settings
that are settings (KV and state dtypes), hardware-dependent kernel constraints."""

from __future__ import annotations

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu, gpu_from_mapping, gpu_names
from kvtwin.sim.planner.models import get_model, model_from_mapping, model_names
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan

PRESETS = ["llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b", "mistral-7b-v0.1", "gemma-3-12b",
           "gemma-3-27b", "gpt-oss-20b", "gpt-oss-120b", "llama-4-scout", "deepseek-v3", "deepseek-v3.2", "qwen3-next-80b-a3b",
           "jamba-mini", "granite-4.0-h-small", "nemotron-h-8b", "minimax-text-01", "kimi-k2", "qwen3-235b-a22b"]


def test_model_presets_are_named_exactly():
    assert sorted(model_names()) == sorted(PRESETS)
    for name in PRESETS:
        assert get_model(name).source  # every preset cites where its facts come from


@pytest.mark.parametrize("name,counts", [
    ("gemma-3-27b", {"full_attention": 10, "sliding_window": 52}),
    ("gemma-3-12b", {"full_attention": 8, "sliding_window": 40}),
    ("gpt-oss-20b", {"full_attention": 12, "sliding_window": 12}),
    ("llama-4-scout", {"full_attention": 12, "chunked_local": 36}),
    ("deepseek-v3", {"mla": 61}),
    ("deepseek-v3.2", {"mla": 61}),
    ("qwen3-next-80b-a3b", {"full_attention": 12, "mamba": 36}),
    ("jamba-mini", {"full_attention": 4, "mamba": 28}),
    ("granite-4.0-h-small", {"full_attention": 4, "mamba": 36}),
    ("nemotron-h-8b", {"full_attention": 4, "mamba": 24}),
    ("minimax-text-01", {"full_attention": 10, "mamba": 70}),
    ("mistral-7b-v0.1", {"sliding_window": 32}),
])
def test_layer_patterns(name, counts):
    model = get_model(name)
    for kind, n in counts.items():
        assert model.count_layers(kind) == n
    assert sum(counts.values()) == sum(1 for k in model.layer_kinds if k)


def test_layer_positions():
    assert [i for i, k in enumerate(get_model("gemma-3-27b").layer_kinds) if k == "full_attention"] == \
        list(range(5, 62, 6))
    assert [i for i, k in enumerate(get_model("nemotron-h-8b").layer_kinds) if k == "full_attention"] == \
        [7, 18, 29, 40]
    assert [i for i, k in enumerate(get_model("minimax-text-01").layer_kinds) if k == "full_attention"] == \
        list(range(7, 80, 8))


@pytest.mark.parametrize("dtype,nbytes", [("auto", 2), ("bfloat16", 2), ("fp8", 1), ("fp8_e5m2", 1)])
def test_kv_cache_dtype_is_a_setting(dtype, nbytes):
    p = plan(get_model("llama-3.1-8b"), get_gpu("h100"),
             EngineConfig(max_model_len=8192, kv_cache_dtype=dtype, kv_cache_memory_bytes=1 << 33))
    assert p.bytes_per_block == 32 * 16 * 8 * 256 * nbytes


def test_mamba_state_dtype_is_a_setting():
    def page(**kw):
        return plan(get_model("jamba-mini"), get_gpu("a100-80gb"),
                    EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 33, **kw)).groups[0].spec
    assert page().dtype_bytes == (2, 2)
    assert page(mamba_ssm_cache_dtype="float32").dtype_bytes == (2, 4)
    assert page(mamba_cache_dtype="float32").dtype_bytes == (4, 4)  # SSM follows the conv dtype on auto
    nemotron = plan(get_model("nemotron-h-8b"), get_gpu("a100-80gb"),
                    EngineConfig(max_model_len=8192, kv_cache_memory_bytes=1 << 33)).groups[0].spec
    assert nemotron.dtype_bytes == (2, 4)  # the model's own fp32 SSM default


def test_gpu_presets():
    assert set(gpu_names()) == {"a100-40gb", "a100-80gb", "h100", "h200", "b200", "l40s", "mi300x"}
    h100 = get_gpu("h100")
    assert h100.hbm_bandwidth_bytes_per_s == 3.35e12 and h100.bf16_flops == 989.4e12
    assert h100.fp8_flops == pytest.approx(2 * h100.bf16_flops, rel=1e-3)
    assert get_gpu("a100-80gb").fp8_flops == 0  # Ampere has no FP8 tensor cores
    assert get_gpu("H200").name == "h200"  # case-insensitive
    for name in gpu_names():
        g = get_gpu(name)
        assert g.memory_bytes > 0 and g.hbm_bandwidth_bytes_per_s > 0 and g.bf16_flops > 0


def test_hardware_dependent_kernel_constraints():
    assert get_gpu("h100").gdn_prefill_checkpoint_alignment_tokens == 64
    assert get_gpu("b200").gdn_prefill_checkpoint_alignment_tokens is None
    assert get_gpu("h200").attention_kernel_block_alignment_tokens(head_size=576, use_mla=True) == 16
    assert get_gpu("b200").attention_kernel_block_alignment_tokens(head_size=576, use_mla=True) == 128
    assert get_gpu("b200").attention_kernel_block_alignment_tokens(head_size=256, use_mla=False) == 32
    assert get_gpu("l40s").attention_kernel_block_alignment_tokens(head_size=256, use_mla=False) == 16


def test_custom_hardware_inline():
    gpu = gpu_from_mapping({"name": "my-card", "memory_gib": 24, "bf16_flops": 100e12})
    assert gpu.memory_bytes == 24 << 30 and gpu.name == "my-card"
    with pytest.raises(ConfigError, match="memory"):
        gpu_from_mapping({"name": "no-memory"})
    with pytest.raises(ConfigError, match="hardware.memory_gb"):
        gpu_from_mapping({"gpu": "h100", "memory_gb": 94})


def test_inline_model_validation():
    base = dict(name="m", num_layers=4, layer_pattern="SF", hidden_size=1024, num_attention_heads=8,
                num_kv_heads=8, head_dim=128, max_position_embeddings=4096, params_total=1e9)
    with pytest.raises(ConfigError, match="sliding_window"):
        model_from_mapping(base)
    with pytest.raises(ConfigError, match="layer_pattern"):
        model_from_mapping({**base, "layer_pattern": "SX", "sliding_window": 64})
    with pytest.raises(ConfigError, match="state"):
        model_from_mapping({**base, "layer_pattern": "MF"})
    with pytest.raises(ConfigError, match="num_kv_heads"):
        model_from_mapping({**base, "layer_pattern": "F", "num_kv_heads": 3})
    # A recurrent state's errors name the field under the model's table.
    mamba = {**base, "layer_pattern": "MF"}
    state = {"kind": "mamba2", "d_state": 128, "head_dim": 64, "num_heads": 8, "d_conv": 4, "n_groups": 1}
    with pytest.raises(ConfigError, match=r"^model\.state\.d_state: expected a positive integer, got -1"):
        model_from_mapping({**mamba, "state": {**state, "d_state": -1}})
    with pytest.raises(ConfigError, match=r"^model\.state\.head_dim: expected a value \(required for a mamba2 state\)"):
        model_from_mapping({**mamba, "state": {k: v for k, v in state.items() if k != "head_dim"}})
    with pytest.raises(ConfigError, match=r"^model\.state\.expand: expected a field of a mamba2 state"):
        model_from_mapping({**mamba, "state": {**state, "expand": 2}})
    with pytest.raises(ConfigError, match="moe_layer_period"):
        model_from_mapping({**base, "sliding_window": 64, "moe_layer_period": 0})
    with pytest.raises(ConfigError, match=r"moe_layer_offset.*from 0 to moe_layer_period - 1 \(1\)"):
        model_from_mapping({**base, "sliding_window": 64, "moe_layer_period": 2, "moe_layer_offset": 2})
    ok = model_from_mapping({**base, "sliding_window": 64})
    assert ok.layer_kinds == ("sliding_window", "full_attention") * 2
