"""A DP MoE group's ranks padded to the largest rank's batch when CUDA graphs run the step
(docs/clock.md#moe-under-data-parallelism): the graph ceiling against vLLM 0.33's ladder,
a [1, 300] group priced by hand, and ``enforce_eager`` giving the unpadded prices."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPU_PRESETS
from kvtwin.sim.planner.models import MODEL_PRESETS
from kvtwin.sim.replay.moe_group_cost import (DPRankCostModel, MoEDPGroup, MoEGroupCost, dp_padding_tokens,
                                               max_cudagraph_capture_tokens, moe_dp_group)
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

REPO = Path(__file__).resolve().parents[2]
MODEL = MODEL_PRESETS["gpt-oss-20b"]
GPU = GPU_PRESETS["h100"]
# No GEMM ramp, so FLOPs / (peak x fraction) is the whole GEMM formula.
EFF = Efficiency(matmul_half_tokens=0.0)


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens, capability, expected", [
    (1024, 8192, "9.0", 512),    # the Hopper ceiling
    (1024, 8192, "10.0", 1024),  # data-centre Blackwell
    (1024, 8192, "12.0", 512),   # a consumer Blackwell is not family 10
    (100, 8192, "9.0", 200),     # twice the requests, on the step-8 ladder
    (133, 8192, "9.0", 256),     # 266 wanted: the step-16 ladder stops at 256
    (1024, 300, "9.0", 300),     # the token budget is captured though off the ladder
    (1024, 100, "", 100),
    (300, 8192, "9.0", 512),
])
def test_the_largest_graph_follows_vllms_default_ladder(max_num_seqs, max_num_batched_tokens, capability,
                                                        expected):
    assert max_cudagraph_capture_tokens(max_num_seqs, max_num_batched_tokens, capability) == expected


@pytest.mark.parametrize("tokens, ceiling, expected", [
    ([1, 300], 512, 300),
    ([7, 512, 3], 512, 512),
    ([1, 513], 512, None),  # one rank past the graphs: every rank runs eager, unpadded
    ([1, 300], None, None),  # enforce_eager
])
def test_the_ranks_pad_to_the_largest_only_when_every_batch_fits_a_graph(tokens, ceiling, expected):
    assert dp_padding_tokens(tokens, ceiling) == expected


def _specs():
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=1, engine={"max_model_len": 32768}))
    return resolved.plan().layers.specs


def _group(max_graph_tokens):
    rank = DPRankCostModel(MODEL, GPU, _specs(), async_scheduling=False, efficiency=EFF)
    moe = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=2, expert_parallel=False,
                       efficiency=EFF)
    return MoEDPGroup(rank, moe, max_graph_tokens=max_graph_tokens)


def _collective_s(group_tokens: int, dp: int = 2) -> float:
    # All-gather + reduce-scatter of every token's bf16 hidden states over NVLink, each MoE layer.
    gathered = group_tokens * MODEL.hidden_size * 2
    per_layer = 2 * gathered * (dp - 1) / dp / (GPU.interconnect_bytes_per_s * EFF.interconnect_fraction) \
        + 2 * EFF.allreduce_latency_s
    return per_layer * MODEL.num_moe_layers


def test_one_decode_beside_300_tokens_runs_300_rows_and_the_collective_moves_600():
    group = _group(512)
    decode = group.rank_model.split_step_cost([2000], [])
    prefill = group.rank_model.split_step_cost([], [(300, 0)])
    steps, seconds = group.step([decode, prefill])
    small = steps[0]
    routed = MODEL.num_moe_layers * MODEL.num_experts_per_token * 3 * MODEL.hidden_size * MODEL.moe_intermediate_size
    per_token = 2.0 * (MODEL.body_params_active - routed)
    assert small.num_tokens == 300
    # The linear part: the dense GEMMs at 300 rows, the LM head on the one request.
    assert small.body_flops - group.moe.part([300, 300]).flops == pytest.approx(per_token * 300, rel=1e-12)
    assert small.head_flops == decode.head_flops
    assert small.elementwise_bytes == pytest.approx(300 * decode.elementwise_bytes, rel=1e-12)
    # Attention, KV and CPU work stay the decode's own.
    assert (small.attention_flops, small.kv_bytes, small.overhead_s) == \
        (decode.attention_flops, decode.kv_bytes, decode.overhead_s)
    hbm = GPU.hbm_bandwidth_bytes_per_s * EFF.hbm_bandwidth_fraction
    peak = GPU.bf16_flops * EFF.matmul_flops_fraction
    gemm_s = per_token * 300 / peak + decode.head_flops / peak
    attention_s = decode.attention_work / (GPU.bf16_flops * EFF.attention_flops_fraction)
    own_gpu_s = (max(gemm_s, group.rank_model.dense_weight_bytes / hbm) + max(attention_s, decode.kv_bytes / hbm)
                 + 300 * decode.elementwise_bytes / hbm + decode.extra_gpu_s)
    # The MoE part: both ranks' 300 rows through the experts and the collective.
    part = group.moe.part([300, 300])
    assert part.communication_s == pytest.approx(_collective_s(600), rel=1e-12)
    assert small.moe_communication_s == part.communication_s
    assert small.total_s == pytest.approx(own_gpu_s + part.total_s + decode.overhead_s, rel=1e-12)
    # The rank that had 300 tokens is not padded; the step is the slower rank's.
    assert steps[1].num_tokens == 300 and steps[1].body_flops == pytest.approx(prefill.body_flops + part.flops)
    assert seconds == max(step.total_s for step in steps)


def test_a_dummy_batch_pads_to_the_largest_rank_too():
    group = _group(512)
    prefill = group.rank_model.split_step_cost([], [(300, 0)])
    steps, _ = group.step([None, prefill])
    assert steps[0].num_tokens == 300
    assert steps[0].moe_communication_s == pytest.approx(_collective_s(600), rel=1e-12)


@pytest.mark.parametrize("ceiling", [None, 256])
def test_eager_or_a_batch_past_the_graphs_prices_each_rank_on_its_own_tokens(ceiling):
    """``enforce_eager``, or a rank whose batch no graph holds: the unpadded prices."""
    group = _group(ceiling)
    decode = group.rank_model.split_step_cost([2000], [])
    prefill = group.rank_model.split_step_cost([], [(300, 0)])
    steps, _ = group.step([decode, prefill])
    part = group.moe.part([1, 300])
    assert part.communication_s == pytest.approx(_collective_s(301), rel=1e-12)
    assert steps[0].num_tokens == 1
    assert steps[0].total_s == pytest.approx(decode.total_s + part.total_s, rel=1e-12)
    assert steps[0].moe_communication_s == part.communication_s


def test_padding_never_makes_a_step_cheaper():
    padded, eager = _group(512), _group(None)
    for batches in (([100] * 3, []), ([], [(64, 0)]), ([5000] * 40, [(200, 100)])):
        small = padded.rank_model.split_step_cost(*batches)
        large = padded.rank_model.split_step_cost([], [(480, 0)])
        assert padded.step([small, large])[1] >= eager.step([small, large])[1]


def _plan(**engine):
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=1, engine={"max_model_len": 32768, "data_parallel_size": 2,
                                                           **engine}))
    return resolved.plan(), resolved.efficiency


def test_the_plans_group_takes_its_graph_ceiling_from_the_engine():
    plan, eff = _plan()
    sched = plan.engine.scheduler
    expected = min(2 * sched.max_num_seqs, 512, sched.max_num_batched_tokens)  # H100, a size on the ladder
    assert moe_dp_group(plan, eff).max_graph_tokens == expected
    eager, eff = _plan(enforce_eager=True)
    assert moe_dp_group(eager, eff).max_graph_tokens is None


def test_enforce_eager_reserves_no_graph_memory():
    plan, _ = _plan()
    eager, _ = _plan(enforce_eager=True)
    assert plan.stages[0].memory.cuda_graph_bytes > 0
    assert eager.stages[0].memory.cuda_graph_bytes == 0
    assert eager.stages[0].memory.kv_cache_bytes == \
        plan.stages[0].memory.kv_cache_bytes + plan.stages[0].memory.cuda_graph_bytes


def test_enforce_eager_must_be_a_boolean():
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")  # type: ignore[arg-type]
