"""The cost model under pipeline parallelism (docs/clock.md#pipeline-parallelism): a step's
work split over the stages by their layers, plus the sends between stages."""

import math

import pytest

from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.pipeline_cost import PipelineCostModel
from kvtwin.sim.replay.run import plan_cost_model

# Steps of every shape: a long prefill chunk (compute bound), a deep decode batch (KV bound),
# and a mix.
BATCHES = [
    ([], [(8192, 0)]),
    ([30000 + 17 * i for i in range(200)], []),
    ([900 + i for i in range(40)], [(2000, 4096), (300, 0)]),
]
EFFICIENCIES = [Efficiency(), Efficiency(layer_fixed_s=4e-6, step_gpu_fixed_s=3e-4, decode_attention_s_per_head=2e-8,
                                         matmul_half_tokens=64.0, attention_half_query_tokens=128.0)]


def _models(model_name, gpu_name, pp, tp, efficiency):
    engine = EngineConfig(max_model_len=32768 * 2, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                          async_scheduling=False)
    planned = plan(get_model(model_name), get_gpu(gpu_name), engine)
    whole = CostModel(planned.model, planned.gpu, planned.layers.specs, async_scheduling=False,
                      tensor_parallel_size=tp, efficiency=efficiency)
    return planned, whole, plan_cost_model(planned, efficiency)


@pytest.mark.parametrize("efficiency", EFFICIENCIES, ids=["default", "fixed_terms"])
@pytest.mark.parametrize("model_name,gpu_name,pp,tp", [
    ("llama-3.1-8b", "h100", 3, 1),
    ("llama-3.1-70b", "h100", 2, 4),
    ("gpt-oss-20b", "h100", 4, 1),
    ("jamba-mini", "h200", 2, 2),
    ("gemma-3-27b", "h100", 2, 2),
])
def test_stage_times_add_up_to_the_whole_step_plus_the_sends(model_name, gpu_name, pp, tp, efficiency):
    planned, whole, piped = _models(model_name, gpu_name, pp, tp, efficiency)
    assert isinstance(piped, PipelineCostModel)
    model, gpu = planned.model, planned.gpu
    # Each send: hidden states and residual, 16-bit, each TP rank 1/TP of them, over the NIC.
    link = gpu.nic_bytes_per_s or gpu.interconnect_bytes_per_s
    for decode_ends, prefill_items in BATCHES:
        num_tokens = len(decode_ends) + sum(n for n, _ in prefill_items)
        one_step = whole.split_step_cost(decode_ends, prefill_items)
        cost = piped.split_step_cost(decode_ends, prefill_items)
        send_s = num_tokens * model.hidden_size * 2 * 2 / tp / link
        assert cost.stage_send_s == pytest.approx([send_s] * (pp - 1) + [0.0], rel=1e-12)
        assert sum(cost.stage_compute_s) == pytest.approx(one_step.total_s, rel=1e-9)
        assert cost.total_s == pytest.approx(one_step.total_s + (pp - 1) * send_s, rel=1e-9)
        assert cost.slowest_stage_s == max(c + s for c, s in zip(cost.stage_compute_s, cost.stage_send_s))
        assert all(c > 0 for c in cost.stage_compute_s)


def test_stages_hold_the_layers_of_vllms_split():
    # 32 layers in 3 stages: 10 each, the two left over to the stages before the last,
    # from the one before the last backwards (vLLM's get_pp_indices): 11, 11, 10.
    _, _, piped = _models("llama-3.1-8b", "h100", 3, 1, Efficiency(step_overhead_s=0.0, per_request_overhead_s=0.0))
    assert piped.stage_layers == [11, 11, 10]
    assert [sum(lc.num_layers for lc in stage.layer_classes) for stage in piped.stage_models] == [11, 11, 10]
    # Without CPU overhead or fixed terms the first two stages (same layers, neither holds
    # the LM head) take the same time; the last has a layer fewer but the head.
    for decode_ends, prefill_items in BATCHES:
        cost = piped.split_step_cost(decode_ends, prefill_items)
        first, second, last = cost.stage_compute_s
        assert first == pytest.approx(second, rel=1e-12)
        assert not math.isclose(last, second, rel_tol=1e-6)


def test_the_cpu_overhead_is_paid_once_per_batch_on_the_first_stage():
    efficiency = Efficiency(step_overhead_s=0.05, per_request_overhead_s=0.0)
    _, _, piped = _models("llama-3.1-8b", "h100", 2, 1, efficiency)
    _, _, bare = _models("llama-3.1-8b", "h100", 2, 1, Efficiency(step_overhead_s=0.0, per_request_overhead_s=0.0))
    cost, without = piped.split_step_cost([], [(512, 0)]), bare.split_step_cost([], [(512, 0)])
    assert cost.stage_compute_s[0] == pytest.approx(without.stage_compute_s[0] + 0.05, rel=1e-12)
    assert cost.stage_compute_s[1] == pytest.approx(without.stage_compute_s[1], rel=1e-12)


def test_one_stage_prices_as_before():
    planned, whole, one = _models("llama-3.1-8b", "h100", 1, 1, Efficiency())
    assert type(one) is CostModel
    cost = one.split_step_cost([1000, 2000], [(512, 100)])
    assert cost.stage_s() == [cost.total_s] and cost.slowest_stage_s == cost.total_s
    assert cost.total_s == whole.split_step_cost([1000, 2000], [(512, 100)]).total_s
