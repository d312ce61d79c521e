"""Data, expert and pipeline parallelism in the plan (docs/semantics.md#parallel-layouts):
vLLM's layer split, the weights of the most loaded GPU, the GPUs a deployment takes, the
new presets' sizes, and the refusals (bad values, EP without experts, more stages than
layers, a run asking for what only the planner sizes)."""

from __future__ import annotations

import math

import pytest

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.parallel import ParallelLayout, pp_partition, stage_weights
from kvtwin.sim.planner.plan import plan
from tests.cli_run import one_error_line, run

GIB = 1 << 30


@pytest.mark.parametrize("layers, pp, expected", [
    (32, 2, (16, 16)),
    (32, 3, (11, 11, 10)),        # the remainder goes to the stages before the last
    (61, 4, (15, 15, 16, 15)),    # one left over: the stage before the last takes it
    (62, 4, (15, 16, 16, 15)),
    (94, 8, (11, 12, 12, 12, 12, 12, 12, 11)),
    (5, 5, (1, 1, 1, 1, 1)),
])
def test_layer_split_is_vllms_default(layers, pp, expected):
    assert pp_partition(layers, pp) == expected


def test_defaults_plan_as_before():
    """No DP, EP or PP: one stage holding every layer, and the pool a single GPU has."""
    p = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=8192))
    assert len(p.stages) == 1 and p.stages[0].layer_start == 0 and p.stages[0].layer_end == 32
    assert p.stages[0].num_blocks == p.num_blocks
    assert p.memory.weights_bytes == math.ceil(8.03e9 * 2)
    j = p.to_json()
    assert (j["num_gpus"], j["data_parallel_size"], j["pipeline_parallel_size"], j["expert_parallel_size"]) == \
        (1, 1, 1, 1)


def _deepseek_parts():
    """DeepSeek-V3's routed experts and the rest, from its config (fp8: one byte a weight)."""
    routed = 58 * 256 * 3 * 7168 * 2048   # 58 MoE layers (61 less 3 dense) x 256 experts
    return routed, 671e9 - routed


def test_expert_parallel_spreads_whole_experts_over_dp_x_tp():
    routed, rest = _deepseek_parts()
    p = plan(get_model("deepseek-v3"), get_gpu("h200"),
             EngineConfig(data_parallel_size=16, enable_expert_parallel=True, max_model_len=32768))
    j = p.to_json()
    assert j["expert_parallel_size"] == 16 and j["num_gpus"] == 16
    assert j["pipeline_stages"][0]["experts_per_gpu"] == 256 // 16
    # Attention, dense layers, embedding and head whole on every DP rank (TP 1); 16 experts of each layer.
    assert p.memory.weights_bytes == pytest.approx(rest + routed * 16 / 256, rel=1e-9)


@pytest.mark.parametrize("redundant", [0, 32])
def test_eplb_adds_its_redundant_experts_and_its_state_to_every_gpu(redundant):
    """EPLB (docs/semantics.md#parallel-layouts): 256 + R physical experts over the 16 GPUs,
    plus a spare copy of one layer's local experts and the load window and maps of vLLM
    0.33's ``EplbState`` on every GPU, all before the memory profile."""
    routed, rest = _deepseek_parts()
    engine = dict(data_parallel_size=16, enable_expert_parallel=True, max_model_len=32768)
    plain = plan(get_model("deepseek-v3"), get_gpu("h200"), EngineConfig(**engine))
    eplb = plan(get_model("deepseek-v3"), get_gpu("h200"),
                EngineConfig(**engine, enable_eplb=True, num_redundant_experts=redundant))
    local = (256 + redundant) // 16
    assert eplb.to_json()["pipeline_stages"][0]["experts_per_gpu"] == local
    assert eplb.to_json()["eplb"] == {"num_redundant_experts": redundant, "num_physical_experts": 256 + redundant}
    one_expert_layer = 3 * 7168 * 2048  # fp8: one byte a weight
    window = 1001 * 58 * (256 + redundant) * 4  # 1000 steps of loads and this pass's, int32
    maps = 58 * (256 * 1024 + (256 + redundant) + 2 * 256) * 8  # int64
    expected = rest + routed * local / 256 + local * one_expert_layer + window + maps
    assert eplb.memory.weights_bytes == pytest.approx(expected, rel=1e-9)
    assert eplb.memory.weights_bytes > plain.memory.weights_bytes and eplb.num_blocks < plain.num_blocks
    assert "eplb" not in plain.to_json()


def test_uneven_experts_weigh_the_most_loaded_gpu():
    routed, rest = _deepseek_parts()
    p = plan(get_model("deepseek-v3"), get_gpu("h200"),
             EngineConfig(data_parallel_size=3, enable_expert_parallel=True, max_model_len=32768))
    assert p.stages[0].experts_per_gpu == 86  # 256 over 3: 86, 85, 85
    assert p.memory.weights_bytes == pytest.approx(rest + routed * 86 / 256, rel=1e-9)


def test_without_expert_parallel_the_moe_layers_are_still_split_over_dp_x_tp():
    """vLLM's FusedMoE flattens TP across the DP ranks: each expert's width is split over
    all DP x TP GPUs; the rest is TP-sharded and replicated per DP rank."""
    routed, rest = _deepseek_parts()
    p = plan(get_model("deepseek-v3"), get_gpu("h200"),
             EngineConfig(data_parallel_size=2, tensor_parallel_size=8, max_model_len=32768))
    assert p.memory.weights_bytes == pytest.approx(rest / 8 + routed / 16, rel=1e-9)
    assert p.to_json()["expert_parallel_size"] == 1


def test_pipeline_stages_hold_their_layers_and_the_vocabulary_ends():
    """Llama-3.1-70B over 2 stages: 40 layers each, the embedding on the first, the LM head
    on the last; the most loaded stage sets nothing alone, each stage has its own pool."""
    model = get_model("llama-3.1-70b")
    vocab = 128256 * 8192
    body = (70.6e9 - 2 * vocab) / 80
    p = plan(model, get_gpu("h200"), EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                  max_model_len=32768))
    for st in p.stages:
        assert st.memory.weights_bytes == pytest.approx((40 * body + vocab) * 2 / 2, rel=1e-9)
    assert p.num_blocks == min(st.num_blocks for st in p.stages)
    assert p.to_json()["num_gpus"] == 4
    # 40 layers of 8 / 2 KV heads of 128 + 128, bf16, 16 tokens.
    assert all(st.bytes_per_block == 40 * 16 * 4 * 256 * 2 for st in p.stages)


def test_tied_embeddings_put_a_copy_on_the_last_stage():
    model = get_model("gemma-3-27b")
    assert model.tie_word_embeddings
    layout = ParallelLayout(pipeline_parallel_size=2)
    first, last = stage_weights(model, layout, 0), stage_weights(model, layout, 1)
    alone = stage_weights(model, ParallelLayout(pipeline_parallel_size=1), 0)
    # Two stages hold the matrix twice; one stage holds it once.
    assert first.total_bytes + last.total_bytes == pytest.approx(alone.total_bytes + model.lm_head_params * 2,
                                                                 rel=1e-9)


# -- presets -------------------------------------------------------------------------------


def _mla_layer_params(hidden, heads, q_lora, kv_lora, rope, nope, v):
    return (hidden * q_lora + q_lora * heads * (nope + rope) + hidden * (kv_lora + rope)
            + kv_lora * heads * (nope + v) + heads * v * hidden)


def test_kimi_k2_totals_its_published_size():
    hidden, moe, dense = 7168, 2048, 18432
    attention = 61 * _mla_layer_params(hidden, 64, 1536, 512, 64, 128, 128)
    mlp = 1 * 3 * hidden * dense + 60 * (384 + 1) * 3 * hidden * moe
    total = attention + mlp + 2 * 163840 * hidden
    assert total == pytest.approx(1.04e12, rel=0.03)
    m = get_model("kimi-k2")
    assert (m.num_experts, m.num_attention_heads, m.num_moe_layers, m.uses_mla) == (384, 64, 60, True)
    assert m.routed_expert_params == 60 * 384 * 3 * hidden * moe
    assert m.params_total == pytest.approx(total, rel=0.03)


def test_qwen3_235b_totals_its_published_size():
    hidden = 4096
    attention = 94 * (hidden * 64 * 128 + 2 * hidden * 4 * 128 + 64 * 128 * hidden)
    experts = 94 * 128 * 3 * hidden * 1536
    total = attention + experts + 2 * 151936 * hidden
    assert total == pytest.approx(235e9, rel=0.03)
    m = get_model("qwen3-235b-a22b")
    assert (m.num_experts, m.num_experts_per_token, m.num_kv_heads, m.num_moe_layers) == (128, 8, 4, 94)
    assert m.routed_expert_params == experts
    assert m.params_total == pytest.approx(total, rel=0.03)


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, needles", [
    (("--model", "llama-3.1-8b", "--enable-expert-parallel"), ("enable_expert_parallel", "no experts")),
    (("--model", "llama-3.1-8b", "--pipeline-parallel-size", "33"), ("pipeline_parallel_size", "at most",
                                                                     "32 layers", "got 33")),
    (("--model", "llama-3.1-8b", "--data-parallel-size", "0"), ("--dp", "a positive integer", "got 0")),
    (("--model", "llama-3.1-8b", "--pp", "-1"), ("--pp", "a positive integer")),
    (("--model", "deepseek-v3", "--dp", "16", "--enable-eplb"), ("enable_eplb", "enable_expert_parallel")),
    (("--model", "deepseek-v3", "--enable-expert-parallel", "--enable-eplb"), ("enable_eplb", "one GPU")),
    (("--model", "deepseek-v3", "--dp", "16", "--enable-expert-parallel", "--num-redundant-experts", "32"),
     ("num_redundant_experts", "unless enable_eplb", "got 32")),
    (("--model", "deepseek-v3", "--dp", "16", "--enable-expert-parallel", "--enable-eplb",
      "--num-redundant-experts", "5"), ("num_redundant_experts", "multiple of the EP group's 16 GPUs", "got 5")),
    (("--model", "deepseek-v3", "--dp", "16", "--enable-expert-parallel", "--enable-eplb",
      "--num-redundant-experts", "1024"), ("--num-redundant-experts", "0 to 1023", "got 1024")),
])
def test_plan_refuses_layouts_vllm_cannot_run(args, needles):
    one_error_line(run("plan", "--gpu", "h200", *args), *needles)


# Pipeline stages, data-parallel ranks and expert parallelism replay (tests/replay/
# test_pipeline_replay.py, test_dp_lockstep.py, test_moe_group_cost.py).
def test_expert_parallelism_is_replayed_and_planned(tmp_path):
    path = tmp_path / "parallel.toml"
    path.write_text('[model]\npreset = "gpt-oss-20b"\n[hardware]\ngpu = "h200"\n'
                    '[engine]\ndata_parallel_size = 2\nenable_expert_parallel = true\nmax_model_len = 8192\n'
                    'async_scheduling = false\n[workload]\ntrace = "bundled:mooncake_conversation_trace.jsonl"\n')
    replayed = run("replay", str(path), "--quiet", "--limit", "3", "--out", str(tmp_path / "run"))
    assert replayed.exit_code == 0, replayed.stderr
    assert (tmp_path / "run").exists()
    result = run("plan", "--scenario", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    assert '"enable_expert_parallel": true' in result.stdout
