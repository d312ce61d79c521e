"""The calibration readers on files written in vLLM 0.33's own formats.

Bench-serve files are built the way ``vllm/benchmarks/serve.py`` builds them (same keys,
ms summaries, second-valued per-request lists, ``"inf"`` rate, detailed lists dropped
without ``--save-detailed``); scrapes are rendered the way prometheus_client renders
vLLM's metrics (``# HELP``/``# TYPE``, ``_total`` + ``_created`` for counters,
``_bucket``/``_count``/``_sum``/``_created`` for histograms, sorted labels
``engine``/``le``/``model_name``, Go-style floats). Each bad input must come back as one
``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from kvtwin.sim.calibration.fit.bench_serve import read_bench_serve, read_bench_serve_all
from kvtwin.sim.calibration.fit.prometheus import Histogram, Scrape, parse_exposition, read_scrape, scrape_delta
from kvtwin.sim.core.errors import ConfigError

# ---------------------------------------------------------------- vllm bench serve files

# (prompt_len, output_tokens, ttft s, itls s, success, error) per request; the third failed
# with an HTTP error whose reason phrase was empty, as vLLM's client can record it.
REQUESTS = [
    (100, 3, 0.10, [0.02, 0.03], True, ""),
    (250, 2, 0.30, [0.05], True, ""),
    (80, 0, 0.0, [], False, ""),
]


def _percentile_ms(values_s: list[float], p: float) -> float:
    """numpy's default (linear) percentile, in ms, as serve.py reports it."""
    values = sorted(values_s) or [0.0]
    rank = (len(values) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(values) - 1)
    return (values[low] + (values[high] - values[low]) * (rank - low)) * 1000


def bench_json(requests=REQUESTS, *, detailed=True, request_rate=math.inf, burstiness=1.0, max_concurrency=None,
               percentiles=(99.0,), metrics=("ttft", "tpot", "itl", "e2el")) -> dict:
    """A result object with serve.py's keys, order and units (settings first, then the run)."""
    ok = [r for r in requests if r[4]]
    latencies = [r[2] + sum(r[3]) for r in requests]
    per_metric_s = {
        "ttft": [r[2] for r in ok],
        "tpot": [(r[2] + sum(r[3]) - r[2]) / (r[1] - 1) for r in ok if r[1] > 1],
        "itl": [itl for r in ok for itl in r[3]],
        "e2el": [r[2] + sum(r[3]) for r in ok],
    }
    duration = 2.5
    result = {
        "date": "20250101-120000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
        "model_id": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
        "num_prompts": len(requests),
        "request_rate": request_rate if request_rate < math.inf else "inf",
        "burstiness": burstiness, "max_concurrency": max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(requests) - len(ok),
        "total_input_tokens": sum(r[0] for r in ok), "total_output_tokens": sum(r[1] for r in requests),
        "request_throughput": len(ok) / duration, "request_goodput": None,
        "output_throughput": sum(r[1] for r in requests) / duration,
        "total_token_throughput": sum(r[0] + r[1] for r in ok) / duration,
        "input_lens": [r[0] for r in requests], "output_lens": [r[1] for r in requests],
        "ttfts": [r[2] for r in requests], "itls": [list(r[3]) for r in requests],
        "latencies": latencies, "start_times": [1000.0 + 0.25 * i for i in range(len(requests))],
        "queue_times": [0.0] * len(requests), "generated_texts": ["x" * r[1] for r in requests],
        "errors": [r[5] for r in requests], "max_output_tokens_per_s": 4.0, "max_concurrent_requests": 3,
        "rtfx": 0.0,
    }
    for metric in metrics:
        values = per_metric_s[metric]
        result[f"mean_{metric}_ms"] = (statistics.fmean(values) if values else 0.0) * 1000
        result[f"median_{metric}_ms"] = _percentile_ms(values, 50)
        result[f"std_{metric}_ms"] = (statistics.pstdev(values) if values else 0.0) * 1000
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            result[f"p{word}_{metric}_ms"] = _percentile_ms(values, p)
    if not detailed:  # serve.py keeps latencies and queue_times either way
        for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"):
            del result[key]
    return result


def write_json(tmp_path: Path, obj, name="vllm-inf-qps-Llama-3.1-8B.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))  # json.dump as serve.py: Infinity for a float inf
    return path


def test_detailed_result_reads_settings_summaries_and_requests(tmp_path):
    result = read_bench_serve(write_json(tmp_path, bench_json()))
    assert (result.model_id, result.backend, result.num_prompts) == ("meta-llama/Llama-3.1-8B-Instruct", "vllm", 3)
    assert result.request_rate == math.inf and result.burstiness == 1.0 and result.max_concurrency is None
    assert (result.duration_s, result.completed, result.failed) == (2.5, 2, 1)
    assert (result.total_input_tokens, result.total_output_tokens) == (350, 5)
    # ms → s: TTFTs 0.1 and 0.3 s are written as mean 200 ms, p99 298 ms.
    assert result.summary_s["mean_ttft_s"] == pytest.approx(0.2, rel=1e-12)
    assert result.summary_s["p99_ttft_s"] == pytest.approx(0.298, rel=1e-12)
    assert result.summary_s["median_itl_s"] == pytest.approx(0.03, rel=1e-12)
    assert result.summary_s["mean_e2el_s"] == pytest.approx((0.15 + 0.35) / 2, rel=1e-12)
    assert set(result.summary_s) == {f"{stat}_{m}_s" for stat in ("mean", "median", "std", "p99")
                                     for m in ("ttft", "tpot", "itl", "e2el")}
    first, second, failed = result.requests
    assert (first.input_tokens, first.output_tokens, first.ttft_s, first.itls_s) == (100, 3, 0.1, (0.02, 0.03))
    assert first.success and first.e2e_s == pytest.approx(0.15) and first.start_s == 1000.0
    assert second.e2e_s == pytest.approx(0.35) and second.start_s == 1000.25
    assert not failed.success and failed.e2e_s is None and failed.output_tokens == 0
    assert not result.e2e_derived


def test_latencies_list_is_used_when_present(tmp_path):
    obj = bench_json()
    obj["latencies"][0] = 0.5  # not ttft + sum(itls): proves the file's value is taken
    assert read_bench_serve(write_json(tmp_path, obj)).requests[0].e2e_s == 0.5


def test_e2e_is_derived_from_ttft_and_itls_without_a_latencies_list(tmp_path):
    obj = bench_json()
    del obj["latencies"]  # files from vLLM versions that did not write it
    result = read_bench_serve(write_json(tmp_path, obj))
    assert result.e2e_derived
    assert [r.e2e_s for r in result.requests] == [0.10 + math.fsum([0.02, 0.03]), 0.30 + 0.05, None]


def test_a_request_with_an_error_is_a_failure_even_with_tokens(tmp_path):
    obj = bench_json()
    obj["errors"][1] = "Traceback (most recent call last): ..."
    assert [r.success for r in read_bench_serve(write_json(tmp_path, obj)).requests] == [True, False, False]


def test_summary_only_file_has_no_requests(tmp_path):
    result = read_bench_serve(write_json(tmp_path, bench_json(detailed=False)))
    assert result.requests == () and result.completed == 2
    assert result.summary_s["p99_ttft_s"] == pytest.approx(0.298, rel=1e-12)


def test_finite_rate_infinite_burstiness_concurrency_and_fractional_percentiles(tmp_path):
    obj = bench_json(request_rate=4.0, burstiness=math.inf, max_concurrency=8, percentiles=(50.0, 99.9),
                     metrics=("ttft",))
    result = read_bench_serve(write_json(tmp_path, obj))
    assert (result.request_rate, result.burstiness, result.max_concurrency) == (4.0, math.inf, 8)
    assert set(result.summary_s) == {"mean_ttft_s", "median_ttft_s", "std_ttft_s", "p50_ttft_s", "p99.9_ttft_s"}
    assert result.summary_s["p99.9_ttft_s"] == pytest.approx(0.2998, rel=1e-12)


def test_appended_results_are_read_in_order(tmp_path):
    path = tmp_path / "appended.json"
    # --append-result: a newline, then the next json.dump, on the same file.
    path.write_text(json.dumps(bench_json(request_rate=2.0)) + "\n" + json.dumps(bench_json(request_rate=8.0)))
    assert [r.request_rate for r in read_bench_serve_all(path)] == [2.0, 8.0]
    with pytest.raises(ConfigError, match="one benchmark result"):
        read_bench_serve(path)


def _bad(obj_edit):
    def build():
        obj = bench_json()
        obj_edit(obj)
        return json.dumps(obj)
    return build


BAD_BENCH = {
    "missing key": (_bad(lambda o: o.pop("model_id")), "model_id", "missing"),
    "string for a number": (_bad(lambda o: o.update(duration="12.5")), "duration", "a finite number"),
    "bool for a number": (_bad(lambda o: o.update(completed=True)), "completed", "an integer"),
    "negative time": (_bad(lambda o: o["ttfts"].__setitem__(1, -0.3)), "ttfts[1]", "a time ≥ 0"),
    "negative summary": (_bad(lambda o: o.update(p99_ttft_ms=-1.0)), "p99_ttft_ms", "a time ≥ 0"),
    "string in itls": (_bad(lambda o: o["itls"][0].__setitem__(1, "0.03")), "itls[0][1]", "a finite number"),
    "NaN time": (_bad(lambda o: o["latencies"].__setitem__(0, math.nan)), "latencies[0]", "a finite number"),
    "lists of different lengths": (_bad(lambda o: o["ttfts"].pop()), "ttfts", "one entry per request"),
    "half-detailed": (_bad(lambda o: o.pop("input_lens")), "input_lens", "missing"),
    "zero rate": (_bad(lambda o: o.update(request_rate=0)), "request_rate", 'a number > 0 or "inf"'),
    "zero concurrency": (_bad(lambda o: o.update(max_concurrency=0)), "max_concurrency", "an integer ≥ 1"),
    "not an object": (lambda: json.dumps([1, 2]), "top level", "a JSON object"),
    "invalid JSON": (lambda: '{"backend": "vllm",\n "duration": }', "JSON (line 2, column 14)", "valid JSON"),
    "empty file": (lambda: "", "file", "a JSON object"),
}


@pytest.mark.parametrize("case", BAD_BENCH)
def test_bad_bench_file_names_file_and_field(tmp_path, case):
    build, field, expected = BAD_BENCH[case]
    path = tmp_path / "result.json"
    path.write_text(build())
    with pytest.raises(ConfigError) as info:
        read_bench_serve(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: expected "), message
    assert expected in message
    assert info.value.field == field and info.value.source == str(path)


def test_missing_bench_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: file: expected an existing .*no such file"):
        read_bench_serve(path)


# ---------------------------------------------------------------- Prometheus scrapes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Bucket bounds from vllm/v1/metrics/buckets.py (0.33).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
COUNTERS = {  # name as registered → HELP text (vllm/v1/metrics/loggers.py)
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "vllm:generation_tokens": "Number of generation tokens processed.",
}
HISTOGRAMS = {
    "vllm:iteration_tokens_total": ("Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS),
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                        REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                          REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                         REQUEST_LATENCY_BUCKETS),
}


def go_float(value: float) -> str:
    """prometheus_client's floatToGoString."""
    value = float(value)
    if value == math.inf:
        return "+Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        return f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.") + f"e+0{dot - 1}"
    return text


def labels_text(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def render(engines: dict[str, dict], model=MODEL, created=1.7e9, skip=()) -> str:
    """A /metrics body for one model; each engine's state is counters (name → value),
    ``success`` (finished_reason → count) and observations (histogram name → values)."""
    out = []
    for name, help_text in COUNTERS.items():
        if name in skip:
            continue
        out += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
        out += [f"{name}_total{labels_text(engine=e, model_name=model)} {go_float(s['counters'][name])}"
                for e, s in engines.items()]
        out += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge"]
        out += [f"{name}_created{labels_text(engine=e, model_name=model)} {go_float(created)}" for e in engines]
    out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter"]
    for e, s in engines.items():
        for reason in ("stop", "length", "abort", "error", "repetition"):
            out.append(f"vllm:request_success_total{labels_text(engine=e, finished_reason=reason, model_name=model)}"
                       f" {go_float(s['success'].get(reason, 0))}")
    for name, (help_text, bounds) in HISTOGRAMS.items():
        if name in skip:
            continue
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for e, s in engines.items():
            values = s["observations"].get(name, [])
            for bound in (*bounds, math.inf):
                count = sum(1 for v in values if v <= bound)
                out.append(f"{name}_bucket{labels_text(engine=e, le=go_float(bound), model_name=model)} "
                           f"{go_float(count)}")
            out.append(f"{name}_count{labels_text(engine=e, model_name=model)} {go_float(len(values))}")
            out.append(f"{name}_sum{labels_text(engine=e, model_name=model)} {go_float(sum(values))}")
        out += [f"# HELP {name}_created {help_text}", f"# TYPE {name}_created gauge"]
        out += [f"{name}_created{labels_text(engine=e, model_name=model)} {go_float(created)}" for e in engines]
    return "\n".join(out) + "\n"


def engine_state(prompt, generation, success, observations):
    return {"counters": {"vllm:prompt_tokens": prompt, "vllm:prompt_tokens_cached": prompt // 4,
                         "vllm:generation_tokens": generation},
            "success": success, "observations": observations}


ITER = "vllm:iteration_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"

BEFORE = {
    "0": engine_state(1000, 50, {"stop": 4}, {ITER: [512, 7], TTFT: [0.03], ITL: [0.02], E2E: [0.9]}),
    "1": engine_state(200, 10, {"length": 1}, {ITER: [100]}),
}
AFTER = {
    "0": engine_state(1800, 90, {"stop": 6, "length": 1},
                      {ITER: [512, 7, 3, 12, 40, 9000], TTFT: [0.03, 0.07, 0.3], ITL: [0.02, 0.012, 0.2],
                       E2E: [0.9, 1.2, 3.0]}),
    "1": engine_state(600, 30, {"length": 2}, {ITER: [100, 16, 20000], TTFT: [0.004], E2E: [0.4]}),
}


def scrapes(tmp_path: Path, before=BEFORE, after=AFTER, **render_args) -> tuple[Path, Path]:
    (tmp_path / "before.prom").write_text(render(before, **render_args))
    (tmp_path / "after.prom").write_text(render(after, **render_args))
    return tmp_path / "before.prom", tmp_path / "after.prom"


def test_parse_exposition_reads_labels_escapes_special_values_and_timestamps():
    text = ('# HELP vllm:x_total A "quoted" help \\ text.\n'
            "# TYPE vllm:x_total counter\n"
            'vllm:x_total{engine="0",model_name="a \\"b\\" \\\\ c\\nd"} 5.0\n'
            "\n"
            'vllm:y_bucket{le="+Inf", engine="1",} +Inf 1712345678000\r\n'
            "vllm:z NaN\n"
            "vllm:w -1.5e-3\n"
            "# EOF\n")
    samples = parse_exposition(text)
    (x,) = samples["vllm:x_total"]
    assert x.labels == (("engine", "0"), ("model_name", 'a "b" \\ c\nd')) and x.value == 5.0 and x.line == 3
    (y,) = samples["vllm:y_bucket"]
    assert y.labels == (("engine", "1"), ("le", "+Inf")) and y.value == math.inf and y.timestamp == 1712345678000
    assert math.isnan(samples["vllm:z"][0].value) and samples["vllm:w"][0].value == -0.0015


def test_histogram_quantile_interpolates_like_promql():
    h = Histogram(upper_bounds=(1.0, 8.0, 16.0, math.inf), cumulative_counts=(2.0, 6.0, 10.0, 10.0), sum=70.0,
                  count=10.0)
    assert h.mean() == 7.0
    assert h.quantile(0.1) == 0.5  # rank 1 of the 2 in (0, 1]
    assert h.quantile(0.5) == 6.25  # rank 5: 1 + 7 * (5 - 2) / (6 - 2)
    assert h.quantile(1.0) == 16.0
    assert h.quantile(0.0) == 0.0
    tail = Histogram((1.0, 8.0, 16.0, math.inf), (2.0, 6.0, 10.0, 12.0), 100.0, 12.0)
    assert tail.quantile(0.99) == 16.0  # in the +Inf bucket: the highest finite bound
    empty = Histogram((1.0, math.inf), (0.0, 0.0), 0.0, 0.0)
    assert math.isnan(empty.mean()) and math.isnan(empty.quantile(0.5))
    with pytest.raises(ConfigError, match="q: expected a quantile between 0 and 1"):
        h.quantile(1.5)


def test_scrape_delta_sums_engines_and_subtracts_the_first_scrape(tmp_path):
    before, after = scrapes(tmp_path)
    metrics = scrape_delta(read_scrape(before), read_scrape(after))
    assert metrics.model_name == MODEL
    assert (metrics.prompt_tokens, metrics.generation_tokens, metrics.requests_finished) == (1200.0, 60.0, 4.0)
    assert metrics.prompt_tokens_cached == (1800 // 4 - 1000 // 4) + (600 // 4 - 200 // 4)
    it = metrics.iteration_tokens
    # New steps: 3, 12, 40, 9000 on engine 0 and 16, 20000 on engine 1.
    assert it.upper_bounds == (*map(float, ITERATION_TOKENS_BUCKETS), math.inf)
    assert it.cumulative_counts == (0, 1, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5, 6)
    assert (it.count, it.sum) == (6.0, 3 + 12 + 40 + 9000 + 16 + 20000)
    assert it.quantile(0.5) == 16.0  # rank 3 at the top of (8, 16]
    assert metrics.ttft_s.count == 3 and metrics.ttft_s.sum == pytest.approx(0.07 + 0.3 + 0.004)
    assert metrics.itl_s.count == 2 and metrics.itl_source == ITL
    assert metrics.itl_s.cumulative_counts[:2] == (0, 1)  # 0.012 ≤ 0.025
    assert metrics.e2e_s.count == 3 and metrics.e2e_s.mean() == pytest.approx((1.2 + 3.0 + 0.4) / 3)
    assert metrics.queue_s.count == 0 and metrics.prefill_s is not None and metrics.decode_s is not None


def test_itl_falls_back_to_time_per_output_token(tmp_path):
    before, after = (render(s) for s in (BEFORE, AFTER))
    legacy = "vllm:time_per_output_token_seconds"
    before, after = (t.replace(ITL, legacy) for t in (before, after))
    metrics = scrape_delta(Scrape("b", parse_exposition(before)), Scrape("a", parse_exposition(after)))
    assert metrics.itl_source == legacy and metrics.itl_s.count == 2


def test_missing_phase_histograms_are_none(tmp_path):
    skip = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds", "vllm:prompt_tokens_cached")
    before, after = scrapes(tmp_path, skip=skip)
    metrics = scrape_delta(read_scrape(before), read_scrape(after))
    assert (metrics.queue_s, metrics.prefill_s, metrics.decode_s, metrics.prompt_tokens_cached) == (None,) * 4


def test_several_models_need_a_model_name(tmp_path):
    other = {"0": engine_state(5, 5, {}, {ITER: [5]})}
    # A second model served by the same process: its series follow the first's.
    before = Scrape("before.prom", parse_exposition(render(BEFORE) + render(other, model="other")))
    after = Scrape("after.prom", parse_exposition(render(AFTER) + render(other, model="other")))
    with pytest.raises(ConfigError, match=r"^after.prom: model_name: expected a model_name argument: .*"
                                          r"meta-llama/Llama-3.1-8B-Instruct, other"):
        scrape_delta(before, after)
    assert scrape_delta(before, after, model_name="other").prompt_tokens == 0.0
    assert scrape_delta(before, after, model_name=MODEL).prompt_tokens == 1200.0
    with pytest.raises(ConfigError, match="model_name: expected one of the models in the scrape"):
        scrape_delta(before, after, model_name="nope")


def test_a_counter_that_went_down_means_a_restart(tmp_path):
    before, after = scrapes(tmp_path, before=AFTER, after=BEFORE)
    with pytest.raises(ConfigError) as info:
        scrape_delta(read_scrape(before), read_scrape(after))
    assert str(info.value).startswith(f'{after}: vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}: '
                                      f"expected ≥ 1800.0, its value in {before}")
    assert "restarted" in str(info.value)


def test_a_changed_created_time_means_a_restart(tmp_path):
    (tmp_path / "before.prom").write_text(render(BEFORE, created=1.7e9))
    (tmp_path / "after.prom").write_text(render(AFTER, created=1.8e9))
    with pytest.raises(ConfigError, match=r"vllm:prompt_tokens_created\{engine=\"0\".*restarted"):
        scrape_delta(read_scrape(tmp_path / "before.prom"), read_scrape(tmp_path / "after.prom"))


def _edit_after(old: str, new: str):
    def edit(text: str) -> str:
        assert old in text
        return text.replace(old, new, 1)
    return edit


BUCKET_8 = f'vllm:iteration_tokens_total_bucket{{engine="0",le="8.0",model_name="{MODEL}"}}'
BAD_DELTA = {
    "non-cumulative buckets": (_edit_after(f"{BUCKET_8} 2.0", f"{BUCKET_8} 9.0"),
                               'vllm:iteration_tokens_total_bucket{engine="0",le="16.0"', "at least the count"),
    "count is not the +Inf bucket": (
        _edit_after(f'vllm:iteration_tokens_total_count{{engine="0",model_name="{MODEL}"}} 6.0',
                    f'vllm:iteration_tokens_total_count{{engine="0",model_name="{MODEL}"}} 7.0'),
        'vllm:iteration_tokens_total_count{engine="0"', 'the le="+Inf" bucket\'s count'),
    "series gone": (_edit_after(f'vllm:generation_tokens_total{{engine="1",model_name="{MODEL}"}} 30.0\n', ""),
                    'vllm:generation_tokens_total{engine="1"', "in the second scrape too"),
    "required metric missing": (lambda t: t.replace("vllm:e2e_request_latency_seconds", "vllm:other"),
                                "vllm:e2e_request_latency_seconds_bucket", "series for model_name"),
}


@pytest.mark.parametrize("case", BAD_DELTA)
def test_bad_delta_names_file_and_series(tmp_path, case):
    edit, field, expected = BAD_DELTA[case]
    before, after = scrapes(tmp_path)
    if case == "required metric missing":  # gone from both, as on a server without it
        before.write_text(edit(before.read_text()))
    after.write_text(edit(after.read_text()))
    with pytest.raises(ConfigError) as info:
        scrape_delta(read_scrape(before), read_scrape(after))
    assert str(info.value).startswith(f"{after}: {field}"), str(info.value)
    assert expected in str(info.value)


BAD_EXPOSITION = {
    "word for a value": ('vllm:x{engine="0"} abc', 2, "a value"),
    "underscore number": ("vllm:x 1_000", 2, "a value"),
    "bool-like value": ("vllm:x true", 2, "a value"),
    "unclosed quote": ('vllm:x{engine="0} 1.0', 2, "a closing quote"),
    "bad escape": ('vllm:x{engine="a\\tb"} 1.0', 2, "escapes"),
    "missing equals": ('vllm:x{engine "0"} 1.0', 2, '`="`'),
    "no value": ('vllm:x{engine="0"}', 2, "a value"),
    "too many fields": ("vllm:x 1.0 2 3", 2, "at most a timestamp"),
    "bad type": ("# TYPE vllm:x countr", 2, "# TYPE"),
    "duplicate series": ('vllm:y{a="1"} 2.0', 2, "each series once (already on line 1)"),
    "bad name": ("9vllm 1.0", 2, "metric name"),
}


@pytest.mark.parametrize("case", BAD_EXPOSITION)
def test_bad_exposition_names_file_and_line(tmp_path, case):
    line, number, expected = BAD_EXPOSITION[case]
    path = tmp_path / "metrics.prom"
    path.write_text(f'vllm:y{{a="1"}} 1.0\n{line}\nvllm:z 3.0\n')
    with pytest.raises(ConfigError) as info:
        read_scrape(path)
    assert str(info.value).startswith(f"{path}: line {number}: expected "), str(info.value)
    assert expected in str(info.value)


def test_missing_scrape_file(tmp_path):
    with pytest.raises(ConfigError, match=r"before\.prom: file: expected an existing Prometheus scrape"):
        read_scrape(tmp_path / "before.prom")


def test_non_vllm_scrape_is_refused(tmp_path):
    path = tmp_path / "node.prom"
    path.write_text("# TYPE node_load1 gauge\nnode_load1 0.5\n")
    with pytest.raises(ConfigError, match=r"node\.prom: vllm:prompt_tokens_total: expected vLLM's metrics"):
        scrape_delta(read_scrape(path), read_scrape(path))
