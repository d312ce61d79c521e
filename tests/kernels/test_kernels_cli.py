"""`kvtwin kernels`: the availability report, with and without torch installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvtwin.cli import app

REPO = Path(__file__).resolve().parents[2]


def _expected_lines() -> list[str]:
    """What this CPU machine must report: torch and Triton's interpreter (the conftest sets
    TRITON_INTERPRET=1) usable, vLLM's flash attention not (no CUDA device)."""
    import torch
    import triton

    return [f"torch:            usable      torch {torch.__version__}, reference (cpu)",
            f"triton:           usable      triton {triton.__version__} (interpreter)",
            "vllm_flash_attn:  not usable  needs a CUDA device (and neither vllm nor vllm_flash_attn is installed)",
            "KVTWIN_ATTN_BACKEND=auto -> torch (auto)"]


def test_kernels_command_reports_each_backend(monkeypatch):
    monkeypatch.delenv("KVTWIN_ATTN_BACKEND", raising=False)
    result = CliRunner().invoke(app, ["kernels", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.output.splitlines() if not line.startswith("kvtwin: notice:")]
    assert lines == _expected_lines()


def test_kernels_command_names_the_requested_backend(monkeypatch):
    monkeypatch.setenv("KVTWIN_ATTN_BACKEND", "triton")
    result = CliRunner().invoke(app, ["kernels", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert (report["requested"], report["selected"]) == ("triton", "triton")


def test_kernels_command_json(monkeypatch):
    import torch
    import triton

    monkeypatch.delenv("KVTWIN_ATTN_BACKEND", raising=False)
    result = CliRunner().invoke(app, ["kernels", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report == {
        "backends": [
            {"name": "torch", "usable": True, "detail": f"torch {torch.__version__}, reference (cpu)"},
            {"name": "triton", "usable": True, "detail": f"triton {triton.__version__} (interpreter)"},
            {"name": "vllm_flash_attn", "usable": False,
             "detail": "needs a CUDA device (and neither vllm nor vllm_flash_attn is installed)"}],
        "requested": "auto", "selected": "torch", "note": "auto"}


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
    lines = [line.rstrip() for line in done.stdout.splitlines()]
    assert lines[0] == "torch:            not usable  not installed (pip install 'kvtwin[kernels]')"
    assert lines[1].startswith("triton:           not usable  ")
    assert lines[2].startswith("vllm_flash_attn:  not usable  ")
    assert lines[3].startswith("KVTWIN_ATTN_BACKEND=auto -> none")
