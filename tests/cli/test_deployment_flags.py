"""``kvtwin replay --replicas N --router NAME`` (issue 37, 10c): the deployment's two
settings from the command line, declared once in the knobs table like every other flag."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.reports.run_dir import read_run_metadata
from tests.tables import assert_tables_equal

SCENARIOS = Path(__file__).parents[2] / "scenarios"
AZURE = SCENARIOS / "azure-conv-llama8b.toml"


def _replay(*args: str):
    return CliRunner().invoke(app, ["replay", *args, "--quiet", "--no-report"])


def test_replicas_and_router_flags_run_what_the_scenario_keys_run(tmp_path):
    by_flags = tmp_path / "flags"
    result = _replay(str(AZURE), "--limit", "30", "--replicas", "3", "--router", "least_loaded",
                     "--out", str(by_flags))
    assert result.exit_code == 0, result.output
    edited = tmp_path / "three.toml"
    edited.write_text(AZURE.read_text().replace("[engine]\n", '[engine]\nreplicas = 3\nrouter = "least_loaded"\n'))
    assert "replicas = 3" in edited.read_text()
    by_file = tmp_path / "file"
    assert _replay(str(edited), "--limit", "30", "--out", str(by_file)).exit_code == 0
    summary = pq.read_table(by_flags / "summary.parquet").to_pylist()[0]
    assert (summary["num_replicas"], summary["router"]) == (3, "least_loaded")
    assert pq.read_table(by_flags / "replicas.parquet").num_rows == 3
    for name in ("requests", "steps", "summary", "replicas"):
        assert_tables_equal(pq.read_table(by_flags / f"{name}.parquet"), pq.read_table(by_file / f"{name}.parquet"),
                            with_metadata=False)
    overrides = read_run_metadata(by_flags / "summary.parquet")["overrides"]
    assert overrides["replicas"] == 3 and overrides["router"] == "least_loaded"
    assert "replicas: 3 behind least_loaded" in result.stdout


@pytest.mark.parametrize("args,message", [
    (("--replicas", "0"), "kvtwin: error: --replicas: expected a positive integer, got 0"),
    (("--router", "random"), "kvtwin: error: --router: expected one of round_robin, least_loaded, "
                             "session_affinity, prefix_aware, dp_lb, got 'random'"),
    ((str(SCENARIOS / "mooncake-llama8b-h100-pd.toml"), "--replicas", "2"),
     "kvtwin: error: --replicas: expected no [disaggregation] table in the scenario"),
])
def test_bad_replicas_or_router_is_one_line_before_any_work(tmp_path, args, message):
    out = tmp_path / "run"
    result = _replay(*args, "--out", str(out))
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not out.exists()
