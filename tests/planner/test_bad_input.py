"""Bad input: one clear `kvtwin: error:` line each, exit code 2, never a traceback."""

from __future__ import annotations

import pytest

from kvtwin.sim.planner.hardware import gpu_names
from kvtwin.sim.planner.models import model_names

BASE = ["--model", "gemma-3-27b", "--gpu", "h100", "--tp", "2"]


def assert_one_error_line(result, *needles: str) -> str:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtwin: error: ")
    assert "Traceback" not in result.stderr and result.stdout == ""
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flag,value", [
    ("--max-model-len", "0"),
    ("--max-model-len", "-4096"),
    ("--block-size", "0"),
    ("--max-num-batched-tokens", "-1"),
    ("--max-num-seqs", "0"),
    ("--kv-cache-memory-bytes", "0"),
    ("--kv-cache-memory-bytes", "-5"),
    ("--tp", "0"),
])
def test_zero_or_negative_sizes(run_plan, flag, value):
    """A bad flag is named as the user typed it."""
    assert_one_error_line(run_plan(*BASE, flag, value), f"kvtwin: error: {flag}: ", "positive")


@pytest.mark.parametrize("value", ["0", "-0.1", "1.01", "92"])
def test_utilization_outside_unit_interval(run_plan, value):
    assert_one_error_line(run_plan(*BASE, "--gpu-memory-utilization", value), "--gpu-memory-utilization",
                          "(0, 1]")


def test_utilization_of_exactly_one_is_allowed(run_plan):
    assert run_plan(*BASE, "--gpu-memory-utilization", "1", "--json").json()["memory"]["gpu_memory_utilization"] == 1


def test_window_larger_than_max_model_len(run_plan):
    assert_one_error_line(run_plan(*BASE, "--max-model-len", "512"), "max_model_len", "sliding window (1024")
    assert_one_error_line(run_plan("--model", "llama-4-scout", "--gpu", "h100", "--tp", "8",
                                   "--max-model-len", "4096"), "attention chunk (8192")


def test_tp_that_does_not_divide_the_heads(run_plan):
    assert_one_error_line(run_plan("--model", "gemma-3-27b", "--gpu", "h100", "--tp", "3"),
                          "tensor_parallel_size", "32 attention heads")
    assert_one_error_line(run_plan("--model", "llama-4-scout", "--gpu", "h100", "--tp", "16"),
                          "tensor_parallel_size", "40 attention heads")


def test_unknown_model_and_gpu_list_the_valid_names(run_plan):
    line = assert_one_error_line(run_plan("--model", "llama-5", "--gpu", "h100"), "--model", "llama-5")
    assert all(name in line for name in model_names())
    line = assert_one_error_line(run_plan("--model", "qwen3-8b", "--gpu", "h300"), "--gpu", "h300")
    assert all(name in line for name in gpu_names())


@pytest.mark.parametrize("args,needle", [
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--mamba-cache-mode", "all"], "--mamba-cache-mode"),
    (["--max-num-batched-tokens", "256", "--max-num-seqs", "512"], "max_num_batched_tokens"),
])
def test_other_bad_settings(run_plan, args, needle):
    assert_one_error_line(run_plan(*BASE, *args), needle)


def test_hybrid_off_impossible_for_state_models(run_plan):
    assert_one_error_line(run_plan("--model", "jamba-mini", "--gpu", "h100", "--no-hybrid-kv-cache"),
                          "hybrid_kv_cache", "full attention")


def test_missing_model_or_gpu(run_plan):
    assert_one_error_line(run_plan("--gpu", "h100"), "--model")
    assert_one_error_line(run_plan("--model", "qwen3-8b"), "--gpu")


def test_bad_scenario_names_file_and_key(run_plan, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\npreset = "qwen3-8b"\n[hardware]\ngpu = "h100"\n[engine]\nmax_model_length = 4096\n')
    assert_one_error_line(run_plan("--scenario", path), str(path), "engine.max_model_length")
    path.write_text('[model]\npreset = "qwen3-8b"\n[hardware]\ngpu = "h100"\n[engine]\nblock_size = -16\n')
    assert_one_error_line(run_plan("--scenario", path), str(path), "engine.block_size")
    path.write_text('[model]\nname = "x"\nnum_layers = 4\n[hardware]\ngpu = "h100"\n')
    assert_one_error_line(run_plan("--scenario", path), str(path), "model.")
    assert_one_error_line(run_plan("--scenario", tmp_path / "missing.toml"), "missing.toml")


def test_bad_hf_config(run_plan, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"architectures": ["BertModel"]}')
    assert_one_error_line(run_plan("--hf-config", path, "--gpu", "h100"), "architectures", "BertModel")
    path.write_text("{not json")
    assert_one_error_line(run_plan("--hf-config", path, "--gpu", "h100"), "valid JSON")


@pytest.mark.parametrize("mode, caching, expected", [
    ("none", True, "expected 'align' when prefix caching is on"),
    ("align", False, "expected 'none' when prefix caching is off"),
])
def test_a_state_cache_mode_that_contradicts_prefix_caching(mode, caching, expected):
    """vLLM 0.33 would quietly switch the mode; kvtwin refuses rather than run another config."""
    from kvtwin.sim.core.errors import ConfigError
    from kvtwin.sim.planner.engine_config import EngineConfig
    from kvtwin.sim.planner.hardware import get_gpu
    from kvtwin.sim.planner.models import get_model

    engine = EngineConfig(mamba_cache_mode=mode, enable_prefix_caching=caching)
    with pytest.raises(ConfigError, match=expected):
        engine.resolve(get_model("nemotron-h-8b"), get_gpu("h100"))
