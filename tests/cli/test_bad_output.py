"""Where outputs go and how a run ends early: a bad --out fails before the run, a run
directory is replaced whole or not at all, Ctrl-C says what was written, a closed stdout
is not an error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

import kvtwin.reports.run_dir as run_dir
from kvtwin.cli import app
from kvtwin.reports.run_dir import write_run
from kvtwin.sim.replay.clock.progress import ReplayClock

REPO = Path(__file__).parents[2]
SMALL = str(REPO / "scenarios" / "azure-conv-llama8b.toml")


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def _no_replay(*args, **kwargs):
    raise AssertionError("the replay ran before --out was checked")


@pytest.mark.parametrize("kind", ["file", "dev_null", "under_a_file", "proc", "foreign_dir"])
def test_out_that_cannot_be_a_run_directory_fails_before_the_run(tmp_path, monkeypatch, kind):
    monkeypatch.setattr("kvtwin.sim.replay.run.run_replay", _no_replay)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine too")
    out = {"file": a_file, "dev_null": Path(os.devnull), "under_a_file": a_file / "run",
           "proc": Path("/proc/kvtwin-run"), "foreign_dir": foreign}[kind]
    result = CliRunner().invoke(app, ["replay", SMALL, "--limit", "5", "--quiet", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = _error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: --out: expected "), lines
    assert str(out) in lines[0] and "Traceback" not in result.output
    assert a_file.read_text() == "mine" and (foreign / "thesis.tex").read_text() == "mine too"


def _tables(tag: str) -> dict:
    table = pa.table({"x": [tag]})
    return dict(requests=table, steps=table, summary=table, plan={"tag": tag}, run_metadata={"tag": tag})


def test_run_directory_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "run"
    write_run(out, **_tables("old"))
    (out / "report.html").write_text("old report")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    real_write_table = run_dir.pq.write_table
    written = []

    def fails_on_the_second_file(table, where, **kwargs):
        written.append(where)
        if len(written) == 2:
            raise OSError("disk full")
        real_write_table(table, where, **kwargs)

    monkeypatch.setattr(run_dir.pq, "write_table", fails_on_the_second_file)
    with pytest.raises(OSError):
        write_run(out, **_tables("new"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp or aside directory left

    monkeypatch.setattr(run_dir.pq, "write_table", real_write_table)
    write_run(out, **_tables("new"))
    # The new set only: nothing of the previous run is left next to it.
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "requests.parquet", "steps.parquet",
                                                     "summary.parquet"]
    assert run_dir.read_run_metadata(out / "steps.parquet") == {"tag": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_ctrl_c_during_replay_says_what_was_written_and_exits_130(tmp_path, monkeypatch):
    out = tmp_path / "run"
    write_run(out, **_tables("previous"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*args, on_progress=None, **kwargs):
        on_progress(ReplayClock(now_s=1234.4, steps=10, arrived=3))
        raise KeyboardInterrupt

    monkeypatch.setattr("kvtwin.sim.replay.run.run_replay", interrupted)
    result = CliRunner().invoke(app, ["replay", SMALL, "--limit", "5", "--out", str(out)])
    assert result.exit_code == 130
    lines = _error_lines(result)
    assert lines[-1] == f"kvtwin: interrupted at t=1,234 s simulated; nothing written, {out} left as it was"
    assert "Traceback" not in result.output and "Aborted" not in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ctrl_c_in_any_command_exits_130_with_one_line(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # The command imports its reader when it runs (tests/test_lazy_imports.py): patch it at home.
    monkeypatch.setattr("kvtwin.traces.load.load_trace", interrupted)
    result = CliRunner().invoke(app, ["trace", "info", "bundled:burstgpt1_first400.csv"])
    assert result.exit_code == 130
    assert _error_lines(result) == ["kvtwin: interrupted"]


def _kvtwin() -> list[str]:
    script = Path(sys.executable).parent / "kvtwin"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtwin.cli"]


def test_closed_stdout_ends_quietly_with_exit_0(tmp_path):
    if shutil.which("head") is None:
        pytest.skip("no head(1) here")
    args = [*_kvtwin(), "replay", "--limit", "50", "--quiet", "--out", str(tmp_path / "a")]
    # `kvtwin replay | head -2`: head leaves after two lines, whatever kvtwin still prints.
    piped = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -2', "kvtwin", *args],
                           capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert len(piped.stdout.splitlines()) == 2 and "Traceback" not in piped.stderr
    # The same with the pipe closed before kvtwin prints a thing: every write fails.
    args[-1] = str(tmp_path / "b")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert err == ""
    assert (tmp_path / "b" / "summary.parquet").exists()
