"""A DP MoE group's MoE layers priced for the group (docs/clock.md#moe-under-data-parallelism):
the group cost against hand-computed values, EP against its absence, DP 1 against the
ordinary cost model, and DP4 gpt-oss-20b replays with and without EP."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.planner.hardware import GPU_PRESETS
from kvtwin.sim.planner.models import MODEL_PRESETS
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.moe_group_cost import (ALL_TO_ALL, DPRankCostModel, MoEDPGroup, MoEGroupCost,
                                               expected_max_gpu_pairs)
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

REPO = Path(__file__).resolve().parents[2]
MODEL = MODEL_PRESETS["gpt-oss-20b"]
GPU = GPU_PRESETS["h100"]
# No GEMM ramp, so FLOPs / (peak x fraction) is the whole formula.
EFF = Efficiency(matmul_half_tokens=0.0)


def _expert_bytes() -> float:
    # gpt-oss-20b's experts are MXFP4: 4.25 bits a parameter; gate, up and down.
    return 3 * MODEL.hidden_size * MODEL.moe_intermediate_size * 4.25 / 8


def _hbm() -> float:
    return GPU.hbm_bandwidth_bytes_per_s * EFF.hbm_bandwidth_fraction


def test_without_ep_every_gpu_runs_a_slice_of_every_routed_token():
    dp, tokens = 4, [3, 5, 1, 7]
    cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=False,
                        efficiency=EFF).part(tokens)
    E, k, L, h = MODEL.num_experts, MODEL.num_experts_per_token, MODEL.num_moe_layers, MODEL.hidden_size
    T = sum(tokens)
    flops = T * k * 2 * 3 * h * MODEL.moe_intermediate_size * L / dp
    assert cost.compute_s == pytest.approx(flops / (GPU.bf16_flops * EFF.matmul_flops_fraction), rel=1e-12)
    touched = E * (1 - (1 - k / E) ** T)
    assert cost.weights_s == pytest.approx(touched * _expert_bytes() / dp * L / _hbm(), rel=1e-12)
    # All-gather + reduce-scatter of every token's hidden states over the 4 ranks' NVLink.
    gathered = T * h * 2
    per_layer = 2 * gathered * (dp - 1) / dp / (GPU.interconnect_bytes_per_s * EFF.interconnect_fraction) \
        + 2 * EFF.allreduce_latency_s
    assert cost.communication_s == pytest.approx(per_layer * L, rel=1e-12)
    assert cost.total_s == max(cost.compute_s, cost.weights_s) + cost.communication_s


def test_ep_holds_whole_experts_and_reads_fewer_bytes_at_small_batch():
    dp = 4
    ep = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True, efficiency=EFF)
    tp_sharded = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=False,
                              efficiency=EFF)
    E, k, L = MODEL.num_experts, MODEL.num_experts_per_token, MODEL.num_moe_layers
    assert ep.experts_per_gpu == math.ceil(E / dp)
    tokens = [1, 1, 1, 1]
    T = 4
    touched_fraction = 1 - (1 - k / E) ** T
    assert ep.weight_bytes(T) == pytest.approx(math.ceil(E / dp) * touched_fraction * _expert_bytes() * L, rel=1e-12)
    # A GPU's share of the touched experts' bytes is the same in expectation (E/DP experts
    # whole, or every expert's 1/DP slice) when DP divides the experts ...
    assert ep.weight_bytes(T) == pytest.approx(tp_sharded.weight_bytes(T), rel=1e-12)
    # ... but EP's busiest GPU runs more than its mean share of pairs, and the same collective.
    assert ep.pairs_on_busiest_gpu(T) > T * k / dp == tp_sharded.pairs_on_busiest_gpu(T)
    assert ep.communication_s(tokens) == tp_sharded.communication_s(tokens)
    # With more GPUs than divide the experts evenly, a GPU's whole experts weigh more than its slices.
    uneven = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=3, expert_parallel=True,
                          efficiency=EFF)
    assert uneven.experts_per_gpu == math.ceil(E / 3) and uneven.experts_per_gpu * 3 > E


def test_the_busiest_gpu_bound_is_the_mean_plus_the_gaussian_tail():
    T, E, k, e, n = 100, 32, 4, 8, 4
    p = e / E
    mean = T * k * p
    sd = math.sqrt(T * k * p * (1 - p) * (E - k) / (E - 1))
    assert expected_max_gpu_pairs(T, E, k, e, n) == pytest.approx(mean + sd * math.sqrt(2 * math.log(n)))
    # One token cannot land more pairs on a GPU than it picks or the GPU holds.
    assert expected_max_gpu_pairs(1, E, k, 2, 16) <= 2
    assert expected_max_gpu_pairs(T, E, k, E, 1) == T * k


def test_all_to_all_sends_top_k_copies_of_the_busiest_ranks_tokens():
    dp, tokens = 4, [10, 2, 2, 2]
    a2a = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True,
                       efficiency=EFF, collective=ALL_TO_ALL)
    k, h, L = MODEL.num_experts_per_token, MODEL.hidden_size, MODEL.num_moe_layers
    link = GPU.interconnect_bytes_per_s * EFF.interconnect_fraction
    sent = 10 * k * (dp - 1) / dp * h * 2
    assert a2a.communication_s(tokens) == pytest.approx((2 * sent / link + 2 * EFF.allreduce_latency_s) * L)


def test_a_group_past_one_node_uses_the_nic():
    nic_gpu = GPU_PRESETS["h200"]
    assert nic_gpu.nic_bytes_per_s > 0
    wide = MoEGroupCost(MODEL, nic_gpu, tensor_parallel_size=1, data_parallel_size=16, expert_parallel=True,
                        efficiency=EFF)
    assert wide.link_bytes_per_s == pytest.approx(nic_gpu.nic_bytes_per_s * EFF.interconnect_fraction)
    narrow = MoEGroupCost(MODEL, nic_gpu, tensor_parallel_size=1, data_parallel_size=8, expert_parallel=True,
                          efficiency=EFF)
    assert narrow.link_bytes_per_s == pytest.approx(nic_gpu.interconnect_bytes_per_s * EFF.interconnect_fraction)


def _dp1_group(specs, tp=1):
    rank = DPRankCostModel(MODEL, GPU, specs, async_scheduling=False, tensor_parallel_size=tp, efficiency=EFF)
    moe = MoEGroupCost(MODEL, GPU, tensor_parallel_size=tp, data_parallel_size=1, expert_parallel=False,
                       efficiency=EFF)
    return MoEDPGroup(rank, moe), CostModel(MODEL, GPU, specs, async_scheduling=False, tensor_parallel_size=tp,
                                            efficiency=EFF)


def _specs():
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=1, engine={"max_model_len": 32768}))
    return resolved.plan().layers.specs


@pytest.mark.parametrize("decodes, prefills", [([4000] * 8, []), ([], [(8192, 0)])])
def test_dp1_equals_the_ordinary_cost_where_both_parts_share_a_bound(decodes, prefills):
    """DP 1: no collective, the same FLOPs and bytes. A small decode batch is bound by the
    weights in both parts, a long prefill by FLOPs in both: then the sum of the two
    rooflines is the roofline of the sums."""
    group, plain = _dp1_group(_specs())
    whole = plain.split_step_cost(decodes, prefills)
    own = group.rank_model.split_step_cost(decodes, prefills)
    steps, seconds = group.step([own])
    assert steps[0].moe_communication_s == 0.0
    assert seconds == pytest.approx(whole.total_s, rel=1e-9)
    assert steps[0].weight_bytes == pytest.approx(whole.weight_bytes, rel=1e-9)
    assert steps[0].linear_flops == pytest.approx(whole.linear_flops, rel=1e-9)


def test_dp1_is_never_below_the_ordinary_cost():
    """Where the parts are bound differently the split prices each kernel on its own
    roofline: max(a, b) + max(c, d) >= max(a + c, b + d)."""
    group, plain = _dp1_group(_specs())
    for decodes, prefills in (([3000] * 64, [(256, 0)]), ([100] * 200, []), ([], [(512, 0)])):
        own = group.rank_model.split_step_cost(decodes, prefills)
        assert group.step([own])[1] >= plain.split_step_cost(decodes, prefills).total_s * (1 - 1e-12)


def _dp_replay(**engine):
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=40, engine={"max_model_len": 32768, "async_scheduling": False,
                                                            "data_parallel_size": 4, **engine}))
    planned = resolved.plan()
    return run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                      efficiency=resolved.efficiency, slo=resolved.slo)


@pytest.fixture(scope="module")
def replays():
    return {ep: _dp_replay(enable_expert_parallel=ep) for ep in (False, True)}


def test_dp4_replays_carry_the_moe_collective_per_step(replays):
    for ep, result in replays.items():
        steps = result.steps
        ran = (steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()) > 0
        comm = steps.column("moe_communication_s").to_numpy()[ran]
        assert len(comm) and (comm > 0).all(), ep
        assert (steps.column("communication_s").to_numpy()[ran] >= comm).all()
        share = result.summary.to_pylist()[0]["moe_communication_share"]
        assert 0 < share < 1


def test_dp4_low_load_tpot_is_below_the_old_per_rank_pricing(replays, monkeypatch):
    """At low load each rank reads a quarter of the touched experts' bytes instead of all
    of them: decodes are faster than when each rank was priced as holding every expert."""
    from kvtwin.sim.replay import data_parallel
    monkeypatch.setattr(data_parallel, "moe_dp_group", lambda plan, efficiency: None)
    old = _dp_replay()
    assert "moe_communication_s" not in old.steps.column_names
    for result in replays.values():
        assert result.summary.to_pylist()[0]["mean_tpot_ms"] < old.summary.to_pylist()[0]["mean_tpot_ms"]
