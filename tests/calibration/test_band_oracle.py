"""The error band a calibration puts on a replay's p99s, and the pessimistic clock.

The band of a figure is recomputed here as value x (1 -/+ error), the error taken from the
most specific held-out kind the calibration states for that figure (TTFT: ttft, else
prefill_step; TPOT and ITL: tpot, else decode_step; E2E: e2e, else tpot, else
decode_step). The pessimistic clock must make every step exactly (1 + error) times as
long: checked on the cost model itself, step by step, for decode, prefill, mixed, TP 2
with an all-reduce curve and a draft head, synchronous and asynchronous.
"""

import math

import pytest

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.calibration.band import band_columns, band_lines, pessimistic, step_error
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.file import Calibration
from kvtwin.sim.calibration.efficiency import AllReduceCurve, Efficiency

EFF = Efficiency(matmul_flops_fraction=0.5, matmul_half_tokens=48.0, attention_flops_fraction=0.4,
                 attention_half_query_tokens=16.0, hbm_bandwidth_fraction=0.75, interconnect_fraction=0.6,
                 allreduce_latency_s=1e-5, layer_fixed_s=2e-6, decode_attention_s_per_head=1e-7,
                 step_gpu_fixed_s=5e-5, step_overhead_s=1e-3, per_request_overhead_s=2e-5, client_overhead_s=0.003,
                 allreduce=(AllReduceCurve(2, (1e3, 1e6, 1e8), (8e-6, 2e-5, 1e-3)),))
ROW = {"p99_ttft_ms": 250.0, "p99_tpot_ms": 20.0, "p99_itl_ms": 30.0, "p99_e2el_ms": 4000.0}


def calibration(errors):
    return Calibration(EFF, "fitted", path="cal.toml", errors=errors)


@pytest.mark.parametrize("errors, expected", [
    ({"ttft": 0.1, "tpot": 0.05, "e2e": 0.2, "prefill_step": 0.5, "decode_step": 0.6},
     {"ttft_ms": 0.1, "tpot_ms": 0.05, "itl_ms": 0.05, "e2el_ms": 0.2}),
    ({"prefill_step": 0.3, "decode_step": 0.07},
     {"ttft_ms": 0.3, "tpot_ms": 0.07, "itl_ms": 0.07, "e2el_ms": 0.07}),
    ({"tpot": 0.04, "decode_step": 0.5}, {"ttft_ms": None, "tpot_ms": 0.04, "itl_ms": 0.04, "e2el_ms": 0.04}),
])
def test_each_p99_gets_the_band_of_its_most_specific_error(errors, expected):
    columns = band_columns(ROW, calibration(errors))
    for figure, error in expected.items():
        value = ROW[f"p99_{figure}"]
        if error is None:
            assert math.isnan(columns[f"p99_{figure}_low"]) and math.isnan(columns[f"error_{figure[:-3]}"])
            continue
        assert columns[f"p99_{figure}_low"] == pytest.approx(value * (1 - error), rel=1e-12)
        assert columns[f"p99_{figure}_high"] == pytest.approx(value * (1 + error), rel=1e-12)
        assert columns[f"error_{figure[:-3]}"] == error
    assert columns["calibration"] == "fitted"


def test_a_band_wider_than_the_value_stops_at_zero_and_prints_in_its_unit():
    row = {**ROW, **band_columns(ROW, calibration({"ttft": 1.5, "tpot": 0.05, "e2e": 0.1}))}
    assert row["p99_ttft_ms_low"] == 0.0 and row["p99_ttft_ms_high"] == pytest.approx(625.0)
    (line,) = band_lines(row, calibration({"ttft": 1.5, "tpot": 0.05, "e2e": 0.1}))
    # 250 ms x (1 ± 1.5); 20 ms x (1 ± 0.05); 4 s x (1 ± 0.1), past a second in seconds.
    assert line == ("clock: fitted; p99 within the held-out error (server-side): TTFT 0.0-625.0 ms (±150%), "
                    "TPOT 19.0-21.0 ms (±5%), E2E 3.60-4.40 s (±10%)")


def test_the_slow_edge_is_the_larger_step_error():
    assert step_error(calibration({"prefill_step": 0.08, "decode_step": 0.12, "e2e": 0.5})) == 0.12
    assert step_error(calibration({"prefill_step": 0.2, "decode_step": 0.12})) == 0.2
    assert step_error(calibration({"e2e": 0.5})) is None


def cost_model(eff, tp=1, async_scheduling=True, draft_head=None):
    p = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(tensor_parallel_size=tp, max_model_len=32768))
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=async_scheduling,
                     efficiency=eff, draft_head=draft_head)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("decodes, prefills", [([3000] * 8, []), ([], [(4096, 0)]), ([100] * 2, []),
                                               ([1500] * 30, [(300, 2000)]), ([20] * 400, [])])
def test_the_pessimistic_clock_slows_every_step_by_the_error(tp, async_scheduling, decodes, prefills):
    error = 0.15
    slow = pessimistic(EFF, error)
    assert slow.client_overhead_s == EFF.client_overhead_s  # outside the step
    assert slow.matmul_half_tokens == EFF.matmul_half_tokens
    head = DraftHead("eagle", 1, 2)
    fast_cost = cost_model(EFF, tp, async_scheduling, head).split_step_cost(decodes, prefills, draft_ends=decodes[:3])
    slow_cost = cost_model(slow, tp, async_scheduling, head).split_step_cost(decodes, prefills, draft_ends=decodes[:3])
    assert slow_cost.total_s == pytest.approx(fast_cost.total_s * (1 + error), rel=1e-12)
    assert slow_cost.communication_s == pytest.approx(fast_cost.communication_s * (1 + error), rel=1e-12)
