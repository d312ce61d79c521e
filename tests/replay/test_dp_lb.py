"""The ``dp_lb`` router: vLLM's data-parallel load balancer
(docs/semantics.md#data-parallel-load-balancing).

The choice (``DPBalancer``) is checked pick by pick against vLLM 0.33's own
``DPLBAsyncMPClient`` (the golden cases of ``scripts/oracle/gen_dp_lb_golden.py``); the
coordinator's publication times (``DPCoordinator``) against the rules read in
coordinator.py; the router in a replay against the rule applied to what it saw.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.hashing import HashIdPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.router import (DP_STATS_IDLE_PUBLISH_INTERVAL_S, DP_STATS_PUBLISH_INTERVAL_S, DPBalancer,
                                      DPCoordinator, DPLoadBalancerRouter, make_router)
from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from tests.replay.chat_workload import chat_trace, llama_plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "dp_lb"
CASES = sorted(GOLDEN.glob("*.json"))


def test_there_are_golden_cases():
    assert len(CASES) >= 5


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_every_pick_matches_vllm(path):
    case = json.loads(path.read_text())
    balancer = DPBalancer(case["num_ranks"], case["client_count"], case["client_index"])
    where: dict[str, int] = {}
    picks = 0
    for event in case["events"]:
        if "publish" in event:
            balancer.receive(event["publish"])
        elif "route" in event:
            rank = balancer.pick(event["rank"])
            assert rank == event["expect"], f"{path.stem}: request {event['route']}"
            where[event["route"]] = rank
            picks += 1
        else:
            for rid in event["finish"]:
                balancer.finished(where.pop(rid))
    assert picks > 0 and sum(balancer.inflight) == len(where)


def test_a_named_rank_is_taken_without_increment_or_rotation():
    balancer = DPBalancer(3)
    assert balancer.pick(2) == 2
    assert balancer.counts == [[0, 0, 0.0]] * 3 and balancer.start_index == 0 and balancer.inflight == [0, 0, 1]
    assert balancer.pick() == 0  # rank 2's in-flight request raises its score to 1


# -- the coordinator's publications ---------------------------------------------------------


def _coordinator(n: int = 2) -> tuple[DPBalancer, DPCoordinator]:
    balancer = DPBalancer(n)
    return balancer, DPCoordinator(balancer)


def test_a_change_is_published_an_interval_after_the_last_publication():
    balancer, coordinator = _coordinator()
    assert coordinator.publications == 1  # at start
    coordinator.report(0, 2, 1, 0.3, now_s=0.03)
    assert coordinator.next_publication_s() == DP_STATS_PUBLISH_INTERVAL_S
    coordinator.report(1, 0, 4, 0.1, now_s=0.05)
    coordinator.advance(DP_STATS_PUBLISH_INTERVAL_S)  # a choice at the instant does not see it
    assert balancer.counts == [[0, 0, 0.0], [0, 0, 0.0]]
    coordinator.advance(0.11)
    assert coordinator.publications == 2 and coordinator.last_publish_s == DP_STATS_PUBLISH_INTERVAL_S
    assert balancer.counts == [[2, 1, 0.3], [0, 4, 0.1]]


def test_a_change_after_a_quiet_interval_is_published_at_once():
    balancer, coordinator = _coordinator()
    coordinator.report(1, 1, 0, 0.0, now_s=2.0)
    assert coordinator.next_publication_s() == 2.0
    coordinator.advance(2.0 + 1e-9)
    assert coordinator.last_publish_s == 2.0 and balancer.counts[1] == [1, 0, 0.0]


def test_unchanged_counts_are_not_sent_and_the_idle_publication_resets_increments():
    balancer, coordinator = _coordinator()
    coordinator.report(0, 0, 0, 0.7, now_s=1.0)  # the pair the engine sent last: nothing sent
    assert coordinator.next_publication_s() == DP_STATS_IDLE_PUBLISH_INTERVAL_S
    coordinator.advance(1.0)
    assert balancer.pick() == 0 and balancer.pick() == 1
    assert [c[0] for c in balancer.counts] == [1, 1]
    coordinator.advance(DP_STATS_IDLE_PUBLISH_INTERVAL_S + 0.01)
    assert coordinator.publications == 2
    assert [c[0] for c in balancer.counts] == [0, 0]  # the local increments are gone
    coordinator.advance(3 * DP_STATS_IDLE_PUBLISH_INTERVAL_S + 0.01)
    assert coordinator.publications == 4 and coordinator.last_publish_s == 3 * DP_STATS_IDLE_PUBLISH_INTERVAL_S


# -- in a replay ----------------------------------------------------------------------------


def _replicas(n: int, async_scheduling: bool = True):
    p = llama_plan(async_scheduling=async_scheduling)
    kv = p.require_fits()
    engines = [EngineCore(kv, p.engine.scheduler, p.engine.cache) for _ in range(n)]
    replicas = [Replica(engine, CostModelExecutor(plan_cost_model(p))) for engine in engines]
    return engines, replicas, len(kv.groups)


def test_a_simultaneous_burst_is_dealt_in_turn():
    """All arrive at one instant: every engine looks idle to the balancer (no publication
    can come in between), so its increments and its rotation deal them in turn."""
    n, per = 4, 5
    engines, replicas, groups = _replicas(n)
    router = make_router("dp_lb", engines)
    arrivals = [Arrival(0.0, Request(f"r{i}", HashIdPrompt((), 16, 64, unique_id=i), 8), None)
                for i in range(n * per)]
    recorder = MetricsRecorder(groups, n)
    run_simulation(replicas, arrivals, recorder, router=router)
    assert router.routed == [per] * n
    assert all(not engine.has_unfinished_requests() for engine in engines)
    assert router.balancer.inflight == [0] * n and router.outstanding == [0] * n


class _Spy(DPLoadBalancerRouter):
    """Records what the balancer saw before each pick."""

    def __init__(self, engines):
        super().__init__(engines)
        self.seen: list[tuple[list[list[float]], list[int], int, int]] = []

    def choose(self, request, session_id):
        self.coordinator.advance(request.arrival_time)
        before = ([list(c) for c in self.balancer.counts], list(self.balancer.inflight), self.balancer.start_index)
        rank = self.balancer.pick()
        self.seen.append((*before, rank))
        return rank


def _expected_pick(counts, inflight, start) -> int:
    """vLLM's rule, written out again: the lowest score, the first in scan order on a tie."""
    n = len(counts)
    order = [(start + i) % n for i in range(n)]

    def score(r: int) -> float:
        waiting, running, usage = counts[r]
        return max(inflight[r], waiting + running) + (waiting * 6.0 * max(0.0, usage - 0.5) if waiting else 0.0)
    best = min(score(r) for r in order)
    return next(r for r in order if score(r) == best)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_replay_routes_each_request_once_by_the_rule_and_spreads_the_load(async_scheduling):
    n = 4
    trace = chat_trace(300)
    engines, replicas, groups = _replicas(n, async_scheduling)
    router = _Spy(engines)
    coordinator = router.coordinator
    published = [coordinator.last_publish_s]
    publish = coordinator._publish

    def recorded(at_s: float) -> None:
        published.append(at_s)
        publish(at_s)
    coordinator._publish = recorded
    recorder = MetricsRecorder(groups, n)
    run_simulation(replicas, arrivals_from_trace(trace), recorder, router=router)
    assert len(router.seen) == trace.num_rows and sum(router.routed) == trace.num_rows
    starts = [s for _, _, s, _ in router.seen]
    assert starts == [i % n for i in range(trace.num_rows)]  # the scan start rotates per request
    for counts, inflight, start, rank in router.seen:
        assert rank == _expected_pick(counts, inflight, start)
    # Every pick went where the rule says; the published counts took part (some pick saw
    # another engine's requests) and every replica served requests.
    assert any(any(c[0] + c[1] for c in counts) for counts, _, _, _ in router.seen)
    assert min(router.routed) > 0
    assert all(not engine.has_unfinished_requests() for engine in engines)
    assert router.balancer.inflight == [0] * n
    # Publications: never two within an interval, never an idle gap longer than the idle one.
    gaps = [b - a for a, b in zip(published, published[1:])]
    assert len(gaps) > trace.num_rows // 10
    assert min(gaps) >= DP_STATS_PUBLISH_INTERVAL_S - 1e-9 and max(gaps) <= DP_STATS_IDLE_PUBLISH_INTERVAL_S + 1e-9
