"""`kvtwin validate`'s verdicts at the edge of their tolerances, on CPU.

The checks' inputs (the executor's runs, the simulator's replays) are stood in for by
small objects made here, so each check sees a discrepancy chosen in the test: just inside
and just outside its tolerance, and placed so that a relative error taken against the
wrong quantity (the prediction instead of the measurement, the run under test instead of
the recomputed reference) lands on the other side. The tolerances are the documented
ones, written here: logits within 1e-4 (fp32) and 5e-2 (bf16) of the largest reference
logit; held-out median TPOT and E2E error under 5% on a GPU. Every expected figure is
recomputed here with NumPy from the numbers the test chose.
"""

from __future__ import annotations

import math
import tomllib
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from kvtwin.executor import validate
from kvtwin.executor.device_executor import ExecutorState
from kvtwin.executor.device_replay import ExecutorOptions
from kvtwin.executor.validate import ValidateOptions, Validation, check_prefix_hits, check_step_latency
from kvtwin.sim.calibration.fit.steps_device import MeasuredOn
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.traces import schema as col

# -- check 1: prefix hits are real ----------------------------------------------------------


def run(logits: dict, hits: dict, sampled_at: dict | None = None):
    state = ExecutorState(logits=logits, sampled_at=sampled_at or {})
    requests = pa.table({"request_id": list(hits), "prefix_cache_hits": list(hits.values())})
    return SimpleNamespace(state=state, result=SimpleNamespace(requests=requests))


def reference_logits(seed: int):
    return torch.tensor(np.random.default_rng(seed).normal(size=16), dtype=torch.float32)


def prefix_runs(relative_error: float, bad_indices=(2,)):
    """Request r0 agrees exactly; r1's output ``i`` in ``bad_indices`` has its largest logit
    off by ``relative_error`` x that logit's size (the run under test larger: its own largest
    logit is then the larger, so a denominator taken from it shrinks the error)."""
    off, on = {}, {}
    for rid in ("r0", "r1"):
        for i in range(4):
            ref = reference_logits(10 * int(rid[1]) + i)
            off[(rid, i)] = ref
            changed = ref.clone()
            if rid == "r1" and i in bad_indices:
                k = int(ref.abs().argmax())
                changed[k] = ref[k] + math.copysign(relative_error * float(ref.abs().max()), float(ref[k]))
            on[(rid, i)] = changed
    sampled = {("r1", i): 5 + i for i in range(4)}
    return run(on, {"r0": 16, "r1": 0}, sampled), run(off, {"r0": 0, "r1": 0})


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("side", [0.98, 1.02])
def test_logits_just_inside_and_just_outside_the_tolerance(dtype, tolerance, side):
    on, off = prefix_runs(side * tolerance)
    out = Validation()
    check_prefix_hits(out, on, off, dtype)
    rows = {r["item"]: r for r in out.rows}
    # Relative to the reference (prefix caching off: everything recomputed).
    assert rows["r1"]["observed"] == pytest.approx(side * tolerance, rel=1e-3)  # float32 logits
    assert rows["r0"]["observed"] == 0.0 and rows["r0"]["passed"] is True
    assert rows["r1"]["passed"] is (side < 1)
    verdict = out.verdicts[-1]
    assert verdict.status == ("pass" if side < 1 else "fail")
    if side > 1:
        assert "1 of 2 requests differ" in verdict.line and "request r1, output 2 at step 7" in verdict.line
    else:
        assert f"worst relative logit error {side * tolerance:.1e}" in verdict.line


def test_the_first_mismatching_output_is_named():
    on, off = prefix_runs(0.2, bad_indices=(1, 3))
    out = Validation()
    check_prefix_hits(out, on, off, torch.float32)
    assert "request r1, output 1 at step 6" in out.verdicts[-1].line


# -- check 4: step latency ------------------------------------------------------------------

P, BW = 1e15, 3e12


def step_cost(decode: int, prefill: int, predicted_s: float) -> StepCost:
    tokens, requests = decode + prefill, decode + (1 if prefill else 0)
    return StepCost(predicted_s, 0.0, 0.0, 0.0, 0.0, 0.0, 16e9, 131072.0 * 2000 * requests, 0.0, 0.0, requests,
                    tokens, 2e9 * tokens, 1e9 * requests, 1e6 * tokens, 3e-4, 4e6 * prefill * 20, 0.0)


STEPS = [(d, p) for d in (1, 8, 64, 200) for p in (0, 512, 4096)]
# What the executor "measured" for each step, and the scenario's prediction: 25% high, so
# its error is 0.25 of the measurement (0.2 of the prediction).
MEASURED_S = [0.004 + 2e-5 * d + 3e-6 * p for d, p in STEPS]


def steps_run():
    records = [SimpleNamespace(predicted=step_cost(d, p, 1.25 * m), device_s=m, num_decode_tokens=d,
                               num_prefill_tokens=p) for (d, p), m in zip(STEPS, MEASURED_S)]
    return SimpleNamespace(state=SimpleNamespace(steps=records))


# Held out: 5 requests; the simulator's TTFT, TPOT and E2E are the executor's times (1 + e).
TRUTH = {"ttft_s": [0.2, 0.35, 0.5, 0.9, 0.12], "tpot_s": [0.02, 0.025, 0.03, 0.04, 0.05],
         "e2el_s": [2.0, 3.0, 4.0, 5.0, 6.0]}


def held_out_errors(middle: float) -> np.ndarray:
    """Five relative errors whose median magnitude is ``middle`` (the others well apart)."""
    return np.array([0.01, -0.02, middle, 0.2, -0.3])


def latency_check(monkeypatch, errors: dict[str, np.ndarray], device: str = "cuda",
                  truth: dict | None = None) -> tuple[Validation, dict]:
    truth = {k: np.asarray(v, float) for k, v in (truth or TRUTH).items()}
    simulated = {k: truth[k] * (1 + errors[k]) for k in truth}
    fitting = steps_run()
    held = SimpleNamespace(result=SimpleNamespace(requests=pa.table(truth)))
    runs = iter([fitting, held])
    monkeypatch.setattr(validate, "run_executor", lambda plan, trace, options, efficiency: next(runs))
    monkeypatch.setattr(validate, "plan_cost_model", lambda plan, efficiency: None)
    monkeypatch.setattr(validate, "CostModelExecutor", lambda cost_model: None)
    monkeypatch.setattr(validate, "run_with_executor",
                        lambda plan, trace, executors: SimpleNamespace(requests=pa.table(simulated)))
    monkeypatch.setattr(validate, "measured_on", lambda options: MeasuredOn(device, "NVIDIA H100 80GB HBM3", False))
    plan = SimpleNamespace(gpu=get_gpu("h100"), engine=SimpleNamespace(async_scheduling=True))
    trace = col.build_table({col.REQUEST_ID: [f"r{i}" for i in range(10)],
                             col.ARRIVAL_TIME_S: [float(i) for i in range(10)], col.PROMPT_TOKENS: [100] * 10,
                             col.OUTPUT_TOKENS: [10] * 10}, col.TraceMeta(source_format="test"))
    out = Validation()
    check_step_latency(out, plan, trace, Efficiency(), ValidateOptions(executor=ExecutorOptions(device=device)))
    return out, simulated


def held_row(out: Validation, metric: str) -> dict:
    return next(r for r in out.rows if r["item"] == "held_out" and r["metric"] == f"{metric}_median_ape")


@pytest.mark.parametrize("kind", ["tpot_s", "e2el_s"])
@pytest.mark.parametrize("middle, passes", [(0.0497, True), (0.0503, False), (-0.0497, True), (-0.0503, False)])
def test_held_out_median_error_just_inside_and_outside_the_goal(monkeypatch, kind, middle, passes):
    errors = {k: held_out_errors(0.01) for k in TRUTH}
    errors[kind] = held_out_errors(middle)
    out, simulated = latency_check(monkeypatch, errors)
    truth = np.asarray(TRUTH[kind])
    ape = np.abs(simulated[kind] - truth) / truth  # relative to the measurement: the executor's
    row = held_row(out, kind)
    assert row["error"] == pytest.approx(float(np.median(ape)), rel=1e-12)
    assert row["error"] == pytest.approx(abs(middle), rel=1e-9)
    assert row["expected"] == pytest.approx(float(np.mean(simulated[kind])))
    assert row["observed"] == pytest.approx(float(np.mean(truth)))
    assert row["passed"] is passes
    verdict = out.verdicts[-1]
    assert verdict.status == ("pass" if passes else "fail")
    assert f"{'TPOT' if kind == 'tpot_s' else 'E2E'} {abs(middle):.1%}" in verdict.line
    # The file's [error] is the p90 of each kind's held-out error, not the median.
    written = tomllib.loads(out.calibration_toml)["error"]
    for metric, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("e2el_s", "e2e")):
        t = np.asarray(TRUTH[metric])
        assert written[name] == pytest.approx(float(np.percentile(np.abs(simulated[metric] - t) / t, 90)))


def test_a_median_exactly_at_the_goal_is_not_under_it(monkeypatch):
    # 21 against 20 is exactly 1/20: the same double as 0.05.
    truth = {**TRUTH, "e2el_s": [20.0] * 5}
    errors = {k: held_out_errors(0.01) for k in TRUTH}
    errors["e2el_s"] = np.array([0.05, 0.05, 0.05, 0.0, 0.0])
    out, _ = latency_check(monkeypatch, errors, truth=truth)
    row = held_row(out, "e2el_s")
    assert row["error"] == 0.05 and row["passed"] is False
    assert out.verdicts[-1].status == "fail"


def test_ttft_has_no_goal_and_a_cpu_run_no_verdict(monkeypatch):
    errors = {k: held_out_errors(0.01) for k in TRUTH}
    errors["ttft_s"] = held_out_errors(0.4)
    out, _ = latency_check(monkeypatch, errors)
    assert held_row(out, "ttft_s")["passed"] is None and out.verdicts[-1].status == "pass"
    errors["tpot_s"] = held_out_errors(0.3)
    out, _ = latency_check(monkeypatch, errors, device="cpu")
    assert out.verdicts[-1].status == "info" and held_row(out, "tpot_s")["passed"] is None


def test_step_errors_are_relative_to_the_measured_steps(monkeypatch):
    out, _ = latency_check(monkeypatch, {k: held_out_errors(0.01) for k in TRUTH})
    before = {r["item"]: r for r in out.rows if r["metric"] == "step_ape_median: before calibration"}
    # Every prediction is 1.25 x the measurement: 25% of the measurement, for every kind.
    assert before["all"]["error"] == pytest.approx(0.25, rel=1e-12)
    kinds = [("decode-only" if p == 0 else "prefill-heavy" if p >= 0.9 * (d + p) else "mixed") for d, p in STEPS]
    for kind in set(kinds):
        assert before[kind]["error"] == pytest.approx(0.25, rel=1e-12)
        assert before[kind]["detail"] == f"{kinds.count(kind)} steps"
    p90 = {r["item"]: r for r in out.rows if r["metric"] == "step_ape_p90: before calibration"}
    assert p90["all"]["error"] == pytest.approx(0.25, rel=1e-12)


@pytest.mark.parametrize("e2e_error, status", [(0.01, "pass"), (0.08, "fail")])
def test_single_token_outputs_leave_tpot_unjudged_and_e2e_decides(monkeypatch, e2e_error, status):
    # Every held-out request generated one token: no TPOT on either side. Its row has no
    # verdict, so the check's verdict is E2E's, whichever way E2E goes.
    truth = {**TRUTH, "tpot_s": [math.nan] * 5}
    errors = {k: held_out_errors(0.01) for k in TRUTH}
    errors["e2el_s"] = held_out_errors(e2e_error)
    out, _ = latency_check(monkeypatch, errors, truth=truth)
    assert held_row(out, "tpot_s")["passed"] is None
    assert held_row(out, "e2el_s")["passed"] is (status == "pass")
    assert out.verdicts[-1].status == status


# -- check 2: predicted hits are executed hits -----------------------------------------------
# The tolerance is none: one hit token or one preemption apart fails.

EXECUTED = {"r0": 32, "r1": 0, "r2": 16}
QUERIES = {"r0": 64, "r1": 40, "r2": 48}


def hits_table(hits: dict) -> pa.Table:
    return pa.table({"request_id": list(hits), "prefix_cache_hits": list(hits.values()),
                     "prefix_cache_queries": [QUERIES[r] for r in hits]})


def hits_check(monkeypatch, measured: dict, cost: dict, measured_preemptions, executed_preemptions=((3, "r1"),)):
    run = SimpleNamespace(state=SimpleNamespace(preemptions=list(executed_preemptions),
                                                steps=[SimpleNamespace(device_s=0.01)]),
                          result=SimpleNamespace(requests=hits_table(EXECUTED)))
    monkeypatch.setattr(validate, "plan_cost_model", lambda plan, efficiency: None)
    monkeypatch.setattr(validate, "CostModelExecutor", lambda cost_model: "cost-model clock")
    monkeypatch.setattr(validate, "RecordedClockExecutor", lambda cost_model, durations: "measured clock")

    def replay(plan, trace, executors):
        (executor,) = executors
        if isinstance(executor, validate.PreemptionLog):  # the simulator on the measured clock
            executor.preemptions = list(measured_preemptions)
            return SimpleNamespace(requests=hits_table(measured))
        return SimpleNamespace(requests=hits_table(cost))

    monkeypatch.setattr(validate, "run_with_executor", replay)
    out = Validation()
    validate.check_predicted_hits(out, None, None, Efficiency(), run)
    return out


def test_hits_and_preemptions_as_executed_pass(monkeypatch):
    cost = {"r0": 16, "r1": 0, "r2": 16}  # the cost-model clock's batches differ: informational
    out = hits_check(monkeypatch, dict(EXECUTED), cost, [(3, "r1")])
    assert out.verdicts[-1].status == "pass"
    rows = {(r["item"], r["metric"]): r for r in out.rows}
    assert rows[("r0", "prefix_cache_hits")]["passed"] is True
    assert rows[("r0", "prefix_cache_hits: cost-model clock")]["error"] == 32 - 16
    # Hit rates: hit tokens over queried tokens of all requests.
    assert rows[("all", "hit_rate: executor (measured clock)")]["observed"] == pytest.approx(48 / 152)
    assert rows[("all", "hit_rate: simulator (cost-model clock)")]["observed"] == pytest.approx(32 / 152)
    assert rows[("all", "requests_differing: cost-model clock")]["observed"] == 1
    assert "cost-model clock: 1 of 3 requests differ, hit rate 21.1% vs 31.6%" in out.verdicts[-1].line


def test_one_hit_token_apart_fails_and_is_named(monkeypatch):
    measured = {**EXECUTED, "r2": 15}
    out = hits_check(monkeypatch, measured, dict(EXECUTED), [(3, "r1")])
    assert out.verdicts[-1].status == "fail"
    assert "1 requests' hits differ (first r2: simulated 15, executed 16)" in out.verdicts[-1].line
    row = next(r for r in out.rows if r["item"] == "r2" and r["metric"] == "prefix_cache_hits")
    # observed − expected: the executor's hits less the simulator's.
    assert row["expected"] == 15 and row["observed"] == 16 and row["error"] == 1 and row["passed"] is False


def test_a_preemption_one_step_apart_fails(monkeypatch):
    out = hits_check(monkeypatch, dict(EXECUTED), dict(EXECUTED), [(4, "r1")])
    assert out.verdicts[-1].status == "fail"
    assert "preemption 0: simulated (step, request) (4, 'r1'), executed (3, 'r1')" in out.verdicts[-1].line
    row = next(r for r in out.rows if r["metric"] == "num_preemptions")
    assert row["passed"] is False and row["error"] == 0
