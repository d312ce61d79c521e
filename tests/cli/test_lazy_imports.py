"""A command loads only the libraries it uses (issue 25): the help, ``plan``, the presets,
``scenarios`` and ``trace list`` answer without pyarrow, NumPy, SimPy, pandas, matplotlib or rich; a
replay without a report loads no matplotlib. Each command runs in a fresh interpreter, as
``kvtwin`` does, which then lists the top-level packages it imported.

kvtwin does not use pandas (it is no dependency). pyarrow (26) imports pandas, when it is
installed, the first time it builds or converts any array (half a second of a short
command), so where pandas is installed only a run with pandas made unimportable shows that
no kvtwin code needs it: the replay, its report and a capacity sweep run so, and write the
very bytes they write with pandas importable.

``bench/bench_startup.py`` times the same commands; this test pins what they import, which
does not depend on how loaded the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
DEFAULT_SCENARIO = str(REPO / "scenarios" / "default.toml")
SMALL_SCENARIO = str(REPO / "scenarios" / "azure-conv-llama8b.toml")
GOLDEN_CASE = str(REPO / "tests" / "golden" / "cases" / "async_priority")

# Runs the command as the console script does and writes the packages it imported to a file.
_RUN = """
import json, sys
if sys.argv[2] == "no-pandas":  # as where pandas is not installed: its import fails
    class NoPandas:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "pandas":
                raise ModuleNotFoundError("No module named 'pandas'", name=name)
    sys.meta_path.insert(0, NoPandas())
from kvtwin.cli import app
try:
    app(args=sys.argv[3:], prog_name="kvtwin")
except SystemExit as exit_:
    code = exit_.code or 0
else:
    code = 0
with open(sys.argv[1], "w") as out:
    json.dump({"exit_code": code, "packages": sorted({name.split(".")[0] for name in sys.modules})}, out)
"""

HEAVY = {"pyarrow", "pandas", "numpy", "matplotlib", "simpy", "torch", "triton", "ray", "rich"}
# What the simulator itself needs; the rest only reports, kernels and clusters do.
SIMULATOR = {"pyarrow", "numpy", "simpy"}


def imported_by(tmp_path: Path, *args: str, pandas: bool = True) -> set[str]:
    """The top-level packages a fresh ``kvtwin ARGS`` imported (it must exit 0); with
    ``pandas=False`` in an interpreter where ``import pandas`` fails."""
    where = tmp_path / "imported.json"
    where.unlink(missing_ok=True)  # a command that dies must not leave the last one's list
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _RUN, str(where), "pandas" if pandas else "no-pandas", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert where.exists(), done.stderr[-3000:]
    result = json.loads(where.read_text())
    assert result["exit_code"] == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return set(result["packages"])


@pytest.mark.parametrize("args", [
    ["--help"], ["plan", "--help"], ["replay", "--help"], ["capacity", "--help"], ["trace", "info", "--help"],
    ["plan", "--scenario", DEFAULT_SCENARIO], ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"],
    ["models"], ["gpus"], ["trace", "list"], ["scenarios"], ["plan", "--scenario", "gemma3-27b-h100-tp2"],
], ids=lambda args: " ".join(a if "/" not in a else Path(a).name for a in args))
def test_help_and_plan_load_none_of_the_heavy_libraries(tmp_path, args):
    assert imported_by(tmp_path, *args) & HEAVY == set()


def test_replay_without_report_loads_the_simulator_and_no_report_libraries(tmp_path):
    loaded = imported_by(tmp_path, "replay", SMALL_SCENARIO, "--limit", "5", "--no-report", "--quiet",
                         "--out", str(tmp_path / "run"))
    assert SIMULATOR <= loaded  # the check can fail: the list is read from the process
    assert loaded & {"matplotlib", "torch", "triton", "ray"} == set()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_replay_report_and_capacity_need_no_pandas(tmp_path):
    """With ``import pandas`` failing, a replay (with its report), ``kvtwin report`` and a
    capacity sweep (with its report) run, load no pandas, and write the same bytes as
    with pandas importable (where it is installed: pyarrow then loads it)."""
    written = {}
    for pandas in (True, False):
        out = tmp_path / ("with-pandas" if pandas else "no-pandas")
        runs = (("replay", SMALL_SCENARIO, "--limit", "20", "--quiet", "--out", str(out / "run")),
                ("report", str(out / "run")),
                ("capacity", SMALL_SCENARIO, "--sweep", "workload.rate_scale=0.5,2", "--sweep",
                 "engine.max_num_seqs=8,64", "--hit-curve", "--limit", "20", "--jobs", "1", "-q", "--out",
                 str(out / "sweep")))
        for args in runs:
            loaded = imported_by(tmp_path, *args, pandas=pandas)
            assert pandas or "pandas" not in loaded, args[0]
        written[pandas] = _files(out)
    assert {"run/report.html", "run/requests.parquet", "sweep/report.html", "sweep/hit_curve.parquet"} <= set(
        written[False])
    assert written[False] == written[True]


def test_trace_info_loads_no_simulator_clock_or_report_libraries(tmp_path):
    loaded = imported_by(tmp_path, "trace", "info", "bundled:burstgpt1_first400.csv")
    assert "pyarrow" in loaded
    assert loaded & {"simpy", "matplotlib", "torch", "triton", "ray"} == set()


def test_lockstep_loads_no_trace_or_report_libraries(tmp_path):
    loaded = imported_by(tmp_path, "lockstep", GOLDEN_CASE, "--out", str(tmp_path / "out"))
    assert loaded & {"pyarrow", "pandas", "numpy", "matplotlib", "simpy", "torch", "triton", "ray"} == set()


def test_the_listing_is_each_commands_own_help():
    """``kvtwin --help`` lists the commands table's lines without importing the commands:
    each must be the first paragraph of the help the command itself shows."""
    from kvtwin import cli

    for entry in cli.COMMANDS:
        command = cli.load_command(entry)
        assert command.help.split("\n\n")[0].strip() == entry.help, entry.name


def test_a_command_runs_from_the_lazy_table_with_its_errors(tmp_path):
    """Loaded on first use, a command keeps its help, its exit codes and its one-line errors."""
    from typer.testing import CliRunner

    from kvtwin.cli import app

    listing = CliRunner().invoke(app, ["--help"])
    assert listing.exit_code == 0 and "plan       What fits: KV cache groups" in listing.stdout
    bad = CliRunner().invoke(app, ["plan", "--model", "no-such-model"])
    assert bad.exit_code == 2
    assert [line for line in bad.stderr.splitlines() if line.strip()][0].startswith("kvtwin: error: ")
    typo = CliRunner().invoke(app, ["plna"])
    assert typo.exit_code == 2 and "Did you mean 'plan'" in typo.stderr
