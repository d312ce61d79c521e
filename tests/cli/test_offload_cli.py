"""``[offload]`` and the ``--offload-*`` flags through ``kvtwin replay`` and ``kvtwin capacity``."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from tests.tables import assert_tables_equal

SCENARIO = """\
description = "offload test: session-heavy chat on a small GPU KV cache"
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 16896
kv_cache_memory_bytes = 3221225472
async_scheduling = false
[workload]
kind = "chat"
seed = 3
num_requests = 100
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 1.0 }
shared_prefix = { count = 4, tokens = 800, zipf_s = 1.0 }
turns = { dist = "zipf", s = 1.2, max = 12 }
user_tokens = { dist = "lognormal", mean = 300, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 100, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 10 }
max_prompt_tokens = 12000
"""
CPU_BYTES = 6 * 2**30


def _scenario(tmp_path, extra: str = "", name: str = "s.toml", engine: str | None = None):
    text = SCENARIO if engine is None else SCENARIO.replace("async_scheduling = false", engine)
    path = tmp_path / name
    path.write_text(text + extra)
    return path


def _replay(*args, report: bool = False):
    return CliRunner().invoke(app, ["replay", *map(str, args), "-q", *([] if report else ["--no-report"])])


def _one_error_line(res, *fragments):
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:"), res.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _tables(run_dir):
    return {name: pq.read_table(run_dir / f"{name}.parquet") for name in ("requests", "steps", "summary", "replicas")}


def test_replay_with_a_cpu_tier_reports_hits_per_tier(tmp_path):
    path = _scenario(tmp_path, f"[offload]\ncpu_bytes = {CPU_BYTES}\npolicy = \"arc\"\n")
    res = _replay(path, "--out", tmp_path / "run", report=True)
    assert res.exit_code == 0, res.output
    assert "hit rate GPU / CPU / disk / total" in (tmp_path / "run" / "report.html").read_text()
    line = next(line for line in res.output.splitlines() if line.startswith("offload:"))
    assert "CPU (arc, 3,072 chunks)" in line and "hits GPU" in line and "of prompt tokens" in line
    summary = pq.read_table(tmp_path / "run" / "summary.parquet").to_pylist()[0]
    assert summary["hit_rate_cpu"] > 0 and summary["offload_cpu_bytes"] == CPU_BYTES
    assert summary["kv_offload_load_bytes"] > 0
    requests = pq.read_table(tmp_path / "run" / "requests.parquet")
    assert {"gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "load_wait_s", "load_transfer_s"} <= set(requests.column_names)


def test_flags_override_the_scenario_and_build_a_disk_tier(tmp_path):
    path = _scenario(tmp_path, f"[offload]\ncpu_bytes = {CPU_BYTES}\n")
    res = _replay(path, "--out", tmp_path / "run", "--offload-cpu-bytes", 2**28, "--offload-disk-bytes", 8 * 2**30,
                  "--offload-disk-bandwidth", 5e9, "--offload-policy", "lru")
    assert res.exit_code == 0, res.output
    line = next(line for line in res.output.splitlines() if line.startswith("offload:"))
    assert "CPU + 8.6 GB disk (lru, 128 chunks)" in line and "disk" in line
    summary = pq.read_table(tmp_path / "run" / "summary.parquet").to_pylist()[0]
    assert (summary["offload_cpu_chunks"], summary["offload_disk_chunks"]) == (128, 4096)
    assert summary["disk_hit_tokens"] > 0


def test_cpu_bytes_zero_gives_exactly_the_run_without_offload(tmp_path):
    plain = _replay(_scenario(tmp_path), "--out", tmp_path / "plain")
    zero = _replay(_scenario(tmp_path, "[offload]\ncpu_bytes = 0\n", name="zero.toml"), "--out", tmp_path / "zero")
    flag = _replay(_scenario(tmp_path, f"[offload]\ncpu_bytes = {CPU_BYTES}\n", name="flag.toml"),
                   "--out", tmp_path / "flag", "--offload-cpu-bytes", 0)
    assert plain.exit_code == zero.exit_code == flag.exit_code == 0
    assert not any(line.startswith("offload:") for line in plain.output.splitlines() + zero.output.splitlines())
    base = _tables(tmp_path / "plain")
    for other in ("zero", "flag"):
        for name, table in _tables(tmp_path / other).items():
            assert_tables_equal(base[name], table, with_metadata=False)


@pytest.mark.parametrize("extra, flags, fragments", [
    ('[offload]\ncpu_bytes = "8 gigs"\n', [], ["s.toml: offload.cpu_bytes", "non-negative number of bytes", "'8 gigs'"]),
    ("[offload]\ncpu_bytes = 1.5e9\ndisk_bytes = 0.5\n", [], ["s.toml: offload.disk_bytes", "got 0.5"]),
    ("[offload]\ncpu_bytes = 1000\ncpu_gib = 8\n", [], ["s.toml: offload.cpu_gib"]),
    ("[offload]\ncpu_bytes = 1000\n", [], ["s.toml: offload.cpu_bytes", "at least one CPU chunk: 2,097,152 bytes"]),
    ("[offload]\ncpu_bytes = 1000000000\ndisk_bytes = 1000000000\n", [],
     ["s.toml: offload.disk_bandwidth_bytes_per_s", "when disk_bytes > 0"]),
    ("", ["--offload-policy", "fifo"], ["--offload-policy: expected one of lru, arc, got 'fifo'"]),
    ("", ["--offload-cpu-bytes", -5], ["--offload-cpu-bytes: expected a non-negative number of bytes"]),
    ("", ["--offload-cpu-bytes", "1.5"], ["--offload-cpu-bytes: expected a non-negative number of bytes", "got 1.5"]),
    ("", ["--offload-cpu-bytes", 1000], ["--offload-cpu-bytes: expected at least one CPU chunk"]),
    ("", ["--offload-cpu-bytes", CPU_BYTES, "--offload-disk-bytes", 2**33],
     ["--offload-disk-bandwidth or [offload] disk_bandwidth_bytes_per_s"]),
    ("", ["--offload-disk-bytes", 2**33, "--offload-disk-bandwidth", 1e9], ["--offload-disk-bytes", "cpu_bytes > 0"]),
])
def test_bad_offload_settings_are_one_error_line(tmp_path, extra, flags, fragments):
    _one_error_line(_replay(_scenario(tmp_path, extra), "--out", tmp_path / "run", *flags), *fragments)
    assert not (tmp_path / "run").exists()


def test_offload_with_vllms_default_asynchronous_scheduling(tmp_path):
    # The scenario says nothing about scheduling (vLLM's default, asynchronous) and the flag
    # turns offloading on.
    default = _scenario(tmp_path, "", name="d.toml", engine="")
    res = _replay(default, "--out", tmp_path / "run", "--offload-cpu-bytes", CPU_BYTES)
    assert res.exit_code == 0, res.output
    summary = pq.read_table(tmp_path / "run" / "summary.parquet").to_pylist()[0]
    assert summary["offload_cpu_bytes"] == CPU_BYTES and summary["cpu_hit_tokens"] > 0


def test_replay_with_prefix_caching_off_serves_reuse_from_the_cpu_tier(tmp_path):
    res = _replay(_scenario(tmp_path), "--out", tmp_path / "run", "--no-prefix-caching",
                  "--offload-cpu-bytes", CPU_BYTES)
    assert res.exit_code == 0, res.output
    summary = pq.read_table(tmp_path / "run" / "summary.parquet").to_pylist()[0]
    assert summary["gpu_hit_tokens"] == 0 and summary["cpu_hit_tokens"] > 0
    assert summary["kv_offload_store_bytes"] > 0
    total = f"{summary['hit_rate_total'] * 100:.1f} % (GPU 0.0 %) of "
    assert any("prefix hits, all tiers" in line and total in line for line in res.output.splitlines()), res.output


def test_offload_of_a_hybrid_mamba_model_needs_prefix_caching(tmp_path):
    res = _replay(_scenario(tmp_path), "--out", tmp_path / "run", "--model", "nemotron-h-8b",
                  "--no-prefix-caching", "--offload-cpu-bytes", CPU_BYTES)
    _one_error_line(res, "--offload-cpu-bytes", "with prefix caching off")
    assert not (tmp_path / "run").exists()


def test_capacity_sweeps_the_cpu_tier(tmp_path):
    path = _scenario(tmp_path)
    res = CliRunner().invoke(app, ["capacity", str(path), "--sweep", f"offload.cpu_bytes=0,{CPU_BYTES}", "--jobs", "1",
                                   "-q", "--no-report", "--out", str(tmp_path / "cap")])
    assert res.exit_code == 0, res.output
    assert "total hit" in res.output
    rows = pq.read_table(tmp_path / "cap" / "capacity.parquet").to_pylist()
    assert [r["offload.cpu_bytes"] for r in rows] == [0, CPU_BYTES]
    assert rows[0]["hit_rate_total"] is None and rows[1]["hit_rate_total"] > rows[0]["prefix_cache_hit_rate"]
    assert rows[1]["p99_ttft_ms"] <= rows[0]["p99_ttft_ms"]


def test_validate_refuses_a_scenario_that_offloads(tmp_path):
    path = _scenario(tmp_path, f"[offload]\ncpu_bytes = {CPU_BYTES}\n")
    res = CliRunner().invoke(app, ["validate", str(path), "--out", str(tmp_path / "val")])
    _one_error_line(res, "s.toml: offload.cpu_bytes", "does not offload")
