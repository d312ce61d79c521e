"""How a setting's value is read, whichever way it comes in (a scenario file, a flag, a
sweep value): byte sizes in every form people write them (an integer, 1e9, 500GB, 1TiB),
never a fractional or negative byte count, never an infinite or NaN number, and a GPU
table that names the field and the value it refuses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtwin.sim.core.config import byte_amount, byte_count, is_number
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import gpu_from_mapping
from kvtwin.sim.scenario.resolve import resolve_scenario
from kvtwin.sim.scenario.sweep_keys import parse_sweeps
from tests.cli_run import one_error_line, run

GIB = 2**30

SCENARIO = """\
[model]
preset = "llama-3.1-8b"

[hardware]
gpu = "h100"

[engine]
max_model_len = 8192

[workload]
trace = "bundled:mooncake_conversation_trace.jsonl"
limit = 20
"""


def scenario_with(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- one reading of a byte size ------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (1_000_000_000, 10**9), (1e9, 10**9), ("1e9", 10**9), ("1_000_000", 10**6), (" 42 ", 42),
    ("500GB", 500 * 10**9), ("1.5 TB", 1_500_000_000_000), ("1TiB", 2**40), ("64GiB", 64 * GIB),
    ("0.5KiB", 512), ("2 MiB", 2 * 2**20), ("3kB", 3000), (1e20, 10**20),
])
def test_a_byte_size_is_read_exactly_in_every_form(value, expected):
    assert byte_count(value, "x", "bytes") == expected


@pytest.mark.parametrize("value", ["1gb", "10 GBs", "KB", "1.5", 0.5, "abc", "", -1, "-5GB", math.inf, math.nan,
                                   True, "1e999999999", [1]])
def test_a_byte_size_is_whole_non_negative_and_finite(value):
    with pytest.raises(ConfigError):
        byte_count(value, "x", "bytes")


def test_only_a_rate_may_end_in_per_second():
    assert byte_amount("2GB/s", per_second=True) == 2 * 10**9
    assert byte_amount("2GB/s") is None


@pytest.mark.parametrize("value, finite", [(1, True), (2.5, True), (math.inf, False), (-math.inf, False),
                                           (math.nan, False), (True, False), ("1", False)])
def test_a_number_is_finite(value, finite):
    assert is_number(value) is finite


# -- byte-valued settings, in a scenario, a flag and a sweep ---------------------------------


def test_byte_settings_take_units_in_a_scenario(tmp_path):
    text = SCENARIO.replace("max_model_len = 8192\n", 'max_model_len = 8192\nkv_cache_memory_bytes = "20GiB"\n'
                            "non_torch_bytes = 1e9\n")
    text += '[offload]\ncpu_bytes = "500GB"\ndisk_bytes = "1TiB"\ndisk_bandwidth_bytes_per_s = "2GB/s"\n'
    resolved = resolve_scenario(scenario_with(tmp_path, text))
    assert resolved.engine.kv_cache_memory_bytes == 20 * GIB and resolved.engine.non_torch_bytes == 10**9
    assert (resolved.offload.cpu_bytes, resolved.offload.disk_bytes) == (500 * 10**9, 2**40)
    assert resolved.offload.disk_bandwidth_bytes_per_s == 2 * 10**9
    assert resolved.plan().memory.kv_cache_bytes == 20 * GIB


@pytest.mark.parametrize("value", ["20GiB", "21474836480", "2.147483648e10"])
def test_the_kv_cache_flag_takes_the_same_forms(value):
    result = run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--max-model-len", "8192",
                 "--kv-cache-memory-bytes", value, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["memory"]["kv_cache_bytes"] == 20 * GIB


def test_sweep_values_take_the_same_forms():
    (axis,) = parse_sweeps(["engine.kv_cache_memory_bytes=20GiB,4e10,none"])
    assert axis.values == (20 * GIB, 40 * 10**9, None)
    (rate,) = parse_sweeps(["offload.disk_bandwidth_bytes_per_s=2GB/s,1.5e9"])
    assert rate.values == (2 * 10**9, 1_500_000_000)


@pytest.mark.parametrize("line, needle", [
    ('kv_cache_memory_bytes = "20 gigs"', "'20 gigs'"),
    ("kv_cache_memory_bytes = 1.5", "got 1.5"),
    ("kv_cache_memory_bytes = -1", "got -1"),
    ("cuda_graph_bytes = 0.25", "got 0.25"),
])
def test_a_bad_byte_size_in_a_scenario_is_one_line(tmp_path, line, needle):
    path = scenario_with(tmp_path, SCENARIO.replace("max_model_len = 8192\n", f"max_model_len = 8192\n{line}\n"))
    key = line.split(" =")[0]
    one_error_line(run("plan", "--scenario", path), f"{path}: engine.{key}: expected a ", "number of bytes", needle)


@pytest.mark.parametrize("value, needle", [("1.5", "got 1.5"), ("-2GB", "got -2000000000"), ("12 parsecs", "parsecs")])
def test_a_bad_byte_flag_is_one_line(value, needle):
    one_error_line(run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--kv-cache-memory-bytes", value),
                   "kvtwin: error: --kv-cache-memory-bytes: expected a ", needle)


def test_a_bad_byte_sweep_value_is_one_line(tmp_path):
    path = scenario_with(tmp_path, SCENARIO)
    one_error_line(run("capacity", path, "--sweep", "engine.kv_cache_memory_bytes=20GiB,0.5", "-q", "--out",
                       tmp_path / "cap"), "--sweep engine.kv_cache_memory_bytes: expected a positive number of bytes",
                   "got 0.5")
    assert not (tmp_path / "cap").exists()


# -- no infinite or NaN setting ------------------------------------------------------------


@pytest.mark.parametrize("table, line, field", [
    ("[workload]", "rate_scale = inf", "workload.rate_scale"),
    ("[workload]", "rate_scale = -inf", "workload.rate_scale"),
    ("[workload]", "rate_scale = nan", "workload.rate_scale"),
    ("[workload]", "end_s = inf", "workload.end_s"),
    ("[engine]", "gpu_memory_utilization = nan", "engine.gpu_memory_utilization"),
    ("[engine]", "watermark = inf", "engine.watermark"),
    ("[slo]", "ttft_s = inf", "slo.ttft_s"),
    ("[cost_model]", "step_overhead_s = inf", "cost_model.step_overhead_s"),
    ("[run]", "time_limit_s = inf", "run.time_limit_s"),
    ("[hardware]", "price_per_hour = inf", "hardware.price_per_hour"),
    ("[hardware]", "memory_gib = 1e308", "hardware.memory_gib"),
])
def test_a_non_finite_value_in_a_scenario_is_refused_by_name(tmp_path, table, line, field):
    text = SCENARIO if f"{table}\n" in SCENARIO else SCENARIO + f"{table}\n"
    path = scenario_with(tmp_path, text.replace(f"{table}\n", f"{table}\n{line}\n"))
    one_error_line(run("replay", path, "-q", "--out", tmp_path / "run"), f"{path}: {field}: expected ")
    assert not (tmp_path / "run").exists()


def test_an_end_before_the_start_is_refused_naming_both(tmp_path):
    path = scenario_with(tmp_path, SCENARIO.replace("limit = 20\n", "limit = 20\nstart_s = 60\nend_s = 30\n"))
    one_error_line(run("replay", path, "-q", "--out", tmp_path / "run"),
                   f"{path}: workload.end_s: expected a time after workload.start_s (60 s), got 30")
    assert not (tmp_path / "run").exists()


# -- GPU tables ------------------------------------------------------------------------------

INLINE_GPU = """\
[hardware]
name = "my-card"
memory_gib = 48
hbm_bandwidth_bytes_per_s = 0.96e12
bf16_flops = 180e12
compute_capability = "8.9"
"""


@pytest.mark.parametrize("line, field, got", [
    ("hbm_bandwidth_bytes_per_s = 0", "hardware.hbm_bandwidth_bytes_per_s", "got 0"),
    ("hbm_bandwidth_bytes_per_s = -1e12", "hardware.hbm_bandwidth_bytes_per_s", "got -1000000000000.0"),
    ("bf16_flops = 0", "hardware.bf16_flops", "got 0"),
    ("interconnect_bytes_per_s = 0.0", "hardware.interconnect_bytes_per_s", "got 0.0"),
    ("pcie_h2d_bytes_per_s = -5", "hardware.pcie_h2d_bytes_per_s", "got -5"),
    ("bf16_flops = inf", "hardware.bf16_flops", "got inf"),
])
def test_a_zero_or_negative_gpu_rate_names_the_file_the_field_and_the_value(tmp_path, line, field, got):
    key = line.split(" =")[0]
    kept = "".join(row for row in INLINE_GPU.splitlines(keepends=True) if not row.startswith(key + " "))
    text = SCENARIO.replace('[hardware]\ngpu = "h100"\n', kept + line + "\n")
    path = scenario_with(tmp_path, text)
    one_error_line(run("replay", path, "-q", "--out", tmp_path / "run"), f"{path}: {field}: expected a positive", got)


def test_a_preset_override_of_a_rate_to_zero_is_refused(tmp_path):
    path = scenario_with(tmp_path, SCENARIO.replace('gpu = "h100"\n', 'gpu = "h100"\nhbm_bandwidth_bytes_per_s = 0\n'))
    one_error_line(run("plan", "--scenario", path), f"{path}: hardware.hbm_bandwidth_bytes_per_s: expected a positive",
                   "got 0")


def test_zero_still_means_none_where_a_preset_uses_it():
    gpu = gpu_from_mapping({"gpu": "h100", "fp8_flops": 0, "nic_bytes_per_s": 0})
    assert (gpu.fp8_flops, gpu.nic_bytes_per_s) == (0, 0)


def test_gpu_rates_take_units():
    gpu = gpu_from_mapping({"name": "x", "memory_bytes": "80GB", "hbm_bandwidth_bytes_per_s": "3.35TB/s",
                            "bf16_flops": 1e15})
    assert (gpu.memory_bytes, gpu.hbm_bandwidth_bytes_per_s) == (80 * 10**9, 3_350_000_000_000)


def test_an_inline_gpu_without_a_bandwidth_plans_but_does_not_replay(tmp_path):
    text = SCENARIO.replace('[hardware]\ngpu = "h100"\n', '[hardware]\nname = "my-card"\nmemory_gib = 48\n')
    path = scenario_with(tmp_path, text)
    assert run("plan", "--scenario", path).exit_code == 0
    one_error_line(run("replay", path, "-q", "--out", tmp_path / "run"),
                   f"{path}: hardware.hbm_bandwidth_bytes_per_s: expected a positive number of bytes per second",
                   "my-card has none", "got 0.0")
