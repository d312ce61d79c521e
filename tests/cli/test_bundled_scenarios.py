"""The bundled scenarios by name (issue 37, 10b): ``kvtwin scenarios`` lists them, and every
command taking a SCENARIO.toml accepts a bundled one's name, from any directory; a path
that exists wins, and an unknown name is one error line listing the names."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.reports.run_dir import read_run_metadata
from tests.tables import assert_tables_equal

SCENARIOS = Path(__file__).parents[2] / "scenarios"
FILES = sorted(SCENARIOS.glob("*.toml"))


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_scenarios_lists_every_bundled_file_with_its_description():
    result = _invoke("scenarios")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [p.stem for p in FILES]
    for line, path in zip(lines, FILES):
        description = tomllib.loads(path.read_text())["description"]
        assert line.split(None, 1)[1] == description


def test_a_bundled_name_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_path = tmp_path / "by-path"
    assert _invoke("replay", str(SCENARIOS / "azure-conv-llama8b.toml"), "--limit", "10", "-q", "--no-report",
                   "--out", str(by_path)).exit_code == 0
    for given in ("azure-conv-llama8b", "azure-conv-llama8b.toml"):
        out = tmp_path / given
        result = _invoke("replay", given, "--limit", "10", "-q", "--no-report", "--out", str(out))
        assert result.exit_code == 0, result.output
        for name in ("requests", "summary"):
            assert_tables_equal(pq.read_table(out / f"{name}.parquet"), pq.read_table(by_path / f"{name}.parquet"))
        metadata = read_run_metadata(out / "summary.parquet")
        assert metadata["scenario_file"] == "azure-conv-llama8b.toml"
        assert metadata["scenario"] == (SCENARIOS / "azure-conv-llama8b.toml").read_text()
    plan = _invoke("plan", "--scenario", "gemma3-27b-h100-tp2", "--json")
    assert plan.exit_code == 0 and '"model": "gemma-3-27b"' in plan.stdout
    sweep = _invoke("capacity", "azure-conv-llama8b", "--limit", "10", "--sweep", "engine.max_num_seqs=8",
                    "--jobs", "1", "-q", "--no-report", "--out", str(tmp_path / "sweep"))
    assert sweep.exit_code == 0, sweep.output


def test_a_path_that_exists_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = (SCENARIOS / "azure-conv-llama8b.toml").read_text().replace('description = "', 'description = "mine: ')
    (tmp_path / "default.toml").write_text(mine)
    out = tmp_path / "run"
    assert _invoke("replay", "default.toml", "--limit", "5", "-q", "--no-report", "--out", str(out)).exit_code == 0
    assert read_run_metadata(out / "summary.parquet")["scenario"] == mine


@pytest.mark.parametrize("command", [
    ("replay", "no-such-scenario"), ("capacity", "no-such-scenario", "--sweep", "engine.max_num_seqs=8"),
    ("validate", "no-such-scenario"), ("calibrate", "no-such-scenario", "--steps", "steps.parquet"),
    ("plan", "--scenario", "no-such-scenario"), ("replay", "elsewhere/azure-conv-llama8b.toml"),
])
def test_an_unknown_name_is_one_line_listing_the_bundled_names(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    result = _invoke(*command, *(("--out", str(tmp_path / "out")) if command[0] != "plan" else ()))
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: "), result.stderr
    assert "bundled scenario's name" in lines[0] and all(p.stem in lines[0] for p in FILES)
    assert not (tmp_path / "out").exists()
