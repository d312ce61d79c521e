"""Wide-EP P/D (docs/semantics.md#data-parallel-pd-sides): each P/D side one DP engine,
a MoE model's ranks in lockstep per side, with a P/D connector on every rank
(docs/semantics.md#a-kv-connector-in-a-group); and a KV offload tier in a lockstep group.

Checked on a DP 2 + DP 2 replay of gpt-oss-20b (40 requests, max_model_len 32768), with
synchronous and asynchronous scheduling: every request is prefilled by one prefill rank
and decoded by one decode rank; each side's ranks step together (every row of a side's
step has its start and duration) and the two sides apart; every rank's pool balances at
every applied batch and ends empty; a side whose requests all wait for their KV runs
dummy batches and its wave stays alive; each side's pool is planned with its own DP size.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.request import RequestStatus
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay import run as run_module
from kvtwin.sim.replay.clock import dp_group
from kvtwin.sim.replay.clock.pd_front import PREFILL_SUFFIX
from kvtwin.sim.replay.pd_sides import side_plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.disaggregation import Disaggregation, disaggregation_from_mapping
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from tests.cli_run import one_error_line, run
from tests.replay.test_pd import WatchedFront
from tests.replay.test_pd_capacity import SCENARIO as CHAT_SCENARIO

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "replay-gpt-oss-20b.toml"
NUM_REQUESTS = 40
SMALL_POOL_BYTES = 3 * 2**30  # 8,192 blocks: one request of 32,768 tokens fits


def _resolved(**engine):
    return resolve_scenario(SCENARIO, Overrides(limit=NUM_REQUESTS, engine={"max_model_len": 32768, **engine}))


class KeptFront(WatchedFront):
    """The P/D test's watched front (every pool checked at every applied batch, a prefill
    request's blocks freed only after its read), keeping the cluster it ran in."""

    last: KeptFront | None = None

    def attach(self, cluster):
        super().attach(cluster)
        self.cluster = cluster
        KeptFront.last = self


def _pd_run(monkeypatch, async_scheduling: bool, prefill_dp: int = 2, decode_dp: int = 2):
    monkeypatch.setattr(run_module, "PDFront", KeptFront)
    # A small pool: the watched front checks every pool at every applied batch.
    resolved = _resolved(async_scheduling=async_scheduling, kv_cache_memory_bytes=SMALL_POOL_BYTES)
    disaggregation = Disaggregation(prefill_data_parallel_size=prefill_dp, decode_data_parallel_size=decode_dp)
    result = run_replay(resolved.plan(), resolved.require_workload().load(), efficiency=resolved.efficiency,
                        slo=resolved.slo, disaggregation=disaggregation)
    front = KeptFront.last
    assert front is not None
    return result, front


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_dp2_plus_dp2_pd_replay_of_a_moe_model(monkeypatch, async_scheduling):
    result, front = _pd_run(monkeypatch, async_scheduling)
    requests = result.requests.to_pydict()
    assert len(requests["request_id"]) == NUM_REQUESTS
    assert set(requests["status"]) <= {"finished", "rejected"}
    finished = [i for i, status in enumerate(requests["status"]) if status == "finished"]
    assert len(finished) > NUM_REQUESTS // 2
    for i in finished:
        request_id = requests["request_id"][i]
        # One prefill rank (0 or 1) ran its prompt; one decode rank (2 or 3) decoded it.
        assert front.prefilled_on[request_id + PREFILL_SUFFIX] == requests["prefill_replica"][i] in (0, 1)
        assert requests["decode_replica"][i] in (2, 3)
        assert requests["generated_tokens"][i] == requests["output_tokens"][i]
        assert front.freed_s[request_id + PREFILL_SUFFIX] >= front.read_done_s[request_id + PREFILL_SUFFIX]
    # Every rank ends with its whole pool free: nothing held for a read, nothing loading.
    for replica in front.cluster.replicas:
        engine = replica.engine
        pool = engine.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert not engine.holds_blocks_for_reads() and not engine.waits_for_transfers()

    # Each side's ranks step together: the rows of one side that start at one instant
    # share a duration (a side's group step), and the two sides keep their own clocks.
    steps = result.steps
    replica = steps.column("replica").to_numpy()
    start = steps.column("time_s").to_numpy()
    duration = steps.column("duration_s").to_numpy()
    ran = (steps.column("prefill_tokens").to_numpy() + steps.column("decode_tokens").to_numpy()) > 0
    side_starts = []
    for ranks in ((0, 1), (2, 3)):
        mine = np.isin(replica, ranks) & ran
        for t in np.unique(start[mine]):
            assert len(set(duration[mine & (start == t)])) == 1
        # Both ranks of a side ran a batch in the same group step at least once.
        both = [t for t in np.unique(start[mine]) if set(replica[mine & (start == t)]) == set(ranks)]
        assert both
        side_starts.append(set(start[mine]))
    assert side_starts[0] != side_starts[1]

    # The replicas table: one row per rank with its role, its dummies summing to the summary's.
    rows = result.replicas.to_pylist()
    assert [(row["replica"], row["role"]) for row in rows] == [(0, "prefill"), (1, "prefill"),
                                                                  (2, "decode"), (3, "decode")]
    summary = result.summary.to_pylist()[0]
    assert summary["num_replicas"] == 4 and summary["dp_waves"] >= 2
    assert sum(row["dummy_steps"] for row in rows) == summary["dummy_steps"] > 0
    if not async_scheduling:
        # A synchronous rank runs its batch or a dummy in each of its side's group steps.
        batches = np.bincount(replica[ran], minlength=4)
        per_side_steps = [batches[0] + rows[0]["dummy_steps"], batches[2] + rows[2]["dummy_steps"]]
        for rank in range(4):
            assert batches[rank] + rows[rank]["dummy_steps"] == per_side_steps[rank // 2]
        assert sum(per_side_steps) == summary["dp_group_steps"]


def test_a_side_waiting_only_for_its_kv_runs_dummies_and_keeps_its_wave(monkeypatch):
    """vLLM 0.33: a request loading its KV is unfinished (``kv_holding_waiting`` counts in
    ``get_request_counts``), so the rank that holds only such requests executes nothing,
    runs a dummy batch, and its side's all-reduce keeps the wave running."""
    seen = []
    original = dp_group._step_ranks

    def spy(ranks, throttle, dummy_batch_s):
        statuses = [[r.status for r in rank.engine.scheduler.requests.values() if not r.is_finished()]
                    for rank in ranks]
        stepped, dummies, duration_s = original(ranks, throttle, dummy_batch_s)
        loading = [rank for rank, mine in zip(ranks, statuses)
                   if mine and all(s is RequestStatus.WAITING_FOR_REMOTE_KVS for s in mine)]
        if loading and len(dummies) == len(ranks):
            # Every rank ran a dummy while a rank held only requests loading their KV.
            seen.append((duration_s, dummy_batch_s, all(rank.engine.has_unfinished_requests() for rank in loading)))
        return stepped, dummies, duration_s

    monkeypatch.setattr(dp_group, "_step_ranks", spy)
    _pd_run(monkeypatch, async_scheduling=False)
    assert seen, "no group step ran dummies while a rank held only loading requests"
    for duration_s, dummy_batch_s, unfinished in seen:
        # The step lasts the dummy's forward (no rank idles), and the loading rank counts
        # as unfinished in the all-reduce, so the wave goes on.
        assert duration_s == dummy_batch_s > 0 and unfinished


def test_each_side_plans_its_pool_with_its_own_dp_size():
    """With expert parallelism the experts spread over a side's DP x TP GPUs: the side of
    more ranks holds fewer expert weights per GPU, so more KV blocks; each side's plan is
    what ``plan`` makes of the engine with that side's DP size."""
    resolved = _resolved(enable_expert_parallel=True)
    base = resolved.plan()
    sizes = {}
    for dp in (2, 4):
        expected = plan(base.model, base.gpu, dataclasses.replace(resolved.engine, data_parallel_size=dp))
        sizes[dp] = side_plan(base, dp).num_blocks
        assert sizes[dp] == expected.num_blocks
    assert sizes[4] > sizes[2] > base.num_blocks
    assert side_plan(base, 1) is base


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_kv_offload_tier_on_every_rank_of_a_lockstep_group(async_scheduling):
    """A DP 2 MoE group with a CPU tier on each rank (docs/semantics.md#a-kv-connector-in-a-group),
    its GPU pools small beside many shared prefixes, so prefixes come back from the CPU:
    every request ends, loads land (a rank whose requests wait for them runs dummies), and
    the waves end."""
    data = tomllib.loads(CHAT_SCENARIO.replace('preset = "llama-3.1-8b"', 'preset = "gpt-oss-20b"'))
    del data["disaggregation"]
    data["engine"].update(replicas=1, data_parallel_size=2, kv_cache_memory_bytes=2**29,
                          async_scheduling=async_scheduling)
    data["workload"].update(num_requests=150, shared_prefix={"count": 40, "tokens": 3000, "zipf_s": 1.0})
    data["offload"] = {"cpu_bytes": 4 * 2**30}
    resolved = resolve_scenario(REPO / "chat.toml", data=data)
    planned = resolved.plan()
    result = run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                        efficiency=resolved.efficiency, offload=resolved.offload_for(planned))
    summary = result.summary.to_pylist()[0]
    assert summary["completed"] == 150
    assert summary["cpu_hit_tokens"] > 0 and summary["offload_cpu_loaded_keys"] > 0
    assert summary["dp_waves"] >= 1 and summary["dummy_steps"] > 0


# -- the config -------------------------------------------------------------------------------


@pytest.mark.parametrize("table, field", [
    ({"prefill_data_parallel_size": 0}, "disaggregation.prefill_data_parallel_size"),
    ({"decode_data_parallel_size": 1.5}, "disaggregation.decode_data_parallel_size"),
    ({"decode_replicas": 2, "decode_data_parallel_size": 2}, "disaggregation.decode_replicas"),
])
def test_bad_side_dp_names_the_field(table, field):
    with pytest.raises(ConfigError) as err:
        disaggregation_from_mapping(table)
    assert err.value.field == field


@pytest.mark.parametrize("size", [0, -2])
def test_a_side_dp_below_one_is_one_error_line(tmp_path, size):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "gpt-oss-20b"\n[hardware]\ngpu = "h100"\n'
                        f'[disaggregation]\ndecode_data_parallel_size = {size}\n')
    one_error_line(run("plan", "--scenario", scenario), "disaggregation.decode_data_parallel_size", "positive integer")


def test_a_side_dp_on_a_dense_model_is_one_error_line(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "llama-3.1-8b"\n[hardware]\ngpu = "h100"\n'
                        '[disaggregation]\nprefill_data_parallel_size = 2\n')
    line = one_error_line(run("plan", "--scenario", scenario), "disaggregation.prefill_data_parallel_size",
                          "prefill_replicas")
    assert "dense" in line


def test_the_engines_dp_beside_disaggregation_points_at_the_sides_keys(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "gpt-oss-20b"\n[hardware]\ngpu = "h100"\n[engine]\n'
                        'data_parallel_size = 2\n[disaggregation]\nprefill_replicas = 1\n')
    one_error_line(run("plan", "--scenario", scenario), "engine.data_parallel_size", "prefill_data_parallel_size")


def test_side_dp_keys_resolve_and_are_recorded(tmp_path):
    data = {"model": {"preset": "gpt-oss-20b"}, "hardware": {"gpu": "h100"},
            "disaggregation": {"prefill_data_parallel_size": 2, "decode_data_parallel_size": 4}}
    resolved = resolve_scenario(tmp_path / "s.toml", data=data)
    pd = resolved.disaggregation
    assert (pd.prefill_engines, pd.decode_engines, pd.num_replicas) == (2, 4, 6)
    described = resolved.describe()["disaggregation"]
    assert (described["prefill_data_parallel_size"], described["decode_data_parallel_size"]) == (2, 4)


def test_a_model_that_fits_only_with_its_sides_experts_spread_replays(tmp_path):
    """DeepSeek-V3 on H200s does not fit one GPU (TP 1, DP 1); as 8 + 8 DP + EP sides it
    does: the run's plan is its prefill side's (DP 8), and the replay runs both sides."""
    path = tmp_path / "wide-ep-pd.toml"
    path.write_text('[model]\npreset = "deepseek-v3"\n[hardware]\ngpu = "h200"\n'
                    '[engine]\nenable_expert_parallel = true\nmax_model_len = 32768\n'
                    '[workload]\ntrace = "bundled:mooncake_conversation_trace.jsonl"\n'
                    '[disaggregation]\nprefill_data_parallel_size = 8\ndecode_data_parallel_size = 8\n')
    resolved = resolve_scenario(path, Overrides(limit=12))
    with pytest.raises(ConfigError, match="a layout that fits"):
        plan(resolved.model, resolved.gpu, resolved.engine).require_fits()
    planned = resolved.plan()
    assert planned.engine.data_parallel_size == 8 and planned.fits
    result = run("replay", str(path), "--quiet", "--limit", "12", "--no-report", "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.stderr


def test_kvtwin_plan_shows_each_dp_sides_own_plan(tmp_path):
    """``kvtwin plan --scenario`` on wide-EP P/D plans each side with its own DP size (the
    scenario's DP 1 engine would not fit DeepSeek-V3 on one H200)."""
    import json

    path = tmp_path / "wide-ep-pd.toml"
    path.write_text('[model]\npreset = "deepseek-v3"\n[hardware]\ngpu = "h200"\n'
                    '[engine]\nenable_expert_parallel = true\nmax_model_len = 32768\n'
                    '[disaggregation]\nprefill_data_parallel_size = 8\ndecode_data_parallel_size = 16\n')
    result = run("plan", "--scenario", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    sides = json.loads(result.stdout)
    resolved = resolve_scenario(path)
    for role, dp in (("prefill", 8), ("decode", 16)):
        alone = plan(resolved.model, resolved.gpu, dataclasses.replace(resolved.engine, data_parallel_size=dp))
        assert sides[role]["data_parallel_size"] == dp and sides[role]["num_blocks"] == alone.num_blocks
    assert sides["decode"]["num_blocks"] > sides["prefill"]["num_blocks"]  # its experts spread over 16 GPUs
    text = run("plan", "--scenario", str(path))
    assert text.exit_code == 0 and "prefill side:" in text.stdout and "decode side:" in text.stdout
