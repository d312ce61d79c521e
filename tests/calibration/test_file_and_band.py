"""Calibration files: read and checked, chosen for a scenario, and turned into the band on
every answer (summary p99s, the pessimistic edge of a rate search)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.calibration import file as calibration_file
from kvtwin.sim.calibration.band import band_columns, band_lines, pessimistic, step_error
from kvtwin.sim.calibration.file import Calibration, read_calibration, uncalibrated
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.efficiency import AllReduceCurve, Efficiency
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

CALIBRATION = """\
label = "test fit"

[cost_model]
matmul_flops_fraction = 0.8
matmul_half_tokens = 100.0
layer_fixed_s = 2.5e-05

[[cost_model.allreduce]]
tensor_parallel_size = 2
message_bytes = [1024.0, 1048576.0]
seconds = [5e-06, 2e-05]

[error]
prefill_step = 0.06
decode_step = 0.04
ttft = 0.1

[[source]]
repository = "example/kernels"
path = "data/gemm.csv"
commit = "0123456789abcdef0123456789abcdef01234567"
licence = "Apache-2.0"
"""


def write(tmp_path: Path, text: str, name: str = "cal.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_calibration_file_reads_back_whole(tmp_path):
    cal = read_calibration(write(tmp_path, CALIBRATION))
    assert cal.calibrated and cal.label == "test fit"
    assert cal.efficiency.matmul_flops_fraction == 0.8
    assert cal.efficiency.matmul_half_tokens == 100.0
    assert cal.efficiency.allreduce == (AllReduceCurve(2, (1024.0, 1048576.0), (5e-06, 2e-05)),)
    assert cal.errors == {"prefill_step": 0.06, "decode_step": 0.04, "ttft": 0.1}
    assert cal.sources[0]["repository"] == "example/kernels"
    # The most specific error bands each figure; TPOT falls back to the decode step.
    assert cal.error_for("ttft_ms") == 0.1
    assert cal.error_for("tpot_ms") == 0.04
    assert cal.error_for("e2el_ms") == 0.04


@pytest.mark.parametrize("edit, field", [
    (("ttft = 0.1", "ttft = -0.5"), "error.ttft"),
    (("ttft = 0.1", 'ttft = "small"'), "error.ttft"),
    (("ttft = 0.1", "latency = 0.1"), "error.latency"),
    (("matmul_flops_fraction = 0.8", "matmul_flops_fraction = 1.8"), "cost_model.matmul_flops_fraction"),
    (("matmul_flops_fraction = 0.8", "matmul_flops_fraction = true"), "cost_model.matmul_flops_fraction"),
    (("seconds = [5e-06, 2e-05]", "seconds = [5e-06]"), "cost_model.allreduce[0].message_bytes"),
    (("message_bytes = [1024.0, 1048576.0]", "message_bytes = [1048576.0, 1024.0]"),
     "cost_model.allreduce[0].message_bytes"),
    (('licence = "Apache-2.0"', "licence = 2"), "source[0].licence"),
    (("label = \"test fit\"", "label = ["), "calibration"),
])
def test_a_bad_calibration_file_is_one_error_naming_file_and_field(tmp_path, edit, field):
    path = write(tmp_path, CALIBRATION.replace(*edit))
    with pytest.raises(ConfigError) as err:
        read_calibration(path)
    assert err.value.field == field
    assert str(path) in str(err.value)


def test_a_missing_calibration_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="an existing TOML file"):
        read_calibration(tmp_path / "nope.toml")


def scenario_text(gpu="h100", cost_model=""):
    return (f'[model]\npreset = "llama-3.1-8b"\n\n[hardware]\ngpu = "{gpu}"\n\n[engine]\nmax_model_len = 32768\n'
            f"{cost_model}")


def test_a_scenario_gets_the_named_file_else_the_gpu_bundled_one_else_none(tmp_path, monkeypatch):
    folder = tmp_path / "bundled"
    folder.mkdir()
    write(folder, CALIBRATION.replace('label = "test fit"', 'label = "bundled h100"'), "h100.toml")
    monkeypatch.setattr(calibration_file, "_bundled_dir", lambda: folder)

    bundled = resolve_scenario(write(tmp_path, scenario_text(), "s.toml"))
    assert bundled.calibration.label == "bundled h100"
    assert bundled.efficiency.matmul_half_tokens == 100.0

    own = write(tmp_path, CALIBRATION.replace("0.8", "0.7"), "mine.toml")
    named = resolve_scenario(write(tmp_path, scenario_text(cost_model=f'\n[cost_model]\ncalibration = "{own.name}"\n'
                                                                       "step_overhead_s = 0.002\n"), "s2.toml"))
    assert named.calibration.path == str(own)
    assert named.efficiency.matmul_flops_fraction == 0.7
    assert named.efficiency.step_overhead_s == 0.002  # the scenario's keys on top of the file

    # A scenario key on top of the bundled file.
    tuned = resolve_scenario(write(tmp_path, scenario_text(cost_model="\n[cost_model]\nlayer_fixed_s = 1e-5\n"),
                                   "s3.toml"))
    assert tuned.calibration.label == "bundled h100" and tuned.efficiency.layer_fixed_s == 1e-5

    # No file for the GPU, or a preset with a step-time field changed: the default factors, said so.
    other = resolve_scenario(write(tmp_path, scenario_text(gpu="l40s"), "s4.toml"))
    assert not other.calibration.calibrated and other.efficiency == Efficiency()
    changed = resolve_scenario(write(tmp_path, scenario_text() + '\n', "s5.toml"),
                               Overrides(gpu="h100"))
    assert changed.calibration.label == "bundled h100"
    custom = write(tmp_path, scenario_text().replace('gpu = "h100"', 'gpu = "h100"\nbf16_flops = 5e14'), "s6.toml")
    assert not resolve_scenario(custom).calibration.calibrated


def test_band_columns_follow_the_held_out_error(tmp_path):
    cal = read_calibration(write(tmp_path, CALIBRATION))
    row = {"p99_ttft_ms": 200.0, "p99_tpot_ms": 50.0, "p99_itl_ms": 40.0, "p99_e2el_ms": 4000.0}
    band = band_columns(row, cal)
    assert band["calibration"] == "test fit"
    assert (band["p99_ttft_ms_low"], band["p99_ttft_ms_high"]) == pytest.approx((180.0, 220.0))
    assert (band["p99_tpot_ms_low"], band["p99_tpot_ms_high"]) == pytest.approx((48.0, 52.0))
    assert band["error_ttft"] == 0.1
    # An error over 100% (a prediction twice the measurement) leaves the band at 0 below.
    wide = band_columns(row, Calibration(cal.efficiency, "wide", "w.toml", {"ttft": 1.3}))
    assert (wide["p99_ttft_ms_low"], wide["p99_ttft_ms_high"]) == pytest.approx((0.0, 460.0))
    none = band_columns(row, uncalibrated(note="why not"))
    assert none["calibration"] == "uncalibrated" and math.isnan(none["p99_ttft_ms_low"])
    assert none["calibration_note"] == "why not" and band["calibration_note"] == ""
    assert band_lines(row, uncalibrated(note="why not")) == [
        "uncalibrated: why not; times use the default cost-model factors and carry no error band. Fit one with "
        "`kvtwin calibrate`."]
    assert "TTFT 180.0-220.0 ms (±10%)" in band_lines({**row, **band}, cal)[0]


def test_the_pessimistic_edge_slows_every_step_by_the_step_error():
    cal = Calibration(Efficiency(matmul_half_tokens=64.0, layer_fixed_s=3e-5, step_gpu_fixed_s=1e-4,
                                 attention_half_query_tokens=500.0, decode_attention_s_per_head=5e-9,
                                 allreduce=(AllReduceCurve(2, (1e3, 1e7), (6e-6, 1e-4)),)),
                      "x", "x.toml", {"prefill_step": 0.05, "decode_step": 0.08})
    assert step_error(cal) == 0.08
    assert step_error(dataclasses.replace(cal, path=None)) is None  # uncalibrated: no edge
    slowed = pessimistic(cal.efficiency, 0.08)
    for tp, async_scheduling in ((1, True), (2, False)):
        p = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(tensor_parallel_size=tp,
                                                                          max_model_len=32768))
        models = [CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp,
                            async_scheduling=async_scheduling, efficiency=e) for e in (cal.efficiency, slowed)]
        for decodes, prefills in (([1000] * 64, []), ([], [(4096, 0)]), ([300] * 5, [(512, 100)])):
            base, slow = (m.split_step_cost(decodes, prefills).total_s for m in models)
            assert slow == pytest.approx(base * 1.08, rel=1e-12)


BANDED = CALIBRATION.replace("[[source]]", "[band]\nttft = [0.5, 3.25]\ne2e = [0.8, 2.0]\n\n[[source]]", 1)


def test_a_band_of_ratios_reads_back_and_takes_the_place_of_the_error(tmp_path):
    # docs/capacity.md#the-band: a [band] kind is p99 x low .. p99 x high; a figure without
    # one keeps the symmetric [error] band.
    cal = read_calibration(write(tmp_path, BANDED))
    assert cal.bands == {"ttft": (0.5, 3.25), "e2e": (0.8, 2.0)}
    assert cal.band_ratios("ttft_ms") == (0.5, 3.25) and cal.band_error("ttft_ms") == 2.25
    assert cal.band_ratios("tpot_ms") == pytest.approx((0.96, 1.04)) and cal.band_error("tpot_ms") == 0.04
    row = {"p99_ttft_ms": 200.0, "p99_tpot_ms": 50.0, "p99_itl_ms": 40.0, "p99_e2el_ms": 4000.0}
    band = band_columns(row, cal)
    assert (band["p99_ttft_ms_low"], band["p99_ttft_ms_high"]) == (100.0, 650.0)
    assert (band["p99_e2el_ms_low"], band["p99_e2el_ms_high"]) == (3200.0, 8000.0)
    assert (band["p99_tpot_ms_low"], band["p99_tpot_ms_high"]) == pytest.approx((48.0, 52.0))
    assert band["error_ttft"] == 2.25 and band["error_e2el"] == pytest.approx(1.0)
    line = band_lines({**row, **band}, cal)[0]
    assert "TTFT 100.0-650.0 ms (x0.50-x3.25)" in line and "TPOT 48.0-52.0 ms (±4%)" in line
    assert "E2E 3.20-8.00 s (x0.80-x2.00)" in line
    # A scenario's own [cost_model] keys keep the file's band.
    assert cal.with_overrides({"layer_fixed_s": 1e-5}).bands == cal.bands


@pytest.mark.parametrize("band, field", [
    ("ttft = [1.2, 3.0]", "band.ttft"),  # the band must hold the replay's own figure
    ("ttft = [0.5, 0.9]", "band.ttft"),
    ("ttft = [0.0, 2.0]", "band.ttft"),
    ("ttft = [0.5]", "band.ttft"),
    ('ttft = ["a", 2.0]', "band.ttft"),
    ("ttft = [0.5, true]", "band.ttft"),
    ("latency = [0.5, 2.0]", "band.latency"),
    ("prefill_step = [0.5, 2.0]", "band.prefill_step"),
])
def test_a_bad_band_names_its_kind(tmp_path, band, field):
    text = CALIBRATION.replace("[[source]]", f"[band]\n{band}\n\n[[source]]", 1)
    with pytest.raises(ConfigError) as err:
        read_calibration(write(tmp_path, text))
    assert field in str(err.value) and "cal.toml" in str(err.value)


def test_every_bundled_calibration_carries_the_serving_band():
    # scripts/calibration/fit_bundled.py copies measurements/serving_band.toml into each file.
    import tomllib
    from importlib import resources

    measured = tomllib.loads(resources.files(calibration_file.BUNDLED_PACKAGE).joinpath(
        "measurements", "serving_band.toml").read_text())
    for gpu in calibration_file.bundled_gpus():
        cal = calibration_file.bundled_calibration(gpu, "any-model")
        assert cal.bands == {k: tuple(v) for k, v in measured.items() if k != "source"}, gpu
        repositories = {s["repository"] for s in cal.sources}
        assert {s["repository"] for s in measured["source"]} <= repositories, gpu
