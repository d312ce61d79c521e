"""Pipeline parallelism on the replay's clock (docs/clock.md#pipeline-parallelism): the
timeline of stages, a PP replay against its cost model, and what is refused."""

import numpy as np
import pytest

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.clock.timeline import DeviceTimeline
from kvtwin.sim.replay.run import plan_cost_model, run_replay
from kvtwin.traces.schema import TraceMeta, build_table
from tests.cli_run import one_error_line, run


def _timeline(passes):
    queue = list(passes)
    return DeviceTimeline(lambda duration_s: queue.pop(0))


def test_batches_through_three_stages_follow_the_hand_worked_schedule():
    # Compute seconds per stage and sends after stages 1 and 2, all scheduled at 0. A stage
    # takes the next batch once its send of the last one is done (vLLM's worker waits for
    # it), and a send starts once the next stage has let its previous batch go:
    #   A (1, 3, 1), sends 0.5: stage 1 0-1, send to 1.5, stage 2 1.5-4.5, send to 5, stage 3 5-6.
    #   B (2, 1, 2), sends 0.5: stage 1 from 1.5 to 3.5; stage 2 lets A go at 5, so B's send
    #     runs 5-5.5 (B holds stage 1 until then); stage 2 5.5-6.5, send 6.5-7 (stage 3 let
    #     A go at 6); stage 3 7-9.
    #   C (1, 1, 1), no sends: stage 1 from 5.5 to 6.5, waits there for B's hand-off from
    #     stage 2 (7); stage 2 7-8, waits for B to leave stage 3 (9); stage 3 9-10.
    timeline = _timeline([([1.0, 3.0, 1.0], [0.5, 0.5, 0.0]), ([2.0, 1.0, 2.0], [0.5, 0.5, 0.0]),
                          ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])])
    for _ in range(3):
        timeline.launch(0.0, 0.0)
    assert [(t.scheduled_s, t.start_s, t.end_s) for t in timeline.in_flight] == [
        (0.0, 0.0, 6.0), (0.0, 1.5, 9.0), (0.0, 5.5, 10.0)]
    # An empty batch is done when the batches before it are, not when the entry is free.
    timeline.launch_empty(2.0)
    assert (timeline.in_flight[-1].start_s, timeline.in_flight[-1].end_s) == (10.0, 10.0)
    # Applied in order, each with the end of the one before.
    assert [(t.previous_end_s, t.end_s) for t in (timeline.take_oldest(), timeline.take_oldest())] == [
        (0.0, 6.0), (6.0, 9.0)]


def test_a_batch_scheduled_late_waits_for_nothing():
    timeline = _timeline([([1.0, 1.0], [0.25, 0.0]), ([1.0, 1.0], [0.25, 0.0])])
    timeline.launch(0.0, 0.0)
    timeline.launch(10.0, 0.0)
    assert [(t.start_s, t.end_s) for t in timeline.in_flight] == [(0.0, 2.25), (10.0, 12.25)]


def test_one_stage_is_the_device_timeline_of_one_gpu():
    staged, plain = _timeline([([0.3], [0.0]), ([0.2], [0.0]), ([0.7], [0.0])]), DeviceTimeline()
    for now_s, duration_s in ((0.0, 0.3), (0.1, 0.2), (2.0, 0.7)):
        staged.launch(now_s, duration_s)
        plain.launch(now_s, duration_s)
    assert [(t.start_s, t.end_s) for t in staged.in_flight] == [(t.start_s, t.end_s) for t in plain.in_flight]


# -- a PP replay --------------------------------------------------------------------------

PROMPT = 8192  # one request per batch: each step prefills one whole prompt of the budget
N = 40


def _plan(pp):
    return plan(get_model("llama-3.1-8b"), get_gpu("h100"),
                EngineConfig(max_model_len=16384, max_num_batched_tokens=PROMPT, pipeline_parallel_size=pp,
                             async_scheduling=False))


@pytest.fixture(scope="module")
def saturated():
    trace = build_table({"request_id": [f"r{i}" for i in range(N)], "arrival_time_s": [0.0] * N,
                         "prompt_tokens": [PROMPT] * N, "output_tokens": [1] * N}, TraceMeta(source_format="test"))
    return {pp: run_replay(_plan(pp), trace) for pp in (1, 2)}


def _in_flight_at_most(steps, limit):
    start = steps.column("time_s").to_numpy()
    end = start + steps.column("duration_s").to_numpy()
    most = max(int(((start <= t) & (t < end)).sum()) for t in start)
    return most <= limit, most


def test_a_pp_replay_completes_with_at_most_pp_batches_in_flight(saturated):
    result = saturated[2]
    assert result.requests.column("status").to_pylist() == ["finished"] * N
    assert result.steps.num_rows == N
    ok, most = _in_flight_at_most(result.steps, 2)
    assert ok and most == 2, most  # the stages overlap batches, never more than two


def test_a_saturated_pipeline_starts_a_batch_every_slowest_stage(saturated):
    # Every batch is one 8192-token prompt from scratch: the cost model's own stage times
    # for it give the pipeline's rate, one batch per slowest stage.
    cost = plan_cost_model(_plan(2)).split_step_cost([], [(PROMPT, 0)])
    steps = saturated[2].steps
    start = steps.column("time_s").to_numpy()
    assert np.diff(start[1:]) == pytest.approx(np.full(N - 2, cost.slowest_stage_s), rel=1e-9)
    assert steps.column("duration_s").to_numpy()[0] == pytest.approx(cost.total_s, rel=1e-12)
    # One stage on half the GPUs starts a batch every whole step: slower.
    one = plan_cost_model(_plan(1)).split_step_cost([], [(PROMPT, 0)])
    single = saturated[1]
    assert np.diff(single.steps.column("time_s").to_numpy()) == pytest.approx(np.full(N - 1, one.total_s), rel=1e-9)
    assert cost.slowest_stage_s < one.total_s
    assert single.end_time_s > saturated[2].end_time_s


def test_pipeline_stages_with_drafts_are_one_error_line(tmp_path):
    scenario = tmp_path / "pp.toml"
    scenario.write_text('[model]\npreset = "llama-3.1-8b"\n[hardware]\ngpu = "h100"\n[engine]\n'
                        'pipeline_parallel_size = 2\nasync_scheduling = false\n'
                        '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 2\nacceptance = 0.5\n'
                        '[workload]\ntrace = "bundled:mooncake_conversation_trace.jsonl"\n')
    out = tmp_path / "run"
    one_error_line(run("replay", scenario, "--out", out),
                   f"kvtwin: error: {scenario}: speculative.method: expected no method with pipeline_parallel_size > 1",
                   "drafting through pipeline stages")
    assert not out.exists()
