"""The collector's pace during a run (``sim/replay/clock/collector.py``): relaxed while
the simulation runs, the caller's own thresholds before and after, whatever happens."""

from __future__ import annotations

import gc

import pytest

from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.collector import RUN_YOUNG_THRESHOLD, relaxed_collection
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from tests.replay.chat_workload import chat_trace, llama_plan


@pytest.fixture
def thresholds():
    """Start each test from CPython's defaults and leave the process as it was."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_a_run_relaxes_the_young_generation_and_restores_it(thresholds):
    p = llama_plan()
    kv = p.require_fits()
    engine = EngineCore(kv, p.engine.scheduler, p.engine.cache)
    seen = []
    run_simulation([Replica(engine, CostModelExecutor(plan_cost_model(p)))], arrivals_from_trace(chat_trace(20)),
                   MetricsRecorder(len(kv.groups)), on_progress=lambda _: seen.append(gc.get_threshold()),
                   progress_every=1)
    # Every step reports while the run lasts; the last report comes after it ended.
    *during, after = seen
    assert during, "the run reported no step"
    assert set(during) == {(RUN_YOUNG_THRESHOLD, 10, 10)}
    assert after == (700, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_the_callers_thresholds_come_back_after_an_error(thresholds):
    gc.set_threshold(500, 7, 3)
    with pytest.raises(RuntimeError), relaxed_collection():
        assert gc.get_threshold() == (RUN_YOUNG_THRESHOLD, 7, 3)
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == (500, 7, 3)


def test_a_larger_threshold_and_a_nested_run_are_left_alone(thresholds):
    gc.set_threshold(RUN_YOUNG_THRESHOLD * 2, 10, 10)
    with relaxed_collection():
        assert gc.get_threshold()[0] == RUN_YOUNG_THRESHOLD * 2
    assert gc.get_threshold()[0] == RUN_YOUNG_THRESHOLD * 2
    gc.set_threshold(700, 10, 10)
    with relaxed_collection():
        with relaxed_collection():
            assert gc.get_threshold()[0] == RUN_YOUNG_THRESHOLD
        assert gc.get_threshold()[0] == RUN_YOUNG_THRESHOLD
    assert gc.get_threshold()[0] == 700


def test_a_command_runs_at_the_runs_pace(thresholds):
    """Every CLI command is ``guarded``: reading a trace and building pools allocate
    hundreds of thousands of long-lived objects before any run starts."""
    from kvtwin.console import guarded

    seen = []
    guarded(lambda: seen.append(gc.get_threshold()))()
    assert seen == [(RUN_YOUNG_THRESHOLD, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)
