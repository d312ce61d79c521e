"""A GPU preset keeps its bundled calibration while only fields no step's time depends on
differ from it (a price, a name, the memory, the host link...); a changed step-time field
(bandwidth, FLOP/s, peer link, chip kind) drops it, and replay, capacity and their reports
say so in one line naming the field. `kvtwin gpus` marks the calibrated presets."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import CALIBRATION_NEUTRAL_FIELDS, GPU_PRESETS, STEP_TIME_FIELDS, GPUSpec, get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.file import bundled_calibration, bundled_gpus
from kvtwin.sim.scenario.resolve import resolve_scenario

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
num_requests = 30
arrival = {{ process = "poisson", rate_per_s = 4.0 }}
prompt_tokens = {{ dist = "lognormal", mean = 800, sigma = 0.6 }}
output_tokens = {{ dist = "lognormal", mean = 40, sigma = 0.5 }}
[slo]
ttft_s = 0.5
tpot_s = 0.05
"""
H100 = bundled_calibration("h100", "llama-3.1-8b")
SLOWER_HBM = "hbm_bandwidth_bytes_per_s = 2e12"
SLOWER_HBM_LINE = ("uncalibrated: the bundled h100 calibration no longer applies: [hardware] sets "
                   "hbm_bandwidth_bytes_per_s = 2e+12 (the preset's: 3.35e+12), which step times depend on; times "
                   "use the default cost-model factors and carry no error band")

# A value unlike the preset's for each field no step time depends on.
NEUTRAL_VALUES = {"name": '"prod-h100"', "description": '"our H100s"', "memory_bytes": 85899345920,
                  "memory_datasheet": '"80 GB"', "fp8_flops": 1.5e15, "pcie_h2d_bytes_per_s": 2e10,
                  "pcie_d2h_bytes_per_s": 2e10, "nic_bytes_per_s": 2.5e10, "price_per_hour": 2.5}


def scenario_file(tmp_path, hardware: str, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(SCENARIO.format(hardware=hardware))
    return path


def invoke(*args):
    result = CliRunner().invoke(app, [*map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_every_gpu_field_is_classified_once():
    names = {f.name for f in dataclasses.fields(GPUSpec)}
    assert set(STEP_TIME_FIELDS) | set(CALIBRATION_NEUTRAL_FIELDS) == names
    assert not set(STEP_TIME_FIELDS) & set(CALIBRATION_NEUTRAL_FIELDS)
    assert set(NEUTRAL_VALUES) == set(CALIBRATION_NEUTRAL_FIELDS) - {"preset"}


def _step_seconds(gpu: GPUSpec) -> list[float]:
    """A decode-only, a prefill and a mixed step at TP 2 (all-reduces over the peer link)."""
    p = plan(get_model("llama-3.1-8b"), gpu, EngineConfig(tensor_parallel_size=2, max_model_len=32768))
    model = CostModel(p.model, gpu, p.layers.specs, tensor_parallel_size=2, async_scheduling=True)
    return [model.split_step_cost(d, f).total_s for d, f in
            (([1000] * 64, []), ([], [(4096, 0)]), ([300] * 5, [(512, 100)]))]


def test_the_neutral_fields_change_no_step_time_and_the_numeric_step_fields_do():
    h100 = get_gpu("h100")
    base = _step_seconds(h100)
    for name, value in NEUTRAL_VALUES.items():
        changed = dataclasses.replace(h100, **{name: tomllib.loads(f"v = {value}")["v"]})
        assert changed != h100 and _step_seconds(changed) == base, name
    for name in ("bf16_flops", "hbm_bandwidth_bytes_per_s", "interconnect_bytes_per_s"):
        changed = dataclasses.replace(h100, **{name: getattr(h100, name) * 0.5})
        assert _step_seconds(changed) != base, name


@pytest.mark.parametrize("field", sorted(NEUTRAL_VALUES))
def test_a_neutral_field_beside_a_preset_keeps_its_bundled_calibration(tmp_path, field):
    resolved = resolve_scenario(scenario_file(tmp_path, f'gpu = "h100"\n{field} = {NEUTRAL_VALUES[field]}'))
    assert resolved.calibration.calibrated and resolved.calibration.label == H100.label
    assert resolved.efficiency == H100.efficiency


@pytest.mark.parametrize("field, value", [("bf16_flops", "5e14"), ("hbm_bandwidth_bytes_per_s", "2e12"),
                                          ("interconnect_bytes_per_s", "4e11"), ("compute_capability", '"10.0"'),
                                          ("vendor", '"amd"')])
def test_a_changed_step_time_field_drops_the_calibration_naming_the_field(tmp_path, field, value):
    resolved = resolve_scenario(scenario_file(tmp_path, f'gpu = "h100"\n{field} = {value}'))
    assert not resolved.calibration.calibrated
    assert resolved.calibration.note.startswith(f"the bundled h100 calibration no longer applies: [hardware] sets "
                                                f"{field} = ")


def test_a_price_keeps_the_replay_on_the_bundled_clock(tmp_path):
    plain, priced = tmp_path / "plain", tmp_path / "priced"
    invoke("replay", scenario_file(tmp_path, 'gpu = "h100"'), "-q", "--no-report", "--out", plain)
    stdout = invoke("replay", scenario_file(tmp_path, 'gpu = "h100"\nprice_per_hour = 2.5', "p.toml"), "-q",
                    "--no-report", "--out", priced)
    assert f"clock: {H100.label}; p99 within the held-out error" in stdout and "uncalibrated" not in stdout
    summary = pq.read_table(priced / "summary.parquet").to_pylist()[0]
    assert summary["calibration"] == H100.label and summary["calibration_note"] == ""
    # The same clock: every request's times are the unpriced run's.
    assert pq.read_table(priced / "requests.parquet").to_pylist() == \
        pq.read_table(plain / "requests.parquet").to_pylist()


def test_a_changed_bandwidth_is_said_by_the_replay_its_summary_and_its_report(tmp_path):
    out = tmp_path / "run"
    stdout = invoke("replay", scenario_file(tmp_path, f'gpu = "h100"\n{SLOWER_HBM}'), "-q", "--out", out)
    lines = [line for line in stdout.splitlines() if "calibrat" in line]
    assert len(lines) == 1 and lines[0].startswith(SLOWER_HBM_LINE), lines
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    assert summary["calibration"] == "uncalibrated"
    assert summary["calibration_note"].startswith("the bundled h100 calibration no longer applies")
    report = (out / "report.html").read_text()
    assert '<p class="note warning">uncalibrated: the bundled h100 calibration no longer applies' in report


def test_a_gpu_without_a_bundled_file_says_which_have_one(tmp_path):
    stdout = invoke("replay", scenario_file(tmp_path, 'gpu = "mi300x"\nprice_per_hour = 3.0'), "-q", "--no-report",
                    "--out", tmp_path / "run")
    have = ", ".join(bundled_gpus())
    assert (f"uncalibrated: no bundled calibration for llama-3.1-8b on mi300x (bundled: {have}); times use the "
            "default cost-model factors") in stdout


def test_capacity_keeps_the_slow_edge_with_a_price_and_says_when_a_point_loses_it(tmp_path):
    priced = scenario_file(tmp_path, 'gpu = "h100"\nprice_per_hour = 2.5')
    # 400 requests: a steady window long enough to judge a rate (docs/capacity.md#sustained-load);
    # two replays per search are enough to find one.
    priced.write_text(priced.read_text().replace("num_requests = 30", "num_requests = 400"))
    out = tmp_path / "sweep"
    stdout = invoke("capacity", priced, "--find-max-rate", "--sweep", "hardware.hbm_bandwidth_bytes_per_s=3.35e12,2e12",
                    "--max-replays", "2", "--jobs", "1", "-q", "--out", out)
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["calibration"] for r in rows] == [H100.label, "uncalibrated"]
    # The calibrated point has its pessimistic edge and its cost; the other no edge, and says why.
    assert rows[0]["calibration_note"] == "" and rows[0]["step_error"] == max(H100.errors.values())
    assert rows[0]["max_request_rate_pessimistic"] is not None and rows[0]["cost_per_hour"] == 2.5
    assert rows[1]["calibration_note"].startswith("the bundled h100 calibration no longer applies")
    assert rows[1]["max_request_rate_pessimistic"] is None
    assert f"point 0: clock: {H100.label}" in stdout.splitlines()
    assert ("point 1: uncalibrated: the bundled h100 calibration no longer applies: [hardware] sets "
            "hbm_bandwidth_bytes_per_s = 2e+12 (the preset's: 3.35e+12), which step times depend on; times use the "
            "default cost-model factors and carry no error band and no slow edge") in stdout
    report = (out / "report.html").read_text()
    assert '<p class="note warning">point 1: uncalibrated: the bundled h100 calibration' in report


def test_gpus_marks_the_calibrated_presets():
    bundled = set(bundled_gpus())
    assert {"h100", "l40s"} <= bundled and "mi300x" not in bundled
    for line in invoke("gpus").splitlines():
        name, clock = line.split()[:2]
        assert clock == ("calibrated" if name in bundled else "uncalibrated"), line
    facts = json.loads(invoke("gpus", "--json"))
    assert {name: entry["calibrated"] for name, entry in facts.items()} == {n: n in bundled for n in GPU_PRESETS}
