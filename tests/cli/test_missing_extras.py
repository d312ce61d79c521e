"""A command that needs an optional extra (``pyproject.toml``) which is not installed says
so in one line naming the extra, before it does anything, and exits 2; the README's
command table says which command needs which extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtwin.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]

# Hides the named modules (as where they are not installed) and runs the command line.
_RUN = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from kvtwin.cli import console_main
sys.argv = ["kvtwin", *sys.argv[2:]]
console_main()
"""


def run_without(modules: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, modules, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=300)


@pytest.mark.parametrize("hidden, args, line", [
    ("torch,triton", ("validate", "--out", "run"),
     "kvtwin: error: validate: expected torch installed for the device executor: pip install 'kvtwin[kernels]', "
     "got 'no torch'"),
    ("torch,triton", ("validate", "--device", "cuda", "--checks", "memory", "--out", "run"),
     "kvtwin: error: validate: expected torch installed for the device executor: pip install 'kvtwin[kernels]', "
     "got 'no torch'"),
    ("ray", ("capacity", "--backend", "ray", "--out", "run"),
     "kvtwin: error: --backend: expected ray installed for a Ray cluster: pip install 'kvtwin[cluster]', or "
     "--backend process, got 'ray'"),
], ids=["validate", "validate cuda", "capacity ray"])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, hidden, args, line):
    done = run_without(hidden, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [line]
    assert not (tmp_path / "run").exists()


def _command_table() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Commands"):].split("\n\n")[1]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in table.splitlines()]


def test_the_readme_says_which_command_needs_which_extra():
    header, _, *rows = _command_table()
    assert header == ["command", "needs", "what it answers"]
    needs = {row[0].split()[1].strip("`,"): row[1] for row in rows}
    assert "`kernels`" in needs["validate"] and "`cluster`" in needs["capacity"]
    assert needs["replay"] == needs["plan"] == needs["report"] == needs["calibrate"] == "–"
    # Every command has its row (`kvtwin models`, `kvtwin gpus` share one).
    listed = {words[i + 1].strip("`,") for row in rows for words in [row[0].split()]
              for i, word in enumerate(words[:-1]) if word.strip("`") == "kvtwin"}
    assert {entry.name for entry in COMMANDS} <= listed, {entry.name for entry in COMMANDS} - listed
