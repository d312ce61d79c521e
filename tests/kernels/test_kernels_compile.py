"""Every Triton kernel compiles for the H200 (sm_90) on a machine without a GPU, to a cubin,
without spilling its tiles to the stack (``kernels.compile_check``, in a process without
the interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason=f"this Triton wheel ships no ptxas at {PTXAS}")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kvtwin.kernels.compile_check", "90"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert len(lines) >= 10 and all(line.startswith("ok") for line in lines), done.stdout
    # A few bytes of stack frame happen (Triton 3.6 keeps 8-24 B in two variants); a spilled
    # tile costs kilobytes.
    stacks = {line: int(line.rsplit(", ", 1)[1].split(" B stack")[0]) for line in lines if "B stack" in line}
    spilling = [line for line, stack in stacks.items() if stack > 64]
    assert not spilling, "register spills:\n" + "\n".join(spilling)
