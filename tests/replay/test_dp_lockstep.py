"""A data-parallel group whose ranks step together (docs/semantics.md#data-parallel-lockstep):
one group step runs every rank (a dummy batch where a rank has no tokens to run), lasts as
long as its slowest rank, and records every rank's row with the same start and end; waves
start when a rank gets a request and end at the first sync point with nothing unfinished;
a dummy batch touches no KV; every request is served by one rank; and a DP MoE scenario
replays as such a group behind vLLM's balancer."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.replay.clock import dp_async, dp_group
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import Cluster, RoutedFront
from kvtwin.sim.replay.clock.dp_group import DPGroup, LockstepSettings
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.router import Router
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from tests.sim.builders import kv_config

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 64
PER_TOKEN_S = 0.001


class TokenClock:
    """An executor whose batch lasts ``PER_TOKEN_S`` per scheduled token, so ranks with
    different batches take different times; it counts the batches with tokens it ran (an
    empty one only drops finished requests' tables)."""

    def __init__(self) -> None:
        self.batches = 0
        # With its engine set: the most batches the engine held in flight as it handed one
        # over (the engine queues a batch right after running it; a class of the compiled
        # engine cannot be subclassed from a test to watch its queue).
        self.engine: EngineCore | None = None
        self.most_in_flight = 0

    def execute(self, output: SchedulerOutput) -> Execution:
        num_tokens = sum(output.num_scheduled_tokens.values())
        self.batches += num_tokens > 0
        if self.engine is not None:
            self.most_in_flight = max(self.most_in_flight, self.engine.num_batches_in_flight() + 1)
        return Execution({rid: [7] for rid in output.num_output_tokens}, num_tokens * PER_TOKEN_S)


class Scripted(Router):
    """Each request goes to the rank its id names (``"r<rank>-..."``)."""

    def choose(self, request, session_id):
        return int(request.request_id[1])


def _group(num_ranks: int, lockstep: LockstepSettings, arrivals: list[Arrival], async_scheduling: bool = False):
    env = simpy.Environment()
    scheduler = SchedulerConfig(max_model_len=512, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    engines = [EngineCore(kv_config(num_blocks=NUM_BLOCKS), scheduler) for _ in range(num_ranks)]
    executors = [TokenClock() for _ in range(num_ranks)]
    for engine, executor in zip(engines, executors):
        executor.engine = engine
    replicas = [Replica(engine, executor) for engine, executor in zip(engines, executors)]
    recorder = MetricsRecorder(1, num_ranks)
    group = DPGroup(lockstep, num_ranks)
    cluster = Cluster(env, replicas, RoutedFront(Scripted(engines)), recorder, dp_group=group)
    cluster.run(arrivals)
    return group, recorder, engines, executors


def _arrival(rank: int, name: str, at_s: float, prompt: int, max_tokens: int) -> Arrival:
    tokens = [hash((rank, name, i)) % 50000 for i in range(prompt)]
    return Arrival(at_s, Request(f"r{rank}-{name}", TokenPrompt(tokens), max_tokens))


def test_an_idle_rank_runs_a_dummy_batch_every_step_and_its_pool_is_untouched():
    arrivals = [_arrival(rank, f"{i}", 0.01 * i, 40 + 7 * i, 6) for i in range(4) for rank in range(3)]
    group, recorder, engines, executors = _group(4, LockstepSettings(dummy_batch_s=0.0005), arrivals)
    assert group.dummy_steps[3] == group.group_steps > 0
    assert executors[3].batches == 0
    pool = engines[3].kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 and not pool.cached_block_hash_to_block[0]
    # The working ranks ran fewer dummies than the group has steps.
    assert all(group.dummy_steps[rank] < group.group_steps for rank in range(3))


def test_every_rank_row_of_a_group_step_shares_its_start_and_end():
    arrivals = [_arrival(rank, f"{i}", 0.003 * i, 20 + 31 * rank + 5 * i, 4 + rank) for i in range(5)
                for rank in range(4)]
    group, recorder, _, _ = _group(4, LockstepSettings(dummy_batch_s=0.0002), arrivals)
    steps = recorder.steps_table()
    start = steps.column("time_s").to_numpy()
    duration = steps.column("duration_s").to_numpy()
    rank = steps.column("replica").to_numpy()
    for t in np.unique(start):
        rows = start == t
        assert len(set(duration[rows])) == 1, "ranks of one group step end together"
        assert len(set(rank[rows])) == rows.sum(), "one row per rank per group step"
    # The group step lasts as long as its slowest rank: the largest batch's tokens.
    prefill = steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()
    for t in np.unique(start):
        rows = start == t
        assert duration[rows][0] == pytest.approx(max(prefill[rows].max() * PER_TOKEN_S, 0.0002))


def test_a_wave_ends_at_the_first_sync_point_with_nothing_unfinished():
    # One request of 5 outputs (5 steps: one prefill step samples the first) at 0 s and
    # another at 100 s: each wave runs to the sync at step 16 (dp_sync_interval), so two
    # waves of 16 steps; the rank with the request runs 5 real batches per wave.
    arrivals = [_arrival(0, "a", 0.0, 30, 5), _arrival(0, "b", 100.0, 30, 5)]
    group, _, _, executors = _group(2, LockstepSettings(dp_sync_interval=16, dummy_batch_s=0.001), arrivals)
    assert (group.waves, group.group_steps) == (2, 32)
    assert executors[0].batches == 10
    assert group.dummy_steps == [22, 32]


def test_the_step_counter_throttles_every_rank_on_the_same_steps(monkeypatch):
    seen: list[tuple[int, bool]] = []
    original = dp_group._step_ranks

    def spy(ranks, throttle, dummy_s):
        seen.append((group_ref[0].step_counter, throttle))
        return original(ranks, throttle, dummy_s)
    group_ref: list[DPGroup] = []
    monkeypatch.setattr(dp_group, "_step_ranks", spy)
    original_init = DPGroup.__init__

    def remember(self, *args):
        original_init(self, *args)
        group_ref.append(self)
    monkeypatch.setattr(DPGroup, "__init__", remember)
    arrivals = [_arrival(rank, f"{i}", 0.002 * i, 90, 12) for i in range(3) for rank in range(2)]
    _group(2, LockstepSettings(prefill_schedule_interval=3, dummy_batch_s=0.001), arrivals)
    assert seen and all(throttle == (counter % 3 != 0) for counter, throttle in seen)
    assert seen[0] == (0, False)


# Random group workloads: (rank, arrival s, prompt tokens, output tokens) per request.
_WORKLOADS = st.lists(st.tuples(st.integers(0, 3), st.floats(0, 0.2), st.integers(1, 150), st.integers(1, 12)),
                      min_size=1, max_size=14)


def _random_group_run(requests, interval: int, sync_interval: int) -> tuple[list[Arrival], LockstepSettings]:
    """A random workload's arrivals in time order, and the group's settings."""
    arrivals = sorted((_arrival(rank, f"{i}", at_s, prompt, out) for i, (rank, at_s, prompt, out)
                       in enumerate(requests)), key=lambda a: a.arrival_s)
    return arrivals, LockstepSettings(prefill_schedule_interval=interval, dp_sync_interval=sync_interval,
                                      dummy_batch_s=0.0003)


@settings(max_examples=25, deadline=None)
@given(_WORKLOADS, st.integers(1, 4), st.integers(1, 20))
def test_lockstep_invariants(requests, interval, sync_interval):
    arrivals, lockstep = _random_group_run(requests, interval, sync_interval)
    group, recorder, engines, executors = _group(4, lockstep, arrivals)
    table = recorder.requests_table()
    ids = table.column("request_id").to_pylist()
    ranks = table.column("replica").to_pylist()
    # Every request served by exactly one rank: the one its id names.
    assert sorted(ids) == sorted(a.request.request_id for a in arrivals)
    assert all(int(rid[1]) == rank for rid, rank in zip(ids, ranks))
    # Blocks balance on every rank: all free again, none leaked.
    for engine in engines:
        assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    # Each rank either ran its batch or a dummy on every group step.
    for rank, executor in enumerate(executors):
        assert executor.batches + group.dummy_steps[rank] == group.group_steps
    steps = recorder.steps_table()
    start = steps.column("time_s").to_numpy()
    duration = steps.column("duration_s").to_numpy()
    for t in np.unique(start):
        assert len(set(duration[start == t])) == 1


def _dp_replay(model: str | None = None, **engine):
    resolved = resolve_scenario(REPO / "scenarios" / "replay-gpt-oss-20b.toml",
                                Overrides(model=model, limit=40, engine={"max_model_len": 32768, **engine}))
    planned = resolved.plan()
    return planned, run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                               efficiency=resolved.efficiency, slo=resolved.slo)


def test_a_dp4_moe_scenario_replays_as_a_lockstep_group_behind_vllms_balancer():
    planned, result = _dp_replay(data_parallel_size=4, async_scheduling=False)
    assert planned.model.num_experts > 0
    summary = result.summary.to_pylist()[0]
    assert summary["router"] == "dp_lb" and summary["num_replicas"] == 4
    assert summary["completed"] + summary["rejected"] == 40
    replicas = result.replicas
    steps = result.steps
    ran = (steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()) > 0
    # A rank ran its batch or a dummy on every group step.
    batches = np.bincount(steps.column("replica").to_numpy()[ran], minlength=4)
    assert replicas.column("dummy_steps").to_pylist() == [summary["dp_group_steps"] - n for n in batches]
    assert sum(replicas.column("dummy_steps").to_pylist()) == summary["dummy_steps"]


def test_a_dense_models_dp_ranks_are_independent_engines_behind_vllms_balancer():
    planned, result = _dp_replay("llama-3.1-8b", data_parallel_size=2)
    assert planned.model.num_experts == 0
    summary = result.summary.to_pylist()[0]
    assert summary["router"] == "dp_lb" and summary["num_replicas"] == 2
    assert "dummy_steps" not in summary and "dummy_steps" not in result.replicas.column_names
    # Independent ranks: their steps do not start together.
    steps = result.steps
    starts = [set(steps.filter(pa.compute.equal(steps.column("replica"), r)).column("time_s").to_pylist())
              for r in range(2)]
    assert starts[0] != starts[1]


@pytest.mark.parametrize("engine, field", [
    # The features table, when the scenario is resolved (the flag that set it is named).
    ({"data_parallel_size": 2, "pipeline_parallel_size": 2}, "--pp"),
])
def test_what_a_dp_group_does_not_model_is_refused(engine, field):
    with pytest.raises(ConfigError) as err:
        _dp_replay(**engine)
    assert field in err.value.field, err.value


@pytest.mark.parametrize("model, dp, lockstep_dp", [(None, 1, 1), ("llama-3.1-8b", 2, 1), (None, 2, 2)])
def test_the_prefill_cadence_is_the_group_engine_cores_only_in_lockstep(model, dp, lockstep_dp):
    """docs/semantics.md#local-prefill-cadence: a single engine and a dense model's DP ranks
    keep the cadence in their own scheduler (it sees DP size 1); a MoE model's ranks in
    lockstep leave it to the group's step counter."""
    planned, result = _dp_replay(model, data_parallel_size=dp, prefill_schedule_interval=3, async_scheduling=False)
    config = planned.engine.scheduler
    assert config.data_parallel_size == lockstep_dp
    assert config.local_prefill_interval == (3 if lockstep_dp == 1 else 1)
    summary = result.summary.to_pylist()[0]
    assert summary["completed"] + summary["rejected"] == 40


# -- asynchronous scheduling (docs/semantics.md#asynchronous-scheduling-in-a-group) ----------


def _async_group(num_ranks: int, lockstep: LockstepSettings, arrivals: list[Arrival], monkeypatch):
    """An asynchronous group, with every group forward's (start, end) in index order."""
    forwards: list[dp_async._Forward] = []
    original = dp_async.ForwardPasses._time

    def spy(self, forward):
        forwards.append(forward)
        return original(self, forward)
    monkeypatch.setattr(dp_async.ForwardPasses, "_time", spy)
    group, recorder, engines, executors = _group(num_ranks, lockstep, arrivals, async_scheduling=True)
    return group, recorder, engines, executors, [(f.start_s, f.end_s) for f in forwards]


def _check_async_invariants(group, recorder, engines, executors, forwards, arrivals, dummy_s):
    table = recorder.requests_table()
    ids = table.column("request_id").to_pylist()
    assert sorted(ids) == sorted(a.request.request_id for a in arrivals)
    assert all(int(rid[1]) == rank for rid, rank in zip(ids, table.column("replica").to_pylist()))
    for engine, executor in zip(engines, executors):
        assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert executor.most_in_flight <= 2 and not engine.batch_queue
    assert len(forwards) == group.group_steps
    # The group's forwards run one after another.
    assert all(start >= previous_end for (_, previous_end), (start, _) in zip(forwards, forwards[1:]))
    # Each rank's k-th forward is its batch or a dummy: every rank takes part in each one.
    for rank, executor in enumerate(executors):
        assert executor.batches + group.dummy_steps[rank] == group.group_steps
    steps = recorder.steps_table()
    tokens = steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()
    ran = tokens > 0
    start = steps.column("time_s").to_numpy()[ran]
    end = start + steps.column("duration_s").to_numpy()[ran]
    rank = steps.column("replica").to_numpy()[ran]
    tokens = tokens[ran]
    by_start = {round(s, 9): (s, e) for s, e in forwards}
    for t in np.unique(start):
        rows = start == t
        forward_start, forward_end = by_start[round(t, 9)]
        # A batch runs as one of the group's forwards: it starts and ends with it.
        assert np.allclose(end[rows], forward_end)
        assert len(set(rank[rows])) == rows.sum(), "one batch per rank per forward"
        # The forward lasts as long as its slowest part (a dummy where a rank had no batch).
        slowest = tokens[rows].max() * PER_TOKEN_S
        if rows.sum() < len(engines):
            slowest = max(slowest, dummy_s)
        assert forward_end - forward_start == pytest.approx(slowest)


def test_async_an_idle_rank_runs_a_dummy_in_every_forward_and_its_pool_is_untouched(monkeypatch):
    arrivals = [_arrival(rank, f"{i}", 0.01 * i, 40 + 7 * i, 6) for i in range(4) for rank in range(3)]
    group, recorder, engines, executors, forwards = _async_group(4, LockstepSettings(dummy_batch_s=0.0005),
                                                                 arrivals, monkeypatch)
    assert group.dummy_steps[3] == group.group_steps > 0
    assert executors[3].batches == 0 and executors[3].most_in_flight == 0
    pool = engines[3].kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 and not pool.cached_block_hash_to_block[0]
    # Working ranks keep two batches in flight.
    assert all(executors[rank].most_in_flight == 2 for rank in range(3))
    _check_async_invariants(group, recorder, engines, executors, forwards, arrivals, 0.0005)


def test_async_waves_start_and_end_at_sync_points(monkeypatch):
    # As in the synchronous case: one request of 5 outputs (a prefill and 4 decodes, each a
    # forward) at 0 s and another at 100 s; each wave runs to the sync at step 16.
    arrivals = [_arrival(0, "a", 0.0, 30, 5), _arrival(0, "b", 100.0, 30, 5)]
    group, recorder, engines, executors, forwards = _async_group(
        2, LockstepSettings(dp_sync_interval=16, dummy_batch_s=0.001), arrivals, monkeypatch)
    assert (group.waves, group.group_steps) == (2, 32)
    assert executors[0].batches == 10 and group.dummy_steps == [22, 32]
    # The second wave's first forward starts at the arrival.
    assert forwards[16][0] == 100.0
    # Back to back: the prefill (30 tokens) then a decode in every forward, the next one
    # scheduled while the one before runs.
    assert [round(e - s, 9) for s, e in forwards[:5]] == [0.03, 0.001, 0.001, 0.001, 0.001]
    _check_async_invariants(group, recorder, engines, executors, forwards, arrivals, 0.001)


def test_async_a_batch_applied_late_still_counts_with_its_forward(monkeypatch):
    # Two ranks with different loads: rank 0's long prefills hold rank 1's short decodes.
    arrivals = [_arrival(0, "a", 0.0, 60, 3), _arrival(1, "b", 0.0, 4, 8), _arrival(0, "c", 0.001, 60, 2)]
    group, recorder, engines, executors, forwards = _async_group(
        2, LockstepSettings(dummy_batch_s=0.0002), arrivals, monkeypatch)
    steps = recorder.steps_table()
    rank1 = steps.filter(pa.compute.equal(steps.column("replica"), 1))
    # Rank 1's 4-token prefill waits in the group's first forward for rank 0's 60 tokens.
    assert rank1.column("duration_s").to_pylist()[0] == pytest.approx(0.06)
    _check_async_invariants(group, recorder, engines, executors, forwards, arrivals, 0.0002)


@settings(max_examples=25, deadline=None)
@given(_WORKLOADS, st.integers(1, 4), st.integers(1, 20))
def test_async_lockstep_invariants(requests, interval, sync_interval):
    arrivals, lockstep = _random_group_run(requests, interval, sync_interval)
    with pytest.MonkeyPatch.context() as monkeypatch:
        result = _async_group(4, lockstep, arrivals, monkeypatch)
    _check_async_invariants(*result, arrivals, 0.0003)


def test_a_dp4_moe_scenario_with_default_async_scheduling_replays_as_a_lockstep_group():
    planned, result = _dp_replay(data_parallel_size=4)
    assert planned.model.num_experts > 0 and planned.engine.async_scheduling
    summary = result.summary.to_pylist()[0]
    assert summary["router"] == "dp_lb" and summary["num_replicas"] == 4
    assert summary["completed"] + summary["rejected"] == 40
    steps = result.steps
    ran = (steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()) > 0
    batches = np.bincount(steps.column("replica").to_numpy()[ran], minlength=4)
    assert result.replicas.column("dummy_steps").to_pylist() == [summary["dp_group_steps"] - n for n in batches]
    # Batches of one forward start and end together on every rank.
    start = steps.column("time_s").to_numpy()[ran]
    duration = steps.column("duration_s").to_numpy()[ran]
    for t in np.unique(start):
        assert len(set(duration[start == t])) == 1


def test_the_report_and_the_replicas_line_show_each_rank():
    """The report's replicas table has one row per rank, read from ``replicas.parquet``
    (requests, hit rate, dummy batches), and the printed line gives the MoE collectives'
    share and each rank's KV usage peak."""
    from kvtwin.reports.replay_report import render_replay_report
    from kvtwin.reports.summary_text import format_percent, replicas_line

    planned, result = _dp_replay(data_parallel_size=4, async_scheduling=False)
    summary = result.summary.to_pylist()[0]
    ranks = result.replicas.to_pylist()
    html = render_replay_report(result.requests, result.steps, result.summary, planned.to_json(), {},
                                replicas=result.replicas)
    table = html.split("<h2>Replicas</h2>", 1)[1].split("</table>", 1)[0]
    head = re.findall(r"<th>(.*?)</th>", table)
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", table)]
    assert len(rows) == 4
    for rank, row in zip(ranks, rows):
        cell = dict(zip(head, row))
        assert cell["replica"] == str(rank["replica"]) and cell["requests"] == f"{rank['num_requests']:,}"
        assert cell["dummy batches"] == f"{rank['dummy_steps']:,}"
        assert cell["prefix cache hit rate"] == format_percent(rank["prefix_cache_hit_rate"])
    assert "MoE collectives (dispatch and combine), share of busy time" in html
    line = replicas_line(summary, result.replicas)
    assert f"MoE collectives {format_percent(summary['moe_communication_share'])} of busy time" in line
    assert line.endswith("; KV cache usage peak " + " / ".join(format_percent(r["kv_cache_usage_peak"], 0)
                                                               for r in ranks))
    # One replica: no table.
    one = render_replay_report(result.requests, result.steps, result.summary, planned.to_json(), {},
                               replicas=result.replicas.slice(0, 1))
    assert "<h2>Replicas</h2>" not in one
