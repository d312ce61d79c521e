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
from kvtwin.sim.replay.metrics import SLO, MetricsRecorder
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.workload import Arrival, run_simulation
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
        return Execution({rid: [self.outputs[rid][index]] for rid, index in output.num_output_tokens.items()}, 1.0)


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
        def step(self, eng, result, start_s, end_s):
            super().step(eng, result, start_s, end_s)
            recorded.append(step_record(0, result, pool))

    run_simulation(engine, _OneSecondModel({r.request_id: r.output_token_ids for r in case.requests}), arrivals,
                   Recorder(len(case.kv_cache_config.groups)))
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


def test_trace_without_identity_shares_nothing(llama_plan):
    table = transforms.limit(load_trace(bundled_path("AzureLLMInferenceTrace_conv.csv")), 80)
    result = run_replay(llama_plan, table)
    assert result.summary.column("prefix_cache_hits")[0].as_py() == 0
    assert isinstance(result.requests, pa.Table)
