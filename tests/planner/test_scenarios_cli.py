"""`kvtwin plan` end to end: scenario files, flag precedence, the table, --compare-hybrid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCENARIOS = sorted((Path(__file__).parents[2] / "scenarios").glob("*.toml"))


def test_there_are_example_scenarios():
    assert len(SCENARIOS) >= 4


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_example_scenario_plans(run_plan, path):
    out = run_plan("--scenario", path, "--json").json()
    assert out["fits"] and out["num_blocks"] >= 2 and out["groups"]


def test_flags_override_the_scenario(run_plan):
    path = next(p for p in SCENARIOS if p.stem == "gemma3-27b-h100-tp2")
    from_file = run_plan("--scenario", path, "--json").json()
    assert (from_file["model"], from_file["gpu"], from_file["tensor_parallel_size"]) == ("gemma-3-27b", "h100", 2)
    overridden = run_plan("--scenario", path, "--max-model-len", "65536", "--gpu", "h200", "--json").json()
    assert overridden["max_model_len"] == 65536 and overridden["gpu"] == "h200"
    assert overridden["tensor_parallel_size"] == 2


def test_golden_scenario_equals_golden_flags(run_plan):
    path = next(p for p in SCENARIOS if p.stem == "golden-gpt-oss-20b")
    out = run_plan("--scenario", path, "--json").json()
    assert (out["num_blocks"], out["kv_cache_tokens"]) == (109226, 1393194)


def test_hf_config_scenario_matches_the_preset_layout(run_plan):
    path = next(p for p in SCENARIOS if p.stem == "hf-config-jamba")
    from_config = run_plan("--scenario", path, "--json").json()
    preset = run_plan("--model", "jamba-mini", "--gpu", "h100", "--tp", "2", "--max-model-len", "65536",
                      "--json").json()
    for key in ("block_size", "bytes_per_block", "num_groups", "blocks_per_request"):
        assert from_config[key] == preset[key]


def test_scenario_model_preset_with_overrides(run_plan, tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[model]\npreset = "gemma-3-27b"\nsliding_window = 4096\n'
                    '[hardware]\ngpu = "h100"\nmemory_gib = 94\n[engine]\nmax_model_len = 32768\n')
    out = run_plan("--scenario", path, "--json").json()
    assert out["groups"][0]["sliding_window"] == 4096
    assert out["memory"]["total_bytes"] == 94 * (1 << 30)


def test_json_has_the_documented_keys(run_plan):
    out = run_plan("--model", "gemma-3-27b", "--gpu", "h100", "--tp", "2", "--max-model-len", "32768",
                   "--json").json()
    for key in ("model", "num_blocks", "bytes_per_block", "kv_cache_tokens", "max_concurrency", "groups", "memory",
                "steady_state_concurrency", "waste"):
        assert key in out
    for group in out["groups"]:
        assert group["kind"] in ("full_attention", "sliding_window", "chunked_local", "mla", "mamba")
        for key in ("num_layers", "num_padding_layers", "block_size", "page_bytes"):
            assert key in group
        assert ("sliding_window" in group) == (group["kind"] == "sliding_window")
    assert set(out["memory"]) >= {"total_bytes", "requested_bytes", "weights_bytes", "activation_peak_bytes",
                                  "cuda_graph_bytes", "kv_cache_bytes"}


def test_table_output(run_plan):
    result = run_plan("--model", "gemma-3-27b", "--gpu", "h100", "--tp", "2", "--max-model-len", "32768")
    assert result.exit_code == 0
    text = result.stdout
    for needle in ("KV cache groups", "sliding_window", "full_attention", "num_blocks", "KV cache tokens",
                   "max concurrency", "steady state", "Memory per GPU", "weights", "padding layers"):
        assert needle in text


def test_the_concurrency_line_reads_as_what_fits_not_as_a_cap(run_plan):
    """Issue 37 (9e): the pool's count of max_model_len requests is what fits together once
    prefilled, beside max_num_seqs, not a limit on running requests."""
    pool_bound = run_plan("--model", "llama-3.1-8b", "--gpu", "h100", "--json").json()
    fits = int(pool_bound["steady_state_concurrency"])
    assert fits < pool_bound["max_num_seqs"]
    text = run_plan("--model", "llama-3.1-8b", "--gpu", "h100").stdout
    assert "limited to" not in text
    line = next(line for line in text.splitlines() if line.strip().startswith("at once"))
    assert (f"{fits} requests of {pool_bound['max_model_len']:,} tokens fit together once prefilled "
            f"(shorter ones: more, up to max_num_seqs {pool_bound['max_num_seqs']:,})") in line
    seqs_bound = run_plan("--model", "llama-3.1-8b", "--gpu", "h100", "--max-model-len", "2048", "--max-num-seqs",
                          "64", "--json").json()
    assert int(seqs_bound["steady_state_concurrency"]) > 64
    text = run_plan("--model", "llama-3.1-8b", "--gpu", "h100", "--max-model-len", "2048", "--max-num-seqs",
                    "64").stdout
    line = next(line for line in text.splitlines() if line.strip().startswith("at once"))
    assert (f"max_num_seqs 64 running requests at most (the pool would hold "
            f"{int(seqs_bound['steady_state_concurrency']):,} of 2,048 tokens once prefilled)") in line


def test_does_not_fit_is_printed_and_exits_1(run_plan):
    result = run_plan("--model", "llama-3.1-70b", "--gpu", "h100", "--max-model-len", "131072")
    assert result.exit_code == 1  # scripts gate on it; 2 is bad input
    assert "DOES NOT FIT" in result.stdout and "would fit: tensor_parallel_size" in result.stdout
    as_json = run_plan("--model", "llama-3.1-70b", "--gpu", "h100", "--max-model-len", "131072", "--json")
    assert as_json.exit_code == 1
    out = json.loads(as_json.stdout)
    assert out["fits"] is False and out["kv_cache_tokens"] is None and out["shortfall_bytes"] > 0


def test_compare_hybrid(run_plan):
    result = run_plan("--model", "gemma-3-27b", "--gpu", "h100", "--tp", "2", "--max-model-len", "131072",
                      "--compare-hybrid")
    assert result.exit_code == 0 and "hybrid on" in result.stdout and "hybrid off" in result.stdout
    out = run_plan("--model", "gemma-3-27b", "--gpu", "h100", "--tp", "2", "--max-model-len", "131072",
                   "--compare-hybrid", "--json").json()
    on, off = out["hybrid_on"], out["hybrid_off"]
    assert on["hybrid_kv_cache_manager"] and not off["hybrid_kv_cache_manager"]
    assert on["kv_cache_tokens"] > off["kv_cache_tokens"]
    assert 0 < out["kv_bytes_per_request_saving"] < 1
    # TP 2: on one H100 jamba-mini does not fit at all, and a plan that does not fit exits 1.
    state = run_plan("--model", "jamba-mini", "--gpu", "h100", "--tp", "2", "--compare-hybrid", "--json").json()
    assert "error" in state["hybrid_off"]


def test_cli_app_mounts_plan():
    from kvtwin import cli
    assert "plan" in [entry.name for entry in cli.COMMANDS]
