"""`kvtwin calibrate`: measurements made by a known clock come back as that clock.

The "server" here is kvtwin itself with chosen knobs: its replay of a small trace is
written out as `vllm bench serve` result files, as a pair of /metrics scrapes, and as
`kvtwin validate` steps. Calibrating the default clock on them must recover the knobs
(or factors), report a small held-out error, and write a file a scenario can name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.calibration.fit.serving import Knobs
from kvtwin.sim.calibration.fit.steps_device import MeasuredOn, device_warning, is_same_gpu
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.calibration.fit.step_model import STEP_TERM_COLUMNS, batch_kind, step_terms
from kvtwin.sim.calibration.file import read_calibration
from kvtwin.sim.replay.run import plan_cost_model, run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.traces import schema as col

SCENARIO = """\
[model]
preset = "llama-3.1-8b"

[hardware]
gpu = "l40s"

[engine]
max_model_len = 8192
"""
TRUTH = Knobs(prefill_scale=1.35, decode_scale=1.25, client_overhead_s=0.006)


def trace_table(n=48, seed=5, rate_per_s=1.0) -> pa.Table:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate_per_s, n))
    return col.build_table({col.REQUEST_ID: [f"r{i}" for i in range(n)], col.ARRIVAL_TIME_S: arrivals.tolist(),
                            col.PROMPT_TOKENS: rng.integers(200, 3000, n).tolist(),
                            col.OUTPUT_TOKENS: rng.integers(20, 200, n).tolist()},
                           col.TraceMeta(source_format="test"))


@pytest.fixture
def setup(tmp_path):
    scenario = tmp_path / "server.toml"
    scenario.write_text(SCENARIO)
    resolved = resolve_scenario(scenario, Overrides())
    return scenario, resolved


def bench_result(requests: pa.Table, trace: pa.Table, overhead_s: float) -> dict:
    """The replay's finished requests as a --save-detailed result (serve.py's keys and units)."""
    rows = requests.to_pylist()
    arrivals = dict(zip(trace.column(col.REQUEST_ID).to_pylist(), trace.column(col.ARRIVAL_TIME_S).to_pylist()))
    ttfts = [r["ttft_s"] + overhead_s for r in rows]
    itls = [[r["tpot_s"]] * (r["generated_tokens"] - 1) for r in rows]
    return {"date": "20261202-120000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
            "model_id": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
            "num_prompts": len(rows), "request_rate": 3.0, "burstiness": 1.0, "max_concurrency": None,
            "duration": 60.0, "completed": len(rows), "failed": 0,
            "total_input_tokens": sum(r["prompt_tokens"] for r in rows),
            "total_output_tokens": sum(r["generated_tokens"] for r in rows),
            "request_throughput": 1.0, "request_goodput": None, "output_throughput": 1.0,
            "total_token_throughput": 1.0, "mean_ttft_ms": 1000 * float(np.mean(ttfts)),
            "median_ttft_ms": 1000 * float(np.median(ttfts)), "std_ttft_ms": 0.0, "p99_ttft_ms": 1.0,
            "input_lens": [r["prompt_tokens"] for r in rows], "output_lens": [r["generated_tokens"] for r in rows],
            "ttfts": ttfts, "itls": itls, "latencies": [t + sum(i) for t, i in zip(ttfts, itls)],
            "start_times": [500.0 + arrivals[r["request_id"]] for r in rows],
            "generated_texts": [""] * len(rows), "errors": [""] * len(rows)}


def invoke(*args):
    result = CliRunner().invoke(app, ["calibrate", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


def test_calibrate_from_bench_serve_recovers_the_knobs(setup, tmp_path):
    scenario, resolved = setup
    base = resolved.efficiency
    runs = []
    for seed in (1, 2):
        # Few requests overlap at 0.2/s, so a TTFT is the overhead and the request's own
        # prefill, not also the rest of a step whose end any change of a knob moves: the
        # residuals of a busier trace hide a 6 ms overhead and the prefill knob beside it.
        trace = trace_table(seed=seed, rate_per_s=0.2)
        truth = run_replay(resolved.plan(), trace, deployment=resolved.deployment,
                           efficiency=TRUTH.apply(base)).requests
        path = tmp_path / f"run{seed}.json"
        path.write_text(json.dumps(bench_result(truth, trace, TRUTH.client_overhead_s)))
        runs.append(path)
    out = tmp_path / "cal.toml"
    code, stdout, stderr = invoke(scenario, "--bench-serve", runs[0], "--bench-serve", runs[1], "-o", out, "-q")
    assert code == 0, stderr
    assert "held out: the last run" in stdout
    cal = read_calibration(out)
    assert cal.efficiency.matmul_flops_fraction == pytest.approx(TRUTH.apply(base).matmul_flops_fraction, rel=0.03)
    assert cal.efficiency.hbm_bandwidth_fraction == pytest.approx(TRUTH.apply(base).hbm_bandwidth_fraction,
                                                                  rel=0.03)
    # 6 ms beside prefills of 30-400 ms: found, to within a couple of milliseconds, and
    # in place of the bundled calibration's default.
    assert cal.efficiency.client_overhead_s == pytest.approx(0.006, abs=0.002)
    assert base.client_overhead_s == pytest.approx(0.008)
    # p90 on the held-out run: TPOT and E2E within 3%; TTFT is the touchiest, as a clock 1%
    # off reorders a few prefills that arrive together.
    assert set(cal.errors) == {"ttft", "tpot", "e2e"}
    assert cal.errors["tpot"] < 0.03 and cal.errors["e2e"] < 0.03 and cal.errors["ttft"] < 0.2
    assert cal.sources[0]["path"] == str(runs[0])
    # A scenario names it, and the replay's summary carries its band.
    named = tmp_path / "named.toml"
    named.write_text(SCENARIO + f'\n[cost_model]\ncalibration = "{out}"\n')
    assert resolve_scenario(named, Overrides()).calibration.errors == cal.errors


def test_calibrate_from_a_scrape_fits_the_server_quantiles(setup, tmp_path):
    scenario, resolved = setup
    trace = trace_table(n=60, seed=3)
    trace_path = tmp_path / "load.parquet"
    pq.write_table(trace, trace_path)
    truth = run_replay(resolved.plan(), trace, deployment=resolved.deployment,
                       efficiency=Knobs(1.2, 1.25).apply(resolved.efficiency))
    done = truth.requests.filter(pa.compute.equal(truth.requests.column("status"), "finished"))
    gaps = np.repeat(done.column("tpot_s").to_numpy(), done.column("generated_tokens").to_numpy() - 1)
    observations = {"vllm:time_to_first_token_seconds": done.column("ttft_s").to_pylist(),
                    "vllm:inter_token_latency_seconds": gaps.tolist(),
                    "vllm:e2e_request_latency_seconds": done.column("e2el_s").to_pylist()}
    before, after = tmp_path / "before.prom", tmp_path / "after.prom"
    before.write_text(scrape_text({}))
    after.write_text(scrape_text(observations))
    out = tmp_path / "scrape.toml"
    code, stdout, stderr = invoke(scenario, "--metrics-before", before, "--metrics-after", after, "--trace",
                                  trace_path, "-o", out, "-q")
    assert code == 0, stderr
    cal = read_calibration(out)
    # The server's own histograms do not see the time outside the engine: the base's
    # default (the bundled calibration's) stays.
    assert cal.efficiency.client_overhead_s == resolved.efficiency.client_overhead_s == pytest.approx(0.008)
    assert "client overhead kept from the base: 8.0 ms" in stdout
    assert cal.efficiency.hbm_bandwidth_fraction == pytest.approx(resolved.efficiency.hbm_bandwidth_fraction / 1.25,
                                                                  rel=0.1)
    assert set(cal.errors) == {"ttft", "tpot", "e2e"}


# Fine buckets, so that the histogram quantiles are close to the raw ones.
BOUNDS = tuple(float(b) for b in np.geomspace(0.001, 200.0, 160))


def scrape_text(observations: dict[str, list[float]]) -> str:
    lines = []
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        values = observations.get(name, [])
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        for bound in (*BOUNDS, math.inf):
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{engine="0",le="{le}",model_name="m"}} {float(sum(v <= bound for v in values))}')
        lines.append(f'{name}_count{{engine="0",model_name="m"}} {float(len(values))}')
        lines.append(f'{name}_sum{{engine="0",model_name="m"}} {float(sum(values))}')
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens"):
        lines += [f"# TYPE {name}_total counter", f'{name}_total{{engine="0",model_name="m"}} {float(len(observations))}']
    lines += ["# TYPE vllm:request_success_total counter",
              f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} '
              f'{float(len(observations.get("vllm:e2e_request_latency_seconds", [])))}']
    lines += ["# TYPE vllm:iteration_tokens_total histogram",
              'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 0.0',
              'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 0.0',
              'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 0.0']
    return "\n".join(lines) + "\n"


def measured_steps(resolved, measured_on: MeasuredOn | None) -> pa.Table:
    """Steps as `kvtwin validate` writes them, "measured" by a clock whose step factors
    moved (the rest, floors and curves, as the base has them), on ``measured_on``."""
    truth_eff = dataclasses.replace(resolved.efficiency, matmul_flops_fraction=0.7, attention_flops_fraction=0.5,
                                    hbm_bandwidth_fraction=0.7, step_overhead_s=1e-3, per_request_overhead_s=2e-5)
    planned = resolved.plan()
    current, truth = plan_cost_model(planned, resolved.efficiency), plan_cost_model(planned, truth_eff)
    rng = np.random.default_rng(4)
    rows = []
    for i in range(120):
        decodes = [int(c) for c in rng.integers(100, 6000, int(rng.integers(0, 64)))]
        prefills = [(int(rng.integers(64, 4096)), int(rng.integers(0, 2000)))] if i % 3 == 0 or not decodes else []
        cost = current.split_step_cost(decodes, prefills)
        measured = truth.split_step_cost(decodes, prefills).total_s
        rows.append({"step": i, "decode_tokens": len(decodes), "prefill_tokens": sum(n for n, _ in prefills),
                     "batch_kind": batch_kind(len(decodes), sum(n for n, _ in prefills)), "measured_s": measured,
                     **step_terms(cost)})
    table = pa.Table.from_pylist(rows)
    return table if measured_on is None else table.replace_schema_metadata(measured_on.metadata())


def test_calibrate_from_validate_steps_recovers_the_factors(setup, tmp_path):
    scenario, resolved = setup
    steps = tmp_path / "steps.parquet"
    pq.write_table(measured_steps(resolved, MeasuredOn("cuda", "NVIDIA L40S", False)), steps)
    out = tmp_path / "steps.toml"
    code, stdout, stderr = invoke(scenario, "--steps", steps, "-o", out)
    assert code == 0, stderr
    cal = read_calibration(out)
    assert cal.efficiency.matmul_flops_fraction == pytest.approx(0.7, rel=0.02)
    assert cal.efficiency.hbm_bandwidth_fraction == pytest.approx(0.7, rel=0.02)
    assert set(cal.errors) == {"decode_step", "prefill_step"} and max(cal.errors.values()) < 0.01
    assert "decode-only" in stdout
    # Measured on the scenario's GPU: nothing to warn about.
    assert "warning" not in stderr and cal.warning == "" and cal.label.endswith("on l40s")
    assert [s.get("gpu") for s in cal.sources] == ["NVIDIA L40S"]


@pytest.mark.parametrize("measured_on, says", [
    (MeasuredOn("cpu", "cpu", True), "the steps were measured on a CPU (kvtwin validate --device cpu, a "
                                     "scaled-down model), not on a l40s"),
    (MeasuredOn("cuda", "NVIDIA H100 80GB HBM3", False), "the steps were measured on NVIDIA H100 80GB HBM3, "
                                                         "not on a l40s"),
    (None, "the steps file does not say which device measured it"),
], ids=["cpu", "another gpu", "unknown"])
def test_steps_measured_elsewhere_warn_once_and_in_the_file(setup, tmp_path, measured_on, says):
    scenario, resolved = setup
    steps = tmp_path / "steps.parquet"
    pq.write_table(measured_steps(resolved, measured_on), steps)
    out = tmp_path / "steps.toml"
    code, stdout, stderr = invoke(scenario, "--steps", steps, "-o", out)
    assert code == 0, stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("kvtwin: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"kvtwin: warning: --steps: {says}"), stderr
    cal = read_calibration(out)
    assert cal.warning.startswith(says)
    where = measured_on.name if measured_on is not None else "an unknown device"
    assert cal.label == f"kvtwin calibrate (steps) for llama-3.1-8b on l40s (measured on {where})"
    assert f"warning: {says}" in stdout


def test_a_gpu_name_is_matched_word_by_word():
    a100_80 = get_gpu("a100-80gb")
    assert is_same_gpu("NVIDIA A100-SXM4-80GB", a100_80) and is_same_gpu("NVIDIA A100 80GB PCIe", a100_80)
    assert not is_same_gpu("NVIDIA A100-SXM4-40GB", a100_80)
    assert is_same_gpu("NVIDIA H100 80GB HBM3", get_gpu("h100")) and not is_same_gpu("NVIDIA H200", get_gpu("h100"))
    assert is_same_gpu("AMD Instinct MI300X", get_gpu("mi300x"))
    assert device_warning(MeasuredOn("cuda", "NVIDIA B200", False), get_gpu("b200")) is None


@pytest.mark.parametrize("args, field", [
    ((), "measurements"),
    (("--steps", "x.parquet", "--metrics-before", "b.prom"), "measurements"),
    (("--metrics-before", "b.prom"), "--metrics-before/--metrics-after"),
    (("--steps", "missing.parquet"), "steps"),
    (("--bench-serve", "missing.json"), "file"),
])
def test_bad_calibrate_input_is_one_error_line(setup, tmp_path, monkeypatch, args, field):
    scenario, _ = setup
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b.prom").write_text("")
    code, stdout, stderr = invoke(scenario, *args, "-o", tmp_path / "o.toml")
    assert code == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:") and field in lines[0]
    assert not (tmp_path / "o.toml").exists()


def test_a_scrape_needs_the_trace_of_its_load(setup, tmp_path):
    scenario, _ = setup
    for name in ("b.prom", "a.prom"):
        (tmp_path / name).write_text(scrape_text({}))
    code, _, stderr = invoke(scenario, "--metrics-before", tmp_path / "b.prom", "--metrics-after",
                             tmp_path / "a.prom", "-o", tmp_path / "o.toml")
    assert code == 2 and "--trace" in stderr


def test_steps_columns_are_one_table():
    # validate writes every term calibrate reads, under the same names.
    assert set(step_terms(None)) == set(STEP_TERM_COLUMNS.values())
