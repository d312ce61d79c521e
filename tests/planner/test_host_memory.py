"""Absurd sizes fail fast: a KV cache larger than the GPU is refused as the scenario is
read, and a deployment whose block pools would not fit in this machine's memory is refused
before any pool is built, saying how much it would need and how much there is. The
estimate's constants are measured again here (bytes, not seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_sim_memory import measure_block_bytes, measure_replica_bytes
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner import host_memory
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.host_memory import (BYTES_PER_BLOCK, BYTES_PER_REPLICA, available_memory_bytes,
                                            estimate_host_memory, require_host_memory, simulator_bytes)
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.resolve import resolve_scenario
from tests.cli_run import one_error_line, run

SCENARIOS = sorted(p for p in DEFAULT_SCENARIO.parent.glob("*.toml"))
GIB = 1 << 30

SCENARIO = """\
[model]
preset = "llama-3.1-8b"

[hardware]
gpu = "h100"

[engine]
max_model_len = 32768
{engine}
[workload]
trace = "bundled:mooncake_conversation_trace.jsonl"
"""


@pytest.fixture
def no_trace_read(monkeypatch):
    """Fails the test if anything reads a workload: a refusal must come before it."""
    import kvtwin.sim.scenario.parse as parse

    monkeypatch.setattr(parse.Workload, "load", lambda self: pytest.fail("the trace was read"))
    monkeypatch.setattr(parse.Workload, "load_source", lambda self: pytest.fail("the trace was read"))


def scenario(tmp_path: Path, engine: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(engine=engine))
    return path


# -- a KV cache larger than the GPU --------------------------------------------------------


@pytest.mark.parametrize("value", ["1e20", "100000000000000000000", '"1TiB"'])
def test_a_kv_cache_larger_than_the_gpu_is_refused_as_the_scenario_is_read(tmp_path, no_trace_read, value):
    path = scenario(tmp_path, f"kv_cache_memory_bytes = {value}")
    for args in (["replay", path, "-q", "--out", tmp_path / "run"], ["plan", "--scenario", path]):
        one_error_line(run(*args), f"{path}: engine.kv_cache_memory_bytes: expected at most h100's memory, "
                                   "85,520,809,984 bytes (79.6 GiB)", "each GPU")
    assert not (tmp_path / "run").exists()


def test_the_kv_cache_flag_is_named_and_tensor_parallelism_does_not_raise_the_bound():
    line = one_error_line(run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "8",
                              "--kv-cache-memory-bytes", "80GiB"), "kvtwin: error: --kv-cache-memory-bytes: ")
    assert "got 85899345920" in line and "whatever the tensor parallelism" in line
    # The whole of one GPU is allowed (the estimate of weights and activations is not).
    assert run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--kv-cache-memory-bytes",
               str(get_gpu("h100").memory_bytes), "--json").exit_code == 0


def test_the_planner_refuses_it_too():
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes: expected at most h100's memory"):
        plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(kv_cache_memory_bytes=10**20))


# -- the simulator's own memory --------------------------------------------------------------


def test_a_hundred_thousand_replicas_are_refused_before_anything_is_built(tmp_path, no_trace_read):
    path = scenario(tmp_path, "replicas = 100000")
    line = one_error_line(run("replay", path, "-q", "--out", tmp_path / "run"),
                          f"{path}: engine.replicas: expected a deployment whose KV block pools fit in memory: "
                          "100,000 replicas x 29,149 KV blocks need about ", " GiB is available",
                          "fewer replicas", "got 100000")
    assert f"{simulator_bytes(29_149, 100_000) / GIB:,.1f} GiB" in line
    assert not (tmp_path / "run").exists()


def test_a_capacity_point_with_too_many_replicas_fails_alone(tmp_path):
    import pyarrow.parquet as pq

    path = scenario(tmp_path, "")
    result = run("capacity", path, "--sweep", "engine.replicas=1,100000", "--limit", "3", "--jobs", "1", "-q",
                 "--no-report", "--out", tmp_path / "cap")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(tmp_path / "cap" / "capacity.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "engine.replicas: expected a deployment whose KV block pools fit in memory" in rows[1]["error"]


def test_one_replica_with_too_many_blocks_names_the_kv_cache_size(tmp_path):
    resolved = resolve_scenario(scenario(tmp_path, 'kv_cache_memory_bytes = "64GiB"'))
    planned = resolved.plan()
    with pytest.raises(ConfigError) as err:
        resolved.require_host_memory(planned, available_bytes=2**20)
    assert err.value.field == "engine.kv_cache_memory_bytes" and err.value.got == 64 * GIB
    assert err.value.source == str(tmp_path / "s.toml")
    assert "1 replica x 32,768 KV blocks need about 9 MiB" in err.value.expected
    assert "1 MiB is available" in err.value.expected


def test_the_replay_itself_refuses_pools_that_do_not_fit(monkeypatch):
    from kvtwin.traces.bundled import MOONCAKE_CONVERSATION, bundled_path
    from kvtwin.traces.load import load_trace

    planned = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=32768))
    trace = load_trace(bundled_path(MOONCAKE_CONVERSATION))
    monkeypatch.setattr(host_memory, "available_memory_bytes", lambda: 10 * 2**20)
    import kvtwin.sim.replay.run as run_module

    monkeypatch.setattr(run_module, "EngineCore", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ConfigError, match="replicas: expected a deployment whose KV block pools fit in memory"):
        run_replay(planned, trace, deployment=Deployment(replicas=4))


def test_the_estimate_scales_with_blocks_and_replicas():
    assert simulator_bytes(1000, 3) == 3 * (1000 * BYTES_PER_BLOCK + BYTES_PER_REPLICA)
    assert estimate_host_memory(1000, 3, available_bytes=1).fits is False
    assert estimate_host_memory(1000, 3, available_bytes=10**9).fits is True
    with pytest.raises(ConfigError) as err:
        require_host_memory(10**6, 10, field="engine.replicas", got=10, available_bytes=GIB)
    assert "10 replicas x 1,000,000 KV blocks need about 2.6 GiB" in err.value.expected
    assert "1.0 GiB is available" in err.value.expected


def test_this_machine_says_how_much_memory_it_has():
    available = available_memory_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_no_bundled_scenario_comes_near_the_guard(path):
    """Every bundled scenario's pools fit in 1 GiB of the machine, so the guard never trips on
    them where a replay could run at all."""
    resolved = resolve_scenario(path)
    planned = resolved.plan()
    if not planned.fits:
        return
    assert simulator_bytes(planned.num_blocks, resolved.num_replicas) < GIB
    resolved.require_host_memory(planned, available_bytes=GIB)


# -- the constants, measured again ---------------------------------------------------------


def test_bytes_per_block_covers_a_pool_with_every_block_cached():
    measured = measure_block_bytes(20_000)
    assert measured["built"] < measured["cached"] <= BYTES_PER_BLOCK <= 1.6 * measured["cached"]


def test_bytes_per_replica_covers_what_a_replica_adds_beyond_its_pool():
    measured = measure_replica_bytes(11, num_requests=20)["fixed"]
    assert 0 < measured <= BYTES_PER_REPLICA <= 4 * measured


def test_a_disaggregated_deployment_names_its_replicas(tmp_path):
    path = tmp_path / "pd.toml"
    path.write_text(SCENARIO.format(engine="") + "[disaggregation]\nprefill_replicas = 3000\ndecode_replicas = 1000\n")
    resolved = resolve_scenario(path)
    with pytest.raises(ConfigError) as err:
        resolved.require_host_memory(resolved.plan(), available_bytes=GIB)
    assert (err.value.field, err.value.got) == ("disaggregation.prefill_replicas + decode_replicas", 4000)
    assert "4,000 replicas x 29,149 KV blocks" in err.value.expected
