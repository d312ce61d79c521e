"""`kvtwin validate` from the command line: a run writes its directory whole and prints a
verdict per check; a failed check exits 1; bad input is one error line and exit 2, before
any kernel runs."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

import kvtwin.executor.validate as validate_module  # noqa: E402
from kvtwin.cli import app  # noqa: E402
from kvtwin.executor.device_executor import Faults  # noqa: E402
from kvtwin.sim.calibration.fit.steps_device import MeasuredOn, read_measured_on  # noqa: E402
from kvtwin.sim.calibration.file import read_calibration  # noqa: E402

# Llama-3.1-8B pages are 2 MiB: 128 MiB of KV cache is a 64-block pool, small enough that
# sixteen chat requests evict each other's prefixes.
SCENARIO = """
description = "tiny llama for the validate CLI"
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 900
kv_cache_memory_bytes = 134217728
max_num_batched_tokens = 512
max_num_seqs = 8
[workload]
kind = "chat"
seed = 3
num_requests = 12
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 4.0 }
shared_prefix = { count = 2, tokens = 200, zipf_s = 1.0 }
turns = { dist = "fixed", value = 2 }
user_tokens = { dist = "lognormal", mean = 60, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 8, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 1 }
max_prompt_tokens = 600
"""


@pytest.fixture
def scenario(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(SCENARIO)
    return path


def _invoke(*args):
    return CliRunner().invoke(app, ["validate", *map(str, args)])


def test_validate_writes_the_directory_and_a_verdict_per_check(scenario, tmp_path):
    out = tmp_path / "run"
    result = _invoke(scenario, "--out", out, "--quiet")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("prefix hits: pass")
    assert lines[1].startswith("predicted hits: pass")
    assert lines[2].startswith("memory: skipped")
    assert lines[3].startswith("step latency: info")
    assert sorted(p.name for p in out.iterdir()) == ["calibration.toml", "plan.json", "steps.parquet",
                                                     "validation.parquet"]
    table = pq.read_table(out / "validation.parquet")
    assert table.column_names == list(validate_module.VALIDATION_COLUMNS)
    assert set(table.column("check").to_pylist()) == set(validate_module.CHECKS)
    own = read_calibration(out / "calibration.toml")  # kvtwin replay accepts it
    assert own.warning.startswith("the steps were measured on a CPU")  # and it says whose factors they are
    steps = pq.read_table(out / "steps.parquet")
    assert steps.num_rows > 0 and min(steps.column("measured_s").to_pylist()) > 0
    # The steps say they were timed on a CPU, so a calibration filed for the scenario's H100
    # from them is said to be the CPU's, on stderr and in the file.
    assert read_measured_on(out / "steps.parquet") == MeasuredOn("cpu", "cpu", True)
    calibrated = CliRunner().invoke(app, ["calibrate", str(scenario), "--steps", str(out / "steps.parquet"),
                                          "-o", str(tmp_path / "cpu.toml")])
    assert calibrated.exit_code == 0, calibrated.output
    warnings = [line for line in calibrated.stderr.splitlines() if line.startswith("kvtwin: warning:")]
    assert warnings == ["kvtwin: warning: --steps: the steps were measured on a CPU (kvtwin validate --device cpu, "
                        "a scaled-down model), not on a h100: the fitted factors describe that CPU, not the h100 the "
                        "calibration is for"]
    assert read_calibration(tmp_path / "cpu.toml").warning == warnings[0].removeprefix("kvtwin: warning: --steps: ")
    # A validation directory is replaced whole by the next validation.
    again = _invoke(scenario, "--out", out, "--quiet", "--checks", "prefix_hits_are_real")
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "steps.parquet", "validation.parquet"]


def test_validate_says_when_its_predictions_ran_on_an_uncalibrated_clock(scenario, tmp_path):
    scenario.write_text(SCENARIO.replace('gpu = "h100"', 'gpu = "h100"\nhbm_bandwidth_bytes_per_s = 2e12'))
    result = _invoke(scenario, "--out", tmp_path / "run", "--quiet", "--checks", "predicted_hits_are_executed")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "calibrat" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "uncalibrated: the bundled h100 calibration no longer applies: [hardware] sets hbm_bandwidth_bytes_per_s = "
        "2e+12 (the preset's: 3.35e+12), which step times depend on"), lines


def test_a_failed_check_exits_1(scenario, tmp_path, monkeypatch):
    real = validate_module.validate

    def broken(resolved, trace, options, **kwargs):
        executor = dataclasses.replace(options.executor, faults=Faults(corrupt_table=True))
        return real(resolved, trace, dataclasses.replace(options, executor=executor), **kwargs)

    monkeypatch.setattr(validate_module, "validate", broken)
    result = _invoke(scenario, "--out", tmp_path / "run", "--quiet", "--checks", "prefix_hits_are_real")
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("prefix hits: FAIL") and "block audit:" in result.stdout


@pytest.mark.parametrize("flags, field", [
    (["--checks", "speed"], "--checks"),
    (["--checks", ","], "--checks"),
    (["--requests", "0"], "--requests"),
    (["--device", "tpu"], "--device"),
    (["--clock", "sundial"], "--clock"),
    (["--size", "huge"], "--size"),
])
def test_bad_flags_are_one_error_line(scenario, tmp_path, monkeypatch, flags, field):
    monkeypatch.setattr(validate_module, "validate", lambda *a, **k: pytest.fail("validation ran"))
    result = _invoke(scenario, "--out", tmp_path / "run", *flags)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"kvtwin: error: {field}: expected"), errors
    assert not (tmp_path / "run").exists()


def test_cuda_without_a_gpu_is_refused_before_running(scenario, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(validate_module, "validate", lambda *a, **k: pytest.fail("validation ran"))
    result = _invoke(scenario, "--device", "cuda", "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("kvtwin: error: --device: expected a CUDA device (torch sees none here); "
                                     "use --device cpu, got 'cuda'")


def test_an_output_path_that_is_a_file_is_refused_first(scenario, tmp_path, monkeypatch):
    monkeypatch.setattr(validate_module, "validate", lambda *a, **k: pytest.fail("validation ran"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    result = _invoke(scenario, "--out", a_file)
    assert result.exit_code == 2 and result.stderr.startswith("kvtwin: error: --out: expected")
    assert a_file.read_text() == "mine"


def test_a_pool_too_big_for_a_cpu_names_the_knob(tmp_path, monkeypatch):
    monkeypatch.setattr(validate_module, "validate", lambda *a, **k: pytest.fail("validation ran"))
    monkeypatch.setattr("kvtwin.executor.device_replay.MAX_CPU_POOL_BYTES", 1 << 16)
    path = tmp_path / "big.toml"
    path.write_text(SCENARIO)
    result = _invoke(path, "--out", tmp_path / "run")
    assert result.exit_code == 2
    assert result.stderr.startswith("kvtwin: error: engine.kv_cache_memory_bytes: expected a KV pool a CPU can hold")


def test_progress_is_a_line_per_stage_off_a_terminal_and_nothing_when_quiet(scenario, tmp_path):
    result = _invoke(scenario, "--out", tmp_path / "run", "--checks", "prefix_hits_are_real,step_latency")
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith("kvtwin: validate: ")]
    stages = [line.removeprefix("kvtwin: validate: ").rsplit(", ", 1)[0] for line in progress]
    assert stages == ["executor, prefix caching on (1/3)", "executor, prefix caching off (2/3)",
                      "step latency and calibration (3/3)", "done"], result.stderr
    assert all(line.endswith(" s wall") for line in progress)
    quiet = _invoke(scenario, "--out", tmp_path / "run", "--checks", "prefix_hits_are_real", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_size_full_keeps_the_scenarios_lengths_and_small_cuts_them(scenario, tmp_path):
    for size, max_model_len in (("full", 900), ("small", None)):
        out = tmp_path / size
        result = _invoke(scenario, "--out", out, "--quiet", "--size", size, "--checks", "prefix_hits_are_real")
        assert result.exit_code == 0, result.output
        assert f"(--size {size})" in result.stdout
        plan = json.loads((out / "plan.json").read_text())
        if max_model_len is not None:
            assert plan["max_model_len"] == max_model_len
        else:  # the longest request left, whole blocks: under the scenario's 900
            assert plan["max_model_len"] < 900 and plan["max_model_len"] % 16 == 0
