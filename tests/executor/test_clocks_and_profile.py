"""The wall clock paces arrivals in real time; the profiling step of check 3 (memory) runs
the planned shapes through the same forward pass (its CUDA half needs a GPU: the GPU
script runs it)."""

from __future__ import annotations

import time

import pyarrow.compute as pc
import pytest

from kvtwin.executor.memory import profile_inputs, profile_step
from kvtwin.executor.device_replay import ExecutorOptions, build_executor, run_executor
from kvtwin.traces import schema as col
from tests.executor.toys import scenario


def test_wall_clock_waits_for_arrivals_in_real_time(tmp_path):
    resolved = scenario("swa", tmp_path, pool=2.0, num_requests=5, rate=8.0, seed=1)
    trace = resolved.workload.load()
    last_arrival_s = pc.max(trace.column(col.ARRIVAL_TIME_S)).as_py()
    assert last_arrival_s > 0.2  # long enough for pacing to show
    started = time.perf_counter()
    run = run_executor(resolved.plan(), trace, ExecutorOptions(clock="wall"))
    wall_s = time.perf_counter() - started
    summary = run.result.summary.to_pylist()[0]
    assert summary["completed"] == 5
    assert wall_s >= last_arrival_s  # a measured clock would finish in a fraction of it
    times = run.result.steps.column("time_s").to_pylist()
    assert times == sorted(times) and times[-1] >= last_arrival_s * 0.9


def test_measured_clock_never_paces_arrivals(tmp_path, monkeypatch):
    """The measured clock is simulated time: it never builds a real-time environment nor
    sleeps, yet its clock covers every arrival gap. (How far ahead of real time it runs
    is measured in ``bench/bench_wall_clocks.py``, not asserted: a loaded machine is slow.)"""
    import simpy.rt

    def refuse(*args, **kwargs):
        raise AssertionError("the measured clock paced in real time")

    monkeypatch.setattr(simpy.rt, "RealtimeEnvironment", refuse)
    monkeypatch.setattr(time, "sleep", refuse)
    resolved = scenario("swa", tmp_path, pool=2.0, num_requests=5, rate=0.5, seed=1)
    trace = resolved.workload.load()
    last_arrival_s = pc.max(trace.column(col.ARRIVAL_TIME_S)).as_py()
    assert last_arrival_s > 2.0  # gaps a paced run would have to wait out
    run = run_executor(resolved.plan(), trace, ExecutorOptions(clock="measured"))
    assert run.result.summary.to_pylist()[0]["completed"] == 5
    assert run.result.end_time_s >= last_arrival_s
    times = run.result.steps.column("time_s").to_pylist()
    assert times == sorted(times) and times[-1] >= max(trace.column(col.ARRIVAL_TIME_S).to_pylist()[:-1])


@pytest.mark.parametrize("kind", ["full", "swa", "mla", "three"])
def test_profiling_step_covers_every_group_at_the_batch_size(kind, tmp_path):
    resolved = scenario(kind, tmp_path, pool=3.0)
    plan = resolved.plan()
    executor = build_executor(plan, ExecutorOptions(audit=False))
    num_tokens, num_reqs = 200, 6
    inputs = profile_inputs(executor, num_tokens, num_reqs)
    assert inputs.num_tokens == num_tokens and len(inputs.request_ids) == num_reqs
    assert inputs.seq_lens.sum().item() == num_tokens
    config = plan.require_fits()
    for gid, group in enumerate(config.groups):
        table = inputs.block_tables[gid]
        assert table.shape[0] == num_reqs
        # Real blocks only, never the null block where a token is stored.
        if inputs.slot_mappings[gid] is not None:
            assert (inputs.slot_mappings[gid] >= group.spec.block_size).all()
    logits = profile_step(executor, num_tokens, num_reqs)
    assert logits.shape == (num_reqs, executor.shape.vocab_size)
    assert logits.isfinite().all()
