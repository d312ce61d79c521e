"""`kvtwin kernels`: the availability report, with and without torch installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvtwin.cli import app

REPO = Path(__file__).resolve().parents[2]


def test_kernels_command_reports_each_backend(monkeypatch):
    monkeypatch.delenv("KVTWIN_ATTN_BACKEND", raising=False)
    result = CliRunner().invoke(app, ["kernels", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    for name in ("torch:", "triton:", "vllm_flash_attn:"):
        assert name in result.output
    assert "KVTWIN_ATTN_BACKEND=auto -> " in result.output


def test_kernels_command_json(monkeypatch):
    monkeypatch.delenv("KVTWIN_ATTN_BACKEND", raising=False)
    result = CliRunner().invoke(app, ["kernels", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {b["name"] for b in report["backends"]} == {"torch", "triton", "vllm_flash_attn"}
    assert report["requested"] == "auto"


def test_kernels_command_rejects_unknown_backend(monkeypatch):
    monkeypatch.setenv("KVTWIN_ATTN_BACKEND", "nope")
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 2
    assert "KVTWIN_ATTN_BACKEND='nope'" in result.output


def test_kernels_command_without_torch():
    """Hide torch and Triton from a fresh interpreter: the command still reports."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "from kvtwin.cli import app\n"
            "app(['kernels'])\n")
    env = {k: v for k, v in os.environ.items() if k != "KVTWIN_ATTN_BACKEND"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch:            not usable  not installed" in done.stdout
    assert "-> none" in done.stdout
