"""Scenario files, the replay command, and its run directory."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.scenario.parse import load_scenario
from kvtwin.reports.run_dir import read_run_metadata, write_run
from kvtwin.sim.core.errors import ConfigError

SCENARIOS = Path(__file__).parent.parent.parent / "scenarios"


def test_default_scenario_is_two_llama_replicas_on_two_b200s_each_with_mooncake():
    s = load_scenario(DEFAULT_SCENARIO)
    assert s.model.name == "llama-3.1-8b" and s.gpu.name == "b200"
    assert s.workload.trace.name == "mooncake_conversation_trace.jsonl"
    assert s.engine.tensor_parallel_size == 2
    assert (s.deployment.replicas, s.deployment.router) == (2, "prefix_aware")
    assert "rate_scale" not in s.workload.transforms  # the trace at its recorded rate
    assert (s.slo.ttft_s, s.slo.tpot_s) == (2.0, 0.1)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_scenario_loads(path):
    assert load_scenario(path).path == path


@pytest.mark.parametrize("text, field", [
    ("[modle]\npreset = 'llama-3.1-8b'\n", "scenario.modle"),
    ("[engine]\nmax_num_seq = 4\n", "engine.max_num_seq"),
    ("[slo]\nttft = 1\n", "slo.ttft"),
    ("[workload]\ntrace = 'bundled:mooncake_conversation_trace.jsonl'\nlimt = 5\n", "workload.limt"),
    ("[cost_model]\nmatmul_fraction = 0.5\n", "cost_model.matmul_fraction"),
    ("[engine]\nscheduling_policy = 'lifo'\n", "engine.scheduling_policy"),
    ("[run]\ntime_limit_s = -1\n", "run.time_limit_s"),
])
def test_unknown_or_bad_keys_are_errors_naming_the_key(tmp_path, text, field):
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {field}")


def test_unknown_key_message_lists_the_allowed_ones(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[slo]\nttft = 1\n")
    with pytest.raises(ConfigError, match="ttft_s, tpot_s"):
        load_scenario(path)


def test_replay_command_writes_a_run_directory(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["replay", str(SCENARIOS / "azure-conv-llama8b.toml"), "--limit", "40",
                                   "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.output and "plan: " in res.output
    for name in ("requests.parquet", "steps.parquet", "summary.parquet", "plan.json"):
        assert (out / name).exists()
    assert pq.read_table(out / "requests.parquet").num_rows == 40
    meta = read_run_metadata(out / "summary.parquet")
    assert meta["kvtwin_version"] and "azure" in meta["scenario_file"]
    assert json.loads((out / "plan.json").read_text())["model"] == "llama-3.1-8b"


def test_replay_command_bad_trace_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["replay", "--trace", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:")


def test_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import pyarrow as pa

    import kvtwin.reports.run_dir as run_dir

    def broken(table, where, **kwargs):
        Path(where).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(run_dir.pq, "write_table", broken)
    table = pa.table({"x": [1]})
    with pytest.raises(OSError):
        write_run(tmp_path, requests=table, steps=table, summary=table, plan={}, run_metadata={})
    assert list(tmp_path.iterdir()) == []
