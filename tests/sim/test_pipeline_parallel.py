"""Pipeline parallelism: the batch queue's depth and the synchronous scheduler with several
batches in flight (docs/semantics.md#pipeline-parallelism), and the asynchronous scheduler's
PP microbatching (docs/semantics.md#asynchronous-pipeline-parallelism). The pp_* golden
cases (tests/sim/test_golden.py) check exactness against vLLM 0.33."""

import json
import shutil
from pathlib import Path

import pytest

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.engine import Execution
from kvtwin.sim.core.pipeline_scheduler import PipelineAsyncScheduler, PipelineScheduler
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.lockstep.runner import ScriptedModel
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import MetricsRecorder

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"
PP_CASES = sorted(p.name for p in CASES_DIR.iterdir() if p.name.startswith("pp_"))
ASYNC_PP_CASES = [name for name in PP_CASES if name.startswith("pp_async_")]
SYNC_PP_CASES = [name for name in PP_CASES if name not in ASYNC_PP_CASES]

# vLLM 0.33's VllmConfig.max_concurrent_batches with its default (V2) model runner
# (config/vllm.py l.588-598), as the oracle printed it for each (pipeline_parallel_size,
# async_scheduling).
VLLM_BATCHES = {(1, False): 1, (1, True): 2, (2, False): 2, (3, False): 3, (4, False): 4, (8, False): 8,
                (2, True): 3, (3, True): 4, (4, True): 5, (8, True): 9}


@pytest.mark.parametrize(("pp", "is_async"), sorted(VLLM_BATCHES))
def test_max_concurrent_batches_is_vllms(pp, is_async):
    config = SchedulerConfig(max_model_len=512, async_scheduling=is_async, pipeline_parallel_size=pp)
    assert config.max_concurrent_batches == VLLM_BATCHES[pp, is_async]
    # The sliding-window admission cap covers every batch in flight (vLLM's max_in_flight_tokens).
    assert config.max_in_flight_tokens == VLLM_BATCHES[pp, is_async] * config.max_num_batched_tokens


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True, None])
def test_pipeline_parallel_size_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=False, pipeline_parallel_size=bad)
    assert err.value.field == "pipeline_parallel_size"
    assert "\n" not in str(err.value) and "a positive integer" in str(err.value)


@pytest.mark.parametrize("pp", [2, 3, 8])
def test_asynchronous_scheduling_with_pp_runs_the_microbatching_scheduler(pp):
    """vLLM 0.33's default V2 runner keeps async on with PP: pp + 1 batches in flight, each
    request's decodes pp schedules apart; never a decode window."""
    case = load_case(CASES_DIR / PP_CASES[0])
    config = SchedulerConfig(max_model_len=512, async_scheduling=True, pipeline_parallel_size=pp)
    engine = EngineCore(case.kv_cache_config, config, case.cache_config)
    scheduler = engine.scheduler
    assert type(scheduler) is PipelineAsyncScheduler and scheduler.decode_stagger == pp
    assert engine.batch_queue_size == pp + 1 and engine.async_scheduling
    assert not scheduler.windows_allowed() and engine.window_scheduler() is None
    one = SchedulerConfig(max_model_len=512, async_scheduling=True)
    assert type(EngineCore(case.kv_cache_config, one, case.cache_config).scheduler) is AsyncScheduler


@pytest.mark.parametrize("is_async", [False, True])
def test_drafts_with_pp_are_refused(is_async):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=is_async, pipeline_parallel_size=2,
                        num_speculative_tokens=2)
    assert err.value.field == "pipeline_parallel_size"
    assert "\n" not in str(err.value)


def test_a_golden_config_with_a_bad_pipeline_parallel_size_is_refused(tmp_path):
    case = tmp_path / "case"
    shutil.copytree(CASES_DIR / PP_CASES[0], case)
    config = json.loads((case / "config.json").read_text())
    config["pipeline_parallel_size"] = "4"
    (case / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_case(case)
    assert err.value.field == "pipeline_parallel_size"


def test_the_pp_cases_have_several_stages_and_the_async_ones_are_async():
    assert len(PP_CASES) - len(ASYNC_PP_CASES) >= 3 and len(ASYNC_PP_CASES) >= 3
    sizes: dict[bool, set[int]] = {False: set(), True: set()}
    for name in PP_CASES:
        config = load_case(CASES_DIR / name).scheduler_config
        assert config.async_scheduling == (name in ASYNC_PP_CASES) and config.pipeline_parallel_size > 1, name
        sizes[config.async_scheduling].add(config.pipeline_parallel_size)
    assert {2, 4} <= sizes[False] and {2, 3} <= sizes[True]


def test_pp_picks_the_pipeline_scheduler_and_its_batch_queue():
    case = load_case(CASES_DIR / SYNC_PP_CASES[0])
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    assert type(engine.scheduler) is PipelineScheduler
    assert engine.batch_queue_size == case.scheduler_config.pipeline_parallel_size
    assert engine.async_scheduling  # the clocks step it through the batch queue
    assert engine.window_scheduler() is None
    one = SchedulerConfig(max_model_len=512, async_scheduling=False)
    plain = EngineCore(case.kv_cache_config, one, case.cache_config)
    assert type(plain.scheduler) is Scheduler and plain.batch_queue_size == 1 and not plain.async_scheduling


def _step_case(name: str, on_step) -> EngineCore:
    """Step a pp case's engine by ``step_async`` as the lockstep runner does, calling
    ``on_step(engine, schedules, output)`` after each step (``schedules``: the schedules so
    far, counted here: a step schedules whenever the engine has requests; ``output``: this
    step's schedule, None if it scheduled nothing)."""
    case = load_case(CASES_DIR / name)
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    model = ScriptedModel({r.request_id: r.output_token_ids for r in case.requests})
    pending = list(case.requests)
    step = schedules = 0
    while pending or engine.has_unfinished_requests() or engine.batch_queue:
        while pending and pending[0].arrival_step == step:
            spec = pending.pop(0)
            engine.add_request(Request(spec.request_id, TokenPrompt(spec.prompt_token_ids),
                                       len(spec.output_token_ids), arrival_time=float(step), priority=spec.priority))
        scheduling = engine.has_requests()
        schedules += scheduling
        record = engine.step_async(model)
        on_step(engine, schedules, record.output if scheduling else None)
        step += 1
        assert step < 10_000
    return engine


@pytest.mark.parametrize("name", PP_CASES)
def test_batches_in_flight_and_requests_in_them(name):
    """At most ``max_concurrent_batches`` (N synchronous, N + 1 asynchronous) batches are in
    flight (between steps one fewer: a step that fills the queue updates its oldest); a
    request samples in at most one of them; its tokens in flight are those the unfinished
    batches hold for it; it holds a placeholder for each of them it samples in while it
    runs (asynchronous), none synchronous or once preempted (that output is stale)."""
    config = load_case(CASES_DIR / name).scheduler_config
    depth = config.pipeline_parallel_size + (1 if config.async_scheduling else 0)
    most = [0]

    def check(engine: EngineCore, schedules: int, _output) -> None:
        queue = engine.batch_queue
        most[0] = max(most[0], len(queue))
        assert len(queue) <= depth - 1
        samplers = [rid for batch in queue for rid in batch.output.num_output_tokens]
        assert len(samplers) == len(set(samplers))
        held: dict[str, int] = {}
        for batch in queue:
            for rid, n in batch.output.num_scheduled_tokens.items():
                held[rid] = held.get(rid, 0) + n
        for rid, request in engine.scheduler.requests.items():
            assert request.num_in_flight_tokens == held.get(rid, 0), (schedules, rid)
            running = request.status is RequestStatus.RUNNING
            expected = samplers.count(rid) if config.async_scheduling and running else 0
            assert request.num_output_placeholders == expected, (schedules, rid)

    _step_case(name, check)
    assert most[0] == depth - 1


@pytest.mark.parametrize("name", ASYNC_PP_CASES)
def test_a_request_decodes_again_only_pp_schedules_after_it_sampled(name):
    """PP microbatching: a request that samples in the batch of schedule n is in no batch
    of schedules n + 1 .. n + N - 1 (preempted or not), and a running decode comes back
    exactly N schedules later when nothing else holds it."""
    pp = load_case(CASES_DIR / name).scheduler_config.pipeline_parallel_size
    sampled_at: dict[str, int] = {}
    gaps: list[int] = []

    def check(_engine: EngineCore, schedules: int, output) -> None:
        if output is None:
            return
        for rid in output.num_scheduled_tokens:
            if rid in sampled_at:
                gaps.append(schedules - sampled_at[rid])
                assert schedules - sampled_at[rid] >= pp, (schedules, rid)
        for rid in output.num_output_tokens:
            sampled_at[rid] = schedules

    _step_case(name, check)
    assert gaps and min(gaps) == pp


class _CountingOneSecondModel:
    """The scripted outputs, one second per batch; it notes, as each batch is handed to it
    (when it is scheduled), how many batches are then in flight, this one included."""

    def __init__(self, engine: EngineCore, outputs: dict[str, tuple[int, ...]]):
        self.engine = engine
        self.outputs = outputs
        self.in_flight: list[int] = []

    def execute(self, output):
        self.in_flight.append(len(self.engine.batch_queue) + 1)
        outputs = self.outputs
        return Execution({rid: [outputs[rid][index] if index < len(outputs[rid]) else 0]
                          for rid, index in output.num_output_tokens.items()}, 1.0)


@pytest.mark.parametrize("name", ASYNC_PP_CASES)
def test_the_simpy_clock_replays_asynchronous_pp(name):
    """The SimPy clock drives a PP engine with asynchronous scheduling to the end: every
    request finishes once with its scripted outputs, and at most N + 1 batches (and at
    some point that many) are in flight."""
    case = load_case(CASES_DIR / name)
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    outputs = {r.request_id: r.output_token_ids for r in case.requests}
    model = _CountingOneSecondModel(engine, outputs)
    arrivals = [Arrival(float(r.arrival_step), Request(r.request_id, TokenPrompt(r.prompt_token_ids),
                                                       len(r.output_token_ids), arrival_time=float(i),
                                                       priority=r.priority))
                for i, r in enumerate(case.requests)]
    finished: list[str] = []

    class Recorder(MetricsRecorder):
        def on_batch_applied(self, result, times, replica=0, synchronous=False):
            finished.extend(snapshot.request_id for snapshot in result.finished)
            for snapshot in result.finished:
                assert snapshot.num_output_tokens == len(outputs[snapshot.request_id])
            return super().on_batch_applied(result, times, replica, synchronous)

    recorder = Recorder(len(case.kv_cache_config.groups))
    end_s = run_simulation([Replica(engine, model)], arrivals, recorder)
    assert sorted(finished) == sorted(outputs)  # each once
    assert not engine.has_unfinished_requests() and not engine.batch_queue
    assert all(record.status == "finished" for record in recorder.order)
    depth = case.scheduler_config.pipeline_parallel_size + 1
    assert max(model.in_flight) == depth
    assert end_s > 0
