"""``kvtwin validate``: are the simulator's predictions true on a device?

Four checks, each a verdict and rows of ``validation.parquet`` (``VALIDATION_COLUMNS``):

1. ``prefix_hits_are_real`` — the workload runs twice on the device, with prefix caching
   on and off (everything recomputed). Every request's logits at every generated
   position must agree within the dtype's tolerance; a mismatch names the request, the
   step, and (from the block audit) the group and block that went wrong.
2. ``predicted_hits_are_executed`` — the hit tokens per request that the replay predicts
   on the cost-model clock, against those the executor reused on the measured clock.
   Batches (and so hits) may differ where the clocks differ, so the verdict is taken on
   the simulator driven by the executor's own measured step times: it must reproduce
   every request's hits and every preemption (same step, same request) exactly. The
   cost-model clock's hit rate and its differing requests are reported beside it.
3. ``memory`` — on a GPU: the plan applied to the device's real memory, the weights (real
   size) and the KV pool at the planned ``num_blocks`` allocated, a profiling step at
   ``max_num_batched_tokens``; predicted against measured peak memory (``memory.py``).
   Skipped on a CPU.
4. ``step_latency`` — measured against predicted step seconds by batch kind; the cost
   model's efficiency factors fitted by least squares on the first half of the trace
   (``calibration.toml``, which ``kvtwin replay`` accepts); the calibrated simulator on the
   held-out second half against the executor there: TTFT, TPOT and E2E errors. The goal
   (median E2E and TPOT error under 5%; TPOT left out when no held-out request has one) is
   judged on a GPU; on a CPU the scaled model's
   timings say nothing about a GPU, so the numbers are reported without a verdict.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from kvtwin.executor.device_executor import Faults
from kvtwin.executor.device_replay import ExecutorOptions, ExecutorRun, run_executor, torch_dtype
# Re-exported: the command and the tests read the checks' names and columns from here.
from kvtwin.executor.verdicts import CHECKS, VALIDATION_COLUMNS, Validation, Verdict  # noqa: F401
from kvtwin.sim.calibration.fit.steps_device import MeasuredOn, device_warning
from kvtwin.sim.core.engine import Execution, ModelExecutor
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.planner.plan import Plan, plan as make_plan
from kvtwin.sim.calibration.fit.step_model import (STEP_TERM_COLUMNS, StepSample, ape_by_kind, batch_kind, calibration_text,
                                           fit_efficiency, step_terms)
from kvtwin.sim.calibration.efficiency import SCALAR_EFFICIENCY_FIELDS, Efficiency
from kvtwin.sim.replay.run import CostModelExecutor, RecordedClockExecutor, plan_cost_model, run_with_executor
from kvtwin.sim.scenario.resolve import ResolvedScenario
from kvtwin.traces import schema as col

# Largest |difference| / largest |logit| two runs of the same tokens may show.
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
E2E_TPOT_GOAL = 0.05



class PreemptionLog:
    """Wraps a simulator's executor and notes each preemption as (executed steps so far,
    request), as ``DeviceExecutor`` records them in ``ExecutorState.preemptions``."""

    def __init__(self, inner: ModelExecutor):
        self.inner = inner
        self.num_steps = 0
        self.preemptions: list[tuple[int, str]] = []

    def execute(self, output: SchedulerOutput) -> Execution:
        self.preemptions += [(self.num_steps, rid) for rid in output.preempted]
        if output.num_scheduled_tokens:
            self.num_steps += 1
        return self.inner.execute(output)


@dataclass(frozen=True)
class ValidateOptions:
    executor: ExecutorOptions = ExecutorOptions()
    checks: tuple[str, ...] = CHECKS
    holdout_fraction: float = 0.5


Progress = Callable[[str], None]

# What ``validate`` tells ``progress`` as each stage starts: a stage is one check's work,
# or the executor run that checks 1 and 2 share.
STAGE_ON = "executor, prefix caching on"
STAGE_OFF = "executor, prefix caching off"
STAGE_PREDICTED = "simulator on the cost-model and measured clocks"
STAGE_MEMORY = "memory and the profiling step"
STAGE_LATENCY = "step latency and calibration"


def stages(options: ValidateOptions) -> list[str]:
    """The stages ``validate`` will report to ``progress``, in order."""
    checks = options.checks
    out = [STAGE_ON] if "prefix_hits_are_real" in checks or "predicted_hits_are_executed" in checks else []
    out += [STAGE_OFF] if "prefix_hits_are_real" in checks else []
    out += [STAGE_PREDICTED] if "predicted_hits_are_executed" in checks else []
    out += [STAGE_MEMORY] if "memory" in checks and options.executor.device == "cuda" else []
    return out + ([STAGE_LATENCY] if "step_latency" in checks else [])


def validate(resolved: ResolvedScenario, trace: pa.Table, options: ValidateOptions = ValidateOptions(), *,
             progress: Progress = lambda message: None) -> Validation:
    plan = resolved.plan()
    plan.require_fits()
    out = Validation()
    run_on = None
    if "prefix_hits_are_real" in options.checks or "predicted_hits_are_executed" in options.checks:
        progress(STAGE_ON)
        run_on = run_executor(plan, trace, options.executor, efficiency=resolved.efficiency)
        out.executor_steps = executor_steps_table(run_on, options.executor)
    if "prefix_hits_are_real" in options.checks:
        release_device_memory()
        progress(STAGE_OFF)
        plan_off = prefix_caching_off(resolved)
        # The reference recomputes everything and runs unbroken (test faults break the run under test).
        reference = dataclasses.replace(options.executor, faults=Faults())
        run_off = run_executor(plan_off, trace, reference, efficiency=resolved.efficiency)
        check_prefix_hits(out, run_on, run_off, torch_dtype(plan, options.executor))
    if "predicted_hits_are_executed" in options.checks:
        progress(STAGE_PREDICTED)
        check_predicted_hits(out, plan, trace, resolved.efficiency, run_on)
    if "memory" in options.checks:
        if options.executor.device != "cuda":
            out.verdicts.append(Verdict("memory", "skipped", "memory: skipped (needs --device cuda: a CPU has no "
                                        "device memory to compare)"))
            out.row("memory", "all", "skipped", detail="needs --device cuda")
        else:
            from kvtwin.executor.memory import check_memory

            release_device_memory()
            progress(STAGE_MEMORY)
            check_memory(out, resolved, options.executor)
    if "step_latency" in options.checks:
        release_device_memory()
        progress(STAGE_LATENCY)
        check_step_latency(out, plan, trace, resolved.efficiency, options)
    return out


def release_device_memory() -> None:
    """Give the previous run's pool back before the next allocates one of the same size."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prefix_caching_off(resolved: ResolvedScenario) -> Plan:
    """The scenario's plan with prefix caching off (recurrent states then keep one block)."""
    engine = resolved.engine
    mode = None if engine.mamba_cache_mode == "align" else engine.mamba_cache_mode
    engine = dataclasses.replace(engine, enable_prefix_caching=False, mamba_cache_mode=mode)
    return make_plan(resolved.model, resolved.gpu, engine)


# --------------------------------------------------------------------------------------
# 1. prefix hits are real
# --------------------------------------------------------------------------------------


def check_prefix_hits(out: Validation, run_on: ExecutorRun, run_off: ExecutorRun, dtype: torch.dtype) -> None:
    name = "prefix_hits_are_real"
    tolerance = LOGIT_TOLERANCE[dtype]
    on, off = run_on.state.logits, run_off.state.logits
    hits = dict(zip(run_on.result.requests.column("request_id").to_pylist(),
                    run_on.result.requests.column("prefix_cache_hits").to_pylist()))
    by_request: dict[str, list[int]] = {}
    for rid, index in on.keys() | off.keys():
        by_request.setdefault(rid, []).append(index)
    mismatches = []
    not_compared = []
    worst = 0.0
    for rid in sorted(by_request):
        indices = sorted(by_request[rid])
        missing = [i for i in indices if (rid, i) not in on or (rid, i) not in off]
        if missing:
            # One run never sampled there (a request the other layout rejected, or a time limit).
            side = "on" if (rid, missing[0]) not in on else "off"
            not_compared.append(rid)
            out.row(name, rid, "max_relative_logit_error", 0.0, None, None, None,
                    f"{len(missing)} of {len(indices)} positions not sampled with prefix caching {side}")
            continue
        first_bad, error = None, 0.0
        for index in indices:
            a, b = on[(rid, index)], off[(rid, index)]
            e = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
            error = max(error, e)
            if e > tolerance and first_bad is None:
                first_bad = index
        worst = max(worst, error)
        passed = first_bad is None
        detail = ""
        if not passed:
            step = run_on.state.sampled_at.get((rid, first_bad))
            finding = run_on.state.first_finding(rid) or run_off.state.first_finding(rid)
            detail = (f"output {first_bad} at step {step}"
                      + (f"; block audit: {finding}" if finding else "; the block audit found no block"))
            mismatches.append((rid, detail))
        out.row(name, rid, "max_relative_logit_error", 0.0, error, error, passed,
                detail or f"{len(indices)} positions, {hits.get(rid, 0)} hit tokens")
    positions = len(on.keys() | off.keys())
    hit_requests = sum(1 for h in hits.values() if h)
    unmatched = f"; {len(not_compared)} requests ran in only one of the runs" if not_compared else ""
    if mismatches:
        rid, detail = mismatches[0]
        out.verdicts.append(Verdict(name, "fail", f"prefix hits: FAIL — {len(mismatches)} of {len(by_request)} "
                                    f"requests differ from recomputing; first: request {rid}, {detail}{unmatched}"))
    elif len(not_compared) == len(by_request):
        out.verdicts.append(Verdict(name, "fail", "prefix hits: FAIL — no request ran in both runs"))
    else:
        out.verdicts.append(Verdict(name, "pass", f"prefix hits: pass — {positions:,} generated positions of "
                                    f"{len(by_request)} requests ({hit_requests} with hits) agree with recomputing "
                                    f"(worst relative logit error {worst:.1e}, tolerance {tolerance:.0e}){unmatched}"))


# --------------------------------------------------------------------------------------
# 2. predicted hits are executed hits
# --------------------------------------------------------------------------------------


def _per_request(table: pa.Table, column: str) -> dict[str, int]:
    return dict(zip(table.column("request_id").to_pylist(), table.column(column).to_pylist()))


def _hit_rate(table: pa.Table) -> float:
    queries = pc.sum(table.column("prefix_cache_queries")).as_py() or 0
    return (pc.sum(table.column("prefix_cache_hits")).as_py() or 0) / queries if queries else math.nan


def check_predicted_hits(out: Validation, plan: Plan, trace: pa.Table, efficiency: Efficiency,
                         run: ExecutorRun) -> None:
    name = "predicted_hits_are_executed"
    executor_preemptions = run.state.preemptions
    cost_model = plan_cost_model(plan, efficiency)
    predicted = run_with_executor(plan, trace, [CostModelExecutor(cost_model)])
    durations = [record.device_s for record in run.state.steps]
    replayed_log = PreemptionLog(RecordedClockExecutor(cost_model, durations))
    replayed = run_with_executor(plan, trace, [replayed_log])
    executed_hits = _per_request(run.result.requests, "prefix_cache_hits")
    measured_hits = _per_request(replayed.requests, "prefix_cache_hits")
    cost_hits = _per_request(predicted.requests, "prefix_cache_hits")
    differ_measured = [rid for rid in executed_hits if measured_hits.get(rid) != executed_hits[rid]]
    differ_cost = [rid for rid in executed_hits if cost_hits.get(rid) != executed_hits[rid]]
    for rid, hits in executed_hits.items():
        out.row(name, rid, "prefix_cache_hits", measured_hits.get(rid), hits,
                hits - measured_hits.get(rid, 0), rid not in differ_measured, "simulator on the measured clock")
        # Informational: where the cost model's step times change the batches, hits may differ.
        out.row(name, rid, "prefix_cache_hits: cost-model clock", cost_hits.get(rid), hits,
                hits - cost_hits.get(rid, 0), None, "kvtwin replay's prediction")
    same_preemptions = replayed_log.preemptions == executor_preemptions
    out.row(name, "all", "num_preemptions", len(replayed_log.preemptions), len(executor_preemptions),
            len(executor_preemptions) - len(replayed_log.preemptions), same_preemptions,
            "same steps and requests" if same_preemptions else _first_difference(replayed_log.preemptions,
                                                                                  executor_preemptions))
    rates = {"executor (measured clock)": _hit_rate(run.result.requests),
             "simulator (measured clock)": _hit_rate(replayed.requests),
             "simulator (cost-model clock)": _hit_rate(predicted.requests)}
    for label, rate in rates.items():
        out.row(name, "all", f"hit_rate: {label}", None, rate, None, None)
    out.row(name, "all", "requests_differing: cost-model clock", 0, len(differ_cost), len(differ_cost), None,
            "batches differ where the two clocks differ" if differ_cost else "")
    passed = not differ_measured and same_preemptions
    cost_note = (f"cost-model clock: {len(differ_cost)} of {len(executed_hits)} requests differ, hit rate "
                 f"{rates['simulator (cost-model clock)']:.1%} vs {rates['executor (measured clock)']:.1%}")
    if passed:
        line = (f"predicted hits: pass — all {len(executed_hits)} requests' hits and {len(executor_preemptions)} "
                f"preemptions as simulated on the measured clock ({cost_note})")
    else:
        what = []
        if differ_measured:
            rid = differ_measured[0]
            what.append(f"{len(differ_measured)} requests' hits differ (first {rid}: simulated "
                        f"{measured_hits.get(rid)}, executed {executed_hits[rid]})")
        if not same_preemptions:
            what.append("preemptions differ: " + _first_difference(replayed_log.preemptions, executor_preemptions))
        line = f"predicted hits: FAIL — on the measured clock {'; '.join(what)} ({cost_note})"
    out.verdicts.append(Verdict(name, "pass" if passed else "fail", line))


def _first_difference(expected: list, observed: list) -> str:
    for i, (a, b) in enumerate(zip(expected, observed)):
        if a != b:
            return f"preemption {i}: simulated (step, request) {a}, executed {b}"
    return f"{len(expected)} simulated, {len(observed)} executed"


# --------------------------------------------------------------------------------------
# 4. step latency and calibration
# --------------------------------------------------------------------------------------


def measured_on(options: ExecutorOptions) -> MeasuredOn:
    """The device the executor times its steps on, as steps.parquet records it."""
    name = torch.cuda.get_device_name() if options.device == "cuda" else options.device
    return MeasuredOn(options.device, name, options.is_scaled)


def executor_steps_table(run: ExecutorRun, options: ExecutorOptions) -> pa.Table:
    """One row per executed batch: its shape, measured and predicted seconds; the schema
    metadata says which device measured them (``kvtwin calibrate --steps`` checks it)."""
    steps = run.state.steps
    table = pa.table({
        "step": pa.array([s.step for s in steps], pa.int64()),
        "num_requests": pa.array([s.num_requests for s in steps], pa.int32()),
        "decode_tokens": pa.array([s.num_decode_tokens for s in steps], pa.int64()),
        "prefill_tokens": pa.array([s.num_prefill_tokens for s in steps], pa.int64()),
        "batch_kind": pa.array([batch_kind(s.num_decode_tokens, s.num_prefill_tokens) for s in steps], pa.string()),
        "measured_s": pa.array([s.device_s for s in steps], pa.float64()),
        "host_s": pa.array([s.host_s for s in steps], pa.float64()),
        "predicted_s": pa.array([s.predicted.total_s if s.predicted else math.nan for s in steps], pa.float64()),
        # The cost model's raw terms of each batch: what `kvtwin calibrate --steps` refits from.
        **{column: pa.array([step_terms(s.predicted)[column] for s in steps], pa.float64())
           for column in STEP_TERM_COLUMNS.values()},
    })
    return table.replace_schema_metadata(measured_on(options).metadata())


def split_trace(trace: pa.Table, holdout_fraction: float) -> tuple[pa.Table, pa.Table]:
    """The first part of the trace by arrival (fitting) and the rest (held out), the held
    out part shifted to start at time 0."""
    order = pc.sort_indices(trace, [(col.ARRIVAL_TIME_S, "ascending")])
    trace = trace.take(order)
    cut = max(1, min(trace.num_rows - 1, round(trace.num_rows * (1 - holdout_fraction))))
    train, held = trace.slice(0, cut), trace.slice(cut)
    start = held.column(col.ARRIVAL_TIME_S)[0].as_py()
    shifted = pc.subtract(held.column(col.ARRIVAL_TIME_S), pa.scalar(start, pa.float64()))
    held = held.set_column(held.schema.get_field_index(col.ARRIVAL_TIME_S), col.ARRIVAL_TIME_S, shifted)
    return train, held


def _samples(run: ExecutorRun) -> list[StepSample]:
    return [StepSample(s.predicted, s.device_s, batch_kind(s.num_decode_tokens, s.num_prefill_tokens))
            for s in run.state.steps if s.predicted is not None and s.device_s > 0]


def check_step_latency(out: Validation, plan: Plan, trace: pa.Table, efficiency: Efficiency,
                       options: ValidateOptions) -> None:
    name = "step_latency"
    on_gpu = options.executor.device == "cuda"
    if trace.num_rows < 2:
        out.verdicts.append(Verdict(name, "skipped", "step latency: skipped (needs at least 2 requests to hold "
                                    "one out)"))
        return
    train, held = split_trace(trace, options.holdout_fraction)
    fitting = run_executor(plan, train, options.executor, efficiency=efficiency)
    samples = _samples(fitting)
    gpu = plan.gpu
    peaks = dict(flops_per_s=gpu.bf16_flops, bytes_per_s=gpu.hbm_bandwidth_bytes_per_s,
                 async_scheduling=plan.engine.async_scheduling)
    kinds = [s.kind for s in samples]
    measured = [s.measured_s for s in samples]
    before = [s.cost.total_s for s in samples]  # the cost model with the scenario's efficiency
    fit = fit_efficiency(samples, base=efficiency, **peaks)
    after = [fit.predict_s(s.cost) for s in samples]
    errors_by_kind = {}
    for label, predicted in (("before calibration", before), ("after calibration", after)):
        errors_by_kind[label] = ape_by_kind(predicted, measured, kinds)
        for entry in errors_by_kind[label]:
            out.row(name, entry["kind"], f"step_ape_median: {label}", None, entry["median_ape"], entry["median_ape"],
                    None, f"{entry['count']} steps")
            out.row(name, entry["kind"], f"step_ape_p90: {label}", None, entry["p90_ape"], entry["p90_ape"], None,
                    f"{entry['count']} steps")
    for factor in SCALAR_EFFICIENCY_FIELDS:
        out.row(name, "calibration", factor, getattr(efficiency, factor), getattr(fit.efficiency, factor), None, None,
                "fitted" if factor in fit.identified else "kept")
    comment = (f"kvtwin validate: {len(samples)} steps of {train.num_rows} requests on {options.executor.device} "
               f"({'scaled model' if options.executor.is_scaled else 'real size'})")
    # The held-out part: the executor's truth and the calibrated simulator's prediction.
    release_device_memory()
    truth = run_executor(plan, held, options.executor, efficiency=fit.efficiency).result.requests
    simulated = run_with_executor(plan, held, [CostModelExecutor(plan_cost_model(plan, fit.efficiency))]).requests
    errors = {}
    held_out_p90 = {}
    for metric in ("ttft_s", "tpot_s", "e2el_s"):
        t = np.asarray(truth.column(metric).to_numpy(zero_copy_only=False), dtype=float)
        s = np.asarray(simulated.column(metric).to_numpy(zero_copy_only=False), dtype=float)
        ok = np.isfinite(t) & np.isfinite(s) & (t > 0)
        ape = np.abs(s[ok] - t[ok]) / t[ok]
        median = float(np.median(ape)) if ape.size else math.nan
        errors[metric] = median
        held_out_p90[metric.removesuffix("_s").replace("e2el", "e2e")] = \
            float(np.percentile(ape, 90)) if ape.size else math.nan
        goal = E2E_TPOT_GOAL if metric in ("tpot_s", "e2el_s") else None
        passed = (median < goal) if (on_gpu and goal is not None and ape.size) else None
        out.row(name, "held_out", f"{metric}_median_ape", float(np.nanmean(s[ok])) if ape.size else None,
                float(np.nanmean(t[ok])) if ape.size else None, median, passed,
                f"{int(ok.sum())} requests; expected/observed are the simulated/executed means")
    # The file carries the held-out error, so that a replay on it shows its band, and says
    # when its device is not the scenario's GPU (a CPU run's factors are the CPU's).
    out.calibration_toml = calibration_text(fit, comment_lines=[comment], errors=held_out_p90,
                                            label=f"kvtwin validate on {options.executor.device}",
                                            warning=device_warning(measured_on(options.executor), plan.gpu))
    summary = (f"held-out {held.num_rows} requests, calibrated simulator vs executor: median error TTFT "
               f"{errors['ttft_s']:.1%}, TPOT {errors['tpot_s']:.1%}, E2E {errors['e2el_s']:.1%}; step error "
               f"median {errors_by_kind['before calibration'][0]['median_ape']:.0%} before, {fit.median_ape:.1%} after "
               "calibration")
    if not on_gpu:
        out.verdicts.append(Verdict(name, "info", f"step latency: info (CPU: no goal) — {summary}"))
        return
    # A metric no held-out request measures (TPOT when every output is one token) is not
    # judged, as its row is not; max() would let its NaN decide, or not, by argument order.
    judged = [errors[metric] for metric in ("tpot_s", "e2el_s") if not math.isnan(errors[metric])]
    status = "pass" if judged and max(judged) < E2E_TPOT_GOAL else "fail"
    out.verdicts.append(Verdict(name, status, f"step latency: {status.upper() if status == 'fail' else status} — "
                                f"{summary} (goal: TPOT and E2E under {E2E_TPOT_GOAL:.0%})"))

