"""The serving and step fits on synthetic measurements from a known clock.

The replay inside the serving fits is replaced by a clock written here in closed form:
a request's server-side TTFT is its prompt tokens times a per-token prefill time divided
by the GEMM fraction, each later token takes a decode time divided by the HBM fraction,
the client adds a fixed overhead. ``vllm bench serve`` result files (serve.py's keys and
units: ms summaries, per-request seconds) and Prometheus scrapes (PromQL histograms) are
written from that clock at known knobs. The fitted knobs must be the known ones; the
held-out fold is then perturbed by known factors, so its errors are known by
construction (recomputed here with NumPy against the measurement), while the fitted fold
is exact: an in-sample error reported as held-out, a median reported as p90 or an error
relative to the prediction each changes a number checked here. The step fit
(``kvtwin calibrate --steps``) gets the same treatment on raw cost terms, and the report's
printed lines and calibration file are checked against the same numbers.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.calibration.fit import serving
from kvtwin.sim.calibration.fit.bench_serve import read_bench_serve, read_bench_serve_all
from kvtwin.sim.calibration.fit.job import CalibrationJob, CalibrationResult, write
from kvtwin.sim.calibration.fit.prometheus import parse_exposition, Scrape, scrape_delta
from kvtwin.sim.calibration.fit.serving import Knobs, fit_bench_serve, fit_scrape, measured_requests
from kvtwin.sim.calibration.fit.steps import fit_steps
from kvtwin.sim.calibration.fit.step_model import StepSample
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.traces import schema as col

BASE = Efficiency()
# exp(0.4) and exp(0.3): points the fit's search reaches exactly (steps 0.4, then 0.4 - 0.1).
TRUTH = Knobs(prefill_scale=math.exp(0.4), decode_scale=math.exp(0.3), client_overhead_s=0.004)
PREFILL_S_PER_TOKEN = 4e-5  # at the base GEMM fraction
DECODE_S = 0.012  # per token of a short prompt at the base HBM fraction


def clock(prompt, output, efficiency: Efficiency):
    """Server-side TTFT, TPOT and E2E of each request under ``efficiency``: the known clock."""
    prompt, output = np.asarray(prompt, float), np.asarray(output, float)
    ttft = prompt * PREFILL_S_PER_TOKEN * BASE.matmul_flops_fraction / efficiency.matmul_flops_fraction
    # A longer prompt decodes slower (more KV to read): TPOTs differ from request to request.
    tpot = DECODE_S * (1 + prompt / 2000) * BASE.hbm_bandwidth_fraction / efficiency.hbm_bandwidth_fraction
    return ttft, tpot, ttft + (output - 1) * tpot


@dataclass
class _Replay:
    requests: pa.Table


@pytest.fixture
def known_clock(monkeypatch):
    """The fits' replay, replaced by ``clock`` (rows in the trace's order, as the replay's)."""
    calls = []

    def replay(plan, trace, *, deployment=None, efficiency):
        calls.append(efficiency)
        prompt = trace.column(col.PROMPT_TOKENS).to_numpy()
        output = trace.column(col.OUTPUT_TOKENS).to_numpy()
        ttft, tpot, e2e = clock(prompt, output, efficiency)
        tpot = np.where(output > 1, tpot, np.nan)
        return _Replay(pa.table({"status": ["finished"] * len(prompt), "ttft_s": ttft, "tpot_s": tpot,
                                 "e2el_s": e2e, "generated_tokens": output}))

    monkeypatch.setattr(serving, "run_replay", replay)
    return calls


RNG = np.random.default_rng(38)


def workload(n):
    return RNG.integers(100, 2000, n), RNG.integers(2, 60, n)


def bench_file(path, prompt, output, ttft_factor=None, itl_factor=None, start_s=100.0, latencies=True):
    """A `vllm bench serve --save-result --save-detailed` file measured on the truth clock;
    request i's client TTFT times ``ttft_factor[i]``, its inter-token gaps times ``itl_factor[i]``."""
    n = len(prompt)
    ttft_factor = np.ones(n) if ttft_factor is None else ttft_factor
    itl_factor = np.ones(n) if itl_factor is None else itl_factor
    ttft, tpot, _ = clock(prompt, output, TRUTH.apply(BASE))
    ttfts = (ttft + TRUTH.client_overhead_s) * ttft_factor
    itls = [[float(tpot[i] * itl_factor[i])] * int(output[i] - 1) for i in range(n)]
    obj = {"backend": "vllm", "model_id": "m", "num_prompts": n, "request_rate": "inf", "burstiness": 1.0,
           "max_concurrency": None, "duration": 30.0, "completed": n, "failed": 0,
           "total_input_tokens": int(np.sum(prompt)), "total_output_tokens": int(np.sum(output)),
           "mean_ttft_ms": 1000 * float(np.mean(ttfts)), "p99_ttft_ms": 1000 * float(np.percentile(ttfts, 99)),
           "median_tpot_ms": 1000 * float(np.median(tpot)),
           "input_lens": [int(p) for p in prompt], "output_lens": [int(o) for o in output],
           "ttfts": ttfts.tolist(), "itls": itls, "start_times": [start_s + 0.5 * i for i in range(n)],
           "generated_texts": [""] * n, "errors": [""] * n}
    if latencies:
        obj["latencies"] = [float(t + sum(i)) for t, i in zip(ttfts, itls)]
    path.write_text(json.dumps(obj))
    return ttfts, itls


def expected_summary(sim, measured):
    """(median, p90, count) of |sim - measured| / measured."""
    ape = np.abs(np.asarray(sim) - np.asarray(measured)) / np.asarray(measured)
    return float(np.median(ape)), float(np.percentile(ape, 90)), len(ape)


def assert_summary(got, expected):
    assert got[2] == expected[2]
    assert got[0] == pytest.approx(expected[0], abs=1e-6) and got[1] == pytest.approx(expected[1], abs=1e-6)


# -- the bench serve reader -------------------------------------------------------------


def test_a_result_file_reads_in_seconds_and_derives_tpot(tmp_path):
    prompt, output = np.array([300, 800, 50]), np.array([10, 1, 25])
    ttfts, itls = bench_file(tmp_path / "r.json", prompt, output, latencies=False)
    result = read_bench_serve(tmp_path / "r.json")
    # serve.py writes summaries in ms: read as seconds.
    assert result.summary_s["mean_ttft_s"] == pytest.approx(float(np.mean(ttfts)), rel=1e-12)
    assert result.summary_s["p99_ttft_s"] == pytest.approx(float(np.percentile(ttfts, 99)), rel=1e-12)
    assert result.e2e_derived
    assert [r.e2e_s for r in result.requests] == pytest.approx([t + sum(i) for t, i in zip(ttfts, itls)])
    measured = measured_requests([result])
    # TPOT is the gaps after the first token over output - 1 of them; undefined for one token.
    assert measured.tpot_s[0] == pytest.approx(sum(itls[0]) / 9, rel=1e-12)
    assert math.isnan(measured.tpot_s[1])
    assert measured.tpot_s[2] == pytest.approx(sum(itls[2]) / 24, rel=1e-12)
    assert measured.trace.column(col.ARRIVAL_TIME_S).to_pylist() == pytest.approx([0.0, 0.5, 1.0])


# -- the bench serve fit ----------------------------------------------------------------


def test_one_run_holds_out_every_other_request_with_its_known_error(tmp_path, known_clock):
    prompt, output = workload(40)
    # The held-out requests (odd rows) measured slower by spread factors; the fitted ones exact.
    odd = np.arange(40) % 2 == 1
    ttft_factor = np.where(odd, 1 + np.linspace(0.01, 0.4, 40), 1.0)
    itl_factor = np.where(odd, 1 + np.linspace(0.3, 0.02, 40), 1.0)
    bench_file(tmp_path / "run.json", prompt, output, ttft_factor, itl_factor)
    measured = measured_requests(read_bench_serve_all(tmp_path / "run.json"))
    fit = fit_bench_serve(None, measured, BASE)
    assert fit.knobs.prefill_scale == pytest.approx(TRUTH.prefill_scale, rel=1e-6)
    assert fit.knobs.decode_scale == pytest.approx(TRUTH.decode_scale, rel=1e-6)
    assert fit.knobs.client_overhead_s == pytest.approx(TRUTH.client_overhead_s, abs=1e-6)
    assert fit.fitted_error == pytest.approx(0.0, abs=1e-10)  # the fitted fold is exact
    assert fit.fold == "every other request (20), fitted on the rest"
    # The truth's client-side latencies against the perturbed measurements of the odd rows.
    ttft, tpot, _ = clock(prompt, output, TRUTH.apply(BASE))
    sim_ttft = ttft + TRUTH.client_overhead_s
    sim_e2e = sim_ttft + (output - 1) * tpot
    meas_ttft = sim_ttft * ttft_factor
    meas_tpot = tpot * itl_factor
    meas_e2e = meas_ttft + (output - 1) * meas_tpot
    assert_summary(fit.held_out["ttft"], expected_summary(sim_ttft[odd], meas_ttft[odd]))
    assert_summary(fit.held_out["tpot"], expected_summary(tpot[odd], meas_tpot[odd]))
    assert_summary(fit.held_out["e2e"], expected_summary(sim_e2e[odd], meas_e2e[odd]))
    assert fit.p90_errors() == {kind: fit.held_out[kind][1] for kind in ("ttft", "tpot", "e2e")}
    # The fitted knobs are applied to the base as documented.
    assert fit.efficiency.matmul_flops_fraction == pytest.approx(BASE.matmul_flops_fraction / TRUTH.prefill_scale)
    assert fit.efficiency.hbm_bandwidth_fraction == pytest.approx(BASE.hbm_bandwidth_fraction / TRUTH.decode_scale)
    assert fit.efficiency.client_overhead_s == fit.knobs.client_overhead_s


def test_several_runs_hold_out_the_last(tmp_path, known_clock):
    paths, factors = [], []
    shapes = [workload(12) for _ in range(3)]
    for r, (prompt, output) in enumerate(shapes):
        f = np.ones(12) if r < 2 else 1 + np.linspace(0.05, 0.5, 12)  # only the last run is off
        bench_file(tmp_path / f"run{r}.json", prompt, output, f, f, start_s=1000.0 * r)
        paths.append(tmp_path / f"run{r}.json")
        factors.append(f)
    results = [res for p in paths for res in read_bench_serve_all(p)]
    fit = fit_bench_serve(None, measured_requests(results), BASE)
    assert fit.fold == "the last run (12 requests), fitted on the 2 before it"
    assert fit.fitted_error == pytest.approx(0.0, abs=1e-10)
    prompt, output = shapes[2]
    ttft, tpot, _ = clock(prompt, output, TRUTH.apply(BASE))
    sim_ttft = ttft + TRUTH.client_overhead_s
    f = factors[2]
    assert_summary(fit.held_out["ttft"], expected_summary(sim_ttft, sim_ttft * f))
    assert_summary(fit.held_out["tpot"], expected_summary(tpot, tpot * f))
    assert_summary(fit.held_out["e2e"], expected_summary(sim_ttft + (output - 1) * tpot,
                                                         (sim_ttft + (output - 1) * tpot) * f))


# -- the scrape fit ---------------------------------------------------------------------

BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def histogram_lines(name, values, bounds=BOUNDS):
    lines = [f"# TYPE {name} histogram"]
    for bound in (*bounds, math.inf):
        le = "+Inf" if bound == math.inf else repr(bound)
        lines.append(f'{name}_bucket{{engine="0",le="{le}",model_name="m"}} {float(np.sum(values <= bound))}')
    lines += [f'{name}_count{{engine="0",model_name="m"}} {float(len(values))}',
              f'{name}_sum{{engine="0",model_name="m"}} {float(np.sum(values))}']
    return lines


def scrape(observations, bounds=BOUNDS):
    lines = []
    for name, values in observations.items():
        lines += histogram_lines(name, np.asarray(values, float), bounds)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"):
        lines += [f"# TYPE {name} counter", f'{name}{{engine="0",model_name="m"}} 1.0']
    lines += histogram_lines("vllm:iteration_tokens_total", np.array([]))
    return Scrape("s", parse_exposition("\n".join(lines) + "\n"))


def promql_quantile(values, q):
    """histogram_quantile over BOUNDS by hand: the bucket holding rank q*n, linear inside it."""
    values = np.asarray(values, float)
    rank = q * len(values)
    lower, below = 0.0, 0.0
    for bound in BOUNDS:
        count = float(np.sum(values <= bound))
        if count >= rank and count > 0:
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return BOUNDS[-1]


def test_a_scrape_fit_holds_out_the_other_quantiles(known_clock):
    # Outputs of 2 to 4 tokens: 1 to 3 gaps each, so how many gaps a request adds to the ITL
    # histogram moves its quantiles from one request's TPOT to another's.
    prompt, output = RNG.integers(100, 2000, 50), RNG.integers(2, 5, 50)
    trace = col.build_table({col.REQUEST_ID: [f"r{i}" for i in range(50)],
                             col.ARRIVAL_TIME_S: np.arange(50, dtype=float).tolist(),
                             col.PROMPT_TOKENS: prompt.tolist(), col.OUTPUT_TOKENS: output.tolist()},
                            col.TraceMeta(source_format="test"))
    ttft, tpot, e2e = clock(prompt, output, Knobs(1.3, 1.2).apply(BASE))
    gaps = np.repeat(tpot, output - 1) * np.linspace(0.7, 1.4, int(np.sum(output - 1)))
    empty = {"vllm:time_to_first_token_seconds": [], "vllm:inter_token_latency_seconds": [],
             "vllm:e2e_request_latency_seconds": []}
    after = {"vllm:time_to_first_token_seconds": ttft, "vllm:inter_token_latency_seconds": gaps,
             "vllm:e2e_request_latency_seconds": e2e * 1.1}
    metrics = scrape_delta(scrape(empty), scrape(after))
    fit = fit_scrape(None, trace, metrics, BASE)
    assert fit.knobs.client_overhead_s == 0.0
    # The simulated quantiles at the fitted knobs, against the histograms' by hand.
    s_ttft, s_tpot, s_e2e = clock(prompt, output, fit.knobs.apply(BASE))
    s_gaps = np.repeat(s_tpot, output - 1)

    def held(sim, measured, qs):
        return expected_summary(np.quantile(sim, qs), [promql_quantile(measured, q) for q in qs])

    assert_summary(fit.held_out["ttft"], held(s_ttft, ttft, (0.75, 0.99)))
    assert_summary(fit.held_out["tpot"], held(s_gaps, gaps, (0.75, 0.99)))
    assert_summary(fit.held_out["e2e"], held(s_e2e, e2e * 1.1, (0.5, 0.9, 0.75, 0.99)))
    # What the fit minimised: the log errors at the fitted quantiles.
    logs = [np.log(np.quantile(s, q) / promql_quantile(m, q)) for s, m in ((s_ttft, ttft), (s_gaps, gaps))
            for q in (0.5, 0.9)]
    assert fit.fitted_error == pytest.approx(float(np.mean(np.square(logs))), rel=1e-9, abs=1e-15)


# -- the step fit -----------------------------------------------------------------------

P, BW = 1e15, 3e12
STEP_TRUTH = dict(matmul=0.55, attention=0.35, hbm=0.7, step=0.9e-3, per_request=3e-5)


def step(decode, prefill, context):
    """A step's raw terms: 2 GFLOP per token of body, 1 GFLOP of head per request, 16 GB of
    weights, KV by context; decode tokens are requests, a prefill is one more."""
    tokens, requests = decode + prefill, decode + (1 if prefill else 0)
    kv = 131072.0 * context * (decode + (1 if prefill else 0))
    cost = StepCost(0.0, 0.0, 0.0, 2e-4, 0.0, 0.0, 16e9, kv, 0.0, 0.0, requests, tokens, 2e9 * tokens,
                    1e9 * requests, 1e6 * tokens, 3e-4, 4e6 * prefill * context / 100, 0.0)
    return cost


def true_step_s(c):
    """The documented roofline at STEP_TRUTH, asynchronous scheduling, written out."""
    t = STEP_TRUTH
    gemms = (c.body_flops + c.head_flops) / (P * t["matmul"])
    attention = c.attention_work / (P * t["attention"])
    gpu = max(gemms, c.weight_bytes / (BW * t["hbm"])) + max(attention, c.kv_bytes / (BW * t["hbm"])) \
        + c.elementwise_bytes / (BW * t["hbm"]) + c.extra_gpu_s + c.communication_s
    return max(gpu, t["step"] + t["per_request"] * c.num_requests)


def step_samples():
    """Steps of every kind measured on STEP_TRUTH; the held-out ones (odd positions) off by
    a known, spread factor, the rest exact. Returns the samples, the truth, the factors."""
    shapes = [(d, 0, c) for d in (1, 4, 16, 64, 128) for c in (500, 4000)]
    shapes += [(d, p, c) for d in (2, 8, 30) for p in (64, 256) for c in (1000, 3000)]
    shapes += [(0, p, c) for p in (512, 2048, 4096, 8192) for c in (100, 2000)]
    costs = [step(*s) for s in shapes]
    kinds = ["decode-only" if p == 0 else ("prefill-heavy" if p >= 0.9 * (d + p) else "mixed")
             for d, p, _ in shapes]
    truth = np.array([true_step_s(c) for c in costs])
    odd = np.arange(len(costs)) % 2 == 1
    factor = np.where(odd, 1 + np.linspace(0.0, 0.3, len(costs)), 1.0)
    samples = [StepSample(c, float(m), k) for c, m, k in zip(costs, truth * factor, kinds)]
    return samples, truth, factor, odd, kinds


def test_the_step_fit_recovers_the_factors_and_reports_the_held_out_steps():
    samples, truth, factor, odd, kinds = step_samples()
    result = fit_steps(samples, flops_per_s=P, bytes_per_s=BW, async_scheduling=True, base=Efficiency())
    fit = result.fit
    assert fit.efficiency.matmul_flops_fraction == pytest.approx(STEP_TRUTH["matmul"], rel=1e-6)
    assert fit.efficiency.hbm_bandwidth_fraction == pytest.approx(STEP_TRUTH["hbm"], rel=1e-6)
    assert fit.median_ape == pytest.approx(0.0, abs=1e-9) and fit.p90_ape == pytest.approx(0.0, abs=1e-9)
    rows = {row["kind"]: row for row in result.held_out}
    kinds_array = np.array(kinds)
    for kind in ("all", "decode-only", "mixed", "prefill-heavy"):
        pick = odd & ((kinds_array == kind) if kind != "all" else True)
        ape = np.abs(truth[pick] - truth[pick] * factor[pick]) / (truth[pick] * factor[pick])
        assert rows[kind]["count"] == int(pick.sum())
        assert rows[kind]["median_ape"] == pytest.approx(float(np.median(ape)), abs=1e-7)
        assert rows[kind]["p90_ape"] == pytest.approx(float(np.percentile(ape, 90)), abs=1e-7)
    assert result.p90_errors() == pytest.approx({
        "decode_step": rows["decode-only"]["p90_ape"],
        "prefill_step": max(rows["mixed"]["p90_ape"], rows["prefill-heavy"]["p90_ape"])})


# -- the report ---------------------------------------------------------------------------


def test_the_report_prints_and_writes_the_held_out_numbers(tmp_path, known_clock):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "llama-3.1-8b"\n\n[hardware]\ngpu = "l40s"\n\n[engine]\n'
                        'max_model_len = 8192\n')
    prompt, output = workload(20)
    odd = np.arange(20) % 2 == 1
    f = np.where(odd, 1 + np.linspace(0.02, 0.6, 20), 1.0)
    bench_file(tmp_path / "run.json", prompt, output, f, f)
    job = CalibrationJob(resolve_scenario(scenario, Overrides()), "bench serve", (str(tmp_path / "run.json"),),
                         bench=tuple(read_bench_serve_all(tmp_path / "run.json")))
    fit = fit_bench_serve(None, measured_requests(job.bench), BASE)  # the clock's base, not the GPU's
    result = CalibrationResult(job, fit)
    lines = result.lines()
    assert lines[0].startswith("calibrated llama-3.1-8b on 1x l40s from 1 file(s) (bench serve); started from ")
    assert "held out: every other request (10), fitted on the rest" in lines
    assert lines[1].startswith(f"fit after {fit.replays} replays: prefill x{TRUTH.prefill_scale:.3f}, "
                               f"decode x{TRUTH.decode_scale:.3f}, client overhead 4.0 ms")
    ttft, tpot, _ = clock(prompt, output, TRUTH.apply(BASE))
    sim = {"ttft": ttft + 0.004, "tpot": tpot}
    sim["e2e"] = sim["ttft"] + (output - 1) * tpot
    meas = {"ttft": sim["ttft"] * f, "tpot": tpot * f}
    meas["e2e"] = meas["ttft"] + (output - 1) * meas["tpot"]
    printed = {}
    for kind in ("ttft", "tpot", "e2e"):
        median, p90, count = expected_summary(sim[kind][odd], meas[kind][odd])
        printed[kind] = p90
        assert f"  {kind:<5} median |error| {median:.1%}, p90 {p90:.1%} over {count} requests" in lines
    out = write(result, tmp_path / "cal.toml")
    written = tomllib.loads(out.read_text())
    assert written["error"] == pytest.approx(printed, abs=1e-6)


def test_the_report_prints_the_held_out_steps(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[model]\npreset = "llama-3.1-8b"\n\n[hardware]\ngpu = "l40s"\n')
    samples, truth, factor, odd, kinds = step_samples()
    fit = fit_steps(samples, flops_per_s=P, bytes_per_s=BW, async_scheduling=True, base=Efficiency())
    job = CalibrationJob(resolve_scenario(scenario, Overrides()), "steps", ("steps.parquet",), steps=samples)
    result = CalibrationResult(job, fit)
    lines = result.lines()
    assert f"held out: every other step ({int(odd.sum())}), fitted on the other {int((~odd).sum())}" in lines
    kinds_array = np.array(kinds)
    p90 = {}
    for kind in ("all", "decode-only", "mixed", "prefill-heavy"):
        pick = odd & ((kinds_array == kind) if kind != "all" else True)
        measured = truth[pick] * factor[pick]
        ape = np.abs(truth[pick] - measured) / measured
        p90[kind] = float(np.percentile(ape, 90))
        assert (f"  {kind:<13} median |error| {float(np.median(ape)):.1%}, p90 {p90[kind]:.1%} "
                f"over {int(pick.sum())} steps") in lines
    written = tomllib.loads(write(result, tmp_path / "cal.toml").read_text())
    assert written["error"] == pytest.approx({"decode_step": p90["decode-only"],
                                              "prefill_step": max(p90["mixed"], p90["prefill-heavy"])}, abs=1e-7)


def test_a_scrape_of_the_known_clock_gives_back_its_knobs(known_clock):
    # Fine buckets: the histograms' quantiles are then the clock's own to a fraction of a
    # percent, and so are the knobs fitted to them.
    prompt, output = workload(60)
    trace = col.build_table({col.REQUEST_ID: [f"r{i}" for i in range(60)],
                             col.ARRIVAL_TIME_S: np.arange(60, dtype=float).tolist(),
                             col.PROMPT_TOKENS: prompt.tolist(), col.OUTPUT_TOKENS: output.tolist()},
                            col.TraceMeta(source_format="test"))
    truth = Knobs(1.3, 1.2)
    ttft, tpot, e2e = clock(prompt, output, truth.apply(BASE))
    names = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
             "vllm:e2e_request_latency_seconds")
    fine = tuple(float(b) for b in np.geomspace(0.001, 10.0, 800))
    metrics = scrape_delta(scrape({n: [] for n in names}, fine),
                           scrape(dict(zip(names, (ttft, np.repeat(tpot, output - 1), e2e))), fine))
    fit = fit_scrape(None, trace, metrics, BASE)
    assert fit.knobs.prefill_scale == pytest.approx(truth.prefill_scale, rel=0.01)
    assert fit.knobs.decode_scale == pytest.approx(truth.decode_scale, rel=0.01)
