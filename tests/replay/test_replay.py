"""The simulated replay: conservation, clocks, counters, caching, determinism, same decisions."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.lockstep.runner import run_case, step_record
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.traces import transforms
from kvtwin.traces.bundled import bundled_path
from kvtwin.traces.load import load_trace

GOLDEN = Path(__file__).parent.parent / "golden" / "cases"


@pytest.fixture(scope="module")
def mooncake_head():
    return transforms.limit(load_trace(bundled_path("mooncake_conversation_trace.jsonl")), 150)


@pytest.fixture(scope="module")
def llama_plan():
    return plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=131072))


@pytest.fixture(scope="module")
def replayed(llama_plan, mooncake_head):
    return run_replay(llama_plan, mooncake_head, slo=SLO(ttft_s=2.0, tpot_s=0.1))


def test_every_request_finishes_or_is_rejected(replayed, mooncake_head):
    status = replayed.requests.column("status").to_pylist()
    assert len(status) == mooncake_head.num_rows
    assert set(status) <= {"finished", "rejected"}
    assert replayed.summary.column("completed")[0].as_py() == status.count("finished")


def test_clocks_never_go_back(replayed):
    steps = replayed.steps
    start = steps.column("time_s").to_numpy()
    duration = steps.column("duration_s").to_numpy()
    assert (duration > 0).all()
    assert (start[1:] >= start[:-1] + duration[:-1] - 1e-9).all()
    r = replayed.requests
    arrival = r.column("arrival_time_s").to_numpy()
    scheduled = r.column("first_scheduled_time_s").to_numpy()
    first = r.column("first_token_time_s").to_numpy()
    finish = r.column("finish_time_s").to_numpy()
    assert (arrival <= scheduled).all() and (scheduled < first).all() and (first <= finish).all()
    assert (r.column("ttft_s").to_numpy() <= r.column("e2el_s").to_numpy()).all()


def test_summary_counters_equal_sums_over_requests_and_steps(replayed):
    s = replayed.summary.to_pylist()[0]
    r, st = replayed.requests, replayed.steps
    assert s["prefix_cache_queries"] == sum(r.column("prefix_cache_queries").to_pylist())
    assert s["prefix_cache_hits"] == sum(r.column("prefix_cache_hits").to_pylist())
    assert s["num_preemptions"] == sum(r.column("num_preemptions").to_pylist())
    assert s["prefill_tokens"] + s["decode_tokens"] == sum(r.column("scheduled_tokens").to_pylist())
    assert s["num_evictions"] == sum(st.column("num_evictions").to_pylist())
    assert s["total_output_tokens"] == sum(r.column("generated_tokens").to_pylist())
    # Every token after a request's first comes from a decode step, or from the step that
    # completes a recompute after a preemption (counted as prefill).
    after_first = sum(g - 1 for g in r.column("generated_tokens").to_pylist())
    assert after_first - s["num_preemptions"] <= s["decode_tokens"] <= after_first


def test_group_usage_adds_up_to_pool_usage(replayed):
    usage = replayed.steps.column("kv_cache_usage").to_numpy()
    by_group = np.array([sum(x) for x in replayed.steps.column("kv_cache_usage_by_group").to_pylist()])
    assert np.allclose(usage, by_group)


def test_prefix_caching_saves_prefill_tokens_on_mooncake(llama_plan, mooncake_head):
    on = run_replay(llama_plan, mooncake_head)
    off_plan = plan(get_model("llama-3.1-8b"), get_gpu("h100"),
                    EngineConfig(max_model_len=131072, enable_prefix_caching=False))
    off = run_replay(off_plan, mooncake_head)
    on_prefill = on.summary.column("prefill_tokens")[0].as_py()
    off_prefill = off.summary.column("prefill_tokens")[0].as_py()
    assert on.summary.column("prefix_cache_hits")[0].as_py() > 0
    assert off.summary.column("prefix_cache_hits")[0].as_py() == 0
    assert on_prefill < off_prefill


def test_requests_longer_than_max_model_len_are_rejected_and_counted(mooncake_head):
    short = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=8192))
    result = run_replay(short, mooncake_head)
    r = result.requests
    rejected = [i for i, s in enumerate(r.column("status").to_pylist()) if s == "rejected"]
    too_long = [i for i, (p, o) in enumerate(zip(r.column("prompt_tokens").to_pylist(),
                                                 r.column("output_tokens").to_pylist())) if p + o > 8192]
    assert rejected == too_long and rejected
    assert set(r.column("reject_reason").take(rejected).to_pylist()) <= {"prompt_too_long", "exceeds_max_model_len"}
    assert "8192" in r.column("reject_detail")[rejected[0]].as_py()
    assert result.summary.column("rejected")[0].as_py() == len(rejected)
    by_reason = json.loads(result.summary.column("rejected_by_reason")[0].as_py())
    assert sum(by_reason.values()) == len(rejected)


def test_time_limit_stops_the_run_and_reports_unfinished(llama_plan, mooncake_head):
    result = run_replay(llama_plan, mooncake_head, time_limit_s=20.0)
    status = result.requests.column("status").to_pylist()
    assert result.end_time_s == pytest.approx(20.0)
    assert "finished" in status and ({"waiting", "running"} & set(status))
    assert result.summary.column("unfinished")[0].as_py() == sum(s in ("waiting", "running") for s in status)


def test_same_scenario_gives_byte_identical_parquet(llama_plan, mooncake_head, tmp_path):
    from kvtwin.reports.run_dir import write_run

    for name in ("a", "b"):
        result = run_replay(llama_plan, mooncake_head)
        write_run(tmp_path / name, requests=result.requests, steps=result.steps, summary=result.summary,
                  plan=llama_plan.to_json(), run_metadata={"scenario": "test"})
    for file in ("requests.parquet", "steps.parquet", "summary.parquet", "plan.json"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()


class _OneSecondModel:
    def __init__(self, outputs):
        self.outputs = outputs

    def execute(self, output):
        outputs = self.outputs
        return Execution({rid: [outputs[rid][index] if index < len(outputs[rid]) else 0]
                          for rid, index in output.num_output_tokens.items()}, 1.0)


@pytest.mark.parametrize("name", ["three_groups", "priority", "multiturn"])
def test_simpy_clock_makes_the_lockstep_clocks_decisions(name):
    """Arrivals at time = arrival step and one second per step: the SimPy replay must make
    exactly the decisions of the lockstep runner (idle lockstep steps aside)."""
    case = load_case(GOLDEN / name)
    lockstep = [s for s in run_case(case).steps if s["scheduled"]]
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    arrivals = [Arrival(float(r.arrival_step), Request(r.request_id, TokenPrompt(r.prompt_token_ids),
                                                       len(r.output_token_ids), arrival_time=float(i),
                                                       priority=r.priority))
                for i, r in enumerate(case.requests)]
    recorded = []
    pool = engine.kv_cache_manager.block_pool

    class Recorder(MetricsRecorder):
        def on_batch_applied(self, result, times, replica=0, synchronous=False):
            wrote_row = super().on_batch_applied(result, times, replica, synchronous)
            recorded.append(step_record(0, result, pool))
            return wrote_row

    run_simulation([Replica(engine, _OneSecondModel({r.request_id: r.output_token_ids for r in case.requests}))],
                   arrivals, Recorder(len(case.kv_cache_config.groups)))
    strip = [{k: v for k, v in s.items() if k != "step"} for s in lockstep]
    assert [{k: v for k, v in s.items() if k != "step"} for s in recorded if s["scheduled"]] == strip


def test_slo_attainment_and_goodput(replayed):
    s = replayed.summary.to_pylist()[0]
    r = replayed.requests
    ttft = r.column("ttft_s").to_numpy()
    tpot = r.column("tpot_s").to_numpy()
    met = [(a <= 2.0) and (math.isnan(b) or b <= 0.1) for a, b in zip(ttft, tpot)]
    assert s["slo_attainment"] == pytest.approx(sum(met) / len(met))
    assert s["request_goodput"] == pytest.approx(sum(met) / s["duration_s"])


def test_slo_attainment_counts_rejected_requests_as_misses(mooncake_head):
    """Issue 37 (7): one rejection of 50 must not read 100 %: the attainment is over every
    arrival, the rejected share beside it; saturation judges the requests admitted."""
    short = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=16384))
    result = run_replay(short, mooncake_head, slo=SLO(ttft_s=60.0, tpot_s=1.0))
    s = result.summary.to_pylist()[0]
    status = result.requests.column("status").to_pylist()
    ttft = result.requests.column("ttft_s").to_pylist()
    tpot = result.requests.column("tpot_s").to_pylist()
    rejected = status.count("rejected")
    # A one-token output has no TPOT (NaN): only its TTFT is bounded.
    met = sum(1 for st, a, b in zip(status, ttft, tpot) if st == "finished" and a <= 60.0 and not b > 1.0)
    assert 0 < rejected < len(status) and met == len(status) - rejected  # every admitted request met it
    assert s["slo_attainment"] == pytest.approx(met / len(status)) and met < len(status)
    assert s["rejected_share"] == pytest.approx(rejected / len(status))
    assert s["request_goodput"] == pytest.approx(met / s["duration_s"])
    assert "slo" not in s["saturation_reason"]


def test_trace_without_identity_shares_nothing(llama_plan):
    table = transforms.limit(load_trace(bundled_path("AzureLLMInferenceTrace_conv.csv")), 80)
    result = run_replay(llama_plan, table)
    assert result.summary.column("prefix_cache_hits")[0].as_py() == 0
    assert isinstance(result.requests, pa.Table)


# -- asynchronous scheduling: the SimPy batch queue against the lockstep engine step ------------

def _async_lockstep(case, arrival_steps):
    """Step ``case`` (with these arrival steps) by ``EngineCore.step_async`` with a model of
    one second per batch, and lay the steps on the SimPy clock: scheduling takes no time, a
    batch runs on the device after the previous one, a step that applies a batch ends at that
    batch's end. Returns the decisions (one record per applied batch that computed or
    preempted something), the SimPy time of each request's arrival step, and the steps whose
    arrivals the SimPy clock cannot place (their step follows a schedule at the same instant)."""
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    sched = engine.scheduler
    pool = engine.kv_cache_manager.block_pool
    model = _OneSecondModel({r.request_id: r.output_token_ids for r in case.requests})
    order = sorted(range(len(case.requests)), key=lambda i: (arrival_steps[i], i))
    records, arrival_s, clashes = [], {}, set()
    now = device_free = 0.0
    last_schedule_s = -1.0
    ends: dict[int, float] = {}
    next_arrival, step = 0, 0
    while True:
        arrived = False
        while next_arrival < len(order) and arrival_steps[order[next_arrival]] == step:
            i = order[next_arrival]
            r = case.requests[i]
            engine.add_request(Request(r.request_id, TokenPrompt(r.prompt_token_ids), len(r.output_token_ids),
                                       arrival_time=float(i), priority=r.priority))
            arrival_s[r.request_id] = now
            arrived = True
            next_arrival += 1
        if arrived and now <= last_schedule_s:
            clashes.add(step)
        batches = sched.num_batches
        result = engine.step_async(model)
        if sched.num_batches > batches:
            last_schedule_s = now
            if result.output.num_scheduled_tokens:
                device_free = max(now, device_free) + 1.0
                ends[id(result.output)] = device_free
            else:
                ends[id(result.output)] = now
        updated = result.updated
        if updated is not None:
            now = max(now, ends.pop(id(updated)))
            if updated.num_scheduled_tokens or updated.preempted:
                records.append((dict(updated.num_scheduled_tokens), list(updated.preempted),
                                sorted(r.request_id for r in result.finished), pool.get_num_free_blocks(),
                                pool.num_cached_blocks()))
        elif sched.num_batches == batches:
            now += 1.0  # an idle step: the SimPy clock waits for the next arrival
        if next_arrival == len(order) and not engine.has_unfinished_requests() and not engine.batch_queue:
            return records, arrival_s, clashes
        step += 1


@pytest.mark.parametrize("name", ["async_pressure", "async_swa128", "async_priority", "async_multiturn"])
def test_simpy_clock_makes_the_lockstep_clocks_decisions_with_async_scheduling(name):
    """The SimPy batch queue (``run_simulation`` with an async config) makes exactly the
    decisions of ``EngineCore.step_async`` stepped by the lockstep clock, batch by batch:
    what each batch scheduled and preempted, what its update finished, and the pool after.

    SimPy schedules in no time, so requests arriving between two schedules at the same
    instant (lockstep steps after a schedule-only step) cannot be placed on its clock; such
    arrivals are moved one step earlier until none is left (a fixed point, usually a handful
    of requests), and the lockstep reference is that adjusted workload."""
    case = load_case(GOLDEN / name)
    assert case.scheduler_config.async_scheduling
    arrival_steps = [r.arrival_step for r in case.requests]
    for _ in range(200):
        records, arrival_s, clashes = _async_lockstep(case, arrival_steps)
        if not clashes:
            break
        arrival_steps = [s - 1 if s in clashes else s for s in arrival_steps]
    else:
        raise AssertionError("arrivals did not settle")
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    pool = engine.kv_cache_manager.block_pool
    order = sorted(range(len(case.requests)), key=lambda i: (arrival_steps[i], i))
    arrivals = [Arrival(arrival_s[case.requests[i].request_id],
                        Request(case.requests[i].request_id, TokenPrompt(case.requests[i].prompt_token_ids),
                                len(case.requests[i].output_token_ids), arrival_time=float(i),
                                priority=case.requests[i].priority)) for i in order]
    recorded = []

    class Recorder(MetricsRecorder):
        def on_batch_applied(self, result, times, replica=0, synchronous=False):
            if not super().on_batch_applied(result, times, replica, synchronous):
                return False
            out = result.output
            recorded.append((dict(out.num_scheduled_tokens), list(out.preempted),
                             sorted(r.request_id for r in result.finished), pool.get_num_free_blocks(),
                             pool.num_cached_blocks()))
            return True

    metrics = Recorder(len(case.kv_cache_config.groups))
    run_simulation([Replica(engine, _OneSecondModel({r.request_id: r.output_token_ids for r in case.requests}))],
                   arrivals, metrics)
    assert len(recorded) == len(records)
    assert recorded == records
    steps = metrics.steps_table()
    start, duration = steps.column("time_s").to_numpy(), steps.column("duration_s").to_numpy()
    # The device runs one batch at a time, back to back while there is work.
    assert (start[1:] >= start[:-1] + duration[:-1] - 1e-9).all()
