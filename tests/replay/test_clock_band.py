"""`kvtwin replay` says which clock it ran on and how far to trust it: the bundled
calibration's band on each p99, an uncalibrated GPU in one line, and client-side latency
columns beside the server's when the calibration has a client overhead."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.replay.client_side import default_client_overhead
from kvtwin.sim.calibration.file import bundled_calibration

SCENARIO = """\
[model]
preset = "llama-3.1-8b"
[hardware]
{hardware}
[engine]
max_model_len = 4096
[workload]
kind = "requests"
seed = 2
num_requests = 40
arrival = {{ process = "poisson", rate_per_s = 4.0 }}
prompt_tokens = {{ dist = "lognormal", mean = 800, sigma = 0.6 }}
output_tokens = {{ dist = "lognormal", mean = 50, sigma = 0.5 }}
{cost_model}
"""


def replay(tmp_path, hardware='gpu = "h100"', cost_model=""):
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO.format(hardware=hardware, cost_model=cost_model))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["replay", str(scenario), "-q", "--no-report", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result.stdout, out


def test_a_bundled_gpu_replays_on_its_calibration_with_a_band(tmp_path):
    stdout, out = replay(tmp_path)
    cal = bundled_calibration("h100", "llama-3.1-8b")
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["calibration"] == cal.label
    # docs/capacity.md#the-band: the bundled band is the serving runs' ratios, not the kernels' error.
    ttft_low, ttft_high = cal.bands["ttft"]
    tpot_low, tpot_high = cal.bands["tpot"]
    assert ttft_low < 1 < ttft_high and tpot_low < 1 < tpot_high
    assert summary["error_ttft"] == max(1 - ttft_low, ttft_high - 1)
    assert summary["p99_ttft_ms_low"] == pytest.approx(summary["p99_ttft_ms"] * ttft_low)
    assert summary["p99_ttft_ms_high"] == pytest.approx(summary["p99_ttft_ms"] * ttft_high)
    assert summary["p99_tpot_ms_high"] == pytest.approx(summary["p99_tpot_ms"] * tpot_high)
    assert summary["p99_itl_ms_low"] == pytest.approx(summary["p99_itl_ms"] * tpot_low)
    assert f"clock: {cal.label}; p99 within the held-out error (server-side): TTFT" in stdout
    assert f"(x{ttft_low:.2f}-x{ttft_high:.2f})" in stdout
    # A bundled calibration carries the default time outside the engine, from its sources'
    # file: the client's columns are the server's plus it.
    default = default_client_overhead()
    assert cal.efficiency.client_overhead_s == default.seconds == pytest.approx(0.008)
    assert default.low_seconds < default.seconds < default.high_seconds
    assert summary["client_overhead_ms"] == pytest.approx(8.0)
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    done = [r for r in requests if r["status"] == "finished"]
    assert done and all(r["ttft_client_s"] == pytest.approx(r["ttft_s"] + 0.008, abs=1e-12) for r in done)
    assert summary["p99_ttft_client_ms"] > summary["p99_ttft_ms"]


def test_a_custom_gpu_is_uncalibrated_and_says_so(tmp_path):
    stdout, out = replay(tmp_path, hardware='name = "mine"\nmemory_gib = 80\nhbm_bandwidth_bytes_per_s = 3e12\n'
                                            'bf16_flops = 9e14')
    assert "uncalibrated: mine is a GPU described inline, not a preset, so no bundled calibration applies" in stdout
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["calibration"] == "uncalibrated" and math.isnan(summary["p99_ttft_ms_low"])


def test_a_client_overhead_adds_client_side_columns(tmp_path):
    # The scenario's value replaces the bundled calibration's default.
    stdout, out = replay(tmp_path, cost_model="[cost_model]\nclient_overhead_s = 0.0125\n")
    requests = pq.read_table(out / "requests.parquet").to_pylist()
    done = [r for r in requests if r["status"] == "finished"]
    assert done and all(r["ttft_client_s"] == pytest.approx(r["ttft_s"] + 0.0125, abs=1e-12) for r in done)
    assert all(r["e2el_client_s"] == pytest.approx(r["e2el_s"] + 0.0125, abs=1e-12) for r in done)
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["client_overhead_ms"] == pytest.approx(12.5)
    assert summary["mean_ttft_client_ms"] == pytest.approx(summary["mean_ttft_ms"] + 12.5)
