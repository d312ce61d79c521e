"""Disaggregated prefill/decode in the replay: the ``[disaggregation]`` config, the P/D
router, the flow between the roles, and its outputs.

Properties (hypothesis) over xPyD shapes, links and scheduling modes, on a short chat
workload with a small KV cache:

* block conservation across both instances: every engine's pool balances at every
  applied batch; a prefill request's blocks stay allocated until its read has landed,
  and are freed only after that instant;
* no request is lost between roles: every arrival ends finished or rejected, each
  finished one ran its prompt on one prefill replica and decoded on one decode replica,
  and every engine ends with nothing held.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.replay.clock.arrivals import arrival_process
from kvtwin.sim.replay.clock.cluster import Cluster, RoutedFront
from kvtwin.sim.replay.clock.engine_processes import async_engine_process, sync_engine_process
from kvtwin.sim.replay.clock.pd_front import PREFILL_SUFFIX, PDFront
from kvtwin.sim.replay.connector_tiers import connector_tiers
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.router import Router
from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model, run_replay, run_with_executor
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.disaggregation import Disaggregation, disaggregation_from_mapping
from kvtwin.sim.scenario.parse import parse_scenario
from kvtwin.sim.scenario.resolve import resolve_scenario
from tests.replay.chat_workload import chat_trace, llama_plan
from tests.sim.invariant_checks import check_pool


@pytest.fixture(scope="module")
def chat():
    return chat_trace(60)


# -- the config ---------------------------------------------------------------------------


@pytest.mark.parametrize("table, field", [
    ({"prefill_replicas": 0}, "disaggregation.prefill_replicas"),
    ({"decode_replicas": 0}, "disaggregation.decode_replicas"),
    ({"prefill_replicas": 1.5}, "disaggregation.prefill_replicas"),
    ({"link": "infiniband"}, "disaggregation.link"),
    ({"link": "rdma", "bandwidth_gbps": 0}, "disaggregation.bandwidth_gbps"),
    ({"latency_us": -1}, "disaggregation.latency_us"),
    ({"prefill_router": "random"}, "disaggregation.prefill_router"),
    ({"prefill": 2}, "disaggregation.prefill"),
])
def test_bad_disaggregation_names_the_field(table, field):
    with pytest.raises(ConfigError) as err:
        disaggregation_from_mapping(table)
    assert err.value.field == field


def test_scenario_section_and_offload_clash(tmp_path):
    scenario = parse_scenario({"disaggregation": {"prefill_replicas": 2, "decode_replicas": 1}}, tmp_path)
    assert scenario.disaggregation == Disaggregation(prefill_replicas=2, decode_replicas=1)
    assert parse_scenario({}, tmp_path).disaggregation is None
    # The clash is refused once every feature is known: when the scenario is resolved.
    data = {"model": {"preset": "llama-3.1-8b"}, "hardware": {"gpu": "h100"},
            "disaggregation": {"prefill_replicas": 1}, "offload": {"cpu_bytes": 2**30}}
    with pytest.raises(ConfigError) as err:
        resolve_scenario(tmp_path / "s.toml", data=data)
    assert err.value.field == "disaggregation" and "[offload]" in err.value.expected


def test_links():
    assert Disaggregation(link="rdma").link_bytes_per_s(900e9) == 400e9 / 8
    assert Disaggregation(link="nvlink").link_bytes_per_s(900e9) == 900e9
    assert Disaggregation(link="nvlink", bandwidth_gbps=800).link_bytes_per_s(900e9) == 100e9
    assert Disaggregation(link="rdma", latency_us=3).link_latency_s == pytest.approx(3e-6)
    with pytest.raises(ConfigError) as err:
        Disaggregation(link="nvlink").link_bytes_per_s(0.0)
    assert err.value.field == "disaggregation.link"


def test_rdma_defaults_to_the_gpu_presets_nic():
    """Without ``bandwidth_gbps`` an RDMA link runs at the GPU preset's NIC per GPU (the
    vendor's reference system: ConnectX-6 200G for A100, ConnectX-7 400G for H100/H200/B200);
    a GPU without a published NIC gets 400 Gb/s; ``bandwidth_gbps`` wins over both."""
    rdma = Disaggregation(link="rdma")
    assert rdma.link_bytes_per_s(900e9, 25e9) == 25e9
    assert rdma.link_bytes_per_s(900e9, 0.0) == 400e9 / 8
    assert Disaggregation(link="rdma", bandwidth_gbps=800).link_bytes_per_s(900e9, 25e9) == 100e9
    assert Disaggregation(link="nvlink").link_bytes_per_s(900e9, 25e9) == 900e9
    nics = {name: get_gpu(name).nic_bytes_per_s for name in ("a100-80gb", "h100", "h200", "b200", "l40s")}
    assert nics == {"a100-80gb": 200e9 / 8, "h100": 400e9 / 8, "h200": 400e9 / 8, "b200": 400e9 / 8, "l40s": 0.0}
    env = simpy.Environment()
    h100, a100 = llama_plan(), dataclasses.replace(llama_plan(), gpu=get_gpu("a100-80gb"))
    for plan, expected in ((h100, 400e9 / 8), (a100, 200e9 / 8)):
        tiers = connector_tiers(plan, env, 2, disaggregation=Disaggregation(prefill_replicas=1, decode_replicas=1))
        assert tiers[1].transfers.link.bandwidth_bytes_per_s == expected
        assert tiers[1].transfers.link.latency_s == pytest.approx(10e-6)


# -- a run, watched batch by batch ----------------------------------------------------------


class WatchedFront(PDFront):
    """Checks block conservation on every engine at every applied batch, and when each
    prefill request's blocks came back against when its read landed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_done_s: dict[str, float] = {}
        self.freed_s: dict[str, float] = {}
        self.prefilled_on: dict[str, int] = {}
        self.delayed_last: dict[int, set[str]] = {}

    def _send_done(self, cluster, flight, at_s):
        self.read_done_s[flight.prefill_id] = at_s
        super()._send_done(cluster, flight, at_s)

    def after_applied(self, cluster, replica, result, times):
        engine = replica.engine
        # What was held at the previous batch (the engine frees while it steps, before this call).
        delayed_before = self.delayed_last.get(replica.index, set())
        super().after_applied(cluster, replica, result, times)
        check_pool(engine)
        state = engine.scheduler.connector_state
        for request_id, request in state.delayed_free.items():
            # Held until the read lands: its blocks are still in its tables.
            assert any(engine.kv_cache_manager.get_block_ids(request_id)), request_id
        if replica.index < self.num_prefill:
            for request in result.finished:
                self.prefilled_on[request.request_id] = replica.index
            for request_id in delayed_before - set(state.delayed_free):
                self.freed_s[request_id] = times.end_s  # the batch whose report freed them ended then
                assert request_id in self.read_done_s, f"{request_id} freed before its read was issued"
                assert self.read_done_s[request_id] <= times.end_s + 1e-12
        self.delayed_last[replica.index] = set(state.delayed_free)


def watched_run(plan, trace, disaggregation: Disaggregation):
    env = simpy.Environment()
    tiers = connector_tiers(plan, env, disaggregation.num_replicas, disaggregation=disaggregation)
    engines = [EngineCore(plan.require_fits(), plan.engine.scheduler, plan.engine.cache, tier) for tier in tiers]
    p = disaggregation.prefill_replicas
    router = PDRouter(engines[:p], engines[p:], disaggregation.prefill_router, disaggregation.decode_router)
    roles = ["prefill"] * p + ["decode"] * disaggregation.decode_replicas
    recorder = MetricsRecorder(len(plan.require_fits().groups), len(engines), roles=roles)
    replicas = [Replica(engine, CostModelExecutor(plan_cost_model(plan))) for engine in engines]
    front = WatchedFront(tiers, router)
    cluster = Cluster(env, replicas, front, recorder)
    cluster.run(arrivals_from_trace(trace))
    return cluster, front, recorder


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefill=st.integers(1, 3), decode=st.integers(1, 2), async_scheduling=st.booleans(),
       link=st.sampled_from([("rdma", 400.0), ("rdma", 1.0), ("nvlink", None)]),
       prefill_router=st.sampled_from(["prefix_aware", "round_robin"]))
def test_blocks_conserved_and_no_request_lost(chat, prefill, decode, async_scheduling, link, prefill_router):
    plan = llama_plan(async_scheduling=async_scheduling)
    trace = chat.slice(0, 40)
    disaggregation = Disaggregation(prefill_replicas=prefill, decode_replicas=decode, link=link[0],
                                    bandwidth_gbps=link[1], prefill_router=prefill_router)
    cluster, front, recorder = watched_run(plan, trace, disaggregation)
    requests = recorder.requests_table().to_pydict()
    assert len(requests["request_id"]) == trace.num_rows
    assert set(requests["status"]) <= {"finished", "rejected"}
    for i, request_id in enumerate(requests["request_id"]):
        if requests["status"][i] != "finished":
            continue
        # Prefilled on the prefill replica the router chose, decoded on a decode replica.
        assert front.prefilled_on[request_id + PREFILL_SUFFIX] == requests["prefill_replica"][i] < prefill
        assert prefill <= requests["decode_replica"][i] < prefill + decode
        assert requests["transfer_bytes"][i] > 0 and requests["transfer_s"][i] > 0
        # The first token comes from the decode side, after the prefill and the read.
        assert (requests["first_token_time_s"][i]
                >= requests["prefill_finish_time_s"][i] + requests["transfer_s"][i] - 1e-9)
        assert requests["generated_tokens"][i] == requests["output_tokens"][i]
        # Every prefill request's blocks came back, and only after its read.
        assert front.freed_s[request_id + PREFILL_SUFFIX] >= front.read_done_s[request_id + PREFILL_SUFFIX]
    for replica, tier in zip(cluster.replicas, front.tiers):
        engine = replica.engine
        assert not engine.scheduler.connector_state.delayed_free
        assert not tier.connector.has_pending_jobs() and not engine.waits_for_transfers()
        pool = engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


# -- one replay path ------------------------------------------------------------------------


def _clusters_the_processes_see(run) -> list:
    """Each SimPy process's ``cluster`` argument during ``run()``: the arrival process's
    and every engine process's, as their frames start (a profile hook sees them whether
    the code that starts them is compiled or not)."""
    codes = {arrival_process.__code__, sync_engine_process.__code__, async_engine_process.__code__}
    # A process by its code and its replica (none for the arrival process): a resumed
    # generator is "called" again, and need not come back in the same frame object.
    seen = {}

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            replica = frame.f_locals.get("replica")
            seen.setdefault((frame.f_code, id(replica)), frame.f_locals["cluster"])

    # An earlier run's processes, closed when the collector frees them, would be "called"
    # once more under the hook: free them first.
    gc.collect()
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return list(seen.values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pd_and_plain_replays_run_the_same_cluster_with_another_front(chat, async_scheduling):
    """``run_replay`` has one path: a P/D replay's processes are handed the same
    ``Cluster`` class as a plain replay's (no wrapper, no second runner), only its front
    differs, and the router the plain front holds is the one ``Router.route`` caller."""
    plan = llama_plan(async_scheduling=async_scheduling)
    trace = chat.slice(0, 12)
    fronts = {}
    for name, kwargs in (("plain", {"deployment": Deployment(replicas=2)}),
                         ("pd", {"disaggregation": Disaggregation(prefill_replicas=2, decode_replicas=1)})):
        seen = _clusters_the_processes_see(lambda: run_replay(plan, trace, **kwargs))
        # The arrival process and one engine process per replica, all given one cluster.
        assert len(seen) == 1 + (2 if name == "plain" else 3)
        assert len({id(cluster) for cluster in seen}) == 1
        assert type(seen[0]) is Cluster
        fronts[name] = seen[0].front
    assert type(fronts["plain"]) is RoutedFront and isinstance(fronts["plain"].router, Router)
    assert type(fronts["pd"]) is PDFront and isinstance(fronts["pd"].router, PDRouter)


def test_the_pd_router_is_not_a_router(chat):
    """It picks pairs for the P/D front and claims no ``route`` of one replica, so only a
    plain front routes (it once raised ``TypeError`` from a ``route`` it had to have)."""
    assert not issubclass(PDRouter, Router)
    assert not hasattr(PDRouter, "route")
    engines = [EngineCore(llama_plan().require_fits(), llama_plan().engine.scheduler, llama_plan().engine.cache)
               for _ in range(3)]
    router = PDRouter(engines[:2], engines[2:], "round_robin", "least_loaded")
    requests = [request for _, request in zip(range(4), (a.request for a in arrivals_from_trace(chat)))]
    pairs = [router.route_pair(r, r, None) for r in requests]
    assert pairs == [(0, 2), (1, 2), (0, 2), (1, 2)]  # round robin over the prefill side, the one decode replica


# -- the outputs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_result(chat):
    return run_replay(llama_plan(), chat, disaggregation=Disaggregation(prefill_replicas=2, decode_replicas=1))


def test_outputs_have_the_pd_columns(pd_result):
    requests = pd_result.requests
    for name in ("prefill_replica", "decode_replica", "transfer_bytes", "transfer_s", "prefill_finish_time_s",
                 "decode_prefix_hit_tokens"):
        assert name in requests.column_names
    roles = pd_result.steps.column("role").to_pylist()
    replicas = pd_result.steps.column("replica").to_pylist()
    assert {(r, role) for r, role in zip(replicas, roles)} <= {(0, "prefill"), (1, "prefill"), (2, "decode")}
    summary = pd_result.summary.to_pylist()[0]
    assert summary["pd_prefill_replicas"] == 2 and summary["pd_link"] == "rdma"
    assert 0 < summary["pd_transfer_share_of_ttft"] < 1
    done = np.array(requests.column("status").to_pylist()) == "finished"
    ttft = requests.column("ttft_s").to_numpy()[done]
    transfer = requests.column("transfer_s").to_numpy()[done]
    assert summary["pd_transfer_share_of_ttft"] == pytest.approx(float((transfer / ttft).mean()))
    # Balance per side: the two prefill replicas' counts (one decode replica is even).
    counts = np.bincount(requests.column("prefill_replica").to_numpy(), minlength=2)
    assert summary["load_imbalance"] == pytest.approx(max(counts.max() / counts.mean(), 1.0))


def test_each_replica_row_is_what_that_replica_did(pd_result):
    """replicas.parquet of a P/D run: a prefill replica's row counts the requests it
    prefilled and the prefix hits found there, a decode replica's the requests it decoded
    and its own hits (before its read); load ratios are over each side's mean."""
    r = {name: pd_result.requests.column(name).to_numpy(zero_copy_only=False)
         for name in ("prefill_replica", "decode_replica", "prefix_hit_tokens", "prefix_cache_queries",
                      "prefix_cache_hits", "decode_prefix_hit_tokens", "decode_prefix_cache_queries",
                      "decode_prefix_cache_hits", "prompt_tokens", "num_preemptions", "status")}
    rows = pd_result.replicas.to_pylist()
    assert [row["role"] for row in rows] == ["prefill", "prefill", "decode"]
    assert [row["replica"] for row in rows] == [0, 1, 2]
    sides = {"prefill": ("prefill_replica", ""), "decode": ("decode_replica", "decode_")}
    for row in rows:
        column, prefix = sides[row["role"]]
        mine = r[column] == row["replica"]
        side = [n for n, (c, _) in sides.items() if c == column][0]
        side_counts = np.array([(r[column] == other["replica"]).sum() for other in rows if other["role"] == side])
        assert row["num_requests"] == mine.sum() > 0
        assert row["load_ratio"] == pytest.approx(mine.sum() / side_counts.mean())
        queries = r[f"{prefix}prefix_cache_queries"][mine].sum()
        hits = r[f"{prefix}prefix_cache_hits"][mine].sum()
        assert (row["prefix_cache_queries"], row["prefix_cache_hits"]) == (queries, hits)
        assert row["prefix_cache_hit_rate"] == pytest.approx(hits / queries)
    # Each side's requests add up to the run's; the prefill side's hits are the summary's.
    summary = pd_result.summary.to_pylist()[0]
    for role in sides:
        assert sum(row["num_requests"] for row in rows if row["role"] == role) == summary["num_requests"]
    assert sum(row["prefix_cache_hits"] for row in rows if row["role"] == "prefill") == summary["prefix_cache_hits"]
    # The decode side looks its prompt up once (no preemption here) and finds its own hit:
    # the query is the prompt, as long as the request was at the lookup (not counting the
    # token its admitting batch samples).
    decoded = (r["status"] == "finished") & (r["num_preemptions"] == 0)
    assert decoded.sum() > 10
    np.testing.assert_array_equal(r["decode_prefix_cache_queries"][decoded], r["prompt_tokens"][decoded])
    np.testing.assert_array_equal(r["decode_prefix_cache_hits"][decoded], r["decode_prefix_hit_tokens"][decoded])
    assert r["decode_prefix_cache_hits"][decoded].sum() > 0


def test_the_replicas_line_balances_each_side_on_its_own(pd_result):
    """No run-wide "imbalance" beside counts that are uneven by construction: each side's
    requests per replica and its own imbalance (largest over its mean)."""
    from kvtwin.reports.summary_text import replicas_line

    summary = pd_result.summary.to_pylist()[0]
    line = replicas_line(summary, pd_result.replicas)
    prefill = np.bincount(pd_result.requests.column("prefill_replica").to_numpy(), minlength=2)
    decoded = pd_result.requests.num_rows
    assert line == (f"replicas: 2 prefill + 1 decode behind {summary['router']}: prefill requests "
                    f"{prefill[0]:,} / {prefill[1]:,} (imbalance {prefill.max() / prefill.mean():.2f}), prefix cache "
                    f"hit rate {_percent(pd_result.replicas, 0)} / {_percent(pd_result.replicas, 1)}; decode "
                    f"requests {decoded:,} (imbalance 1.00), prefix cache hit rate {_percent(pd_result.replicas, 2)}")
    assert " 0 / 0 " not in line


def _percent(replicas, index: int) -> str:
    row = replicas.to_pylist()[index]
    return f"{row['prefix_cache_hits'] / row['prefix_cache_queries'] * 100:.1f} %"


def test_transfer_bytes_are_every_layer_of_the_prompt(pd_result):
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes per token, in whole
    # 16-token blocks past the decode side's own hit (none for the first request: one
    # decode replica starts cold, then hits its own earlier decodes' prompts).
    requests = pd_result.requests.to_pydict()
    per_token = 32 * 8 * 128 * 2 * 2
    assert requests["decode_prefix_hit_tokens"][0] == 0
    hits = 0
    for i, status in enumerate(requests["status"]):
        if status != "finished":
            continue
        hit = requests["decode_prefix_hit_tokens"][i]
        assert hit % 16 == 0 and hit < requests["prompt_tokens"][i]
        blocks = math.ceil(requests["prompt_tokens"][i] / 16) - hit // 16
        assert requests["transfer_bytes"][i] == blocks * 16 * per_token, i
        hits += hit > 0
    assert hits > 10  # the decode side's own hits are reported (they used to read 0)


def test_deterministic(chat):
    disaggregation = Disaggregation(prefill_replicas=1, decode_replicas=2)
    plan = llama_plan()
    a = run_replay(plan, chat, disaggregation=disaggregation)
    b = run_replay(plan, chat, disaggregation=disaggregation)
    assert a.requests.equals(b.requests) and a.steps.equals(b.steps)


def test_slow_link_shows_in_ttft(chat):
    plan = llama_plan()
    executors = [CostModelExecutor(plan_cost_model(plan)) for _ in range(2)]
    fast = run_with_executor(plan, chat, executors, disaggregation=Disaggregation(bandwidth_gbps=800))
    executors = [CostModelExecutor(plan_cost_model(plan)) for _ in range(2)]
    slow = run_with_executor(plan, chat, executors, disaggregation=Disaggregation(bandwidth_gbps=1))
    fast_s, slow_s = fast.summary.to_pylist()[0], slow.summary.to_pylist()[0]
    assert slow_s["pd_transfer_mean_ms"] > 100 * fast_s["pd_transfer_mean_ms"]
    assert slow_s["mean_ttft_ms"] > fast_s["mean_ttft_ms"]


def test_every_pd_column_is_documented_in_the_schema(pd_result):
    from pathlib import Path

    schema_doc = (Path(__file__).parents[2] / "reports" / "SCHEMA.md").read_text()
    for name, table in (("requests", pd_result.requests), ("steps", pd_result.steps),
                        ("summary", pd_result.summary), ("replicas", pd_result.replicas)):
        missing = [c for c in table.column_names if f"`{c}`" not in schema_doc]
        assert not missing, f"{name} columns missing from reports/SCHEMA.md: {missing}"


def test_a_pool_too_small_for_one_request_is_refused_up_front(tmp_path):
    """The replay path refuses a P/D deployment whose engines' KV cache cannot hold one
    request of max_model_len with one ``kvtwin: error:`` line and exit code 2 before
    anything runs, as vLLM refuses to start it (docs/semantics.md#room-for-one-request)."""
    from typer.testing import CliRunner

    from kvtwin.cli import app

    scenario = tmp_path / "pd.toml"
    scenario.write_text("""\
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 16896
kv_cache_memory_bytes = 1000000
[disaggregation]
prefill_replicas = 1
decode_replicas = 1
[workload]
kind = "chat"
seed = 3
num_requests = 10
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 1.0 }
turns = { dist = "zipf", s = 1.2, max = 4 }
user_tokens = { dist = "lognormal", mean = 300, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 100, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 10 }
""")
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["replay", str(scenario), "-q", "--no-report", "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:"), res.output
    assert "for one request of 16,896 tokens" in lines[0]
    assert not out.exists()


def test_transfer_bytes_of_a_sliding_window_model():
    """gpt-oss-20b (full attention and a 128-token window): each read moves, per group,
    the blocks the decode side's admission allocated past its own hit, the window's group
    none of the prefix it skips (docs/semantics.md#disaggregated-prefill-and-decode), so
    a long prompt's window group reads 8 or 9 blocks as its length falls on the grid."""
    from kvtwin.sim.core.pd_connector import group_block_bytes
    from kvtwin.sim.planner.engine_config import EngineConfig
    from kvtwin.sim.planner.models import get_model
    from kvtwin.sim.planner.plan import plan as make_plan
    from kvtwin.sim.replay.connector_tiers import link_copies
    from tests.sim.pd.test_pd_reads import expected_counts

    gpt_oss = make_plan(get_model("gpt-oss-20b"), get_gpu("h100"), EngineConfig(max_model_len=16896))
    config = gpt_oss.require_fits()
    specs = [g.spec for g in config.groups]
    assert any(getattr(s, "sliding_window", None) == 128 for s in specs)
    block_bytes = group_block_bytes(config)
    result = run_replay(gpt_oss, chat_trace(40), disaggregation=Disaggregation())
    requests = result.requests.to_pydict()
    window_blocks = set()
    for i, status in enumerate(requests["status"]):
        assert status == "finished"
        counts = expected_counts(specs, requests["decode_prefix_hit_tokens"][i], requests["prompt_tokens"][i])
        expected = link_copies(gpt_oss) * sum(n * b for n, b in zip(counts, block_bytes))
        assert requests["transfer_bytes"][i] == expected, i
        window_blocks |= {n for n, s in zip(counts, specs) if getattr(s, "sliding_window", None)}
    assert {8, 9} <= window_blocks
