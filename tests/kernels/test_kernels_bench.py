"""bench/gpu_kernels.py runs end to end at toy sizes on CPU (``--smoke``): every section,
the table and the parquet file, so the script that goes to a GPU machine is not untried."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
pq = pytest.importorskip("pyarrow.parquet")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"


def test_gpu_bench_smoke(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_kernels_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    table = pq.read_table(tmp_path / "gpu_kernels.parquet").to_pylist()
    sections = {r["section"] for r in table}
    assert {"correctness", "decode", "decode_sweep", "prefill", "state_decode"} <= sections
    correctness = [r for r in table if r["section"] == "correctness"]
    assert {r["backend"] for r in correctness} == {"torch", "triton"}
    assert all(r["passed"] for r in correctness)
    assert "wrote" in capsys.readouterr().out
