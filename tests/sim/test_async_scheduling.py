"""Asynchronous scheduling (vLLM 0.33's default AsyncScheduler, two batches in flight).

The rules, one test each where a small workload shows it: the engine step of
``EngineCore.step_async`` (schedule-only steps, a queue of at most two batches, updates in
schedule order), output placeholders (a request whose batch samples in flight counts that
token), no extra step once the last token is in flight, finished requests reported one
schedule late, blocks completed by a sampled token cached at its update, a preempted
request's in-flight token still delivered (and it may finish from the waiting queue), a
preempted request not resumed while such output is in flight, and the doubled in-flight
token count of the windowed admission caps. The golden cases ``async_*`` check all of it
against vLLM itself; the SimPy side is in ``tests/replay/test_replay.py``.
"""

from pathlib import Path

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.engine import Execution
from kvtwin.sim.core.request import RequestStatus
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.lockstep.golden import load_case, read_jsonl
from kvtwin.sim.lockstep.runner import run_case
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica

from .builders import EchoModel, engine, full, new_request, tokens

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"


def async_engine(**kwargs):
    kwargs.setdefault("max_num_batched_tokens", 64)
    return engine(full(), async_scheduling=True, **kwargs)


def test_in_flight_tokens_cover_two_batches():
    assert SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, async_scheduling=True).max_in_flight_tokens \
        == 64
    assert SchedulerConfig(max_model_len=64, max_num_batched_tokens=32, async_scheduling=False).max_in_flight_tokens \
        == 32


def test_the_next_batch_is_scheduled_before_the_previous_tokens_are_known():
    eng = async_engine(num_blocks=16)
    a = new_request("a", tokens(0, 20), max_tokens=3)
    eng.add_request(a)
    model = EchoModel()
    first = eng.step_async(model)  # schedule-only: the queue had room
    assert first.output.num_scheduled_tokens == {"a": 20} and first.output.num_output_tokens == {"a": 0}
    assert first.updated is None and len(eng.batch_queue) == 1
    assert a.num_output_placeholders == 1 and a.num_output_tokens == 0
    second = eng.step_async(model)
    # Its first token is still a placeholder, yet its decode is scheduled, sampling output 1.
    assert second.output.num_scheduled_tokens == {"a": 1} and second.output.num_output_tokens == {"a": 1}
    assert second.output.num_computed_tokens == [20]
    assert second.updated is first.output  # then the oldest batch is applied
    assert a.output_token_ids == [50_000] and a.num_output_placeholders == 1
    assert a.num_computed_tokens == 21 == a.num_tokens
    assert len(eng.batch_queue) == 1


def test_no_batch_is_scheduled_once_the_last_token_is_in_flight_and_finishes_are_reported_late():
    eng = async_engine(num_blocks=16)
    eng.add_request(new_request("a", tokens(0, 20), max_tokens=3))
    model = EchoModel()
    results = []
    while eng.has_requests() or eng.batch_queue:
        results.append(eng.step_async(model))
        assert len(eng.batch_queue) <= 2
    scheduled = [dict(r.output.num_scheduled_tokens) for r in results]
    # Prefill, two decodes; the third output is in flight when step 3 schedules: nothing.
    assert scheduled[:4] == [{"a": 20}, {"a": 1}, {"a": 1}, {}]
    assert [r.request_id for r in results[3].finished] == ["a"]  # finish_step = 0 + max_tokens
    # The executor hears of it with the next schedule.
    assert results[4].output.finished_req_ids == ["a"] and results[4].output.num_scheduled_tokens == {}
    assert not results[-1].finished and eng.kv_cache_manager.block_pool.get_num_free_blocks() == 15


def test_a_block_completed_by_the_last_sampled_token_is_cached_at_its_update():
    # 30 prompt tokens + 3 outputs: the last token to be computed is position 31, which
    # fills the second block; no later batch allocates (the last output is in flight), so
    # only the update can register it, before the request is freed.
    eng = async_engine(num_blocks=16)
    eng.add_request(new_request("a", tokens(0, 30), max_tokens=3))
    pool = eng.kv_cache_manager.block_pool
    model = EchoModel()
    cached = []
    while eng.has_requests() or eng.batch_queue:
        result = eng.step_async(model)
        cached.append((bool(result.finished), pool.num_cached_blocks()))
    finish = next(i for i, (finished, _) in enumerate(cached) if finished)
    assert cached[finish - 1][1] == 1 and cached[finish][1] == 2  # cached, then freed (still cached)


def test_a_request_whose_last_token_was_in_flight_when_preempted_finishes_from_the_waiting_queue():
    # vLLM delivers the stale token; the request reaches max_tokens without another admission.
    case = load_case(CASES_DIR / "async_no_chunking")
    result = run_case(case)
    waiting_finishes = [r for r in result.requests if r["num_preemptions"] == len(r["admissions"])]
    assert waiting_finishes and waiting_finishes == [r for r in read_jsonl(CASES_DIR / "async_no_chunking" /
                                                                           "expected_requests.jsonl")
                                                     if r["num_preemptions"] == len(r["admissions"])]


def test_a_preempted_request_still_receives_the_token_in_flight():
    eng = async_engine(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=128)
    a, b = new_request("a", tokens(0, 40), max_tokens=60), new_request("b", tokens(1000, 40), max_tokens=60)
    eng.add_request(a)
    eng.add_request(b)
    model = EchoModel()
    while not (result := eng.step_async(model)).output.preempted:
        pass
    assert result.output.preempted == ["b"] and b.status is RequestStatus.PREEMPTED
    # The batch in flight held b's decode: its token arrived with this step's update,
    # without a placeholder to resolve.
    assert b.num_output_placeholders == 0 and b.num_in_flight_tokens == 0
    assert b.num_output_tokens == result.updated.num_output_tokens["b"] + 1
    assert eng.step_async(model).output.num_scheduled_tokens  # and the run goes on


def test_a_preempted_request_is_not_resumed_while_its_output_is_in_flight():
    # Two schedules without an update between them (a deeper queue than vLLM's two
    # batches ever has at a schedule, so it is driven by hand): the preempted request, its
    # output in flight, is set aside; the one behind it is admitted; once the stale output
    # is delivered it resumes with it.
    eng = async_engine(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=128)
    sched = eng.scheduler
    x, y = new_request("x", tokens(0, 20), max_tokens=8), new_request("y", tokens(2000, 20), max_tokens=8)
    eng.add_request(x)
    first = sched.schedule()
    assert first.num_output_tokens == {"x": 0} and x.num_in_flight_tokens == 20
    sched.running.remove(x)
    sched._preempt(x)  # as the running pass would
    eng.add_request(y)
    second = sched.schedule()
    assert list(second.num_scheduled_tokens) == ["y"] and [r.request_id for r in sched.waiting] == ["x"]
    sched.update_from_output(first, {"x": [50_000]})  # stale: delivered, no placeholder
    assert x.output_token_ids == [50_000] and x.num_in_flight_tokens == 0 and x.status is RequestStatus.PREEMPTED
    sched.update_from_output(second, {"y": [60_000]})
    third = sched.schedule()
    [resumed] = third.scheduled_new_reqs
    assert resumed.req_id == "x" and resumed.resumed and resumed.num_tokens == 21


def test_schedule_only_steps_and_idle_steps():
    eng = async_engine(num_blocks=16)
    model = EchoModel()
    idle = eng.step_async(model)
    assert idle.output.num_scheduled_tokens == {} and idle.updated is None and not eng.batch_queue
    eng.add_request(new_request("a", tokens(0, 8), max_tokens=1))
    assert eng.step_async(model).updated is None  # scheduled, queue has room
    step = eng.step_async(model)  # nothing more to schedule (its only token is in flight)
    assert step.output.num_scheduled_tokens == {} and [r.request_id for r in step.finished] == ["a"]


def test_the_synchronous_step_never_uses_placeholders():
    eng = engine(full(), num_blocks=16, max_num_batched_tokens=64)
    a = new_request("a", tokens(0, 20), max_tokens=3)
    eng.add_request(a)
    while eng.has_unfinished_requests():
        eng.step(EchoModel())
        assert a.num_output_placeholders == 0 and a.num_in_flight_tokens == 0
    assert type(eng.scheduler) is Scheduler  # not the AsyncScheduler


class _OneSecond:
    def execute(self, output):
        return Execution({rid: [50_000 + i] for rid, i in output.num_output_tokens.items()}, 1.0)


def _replay(async_scheduling: bool):
    eng = engine(full(), num_blocks=32, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    arrivals = [Arrival(0.0, new_request("a", tokens(0, 20), max_tokens=3)),
                Arrival(0.5, new_request("b", tokens(1000, 20), max_tokens=2))]
    metrics = MetricsRecorder(1)
    end = run_simulation([Replica(eng, _OneSecond())], arrivals, metrics)
    return metrics, end


def test_simpy_overlaps_scheduling_with_the_batch_in_flight():
    sync, sync_end = _replay(False)
    overlapped, async_end = _replay(True)
    s = {r.request_id: r for r in sync.order}
    a = {r.request_id: r for r in overlapped.order}
    # Synchronous: b (arriving at 0.5) joins the step starting at 1, its token at 2.
    assert (s["b"].first_scheduled_s, s["b"].first_token_s) == (1.0, 2.0)
    # Async: at 1 the engine applies batch 0 and schedules batch 2, which runs after batch
    # 1 (scheduled at 0 while batch 0 ran): b's first token comes at 3.
    assert (a["b"].first_scheduled_s, a["b"].first_token_s) == (1.0, 3.0)
    assert (a["a"].first_token_s, a["a"].finish_s) == (1.0, 3.0)
    steps = overlapped.steps_table()
    # One row per batch, back to back on the device, each lasting its device time.
    assert steps.column("time_s").to_pylist() == [0.0, 1.0, 2.0, 3.0]
    assert steps.column("duration_s").to_pylist() == [1.0] * 4
    assert async_end == 4.0 and sync_end == 3.0


def test_the_synchronous_step_also_runs_an_async_configuration_one_batch_at_a_time():
    # Placeholders resolve at once; the decisions are the synchronous ones.
    def run(async_scheduling):
        eng = engine(full(), num_blocks=12, max_num_batched_tokens=48, max_num_seqs=3,
                     async_scheduling=async_scheduling)
        for i in range(5):
            eng.add_request(new_request(f"r{i}", tokens(1000 * i, 30 + 7 * i), max_tokens=6 + i))
        steps = []
        while eng.has_unfinished_requests():
            result = eng.step(EchoModel())
            steps.append((dict(result.output.num_scheduled_tokens), list(result.output.preempted),
                          [r.request_id for r in result.finished]))
            assert all(r.num_in_flight_tokens == 0 for r in eng.scheduler.requests.values())
        return steps

    assert run(True) == run(False)


def test_asynchrony_attaches_through_the_hooks_only():
    """vLLM's shape (issue 40 item 3): one advance loop and one update loop, in
    ``Scheduler``, drafts handled inline; ``AsyncScheduler`` overrides only the small
    per-batch and per-request hooks those loops call, never a loop."""
    from kvtwin.sim.core.async_scheduler import AsyncScheduler

    hooks = {"_start_batch", "_update_request_after_schedule", "_start_update", "_update_request_before_output",
             "_cache_after_output"}
    overridden = {name for name, value in vars(AsyncScheduler).items()
                  if callable(value) and name in vars(Scheduler) and not name.startswith("__")}
    assert overridden == hooks
    # Each hook is a method the base class calls from its loop.
    assert hooks <= set(vars(Scheduler))
    assert not [name for name in vars(Scheduler) if name.endswith("_spec") or name.endswith("_spec_async")]
