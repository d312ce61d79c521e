"""`kvtwin capacity`: sweeps, the rate search, the one-pass hit curve and the backends.

Small workloads only: a 40-request cut of the Azure trace, a synthetic constant-rate trace
whose saturation rate is known by hand, and a small synthetic chat trace for the curve.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from kvtwin.commands.capacity import capacity
from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.calibration.band import CLOCK_COLUMNS
from kvtwin.sim.replay.capacity_points import MAX_RATE_COLUMNS
from kvtwin.sim.replay.capacity_table import CAPACITY_METADATA_KEY, summary_schema
from kvtwin.sim.replay.rate_search import DEFAULT_MAX_REPLAYS, bracket_and_bisect, slo_holds
from kvtwin.sim.scenario.sweep_keys import apply_values, parse_sweeps, sweep_points
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.replay.reuse_curve import hit_curve, reuse_profile
from kvtwin.traces.expand import table_block_ids
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec

AZURE = SCENARIOS_DIR / "azure-conv-llama8b.toml"

# Identical one-token requests arriving every 100 ms (gamma gaps with cv 1e-6: constant), on a
# GPU so fast that a step costs only its fixed overhead (10 ms, synchronous scheduling), one
# request per step: the engine serves 100 requests/s, so the TTFT stays 10 ms up to rate
# scale 10 and grows with the queue above it. With a 15 ms TTFT SLO and 400 requests the p99
# breaks just above 10 (at about 10 * (1 + 1.3e-3)). 400, not fewer: the steady window (the
# middle 60% of the arrivals) must hold the 200 that docs/capacity.md#sustained-load asks.
CONSTANT = """
description = "constant-rate identical requests, 10 ms per step, one request per step"
[model]
preset = "llama-3.1-8b"
[hardware]
name = "fast"
memory_gib = 80
hbm_bandwidth_bytes_per_s = 1e18
bf16_flops = 1e20
price_per_hour = 2.0
[engine]
max_model_len = 1024
max_num_seqs = 1
max_num_batched_tokens = 64
kv_cache_memory_bytes = 268435456
async_scheduling = false
[workload]
kind = "requests"
seed = 1
num_requests = 400
arrival = { process = "gamma", rate_per_s = 10.0, cv = 0.000001 }
prompt_tokens = 16
output_tokens = 1
[slo]
ttft_s = 0.015
[cost_model]
step_overhead_s = 0.01
per_request_overhead_s = 0.0
"""
THRESHOLD_SCALE = 10.0

CHAT = {"kind": "chat", "seed": 3, "num_requests": 150, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": 4.0},
        "shared_prefix": {"count": 3, "tokens": 200, "zipf_s": 1.0}, "turns": {"dist": "fixed", "value": 3},
        "user_tokens": {"dist": "lognormal", "mean": 60, "sigma": 0.5},
        "output_tokens": {"dist": "lognormal", "mean": 20, "sigma": 0.5},
        "turn_gap_s": {"dist": "exponential", "mean": 1}}


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(capacity)

    @app.callback()
    def main() -> None:
        pass

    return app


def _invoke(*args):
    return CliRunner().invoke(_app(), ["capacity", *map(str, args)])


@pytest.fixture
def constant(tmp_path) -> Path:
    path = tmp_path / "constant.toml"
    path.write_text(CONSTANT)
    return path


def test_sweep_rows_and_columns(tmp_path):
    out = tmp_path / "cap"
    result = _invoke(AZURE, "--sweep", "engine.max_num_seqs=8,64", "--sweep", "hardware.gpu=h100,h200",
                     "--limit", 40, "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "capacity.parquet")
    assert table.num_rows == 4
    names = table.column_names
    assert names[:5] == ["point", "status", "error", "engine.max_num_seqs", "hardware.gpu"]
    assert names[5:] == summary_schema().names + list(CLOCK_COLUMNS) + ["num_gpus"]
    assert str(table.schema.field("point").type) == "int64"
    assert str(table.schema.field("engine.max_num_seqs").type) == "int64"
    assert str(table.schema.field("hardware.gpu").type) == "string"
    rows = table.to_pylist()
    assert [(r["engine.max_num_seqs"], r["hardware.gpu"]) for r in rows] == [
        (8, "h100"), (8, "h200"), (64, "h100"), (64, "h200")]
    assert all(r["status"] == "ok" and r["error"] is None and r["num_requests"] == 40 for r in rows)
    # The scenario sets neither replicas nor tensor parallelism: one GPU per point.
    assert [r["num_gpus"] for r in rows] == [1] * 4
    # Each point on its GPU's bundled clock, said once per clock.
    assert [r["calibration"].split()[:2] for r in rows] == [["bundled", gpu] for gpu in ("h100", "h200") * 2]
    assert [line for line in result.output.splitlines() if "clock: " in line] == [
        "points 0, 2: clock: " + rows[0]["calibration"], "points 1, 3: clock: " + rows[1]["calibration"]]
    assert "capacity.parquet" in result.output


def test_same_sweep_gives_identical_bytes_with_one_or_two_jobs(tmp_path):
    args = (AZURE, "--sweep", "engine.max_num_seqs=8,16,64", "--limit", 30, "-q")
    one = _invoke(*args, "--jobs", 1, "--out", tmp_path / "a")
    again = _invoke(*args, "--jobs", 1, "--out", tmp_path / "b")
    pool = _invoke(*args, "--jobs", 2, "--out", tmp_path / "c")
    assert one.exit_code == again.exit_code == pool.exit_code == 0, (one.output, pool.output)
    data = [(tmp_path / d / "capacity.parquet").read_bytes() for d in "abc"]
    assert data[0] == data[1] == data[2]


def test_bisection_finds_the_analytic_saturation_rate(constant, tmp_path):
    out = tmp_path / "cap"
    tolerance = 0.05
    result = _invoke(constant, "--find-max-rate", "--rate-tolerance", tolerance, "--target-rate", 250,
                     "--out", out, "-q")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "capacity.parquet")
    row = table.to_pylist()[0]
    assert list(MAX_RATE_COLUMNS) == table.column_names[-len(MAX_RATE_COLUMNS):]
    lo = row["max_rate_scale"]
    # lo holds and is within the tolerance below the threshold (which is <= 10.025).
    assert THRESHOLD_SCALE * (1 - tolerance) <= lo <= THRESHOLD_SCALE * 1.003
    assert row["max_request_rate"] == pytest.approx(10.0 * lo, rel=1e-4)
    assert row["max_request_rate_per_replica"] == row["max_request_rate"]
    assert row["replicas_needed_trace_rate"] == 1
    assert row["replicas_needed_target_rate"] == math.ceil(250 / row["max_request_rate"])
    assert row["cost_per_hour"] == 2.0
    tokens_per_hour = row["total_token_throughput"] * 3600
    assert row["cost_per_million_tokens"] == pytest.approx(2.0 / tokens_per_hour * 1e6)
    assert row["p99_ttft_ms"] <= 15.0
    import json
    search = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]
    assert search["converged"] and len(search["tried"]) <= DEFAULT_MAX_REPLAYS
    holding = [x for x, ok in search["tried"] if ok]
    failing = [x for x, ok in search["tried"] if not ok]
    assert max(holding) == lo and min(failing) / lo - 1 <= tolerance
    assert max(holding) <= THRESHOLD_SCALE * 1.003 < min(failing) or min(failing) > THRESHOLD_SCALE


def test_bracket_and_bisect_on_a_known_predicate():
    for threshold in (0.013, 3.7, 40.0):
        found = bracket_and_bisect(lambda x, t=threshold: x <= t, 1.0, tolerance=0.01, max_replays=40)
        assert found.converged and found.lo <= threshold < found.hi and found.hi / found.lo - 1 <= 0.01
    never = bracket_and_bisect(lambda x: False, 1.0, max_replays=40)
    assert never.lo is None and not never.converged


def test_slo_criterion():
    base = {"num_requests": 1000, "completed": 1000, "rejected": 0, "unfinished": 0, "p99_ttft_ms": 900.0,
            "p99_tpot_ms": 40.0, "slo_attainment": 0.9, "sustained": True, "saturated": False}
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    assert slo_holds(base, slo)
    # A load not sustained holds no SLO (docs/capacity.md#sustained-load).
    assert not slo_holds({**base, "sustained": False}, slo) and not slo_holds({**base, "saturated": True}, slo)
    assert not slo_holds({**base, "p99_tpot_ms": 51.0}, slo)
    assert not slo_holds({**base, "unfinished": 1}, slo)
    assert slo_holds({**base, "p99_tpot_ms": 99.0}, slo, goodput=0.9)
    # 900 met of 1,200 arrivals; 200 unfinished count as misses, 200 rejected do not.
    assert not slo_holds({**base, "num_requests": 1200, "completed": 1000, "unfinished": 200,
                          "slo_attainment": 0.75}, slo, goodput=0.9)
    rejected = {**base, "num_requests": 1200, "rejected": 200, "slo_attainment": 0.75}
    assert slo_holds(rejected, slo, goodput=0.9) and not slo_holds(rejected, slo, goodput=0.95)
    # Too few admitted requests to judge (docs/capacity.md#enough-load): 1,000 for the p99,
    # 100 for a 0.9 goodput (ten beyond the quantile); rejected ones do not count.
    assert not slo_holds({**base, "num_requests": 999, "completed": 999}, slo)
    assert not slo_holds({**base, "rejected": 1, "completed": 999}, slo)
    assert slo_holds({**base, "num_requests": 100, "completed": 100}, slo, goodput=0.9)
    assert not slo_holds({**base, "num_requests": 99, "completed": 99}, slo, goodput=0.9)


def _exact_lru_hit_rate(trace, block_size: int, capacity_blocks: int, include_outputs: bool) -> float:
    """A plain LRU cache of blocks, simulated request by request (the curve's model)."""
    ids = table_block_ids(trace, block_size).to_pylist()
    prompts = trace.column("prompt_tokens").to_pylist()
    outputs = trace.column("output_tokens").to_pylist()
    cache: OrderedDict = OrderedDict()
    total = hits = 0
    for r, (blocks, prompt, output) in enumerate(zip(ids, prompts, outputs)):
        hit = 0
        for block in blocks[:(prompt - 1) // block_size]:
            if block not in cache:
                break
            hit += 1
        hits += hit * block_size
        weights = [1 if k < prompt // block_size else 0 for k in range(len(blocks))]
        unique = (prompt + output - 1) // block_size - sum(weights) if include_outputs else 0
        touched = ([(("outputs", r), unique)] if unique > 0 else []) + \
            [(blocks[k], weights[k]) for k in reversed(range(len(blocks)))]
        for key, weight in touched:
            if key in cache:
                total -= cache.pop(key)
            cache[key] = weight
            total += weight
            while total > capacity_blocks:
                total -= cache.popitem(last=False)[1]
    return hits / sum(prompts)


@pytest.mark.parametrize("include_outputs", [True, False])
def test_one_pass_curve_equals_an_exact_lru(include_outputs):
    trace = synthesize(parse_spec(CHAT, "workload"), Path("."), "test")
    profile = reuse_profile(trace, 16, include_outputs=include_outputs)
    for capacity_blocks in (1, 3, 10, 40, 100, 250, 600, 2000, 10**6):
        assert float(profile.hit_rate(capacity_blocks)) == pytest.approx(
            _exact_lru_hit_rate(trace, 16, capacity_blocks, include_outputs), abs=1e-12)
    curve = hit_curve(trace, 16, [77])
    assert curve.column_names == ["kv_cache_blocks", "kv_cache_tokens", "hit_rate"]
    assert 77 in curve.column("kv_cache_blocks").to_pylist()
    rates = curve.column("hit_rate").to_pylist()
    assert rates == sorted(rates) and 0 < rates[-1] < 1


CHAT_SCENARIO = """
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 900
max_num_seqs = 16
[workload]
kind = "chat"
seed = 3
num_requests = 60
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 4.0 }
shared_prefix = { count = 3, tokens = 200, zipf_s = 1.0 }
turns = { dist = "fixed", value = 3 }
user_tokens = { dist = "lognormal", mean = 60, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 20, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 1 }
max_prompt_tokens = 800
"""


def test_hit_curve_file_next_to_the_points(tmp_path):
    out = tmp_path / "cap"
    scenario = tmp_path / "chat.toml"
    scenario.write_text(CHAT_SCENARIO)
    # Llama-3.1-8B blocks are 2 MiB: 128 and 512 MiB pools of 63 and 255 usable blocks.
    result = _invoke(scenario, "--sweep", "engine.kv_cache_memory_bytes=134217728,536870912",
                     "--hit-curve", "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"], rows[0]["error"]
    curve = pq.read_table(out / "hit_curve.parquet")
    assert curve.column_names == ["kv_cache_blocks", "kv_cache_tokens", "hit_rate"]
    assert "hit curve at 63 blocks" in result.output and "hit curve at 255 blocks" in result.output
    assert {63, 255} <= set(curve.column("kv_cache_blocks").to_pylist())


def test_process_and_ray_backends_agree(tmp_path):
    ray = pytest.importorskip("ray")
    args = (AZURE, "--sweep", "engine.max_num_seqs=8,64", "--limit", 20, "-q")
    local = _invoke(*args, "--jobs", 2, "--out", tmp_path / "p")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = _invoke(*args, "--backend", "ray", "--out", tmp_path / "r")
    finally:
        ray.shutdown()
    assert local.exit_code == remote.exit_code == 0, (local.output, remote.output)
    assert (tmp_path / "p" / "capacity.parquet").read_bytes() == (tmp_path / "r" / "capacity.parquet").read_bytes()


@pytest.mark.parametrize("flag, message", [
    ("engine.max_num_seqz=1,2", "--sweep engine.max_num_seqz: expected a field of [engine] to sweep"),
    ("engine.max_num_seqs=8,lots", "--sweep engine.max_num_seqs: expected an integer"),
    ("engine.max_num_seqs=0", "--sweep engine.max_num_seqs: expected a positive integer, got 0"),
    ("engine.enable_prefix_caching=yes", "--sweep engine.enable_prefix_caching: expected true or false"),
    ("hardware.gpu=h999", "--sweep hardware.gpu: expected one of"),
    ("workload.rate_scale=-1", "--sweep workload.rate_scale: expected a positive factor"),
    ("nothing=1", "--sweep: expected KEY=V1,V2,... with KEY one of"),
    ("engine.max_num_seqs", "--sweep: expected KEY=V1,V2,..."),
])
def test_bad_sweep_is_one_error_line_and_exit_2(tmp_path, flag, message):
    out = tmp_path / "cap"
    result = _invoke(AZURE, "--sweep", flag, "--limit", 5, "--out", out)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvtwin: error: {message}"), lines
    assert not out.exists()


def test_bad_flags_refused_before_any_replay(tmp_path):
    for args in (("--backend", "dask"), ("--find-max-rate", "--rate-tolerance", 0), ("--goodput", 0.9),
                 ("--find-max-rate", "--goodput", 1.5), ("--jobs", 0)):
        result = _invoke(AZURE, *args, "--out", tmp_path / "cap")
        assert result.exit_code == 2 and result.stderr.startswith("kvtwin: error: --"), (args, result.output)


def test_a_failed_point_is_recorded_and_the_others_go_on(constant, tmp_path):
    out = tmp_path / "cap"
    # 128 sequences need max_num_batched_tokens >= 128 (the scenario has 64); 1 KiB of KV fits nothing.
    result = _invoke(constant, "--sweep", "engine.max_num_seqs=1,128", "--sweep",
                     "engine.kv_cache_memory_bytes=1024,268435456", "--out", out, "--jobs", 1)
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["status"] for r in rows] == ["failed", "ok", "failed", "failed"]
    assert "max_num_batched_tokens" in rows[2]["error"] and "fits" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["completed"] == 400
    assert rows[0]["completed"] is None
    assert "point 0 failed" in result.output


def test_points_and_values():
    axes = parse_sweeps(["engine.block_size=16,32", "workload.rate_scale=0.5,1,2", "engine.max_model_len=none"])
    points = sweep_points(axes)
    assert len(points) == 6 and [p.index for p in points] == list(range(6))
    assert points[1].values == {"engine.block_size": 16, "workload.rate_scale": 1.0, "engine.max_model_len": None}
    data = apply_values({"engine": {"max_model_len": 4096}, "workload": {"kind": "x"}}, points[5].values)
    assert data == {"engine": {"block_size": 32}, "workload": {"kind": "x", "rate_scale": 2.0}}
    with pytest.raises(ConfigError, match="each key swept once"):
        parse_sweeps(["engine.block_size=16", "engine.block_size=32"])


def test_the_pessimistic_edge_searches_again_with_every_step_slower(constant, tmp_path):
    # The constant workload's steps cost 10 ms; a calibration whose held-out step error is
    # 25% makes them 12.5 ms at the pessimistic edge: 80 requests/s, rate scale 8.
    (tmp_path / "cal.toml").write_text('label = "test"\n[cost_model]\n[error]\nprefill_step = 0.1\n'
                                       'decode_step = 0.25\n')
    scenario = tmp_path / "calibrated.toml"
    scenario.write_text(CONSTANT.replace("[cost_model]\n", '[cost_model]\ncalibration = "cal.toml"\n'))
    out = tmp_path / "cap"
    result = _invoke(scenario, "--find-max-rate", "--rate-tolerance", 0.02, "--target-rate", 250, "--out", out)
    assert result.exit_code == 0, result.output
    row = pq.read_table(out / "capacity.parquet").to_pylist()[0]
    assert row["step_error"] == 0.25
    assert THRESHOLD_SCALE * 0.98 <= row["max_rate_scale"] <= THRESHOLD_SCALE * 1.003
    assert 8.0 * 0.98 <= row["max_rate_scale_pessimistic"] <= 8.0 * 1.003
    assert row["max_request_rate_pessimistic"] == pytest.approx(10.0 * row["max_rate_scale_pessimistic"], rel=1e-4)
    assert row["replicas_needed_target_rate_pessimistic"] == math.ceil(250 / row["max_request_rate_pessimistic"])
    assert "slow edge" in result.output
    # Uncalibrated (the plain scenario): no edge, and the columns say so with nulls.
    plain = tmp_path / "plain"
    assert _invoke(constant, "--find-max-rate", "--out", plain, "-q").exit_code == 0
    assert pq.read_table(plain / "capacity.parquet").to_pylist()[0]["max_rate_scale_pessimistic"] is None


def test_pipeline_stages_and_data_parallel_ranks_count_as_gpus(tmp_path):
    """A point's GPUs are each engine's TP x PP GPUs times its engines, every DP rank one
    (docs/semantics.md#parallel-layouts): what its cost per hour is priced on."""
    out = tmp_path / "cap"
    result = _invoke(AZURE, "--sweep", "engine.pipeline_parallel_size=1,2", "--sweep", "engine.data_parallel_size=1,2",
                     "--limit", 30, "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [(r["engine.pipeline_parallel_size"], r["engine.data_parallel_size"], r["status"]) for r in rows] == [
        (1, 1, "ok"), (1, 2, "ok"), (2, 1, "ok"), (2, 2, "ok")]
    assert [r["num_gpus"] for r in rows] == [pp * dp for pp in (1, 2) for dp in (1, 2)]
    # Each DP rank is an engine of the replay: the GPUs of one are the TP x PP group.
    assert [r["num_gpus"] / r["num_replicas"] for r in rows] == [1, 1, 2, 2]
