"""Data-parallel replicas behind a router (``engine.replicas``, ``engine.router``).

One replica with any router is today's replay; with several, every request is routed
once, the replica columns and the per-replica summary add up to the cluster, each router
does what its name says, and ``prefix_aware`` catches more prefix reuse than
``round_robin`` on a session-heavy workload.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import HashIdPrompt, TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.scenario.deployment import ROUTER_NAMES, Deployment
from kvtwin.sim.scenario.parse import engine_and_deployment
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.run_tables import RunSettings, run_tables
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.replay.router import ROUTERS, SingleReplicaRouter, LeastLoadedRouter, PrefixAwareRouter, make_router
from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model, run_replay
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.traces import transforms
from kvtwin.traces.bundled import bundled_path
from kvtwin.traces.load import load_trace
from tests.replay.chat_workload import chat_trace, llama_plan
from tests.tables import assert_tables_equal

NEW_REQUEST_COLUMNS = ("replica",)
NEW_STEP_COLUMNS = ("replica",)
NEW_SUMMARY_COLUMNS = ("num_replicas", "router", "load_imbalance")
SLO_ = SLO(ttft_s=2.0, tpot_s=0.1)
NUM_REPLICAS = 4



@pytest.fixture(scope="module")
def chat():
    return chat_trace(400)


@pytest.fixture(scope="module")
def mooncake_head():
    return transforms.limit(load_trace(bundled_path("mooncake_conversation_trace.jsonl")), 150)


@pytest.fixture(scope="module")
def cluster_runs(chat):
    return {router: run_replay(llama_plan(), chat, deployment=Deployment(NUM_REPLICAS, router), slo=SLO_)
            for router in ROUTER_NAMES}


# -- one replica: today's replay ----------------------------------------------------------


def _single_engine_replay(p, trace):
    """The replay as it ran before replicas: one engine, one executor, no router."""
    kv = p.require_fits()
    engine = EngineCore(kv, p.engine.scheduler, p.engine.cache)
    metrics = MetricsRecorder(len(kv.groups))
    end_s = run_simulation([Replica(engine, CostModelExecutor(plan_cost_model(p)))], arrivals_from_trace(trace),
                           metrics)
    # Every run has the client-side columns, the server's when nothing lies outside the engine.
    tables = run_tables(metrics, end_s, RunSettings(SLO_, trace, "round_robin", "0"))
    return tables.requests, tables.steps, tables.summary


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_one_replica_with_any_router_is_todays_replay(mooncake_head, async_scheduling):
    """Checked once, too, against the code before replicas existed (600 Mooncake rows,
    both clocks): identical tables but for the new columns."""
    settings = {"max_model_len": 131072, "async_scheduling": async_scheduling}
    reference = _single_engine_replay(plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(**settings)),
                                      mooncake_head)
    for router in ROUTER_NAMES:
        p = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(**settings))
        result = run_replay(p, mooncake_head, deployment=Deployment(router=router), slo=SLO_)
        assert_tables_equal(result.requests.drop(list(NEW_REQUEST_COLUMNS)),
                            reference[0].drop(list(NEW_REQUEST_COLUMNS)))
        assert_tables_equal(result.steps.drop(list(NEW_STEP_COLUMNS)), reference[1].drop(list(NEW_STEP_COLUMNS)))
        assert_tables_equal(result.summary.drop(list(NEW_SUMMARY_COLUMNS)),
                            reference[2].drop(list(NEW_SUMMARY_COLUMNS)))
        assert set(result.requests.column("replica").to_pylist()) == {0}
        assert set(result.steps.column("replica").to_pylist()) == {0}
        s = result.summary.to_pylist()[0]
        assert (s["num_replicas"], s["router"], s["load_imbalance"]) == (1, router, 1.0)
        row = result.replicas.to_pylist()
        assert len(row) == 1 and row[0]["replica"] == 0 and row[0]["load_ratio"] == 1.0
        assert row[0]["num_requests"] == s["num_requests"] and row[0]["num_steps"] == s["num_steps"]


# -- several replicas: conservation --------------------------------------------------------


SUMMED = ("num_requests", "completed", "rejected", "unfinished", "total_input_tokens", "total_output_tokens",
          "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "recomputed_tokens", "num_evictions",
          "num_steps", "prefill_tokens", "decode_tokens", "busy_time_s")


@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_every_request_routed_once_and_per_replica_figures_sum_to_the_cluster(cluster_runs, chat, router):
    result = cluster_runs[router]
    requests, steps, summary = result.requests, result.steps, result.summary.to_pylist()[0]
    assert requests.column("request_id").to_pylist() == chat.column("request_id").to_pylist()
    assert set(requests.column("status").to_pylist()) <= {"finished", "rejected"}
    assert requests.schema.field("replica").type == pa.int32() and steps.schema.field("replica").type == pa.int32()
    replica = requests.column("replica").to_numpy()
    assert replica.min() >= 0 and replica.max() < NUM_REPLICAS
    assert set(steps.column("replica").to_pylist()) <= set(range(NUM_REPLICAS))
    assert summary["num_replicas"] == NUM_REPLICAS and summary["router"] == router
    table = result.replicas
    assert table.column("replica").to_pylist() == list(range(NUM_REPLICAS))
    assert table.schema.field("replica").type == pa.int32()
    rows = table.to_pylist()
    for name in SUMMED:
        assert sum(r[name] for r in rows) == pytest.approx(summary[name]), name
    counts = np.bincount(replica, minlength=NUM_REPLICAS)
    assert [r["num_requests"] for r in rows] == counts.tolist()
    assert summary["load_imbalance"] == pytest.approx(counts.max() / counts.mean())
    assert [r["load_ratio"] for r in rows] == pytest.approx((counts / counts.mean()).tolist())
    # Each replica's device runs one batch at a time; its clock never goes back.
    step_replica = steps.column("replica").to_numpy()
    for r in range(NUM_REPLICAS):
        start = steps.column("time_s").to_numpy()[step_replica == r]
        duration = steps.column("duration_s").to_numpy()[step_replica == r]
        assert (start[1:] >= start[:-1] + duration[:-1] - 1e-9).all()
    # A request's steps ran where it was routed: its scheduled tokens add up there.
    per_replica_tokens = [int(requests.column("scheduled_tokens").to_numpy()[replica == r].sum())
                          for r in range(NUM_REPLICAS)]
    per_replica_steps = [int(steps.column("prefill_tokens").to_numpy()[step_replica == r].sum()
                             + steps.column("decode_tokens").to_numpy()[step_replica == r].sum())
                         for r in range(NUM_REPLICAS)]
    assert per_replica_tokens == per_replica_steps


def test_round_robin_deals_arrivals_in_turn(cluster_runs, chat):
    replica = cluster_runs["round_robin"].requests.column("replica").to_pylist()
    assert replica == [i % NUM_REPLICAS for i in range(chat.num_rows)]
    assert cluster_runs["round_robin"].summary.column("load_imbalance")[0].as_py() == 1.0


def test_session_affinity_keeps_sessions_together(cluster_runs):
    requests = cluster_runs["session_affinity"].requests
    where: dict[str, set[int]] = {}
    for session, replica in zip(requests.column("session_id").to_pylist(), requests.column("replica").to_pylist()):
        where.setdefault(session, set()).add(replica)
    assert len(where) > NUM_REPLICAS and all(len(r) == 1 for r in where.values())
    assert len(set().union(*where.values())) == NUM_REPLICAS  # new sessions spread over every replica


def test_least_loaded_balances(cluster_runs):
    imbalance = {name: cluster_runs[name].summary.column("load_imbalance")[0].as_py() for name in ROUTER_NAMES}
    assert imbalance["least_loaded"] < 1.3
    assert imbalance["least_loaded"] < imbalance["session_affinity"]
    assert min(cluster_runs["least_loaded"].replicas.column("num_requests").to_pylist()) > 0


def test_least_loaded_picks_the_fewest_outstanding_tokens_lowest_index_on_ties():
    p = llama_plan()
    kv = p.require_fits()
    engines = [EngineCore(kv, p.engine.scheduler, p.engine.cache) for _ in range(3)]
    router = LeastLoadedRouter(engines)

    def request(i: int, tokens: int) -> Request:
        return Request(f"r{i}", HashIdPrompt((), 16, tokens, unique_id=i), 10)

    big, small = request(0, 1000), request(1, 100)
    assert router.route(big) == 0  # all idle: the lowest index
    assert router.route(small) == 1
    assert router.route(request(2, 100)) == 2
    assert router.outstanding == [1010, 110, 110]
    assert router.route(request(3, 5)) == 1  # 1 and 2 tie
    router.release(0, big)
    assert router.route(request(4, 5)) == 0


def test_prefix_aware_beats_round_robin_on_prefix_hits(cluster_runs):
    """Measured on this 400-request chat workload, 4 replicas of 3 GiB of KV cache each:
    prefix-cache hit rate 0.578 with ``prefix_aware`` against 0.433 with ``round_robin``
    (+14.5 points; ``session_affinity`` 0.682, ``least_loaded`` 0.474; the trace's
    infinite-cache bound 0.833), with a load imbalance of 1.19 against 1.00."""
    hit = {name: cluster_runs[name].summary.column("prefix_cache_hit_rate")[0].as_py() for name in ROUTER_NAMES}
    assert hit["prefix_aware"] > hit["round_robin"] + 0.10
    assert cluster_runs["prefix_aware"].summary.column("load_imbalance")[0].as_py() < 1.5


def test_prefix_aware_reads_each_replicas_cached_blocks():
    """The router's score is the prefix cached on each replica, from its pool's hash map,
    with the engine's own hashes (hash-id prompts and token prompts)."""
    p = llama_plan(async_scheduling=False)
    kv = p.require_fits()
    engines = [EngineCore(kv, p.engine.scheduler, p.engine.cache) for _ in range(2)]
    router = PrefixAwareRouter(engines)
    executor = CostModelExecutor(plan_cost_model(p))
    ids = list(range(100, 110))  # ten 16-token chunks
    tokens = list(range(1000, 1000 + 160))
    engines[1].add_request(Request("a", HashIdPrompt(ids, 16, 160), 4))
    engines[1].add_request(Request("b", TokenPrompt(tokens), 4))
    while engines[1].has_unfinished_requests():
        engines[1].step(executor)
    # A longer prompt sharing the first 6 chunks / 100 tokens (6 whole blocks).
    again = Request("c", HashIdPrompt(ids[:6] + [7, 8], 16, 128), 4)
    assert router.cached_tokens(again) == [0, 96]
    token_again = Request("d", TokenPrompt(tokens[:100] + [1, 2, 3]), 4)
    assert router.cached_tokens(token_again) == [0, 96]
    assert router.route(again) == 1  # 96 fewer prefill tokens, both idle
    # Replica 1 now has 132 outstanding tokens against 96 tokens of saved prefill:
    # the same prompt goes to the idle replica.
    assert router.costs(Request("e", HashIdPrompt(ids[:6] + [7, 8], 16, 128), 4)) == [128.0, 128.0 - 96 + 132]
    assert router.route(Request("e", HashIdPrompt(ids[:6] + [7, 8], 16, 128), 4)) == 0


def test_router_registry_matches_the_config_names():
    assert tuple(ROUTERS) == ROUTER_NAMES
    p = llama_plan()
    kv = p.require_fits()
    engines = [EngineCore(kv, p.engine.scheduler, p.engine.cache) for _ in range(2)]
    for name in ROUTER_NAMES:
        assert type(make_router(name, engines)) is ROUTERS[name]
    # One replica needs no choice, whatever the name.
    assert type(make_router("prefix_aware", engines[:1])) is SingleReplicaRouter


def test_cluster_replay_is_deterministic(chat):
    p, deployment = llama_plan(), Deployment(3, "prefix_aware")
    first, second = run_replay(p, chat, deployment=deployment), run_replay(p, chat, deployment=deployment)
    for name in ("requests", "steps", "summary", "replicas"):
        assert_tables_equal(getattr(first, name), getattr(second, name))
    assert first.end_time_s == second.end_time_s


@pytest.mark.parametrize("key, value", [("replicas", 0), ("replicas", -2), ("replicas", 1.5), ("replicas", "2"),
                                        ("replicas", True), ("router", "random"), ("router", 3),
                                        ("router", "Round_Robin")])
def test_bad_replicas_or_router_is_one_config_error_naming_the_field(key, value):
    with pytest.raises(ConfigError) as err:
        engine_and_deployment({key: value})
    assert err.value.field == f"engine.{key}"
    assert str(err.value).startswith(f"engine.{key}: expected ")
    with pytest.raises(ConfigError) as err:
        Deployment(**{key: value})
    assert err.value.field == key


def test_replicas_and_router_flow_from_the_engine_table():
    engine, deployment = engine_and_deployment({"replicas": 3, "router": "session_affinity", "max_num_seqs": 8})
    assert (deployment.replicas, deployment.router) == (3, "session_affinity")
    assert engine == EngineConfig(max_num_seqs=8)
    assert (Deployment().replicas, Deployment().router) == (1, "round_robin")
