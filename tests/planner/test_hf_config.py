"""A local HF config.json gives the same per-layer specs as the built-in preset, for every
architecture of the presets. The configs are written here with HF's field names from the
same published facts the presets hold (``sim/planner/data/models.toml``)."""

from __future__ import annotations

import json

import pytest

from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.hf_config import load_hf_config
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import build_layer_specs, plan

COMMON = {"torch_dtype": "bfloat16"}
NEMOTRON_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"  # Nemotron-H 8B hybrid_override_pattern


def _attn(m, **extra):
    return {"num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "vocab_size": m.vocab_size,
            "max_position_embeddings": m.max_position_embeddings, **COMMON, **extra}


HF_CONFIGS = {
    "llama-3.1-8b": lambda m: {"architectures": ["LlamaForCausalLM"], **_attn(m, intermediate_size=14336)},
    "llama-3.1-70b": lambda m: {"architectures": ["LlamaForCausalLM"], **_attn(m, intermediate_size=28672)},
    "qwen3-8b": lambda m: {"architectures": ["Qwen3ForCausalLM"],
                           **_attn(m, sliding_window=None, use_sliding_window=False)},
    "qwen3-32b": lambda m: {"architectures": ["Qwen3ForCausalLM"],
                            **_attn(m, sliding_window=4096, use_sliding_window=False)},
    "mistral-7b-v0.1": lambda m: {"architectures": ["MistralForCausalLM"], **_attn(m, sliding_window=4096)},
    "gemma-3-12b": lambda m: {"architectures": ["Gemma3ForConditionalGeneration"],
                              "text_config": _attn(m, sliding_window=1024, sliding_window_pattern=6)},
    "gemma-3-27b": lambda m: {"architectures": ["Gemma3ForConditionalGeneration"],
                              "text_config": _attn(m, sliding_window=1024)},
    "gpt-oss-20b": lambda m: {"architectures": ["GptOssForCausalLM"],
                              **_attn(m, sliding_window=128, num_local_experts=32, num_experts_per_tok=4,
                                      intermediate_size=2880,
                                      layer_types=["sliding_attention", "full_attention"] * 12),
                              "quantization_config": {"quant_method": "mxfp4"}},
    "gpt-oss-120b": lambda m: {"architectures": ["GptOssForCausalLM"],
                               **_attn(m, sliding_window=128, num_local_experts=128, intermediate_size=2880,
                                       layer_types=["sliding_attention", "full_attention"] * 18),
                               "quantization_config": {"quant_method": "mxfp4"}},
    "llama-4-scout": lambda m: {"architectures": ["Llama4ForConditionalGeneration"],
                                "text_config": _attn(m, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12,
                                                     num_local_experts=16, intermediate_size=8192)},
    "deepseek-v3": lambda m: {"architectures": ["DeepseekV3ForCausalLM"],
                              **_attn(m, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                      q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
                                      moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
                                      intermediate_size=18432),
                              "quantization_config": {"quant_method": "fp8"}},
    "deepseek-v3.2": lambda m: {"architectures": ["DeepseekV32ForCausalLM"],
                                **_attn(m, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                        v_head_dim=128, q_lora_rank=1536, n_routed_experts=256,
                                        num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                                        first_k_dense_replace=3, intermediate_size=18432, index_head_dim=128,
                                        index_n_heads=64, index_topk=2048),
                                "quantization_config": {"quant_method": "fp8"}},
    "kimi-k2": lambda m: {"architectures": ["DeepseekV3ForCausalLM"],
                          **_attn(m, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                  q_lora_rank=1536, n_routed_experts=384, num_experts_per_tok=8,
                                  moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=1,
                                  intermediate_size=18432),
                          "quantization_config": {"quant_method": "fp8"}},
    "qwen3-235b-a22b": lambda m: {"architectures": ["Qwen3MoeForCausalLM"],
                                  **_attn(m, intermediate_size=12288, num_experts=128, num_experts_per_tok=8,
                                          moe_intermediate_size=1536)},
    "qwen3-next-80b-a3b": lambda m: {"architectures": ["Qwen3NextForCausalLM"],
                                     **_attn(m, full_attention_interval=4, linear_conv_kernel_dim=4,
                                             linear_num_key_heads=16, linear_num_value_heads=32,
                                             linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512,
                                             num_experts_per_tok=10, moe_intermediate_size=512,
                                             shared_expert_intermediate_size=512)},
    "jamba-mini": lambda m: {"architectures": ["JambaForCausalLM"],
                             **_attn(m, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4,
                                     mamba_expand=2, num_experts=16, num_experts_per_tok=2,
                                     intermediate_size=14336)},
    "granite-4.0-h-small": lambda m: {"architectures": ["GraniteMoeHybridForCausalLM"],
                                      **_attn(m, layer_types=["attention" if i % 10 == 5 else "mamba"
                                                              for i in range(40)],
                                              mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128,
                                              mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1,
                                              num_local_experts=72, num_experts_per_tok=10, intermediate_size=768,
                                              shared_intermediate_size=1536, tie_word_embeddings=True)},
    "nemotron-h-8b": lambda m: {"architectures": ["NemotronHForCausalLM"],
                                **_attn(m, hybrid_override_pattern=NEMOTRON_PATTERN,
                                        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
                                        conv_kernel=4, expand=2, intermediate_size=21504)},
    "minimax-text-01": lambda m: {"architectures": ["MiniMaxText01ForCausalLM"],
                                  **_attn(m, attn_type_list=[0, 0, 0, 0, 0, 0, 0, 1] * 10, num_local_experts=32,
                                          num_experts_per_tok=2, intermediate_size=9216)},
}


def test_every_preset_has_an_hf_config_case():
    from kvtwin.sim.planner.models import model_names
    assert sorted(HF_CONFIGS) == sorted(model_names())


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
@pytest.mark.parametrize("gpu,tp", [("h100", 1), ("a100-80gb", 2)])
def test_hf_config_gives_the_presets_layer_specs(tmp_path, name, gpu, tp):
    preset = get_model(name)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[name](preset)))
    loaded = load_hf_config(tmp_path)  # a directory holding config.json
    assert loaded.layer_kinds == preset.layer_kinds
    engine = EngineConfig(tensor_parallel_size=tp, max_model_len=8192, kv_cache_memory_bytes=1 << 34)
    ours = build_layer_specs(loaded, get_gpu(gpu), engine.resolve(loaded, get_gpu(gpu)))
    theirs = build_layer_specs(preset, get_gpu(gpu), engine.resolve(preset, get_gpu(gpu)))
    assert ours.specs == theirs.specs
    a, b = plan(loaded, get_gpu(gpu), engine), plan(preset, get_gpu(gpu), engine)
    assert a.num_blocks == b.num_blocks and a.bytes_per_block == b.bytes_per_block
    assert [g.layer_names for g in a.groups] == [g.layer_names for g in b.groups]
    assert loaded.weight_format == preset.weight_format


def test_v32_config_adds_the_indexer_to_v3s_estimate(tmp_path):
    # Same shapes as DeepSeek-V3 plus index_*: the estimate grows by 61 indexers (queries
    # 1536 -> 64 x 128, key 7168 -> 128, head weights 7168 -> 64, LayerNorm 2 x 128).
    v32 = get_model("deepseek-v3.2")
    estimates = {}
    for name in ("deepseek-v3", "deepseek-v3.2"):
        (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS[name](v32)))
        estimates[name] = load_hf_config(tmp_path / "config.json")
    assert (estimates["deepseek-v3.2"].index_topk, estimates["deepseek-v3"].index_topk) == (2048, None)
    indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64 + 2 * 128
    assert estimates["deepseek-v3.2"].params_total - estimates["deepseek-v3"].params_total == 61 * indexer


def test_parameter_estimate_is_close_for_dense_models(tmp_path):
    preset = get_model("llama-3.1-8b")
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["llama-3.1-8b"](preset)))
    loaded = load_hf_config(tmp_path / "config.json")
    assert loaded.params_total == pytest.approx(8.03e9, rel=0.01)


def test_jamba_routes_every_other_layer_from_its_config_and_its_preset(tmp_path):
    # HF's expert_layer_period 2 / expert_layer_offset 1: layers 1, 3, ..., 31 route, 16 of
    # 32; the routed experts are then 16 x 16 x 3 x 4096 x 14336 parameters, inside 52e9.
    preset = get_model("jamba-mini")
    config = HF_CONFIGS["jamba-mini"](preset) | {"expert_layer_period": 2, "expert_layer_offset": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_config(tmp_path / "config.json")
    for model in (preset, loaded):
        assert (model.moe_layer_period, model.moe_layer_offset, model.num_moe_layers) == (2, 1, 16)
        assert model.routed_expert_params == 16 * 16 * 3 * 4096 * 14336 < model.params_total
    assert get_model("deepseek-v3").num_moe_layers == 61 - 3
