"""The executor on the Triton kernels, run by Triton's interpreter on a CPU.

``TRITON_INTERPRET=1`` and ``KVTWIN_ATTN_BACKEND=triton`` must be set before the kernel
modules are imported, so the run happens in a fresh interpreter. Check 1 passes on a tiny
workload (a few short requests, some with prefix hits) for full attention and for Mamba-2
(one layer per group: the interpreted state kernel walks tokens one at a time), and both
of check 1's runs really used the Triton backend.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: Triton reads TRITON_INTERPRET when it is first imported, and the
# kernel tests (tests/kernels) need it imported after their conftest sets it.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from pathlib import Path

import torch

torch.set_num_threads(1)
from kvtwin.executor.device_replay import ExecutorOptions
from kvtwin.executor.validate import ValidateOptions
from tests.executor.toys import scenario, validate_with_runs

report = {}
for kind, layers_per_group in (("full", 2), ("mamba2", 1)):
    resolved = scenario(kind, Path(sys.argv[1]), num_requests=4, shared_tokens=32, prompt_mean=8, output_mean=3)
    options = ValidateOptions(executor=ExecutorOptions(layers_per_group=layers_per_group),
                              checks=("prefix_hits_are_real",))
    validation, runs = validate_with_runs(resolved, options)
    [verdict] = validation.verdicts
    report[kind] = dict(status=verdict.status, line=verdict.line,
                        backends=[runs["on"].kernels.name, runs["off"].kernels.name],
                        mixers=sorted({layer.mixer for layer in runs["on"].shape.layers}),
                        hits=runs["on"].result.summary.column("prefix_cache_hits")[0].as_py(),
                        compared=sum(r["passed"] is True for r in validation.rows),
                        requests=resolved.workload.load().num_rows)
print(json.dumps(report))
"""


def test_check_1_passes_on_the_triton_kernels_under_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", KVTWIN_ATTN_BACKEND="triton", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.keys() == {"full", "mamba2"}
    for kind, got in report.items():
        assert got["status"] == "pass", got["line"]
        assert got["backends"] == ["triton", "triton"], kind
        assert got["hits"] > 0 and got["compared"] == got["requests"], got
    assert "state" in report["mamba2"]["mixers"] and "state" not in report["full"]["mixers"]
