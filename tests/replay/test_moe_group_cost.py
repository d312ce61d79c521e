"""A DP MoE group's MoE layers priced for the group (docs/clock.md#moe-under-data-parallelism):
the group cost against hand-computed values, EP against its absence, DP 1 against the
ordinary cost model, and DP4 gpt-oss-20b replays with and without EP."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from kvtwin.sim.calibration.efficiency import CollectiveCurve, DeepEPTable, Efficiency
from kvtwin.sim.planner.hardware import GPU_PRESETS
from kvtwin.sim.planner.models import MODEL_PRESETS
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.moe_group_cost import (ALL_TO_ALL, ALLGATHER_REDUCESCATTER, DPRankCostModel, MoEDPGroup,
                                               MoEGroupCost, expected_max_gpu_pairs, moe_dp_group)
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


def _link_seconds(message_bytes: float, n: int, link: float) -> float:
    """One MoE layer's collective priced as a ring all-reduce of ``message_bytes``."""
    return 2 * message_bytes * (n - 1) / n / link + 2 * EFF.allreduce_latency_s


@pytest.mark.parametrize("tokens, agrs_tokens, a2a_tokens", [
    ([10, 2, 2, 2], 16, 40),  # one busy rank: its 4 copies of 10 tokens outweigh the 16 gathered
    ([4, 4, 4, 4], 16, 16),   # balanced at DP = top-k = 4: the same bytes per GPU
])
def test_the_two_shapes_move_what_each_sends(tokens, agrs_tokens, a2a_tokens):
    """gpt-oss-20b (top-4 of 32) at DP 4 + EP on NVLink: the all-gather moves every rank's
    tokens to every GPU, the all-to-all the busiest rank's top-4 copies; as all-reduces of
    those hidden states (2,880 x 2 bytes each)."""
    dp, h, L = 4, MODEL.hidden_size, MODEL.num_moe_layers
    link = GPU.interconnect_bytes_per_s * EFF.interconnect_fraction
    costs = {shape: MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True,
                                 efficiency=EFF, collective=shape) for shape in (ALLGATHER_REDUCESCATTER, ALL_TO_ALL)}
    assert costs[ALLGATHER_REDUCESCATTER].communication_s(tokens) == pytest.approx(
        _link_seconds(agrs_tokens * h * 2, dp, link) * L, rel=1e-12)
    assert costs[ALL_TO_ALL].communication_s(tokens) == pytest.approx(
        _link_seconds(a2a_tokens * h * 2, dp, link) * L, rel=1e-12)


def test_deepseek_v3_dp16_all_to_all_moves_half_the_gather_over_the_nic():
    """DeepSeek-V3 (top-8 of 256) at DP 16 + EP on H200s, past one node: with every rank at
    100 tokens the all-gather brings 1,600 tokens' states to each GPU, the all-to-all sends
    100 x 8 copies from each: half the bytes (k / DP), the same latency."""
    model, gpu, dp = MODEL_PRESETS["deepseek-v3"], GPU_PRESETS["h200"], 16
    h, L = model.hidden_size, model.num_moe_layers
    assert (model.num_experts_per_token, L) == (8, 58)
    nic = gpu.nic_bytes_per_s * EFF.interconnect_fraction
    tokens = [100] * dp
    agrs = MoEGroupCost(model, gpu, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True,
                        efficiency=EFF)
    a2a = MoEGroupCost(model, gpu, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True,
                       efficiency=EFF, collective=ALL_TO_ALL)
    assert agrs.communication_s(tokens) == pytest.approx(_link_seconds(1600 * h * 2, dp, nic) * L, rel=1e-12)
    assert a2a.communication_s(tokens) == pytest.approx(_link_seconds(800 * h * 2, dp, nic) * L, rel=1e-12)


def _without_collectives(efficiency: Efficiency) -> Efficiency:
    return dataclasses.replace(efficiency, allgather=(), reducescatter=(), alltoall=(), deepep=())


def test_without_collective_curves_the_all_reduce_curve_prices_both_shapes():
    """A calibration without the collective keys prices as before they existed: each shape
    as the measured all-reduce of its message (docs/clock.md#moe-under-data-parallelism)."""
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml", Overrides(limit=1))
    efficiency = _without_collectives(resolved.efficiency)
    curve = efficiency.allreduce_curve(4)
    assert curve is not None
    h, L = MODEL.hidden_size, MODEL.num_moe_layers
    for collective, message in ((ALL_TO_ALL, 300 * 4 * h * 2), (ALLGATHER_REDUCESCATTER, 322 * h * 2)):
        cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=4, expert_parallel=True,
                            efficiency=efficiency, collective=collective, deepep_mode="low_latency")
        assert cost.communication_s([300, 20, 1, 1]) == curve.seconds_for(message) * L
        assert cost.pricing == "measured all-reduce of the same bytes (4 GPUs)"


# Hand-made tables: two points each, so every lookup below is one line of arithmetic.
AG4 = CollectiveCurve(4, (1e3, 1e7), (1e-5, 1e-3))
RS4 = CollectiveCurve(4, (1e3, 1e7), (2e-5, 3e-3))
A2A4 = CollectiveCurve(4, (1e3, 1e7), (4e-5, 5e-3))
LL1 = DeepEPTable("low_latency", 1, 7168, 8, (1.0, 128.0), (1e-5, 4e-5), (1e-5, 7e-5))
HT1 = DeepEPTable("high_throughput", 1, 7168, 8, (1.0, 128.0), (3e-5, 5e-5), (5e-5, 9e-5))
LL2 = DeepEPTable("low_latency", 2, 7168, 8, (1.0, 128.0), (2e-5, 1e-4), (3e-5, 2e-4))
TABLES = Efficiency(matmul_half_tokens=0.0, allgather=(AG4,), reducescatter=(RS4,), alltoall=(A2A4,),
                    deepep=(LL1, HT1, LL2))


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def test_the_gather_is_an_all_gather_and_a_reduce_scatter_of_the_groups_tokens():
    """DP 4: 100 + 50 + 30 + 20 tokens of 2,880 bf16 values; nccl-tests' all-gather output
    and reduce-scatter input are all of them, 1,152,000 bytes."""
    cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=4, expert_parallel=True,
                        efficiency=TABLES)
    message = 1_152_000
    assert message == 200 * MODEL.hidden_size * 2
    per_layer = _line(1e3, 1e-5, 1e7, 1e-3, message) + _line(1e3, 2e-5, 1e7, 3e-3, message)
    assert cost.communication_s([100, 50, 30, 20]) == pytest.approx(per_layer * MODEL.num_moe_layers, rel=1e-12)
    assert cost.pricing == "measured NCCL all-gather and reduce-scatter (4 GPUs)"
    # Without EP every backend gathers, and the same curves price it.
    no_ep = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=4, expert_parallel=False,
                         efficiency=TABLES)
    assert no_ep.communication_s([100, 50, 30, 20]) == cost.communication_s([100, 50, 30, 20])


def test_an_all_to_all_backend_sends_the_busiest_ranks_copies_each_way():
    """nixl_ep at DP 4: the busiest rank's 100 tokens x top-4 x 2,880 x 2 bytes is its
    send buffer, 2,304,000 bytes, once to dispatch and once to combine."""
    cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=4, expert_parallel=True,
                        efficiency=TABLES, collective=ALL_TO_ALL)
    message = 100 * 4 * 2880 * 2
    per_layer = 2 * _line(1e3, 4e-5, 1e7, 5e-3, message)
    assert cost.communication_s([100, 50, 30, 20]) == pytest.approx(per_layer * MODEL.num_moe_layers, rel=1e-12)
    assert cost.pricing == "measured NCCL all-to-all (4 GPUs)"


@pytest.mark.parametrize("mode, dispatch, combine", [
    ("low_latency", (1e-5, 4e-5), (1e-5, 7e-5)), ("high_throughput", (3e-5, 5e-5), (5e-5, 9e-5))])
def test_deepep_prices_the_table_tokens_of_the_same_bytes(mode, dispatch, combine):
    """gpt-oss-20b sends 4 x 2,880 values a token, the table's model 8 x 7,168: the
    busiest rank's 100 tokens are 100 x 11,520 / 57,344 of the table's tokens."""
    cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=4, expert_parallel=True,
                        efficiency=TABLES, collective=ALL_TO_ALL, deepep_mode=mode)
    tokens = 100 * 4 * 2880 / (8 * 7168)
    per_layer = _line(1, dispatch[0], 128, dispatch[1], tokens) + _line(1, combine[0], 128, combine[1], tokens)
    assert cost.communication_s([100, 50, 30, 20]) == pytest.approx(per_layer * MODEL.num_moe_layers, rel=1e-12)
    assert cost.deepep.mode == mode and cost.deepep.nodes == 1


def test_deepep_picks_the_table_of_the_groups_node_count_and_else_the_link():
    """DP 16 spans 2 nodes of 8: the 2-node table; DP 24 (3 nodes) has none, nor has the
    NCCL all-to-all past one node: the bandwidth model over the NIC, and ``pricing`` says so."""
    gpu = GPU_PRESETS["h200"]
    two = MoEGroupCost(MODEL, gpu, tensor_parallel_size=1, data_parallel_size=16, expert_parallel=True,
                       efficiency=TABLES, collective=ALL_TO_ALL, deepep_mode="low_latency")
    assert two.deepep is LL2
    tokens = 10 * 4 * 2880 / (8 * 7168)
    assert two.communication_s([10] * 16) == pytest.approx(
        (_line(1, 2e-5, 128, 1e-4, tokens) + _line(1, 3e-5, 128, 2e-4, tokens)) * MODEL.num_moe_layers, rel=1e-12)
    # One token a rank is 0.2 of the table's: below it, its smallest row (the latency floor).
    assert two.communication_s([1] * 16) == pytest.approx((2e-5 + 3e-5) * MODEL.num_moe_layers, rel=1e-12)
    three = MoEGroupCost(MODEL, gpu, tensor_parallel_size=1, data_parallel_size=24, expert_parallel=True,
                         efficiency=TABLES, collective=ALL_TO_ALL, deepep_mode="low_latency")
    plain = MoEGroupCost(MODEL, gpu, tensor_parallel_size=1, data_parallel_size=24, expert_parallel=True,
                         efficiency=EFF, collective=ALL_TO_ALL)
    assert three.deepep is None and three.alltoall is None
    assert three.communication_s([10] * 24) == plain.communication_s([10] * 24)
    assert three.pricing.startswith("bandwidth model: 24 GPUs over the NIC")
    # The gather past one node: no NCCL curve was measured over the NIC.
    wide = MoEGroupCost(MODEL, gpu, tensor_parallel_size=1, data_parallel_size=16, expert_parallel=True,
                        efficiency=TABLES)
    assert wide.allgather is None and wide.pricing.startswith("bandwidth model")


@pytest.mark.parametrize("backend, picks", [
    ("allgather_reducescatter", "allgather"), ("deepep_low_latency", "deepep"), ("deepep_high_throughput", "deepep"),
    ("mori_low_latency", "alltoall"), ("nixl_ep", "alltoall"), ("deepep_v2", "alltoall")])
def test_each_backend_picks_its_table_from_the_bundled_h100_file(backend, picks):
    group = _group_for(backend)
    found = {name: getattr(group, name) is not None for name in ("allgather", "alltoall", "deepep")}
    assert found == {name: name == picks for name in found}
    if picks == "deepep":
        assert group.deepep.mode == backend.removeprefix("deepep_")


def _group_for(backend: str, *, ep: bool = True, tp: int = 1, dp: int = 4):
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=1, engine={"max_model_len": 32768, "data_parallel_size": dp,
                                                           "tensor_parallel_size": tp, "enable_expert_parallel": ep,
                                                           "all2all_backend": backend}))
    return moe_dp_group(resolved.plan(), resolved.efficiency).moe


@pytest.mark.parametrize("backend, shape", [
    ("allgather_reducescatter", ALLGATHER_REDUCESCATTER), ("naive", ALLGATHER_REDUCESCATTER),
    ("pplx", ALLGATHER_REDUCESCATTER), ("deepep_low_latency", ALL_TO_ALL), ("deepep_high_throughput", ALL_TO_ALL),
    ("deepep_v2", ALL_TO_ALL), ("mori_low_latency", ALL_TO_ALL), ("nixl_ep", ALL_TO_ALL), ("moonep", ALL_TO_ALL),
    ("flashinfer_all2allv", ALL_TO_ALL), ("flashinfer_nvlink_one_sided", ALL_TO_ALL),
])
def test_the_backend_picks_the_shape_with_ep_and_none_without(backend, shape):
    assert _group_for(backend).collective == shape
    # Without EP vLLM runs no all-to-all kernel: every backend gathers (all2all_utils.py:203-226).
    assert _group_for(backend, ep=False).collective == ALLGATHER_REDUCESCATTER


def test_sequence_parallel_backends_split_a_ranks_tokens_over_its_tp_gpus():
    """DP 2 x TP 2 + EP: DeepEP's EP group of 4 GPUs each sends half its rank's tokens;
    FlashInfer's two-sided kernels are not sequence-parallel (vLLM's
    use_sequence_parallel_moe), so each TP GPU sends them all."""
    deepep = _group_for("deepep_low_latency", tp=2, dp=2)
    flashinfer = _group_for("flashinfer_nvlink_two_sided", tp=2, dp=2)
    assert deepep.collective_gpus == flashinfer.collective_gpus == 4
    assert deepep.token_split == 2 and flashinfer.token_split == 1


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


def _dp_replay(efficiency_edit=None, moe_fit: bool = True, **engine):
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(limit=40, engine={"max_model_len": 32768, "async_scheduling": False,
                                                            "data_parallel_size": 4, **engine}))
    planned = resolved.plan()
    efficiency = efficiency_edit(resolved.efficiency) if efficiency_edit else resolved.efficiency
    if not moe_fit:
        efficiency = dataclasses.replace(efficiency, moe_flops_fraction=0.0)
    return run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                      efficiency=efficiency, slo=resolved.slo)


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


def test_dp4_replays_name_what_priced_the_collective(replays):
    """The bundled H100 file has NCCL curves for 4 GPUs: the gather is priced from them,
    and without them from the all-reduce curve; the summary says which."""
    for result in replays.values():
        assert result.summary.to_pylist()[0]["moe_communication_pricing"] == \
            "measured NCCL all-gather and reduce-scatter (4 GPUs)"
    stripped = _dp_replay(_without_collectives, enable_expert_parallel=True)
    assert stripped.summary.to_pylist()[0]["moe_communication_pricing"] == \
        "measured all-reduce of the same bytes (4 GPUs)"


def test_dp4_deepep_low_latency_moves_more_than_the_gather_for_gpt_oss_20b(replays):
    """gpt-oss-20b sends each token to 4 experts, as many as DP 4 has ranks: the all-to-all
    moves ``t_max x 4`` tokens' states per GPU where the all-gather moves the sum of the
    ranks' tokens, never more than ``4 x t_max``. At this low load one rank often runs alone
    beside dummy batches, so with vLLM's DeepEP low-latency backend the collective costs
    more per step than with the default (the win needs top-k below DP: the DeepSeek-V3
    test above)."""
    a2a = _dp_replay(enable_expert_parallel=True, all2all_backend="deepep_low_latency")

    def per_step(result):
        steps = result.steps
        ran = (steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()) > 0
        return steps.column("moe_communication_s").to_numpy()[ran].mean()

    assert per_step(a2a) > 1.5 * per_step(replays[True])
    assert a2a.summary.to_pylist()[0]["moe_communication_share"] > \
        replays[True].summary.to_pylist()[0]["moe_communication_share"]


def test_dp4_low_load_tpot_is_below_the_old_per_rank_pricing(monkeypatch):
    """At low load each rank reads a quarter of the touched experts' bytes instead of all
    of them: decodes are faster than when each rank was priced as holding every expert.
    Both on the dense GEMMs' factors (no MoE fit: the fit's floor and per-token time have
    no counterpart in the per-rank pricing)."""
    unfitted = {ep: _dp_replay(moe_fit=False, enable_expert_parallel=ep) for ep in (False, True)}
    from kvtwin.sim.replay import data_parallel
    monkeypatch.setattr(data_parallel, "moe_dp_group", lambda plan, efficiency: None)
    old = _dp_replay(moe_fit=False)
    assert "moe_communication_s" not in old.steps.column_names
    for result in unfitted.values():
        assert result.summary.to_pylist()[0]["mean_tpot_ms"] < old.summary.to_pylist()[0]["mean_tpot_ms"]


def _without_moe_keys(path: Path, out: Path) -> Path:
    """``path``'s calibration with its ``moe_*`` lines taken out."""
    out.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                           if not line.startswith("moe_")))
    return out


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_calibration_without_the_moe_keys_prices_the_experts_as_before(tmp_path, expert_parallel):
    from kvtwin.sim.calibration.file import read_calibration
    bundled = REPO / "sim" / "replay" / "data" / "calibration" / "h100.toml"
    eff = read_calibration(_without_moe_keys(bundled, tmp_path / "h100.toml")).efficiency
    assert not eff.moe_fitted
    dp, tokens = 4, [3, 5, 1, 7]
    part = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=expert_parallel,
                        efficiency=eff).part(tokens)
    E, k, L, h = MODEL.num_experts, MODEL.num_experts_per_token, MODEL.num_moe_layers, MODEL.hidden_size
    T = sum(tokens)
    pairs = expected_max_gpu_pairs(T, E, k, E // dp, dp) if expert_parallel else T * k / dp
    flops = pairs * 2 * 3 * h * MODEL.moe_intermediate_size * L
    fraction = eff.matmul_flops_fraction * T / (T + eff.matmul_half_tokens)
    assert part.compute_s == pytest.approx(flops / (GPU.bf16_flops * fraction), rel=1e-12)
    touched = (1 - (1 - k / E) ** T)
    held = E // dp * touched * _expert_bytes() if expert_parallel else E * touched * _expert_bytes() / dp
    assert part.weights_s == pytest.approx(held * L / (GPU.hbm_bandwidth_bytes_per_s * eff.hbm_bandwidth_fraction),
                                           rel=1e-12)
    assert part.fixed_s == 0.0
    assert part.total_s == max(part.compute_s, part.weights_s) + part.communication_s


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_moe_fit_prices_the_experts_by_rows_per_expert_with_floor_tokens_and_load(expert_parallel):
    eff = Efficiency(moe_flops_fraction=0.5, moe_expert_half_tokens=4.0, moe_hbm_bandwidth_fraction=0.6,
                     moe_floor_s=30e-6, moe_s_per_token_value=1e-11, moe_ep_imbalance=1.5, moe_tp_imbalance=1.2)
    dp, tokens = 4, [30, 50, 10, 70]
    part = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=expert_parallel,
                        efficiency=eff).part(tokens)
    E, k, L, h = MODEL.num_experts, MODEL.num_experts_per_token, MODEL.num_moe_layers, MODEL.hidden_size
    T = sum(tokens)
    # The mean load (E / dp experts a GPU with EP, a 1/dp slice of each without) times the factor.
    pairs = T * k / dp * (1.5 if expert_parallel else 1.2)
    rows = T * k / E
    flops = pairs * 2 * 3 * h * MODEL.moe_intermediate_size * L
    assert part.compute_s == pytest.approx(flops / (GPU.bf16_flops * 0.5 * rows / (rows + 4.0)), rel=1e-12)
    touched = (1 - (1 - k / E) ** T)
    held = E // dp * touched * _expert_bytes() if expert_parallel else E * touched * _expert_bytes() / dp
    assert part.weights_s == pytest.approx(held * L / (GPU.hbm_bandwidth_bytes_per_s * 0.6), rel=1e-12)
    # Every GPU receives the group's tokens (all-gather) and pays the floor, per MoE layer.
    assert part.fixed_s == pytest.approx((30e-6 + 1e-11 * h * T) * L, rel=1e-12)
    assert part.total_s == pytest.approx(max(part.compute_s, part.weights_s) + part.fixed_s + part.communication_s,
                                         rel=1e-15)


def test_an_all_to_all_gpu_pays_the_per_token_time_on_the_copies_it_receives():
    eff = Efficiency(moe_flops_fraction=0.5, moe_s_per_token_value=1e-11)
    dp, tokens = 8, [2, 1, 1, 1, 1, 1, 1, 1]
    cost = MoEGroupCost(MODEL, GPU, tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True,
                        efficiency=eff, collective=ALL_TO_ALL)
    part = cost.part(tokens)
    # 9 tokens x 4 copies over 8 GPUs of 4 experts each: 4.5 pairs on the busiest, fewer than 9 tokens.
    pairs = 9 * MODEL.num_experts_per_token * (MODEL.num_experts // dp) / MODEL.num_experts
    assert part.fixed_s == pytest.approx(1e-11 * MODEL.hidden_size * pairs * MODEL.num_moe_layers, rel=1e-12)


@pytest.mark.parametrize("fitted", [False, True])
def test_eplb_holds_its_redundant_experts_and_evens_the_load(fitted):
    """docs/clock.md#moe-under-data-parallelism, EPLB: (32 + 8) physical experts over 4 GPUs,
    10 each read when touched, and the busiest GPU at the mean load whatever the fit's load
    factor or uniform routing's tail."""
    eff = Efficiency(moe_flops_fraction=0.5, moe_ep_imbalance=1.5) if fitted else EFF
    dp, tokens = 4, [30, 50, 10, 70]
    common = dict(tensor_parallel_size=1, data_parallel_size=dp, expert_parallel=True, efficiency=eff)
    plain = MoEGroupCost(MODEL, GPU, **common)
    eplb = MoEGroupCost(MODEL, GPU, **common, eplb_redundant_experts=8)
    E, k, L, T = MODEL.num_experts, MODEL.num_experts_per_token, MODEL.num_moe_layers, sum(tokens)
    assert eplb.experts_per_gpu == (E + 8) // dp == plain.experts_per_gpu + 2
    assert eplb.pairs_on_busiest_gpu(T) == pytest.approx(T * k / dp, rel=1e-15)
    assert plain.pairs_on_busiest_gpu(T) > eplb.pairs_on_busiest_gpu(T)
    touched = 1 - (1 - k / E) ** T
    assert eplb.weight_bytes(T) == pytest.approx((E + 8) // dp * touched * _expert_bytes() * L, rel=1e-12)
    # EPLB without EP is no EPLB (vLLM refuses it; the planner first).
    tp = MoEGroupCost(MODEL, GPU, **{**common, "expert_parallel": False}, eplb_redundant_experts=8)
    assert not tp.eplb and tp.experts_per_gpu == E
