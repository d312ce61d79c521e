"""How close replays are to public vLLM V1 serving runs, light load through saturation, no fit used.

    python bench/bench_fidelity_serving.py            # table, targets, bench/out/fidelity_serving.parquet
    python bench/bench_fidelity_serving.py --cap 300  # at most 300 requests per Poisson point (default 1000: none capped)

Each row of ``bench/data/fidelity_serving.csv`` is one measured point of a `vllm bench serve`
run of vLLM 0.10 or later (sources, commits and licences: ``bench/data/FIDELITY_SOURCES.md``).
The bench rebuilds the point as a scenario (the model, GPU and engine settings the source ran;
the GPU's bundled calibration, or the default factors where the GPU has none, as a user gets),
replays its workload (a Poisson point through the synthetic ``[workload]`` spec, capped at
``--cap`` requests; a burst of N requests, all arriving at time 0 as ``vllm bench serve``
sends them without ``--request-rate``, never capped: N is the load) and compares:

* TTFT, TPOT and E2E, each statistic the source gives (mean, p50, p99): signed relative error.
  Client-side columns (``ttft_client_s``...) where the calibration has a client overhead,
  else the server's; the ``latency_side`` column says which.
* Saturation: at every point the source marks as past its knee (``source_saturated``), the
  request throughput against the measured one.
* The band (docs/capacity.md#the-band): the ratios of measured to replayed p99 TTFT and TPOT
  at the calibrated points, their 5th to 95th percentiles per figure. Each point is judged on
  the band of the other series alone (a series is one GPU and model of one source: leave one
  series out), so the coverage it reports is held out. A point on an uncalibrated GPU has no
  band and is not judged. ``--write-band`` writes the band of every calibrated point to
  ``sim/replay/data/measurements/serving_band.toml``, which ``scripts/calibration/fit_bundled.py``
  puts into every bundled calibration as its ``[band]``.

The targets (issue 39, item 6) are printed beside the results with pass or fail. Nothing here
feeds back into the clock: the band frames its answers, it does not move them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data"
POINTS_CSV = DATA / "fidelity_serving.csv"
HARDWARE_TOML = DATA / "fidelity_hardware.toml"
MODELS_DIR = DATA / "fidelity_models"

MEDIAN_ERROR_TARGET = 0.05
SATURATION_TARGET = 0.05
COVERAGE_TARGET = 0.80

INT_COLUMNS = ("tp", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_tokens", "input_tokens",
               "output_tokens", "num_prompts", "seed", "source_saturated")
FLOAT_COLUMNS = ("gpu_memory_utilization", "rate_per_s", "req_s", "out_tok_s", "ttft_mean_ms", "ttft_p50_ms",
                 "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_mean_ms")
BOOL_COLUMNS = ("enable_prefix_caching", "async_scheduling")
ARRIVALS = ("poisson", "burst")

# (figure, statistic) -> the summary column it is compared with; "{side}" is "_client" when
# the replay has client-side columns (TTFT and E2E only: TPOT is a difference of two
# client times, so the overhead cancels).
LATENCY_FIGURES = {("ttft", "mean"): "mean_ttft{side}_ms", ("ttft", "p50"): "median_ttft{side}_ms",
                   ("ttft", "p99"): "p99_ttft{side}_ms", ("tpot", "mean"): "mean_tpot_ms",
                   ("tpot", "p50"): "median_tpot_ms", ("tpot", "p99"): "p99_tpot_ms",
                   ("itl", "p99"): "p99_itl_ms", ("e2e", "mean"): "mean_e2el{side}_ms"}
BANDS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl"}
# The p99 figures a band is measured on, each with the calibration [band] kind it becomes, and
# the band's quantiles of measured / replayed p99 (a 90% interval).
BAND_KINDS = {"ttft": "ttft", "tpot": "tpot", "itl": "tpot"}
BAND_QUANTILES = (0.05, 0.95)
BAND_FILE = REPO / "sim" / "replay" / "data" / "measurements" / "serving_band.toml"
# The sources of the calibrated points (bench/data/FIDELITY_SOURCES.md), as calibration files
# cite theirs: serving_band.toml carries them into every bundled file beside its [band].
BAND_SOURCES = {
    "S4": {"repository": "dennislee22/vLLM-benchmarking", "path": "README.md (Tests 4 and 5) and log/",
           "commit": "b474d1e053c35c9aef8c02aae4efbc0d8675f033", "licence": "none stated: numbers used as facts only",
           "engine": "vLLM 0.10.1.1 (V1)", "gpu": "1x A100 80GB",
           "notes": "serving band: Qwen2-7B-Instruct bursts of 1-1000 requests, 1024 in / 1024 out"},
    "S5": {"repository": "gpustack/gpustack", "path": "docs/performance-lab/{qwen3-14b,qwen3-32b,gpt-oss-20b}/",
           "commit": "10e9444a07c73556f2ef0d10d2b2766bbf54c9c0, 7ae332aaf05783e657560ef927c527b156e2536d, "
                     "7b50d5067ddbdeba0739e7f72d6f40e53d3b9a04", "licence": "Apache-2.0",
           "engine": "vLLM 0.11.0 (V1)", "gpu": "1x H100 SXM, 1x A100 80GB",
           "notes": "serving band: baseline bursts of 100-1000 requests, 128-32000 in / 4-200 out"},
}


class PointError(ValueError):
    """A row of the points file that cannot be read; names the row and the column."""


def _cell(row: dict, column: str, kind):
    text = (row.get(column) or "").strip()
    if not text:
        return None
    try:
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        return kind(text)
    except ValueError:
        raise PointError(f"{row.get('point_id', '?')}: {column} = {text!r} is not {kind.__name__}") from None


def parse_points(lines) -> list[dict]:
    """The rows of a points CSV (an iterable of lines), typed: empty cells are None (the
    engine's default, or a figure the source does not give)."""
    points = []
    for row in csv.DictReader(lines):
        point = {k: (v.strip() if isinstance(v, str) else v) for k, v in row.items()}
        for column in INT_COLUMNS:
            point[column] = _cell(row, column, int)
        for column in FLOAT_COLUMNS:
            point[column] = _cell(row, column, float)
        for column in BOOL_COLUMNS:
            point[column] = _cell(row, column, bool)
        if point["arrival"] not in ARRIVALS:
            raise PointError(f"{point['point_id']}: arrival = {point['arrival']!r}, expected one of {ARRIVALS}")
        if point["arrival"] == "poisson" and not point["rate_per_s"]:
            raise PointError(f"{point['point_id']}: a poisson point needs rate_per_s")
        for column in ("input_tokens", "output_tokens", "num_prompts"):
            if not point[column] or point[column] < 1:
                raise PointError(f"{point['point_id']}: {column} must be a positive integer")
        points.append(point)
    return points


def relative_error(predicted: float | None, measured: float | None) -> float:
    """Signed (predicted - measured) / measured; NaN when either is missing."""
    if predicted is None or measured is None or not math.isfinite(predicted) or not measured:
        return math.nan
    return (predicted - measured) / measured


def covers(low: float | None, high: float | None, measured: float | None) -> bool | None:
    """Whether [low, high] holds the measured value: None when nothing was measured,
    False when there is no band (NaN edges: an uncalibrated clock states no error)."""
    if measured is None:
        return None
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return False
    return low <= measured <= high


def p99_ratios(results: list[dict]) -> list[tuple[str, str, float]]:
    """(series, band kind, measured p99 / replayed p99) at every calibrated point: the band is
    a calibrated clock's claim, an uncalibrated one makes none."""
    out = []
    for r in results:
        if not _calibrated(r):
            continue
        for figure, kind in BAND_KINDS.items():
            measured, replayed = r.get(f"measured_{figure}_p99_ms"), r.get(f"kvtwin_{figure}_p99_ms")
            if measured and replayed and math.isfinite(measured) and math.isfinite(replayed) and replayed > 0:
                out.append((r["series"], kind, measured / replayed))
    return out


def serving_band(ratios: list[tuple[str, str, float]], *, without: str | None = None) -> dict[str, tuple[float, float]]:
    """Per kind, the ``BAND_QUANTILES`` of the ratios (leaving out series ``without``), widened
    to hold 1 (the replay's own figure); ``e2e`` spans both kinds (an E2E is a TTFT and the
    TPOTs after it)."""
    band = {}
    for kind in sorted({k for _, k, _ in ratios}):
        values = np.array([v for series, k, v in ratios if k == kind and series != without])
        if len(values):
            low, high = np.quantile(values, BAND_QUANTILES)
            band[kind] = (min(float(low), 1.0), max(float(high), 1.0))
    if band:
        band["e2e"] = (min(low for low, _ in band.values()), max(high for _, high in band.values()))
    return band


def held_out_covered(result: dict, bands_without: dict[str, dict[str, tuple[float, float]]]) -> dict:
    """``covered_<figure>`` of one point: whether the band of the other series holds its
    measured p99. None when nothing was measured or the GPU is uncalibrated (it claims no
    band); False when the other series give no band for the figure."""
    out = {}
    for figure, kind in BAND_KINDS.items():
        measured, replayed = result.get(f"measured_{figure}_p99_ms"), result.get(f"kvtwin_{figure}_p99_ms")
        ratios = bands_without.get(result["series"], {}).get(kind)
        if measured is None or not _calibrated(result):
            out[f"covered_{figure}"] = None
        elif ratios is None or replayed is None:
            out[f"covered_{figure}"] = False
        else:
            low, high = replayed * ratios[0], replayed * ratios[1]
            out[f"band_{figure}_low_ms"], out[f"band_{figure}_high_ms"] = low, high
            out[f"covered_{figure}"] = covers(low, high, measured)
    return out


def _calibrated(result: dict) -> bool:
    return result.get("calibration") not in (None, "uncalibrated")


def median_abs(errors) -> float:
    finite = [abs(e) for e in errors if e is not None and math.isfinite(e)]
    return statistics.median(finite) if finite else math.nan


def verdicts(results: list[dict]) -> list[dict]:
    """The issue's targets against per-point results: median |error| of TTFT, TPOT and E2E
    (the central figures, mean and p50, pooled), every saturated point's throughput within
    the target, and the share of measured p99s the band holds."""
    out = []
    for figure, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E")):
        errors = [r[f"err_{figure}_{stat}"] for r in results for stat in ("mean", "p50")
                  if f"err_{figure}_{stat}" in r]
        count = sum(1 for e in errors if math.isfinite(e))
        value = median_abs(errors)
        out.append({"target": f"{label} median |error| <= {MEDIAN_ERROR_TARGET:.0%}", "value": value, "points": count,
                    "holds": count > 0 and value <= MEDIAN_ERROR_TARGET})
    saturated = [r["err_req_s"] for r in results if r.get("source_saturated") and math.isfinite(r["err_req_s"])]
    worst = max((abs(e) for e in saturated), default=math.nan)
    within = sum(1 for e in saturated if abs(e) <= SATURATION_TARGET)
    out.append({"target": f"saturation req/s within {SATURATION_TARGET:.0%} at every saturated point",
                "value": worst, "points": len(saturated), "within": within,
                "holds": bool(saturated) and worst <= SATURATION_TARGET})
    judged = [r[f"covered_{f}"] for r in results for f in BANDS if r.get(f"covered_{f}") is not None]
    share = sum(judged) / len(judged) if judged else math.nan
    out.append({"target": f"band (held out) holds the measured p99 in >= {COVERAGE_TARGET:.0%}", "value": share,
                "points": len(judged), "holds": bool(judged) and share >= COVERAGE_TARGET})
    return out


def by_source(results: list[dict]) -> list[dict]:
    """Per source and overall: median |error| per figure, saturation error, band coverage."""
    groups = sorted({r["source"] for r in results}) + ["all"]
    rows = []
    for source in groups:
        chosen = [r for r in results if source == "all" or r["source"] == source]
        row = {"source": source, "points": len(chosen)}
        for key in ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p99", "e2e_mean", "req_s"):
            row[key] = median_abs(r.get(f"err_{key}") for r in chosen)
        sat = [abs(r["err_req_s"]) for r in chosen if r.get("source_saturated") and math.isfinite(r["err_req_s"])]
        row["saturation"] = statistics.median(sat) if sat else math.nan
        judged = [r[f"covered_{f}"] for r in chosen for f in BANDS if r.get(f"covered_{f}") is not None]
        row["coverage"] = sum(judged) / len(judged) if judged else math.nan
        rows.append(row)
    return rows


# --- replay (needs the simulator) -------------------------------------------------------------


def scenario_data(point: dict, hardware: dict) -> dict:
    """The scenario mapping of one point: model, GPU and the engine settings the source set."""
    model = point["model"]
    if model.startswith("hf:"):
        model_table = {"hf_config": str(MODELS_DIR / f"{model[3:]}.json"), "name": model[3:]}
    else:
        model_table = {"preset": model}
    gpu = point["gpu"]
    gpu_table = dict(hardware[gpu[7:]]) if gpu.startswith("inline:") else {"gpu": gpu}
    engine = {"tensor_parallel_size": point["tp"]}
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
                "async_scheduling", "gpu_memory_utilization"):
        if point[key] is not None:
            engine[key] = point[key]
    return {"model": model_table, "hardware": gpu_table, "engine": engine}


def _with_kv_tokens(data: dict, point: dict) -> dict:
    """A source that logged its KV cache size in tokens gets exactly that many: the bytes are
    the tokens times the planned bytes per token."""
    from kvtwin.sim.scenario.resolve import resolve_scenario

    if point["kv_cache_tokens"] is None:
        return data
    planned = resolve_scenario(POINTS_CSV, data=data).plan()
    block_tokens = planned.to_json()["block_size"]
    blocks = -(-point["kv_cache_tokens"] // block_tokens)
    engine = dict(data["engine"], kv_cache_memory_bytes=blocks * planned.bytes_per_block)
    engine.pop("gpu_memory_utilization", None)
    return dict(data, engine=engine)


def workload(point: dict, cap: int):
    """The point's requests: Poisson through the synthetic spec, a burst all at time 0."""
    from kvtwin.traces import schema as col

    if point["arrival"] == "burst":
        n = point["num_prompts"]
        return col.build_table({col.REQUEST_ID: [f"{point['point_id']}-{i}" for i in range(n)],
                                col.ARRIVAL_TIME_S: [0.0] * n,
                                col.PROMPT_TOKENS: [point["input_tokens"]] * n,
                                col.OUTPUT_TOKENS: [point["output_tokens"]] * n},
                               col.TraceMeta(source_format="bench_fidelity_serving"))
    return {"kind": "requests", "seed": point["seed"] or 0, "num_requests": min(point["num_prompts"], cap),
            "arrival": {"process": "poisson", "rate_per_s": point["rate_per_s"]},
            "prompt_tokens": point["input_tokens"], "output_tokens": point["output_tokens"]}


def replay_point(point: dict, hardware: dict, cap: int) -> dict:
    from kvtwin.sim.calibration.band import with_band
    from kvtwin.sim.replay.run import run_replay
    from kvtwin.sim.scenario.resolve import resolve_scenario

    data = _with_kv_tokens(scenario_data(point, hardware), point)
    requests = workload(point, cap)
    if isinstance(requests, dict):
        data = dict(data, workload=requests)
    resolved = resolve_scenario(POINTS_CSV, data=data)
    planned = resolved.plan()
    planned.require_fits()
    trace = requests if not isinstance(requests, dict) else resolved.require_workload().load()
    result = run_replay(planned, trace, deployment=resolved.deployment, efficiency=resolved.efficiency,
                        slo=resolved.slo)
    summary = with_band(result.summary, resolved.calibration).to_pylist()[0]
    client = "ttft_client_s" in result.requests.column_names
    summary["latency_side"] = "client" if client else "server"
    summary["replayed_requests"] = trace.num_rows
    summary["kv_cache_tokens_planned"] = planned.kv_cache_tokens
    return summary


def compare(point: dict, summary: dict) -> dict:
    """One result row: the point's measurements, kvtwin's figures, errors and band verdicts."""
    side = "_client" if summary["latency_side"] == "client" else ""
    row = {k: point[k] for k in ("point_id", "source", "series", "gpu", "model", "arrival", "rate_per_s",
                                 "num_prompts", "source_saturated")}
    row.update(latency_side=summary["latency_side"], calibration=summary["calibration"],
               replayed_requests=summary["replayed_requests"], kv_cache_tokens=summary["kv_cache_tokens_planned"])
    for (figure, stat), column in LATENCY_FIGURES.items():
        measured = point[f"{figure}_{stat}_ms"]
        predicted = summary.get(column.format(side=side))
        row[f"measured_{figure}_{stat}_ms"] = measured
        row[f"kvtwin_{figure}_{stat}_ms"] = predicted
        row[f"err_{figure}_{stat}"] = relative_error(predicted, measured)
    for name, column in (("req_s", "request_throughput"), ("out_tok_s", "output_throughput")):
        row[f"measured_{name}"] = point[name]
        row[f"kvtwin_{name}"] = summary[column]
        row[f"err_{name}"] = relative_error(summary[column], point[name])
    for figure in BANDS:
        # Filled in by ``judge_bands`` once every point has run: the band is held out by series.
        row[f"band_{figure}_low_ms"] = row[f"band_{figure}_high_ms"] = math.nan
        row[f"covered_{figure}"] = None
    row["kvtwin_saturated"] = summary["saturated"]
    return row


def judge_bands(results: list[dict]) -> dict[str, tuple[float, float]]:
    """Each point's ``covered_*`` against the band of the other series, in place; returns the
    band of every calibrated point (what ``--write-band`` writes)."""
    ratios = p99_ratios(results)
    without = {series: serving_band(ratios, without=series) for series in {r["series"] for r in results}}
    for r in results:
        r.update(held_out_covered(r, without))
    return serving_band(ratios)


def band_file_text(band: dict[str, tuple[float, float]], results: list[dict]) -> str:
    """``serving_band.toml``: the band, what it was measured on, and its held-out coverage."""
    judged = [r[f"covered_{f}"] for r in results for f in BANDS if r.get(f"covered_{f}") is not None]
    calibrated = sorted({r["series"] for r in results if _calibrated(r)})
    lines = [
        "# How far real vLLM servers' p99s lay from kvtwin's replays of the same load: the ratio",
        "# measured p99 / replayed p99, its 5th and 95th percentiles per figure, over the calibrated points",
        "# of bench/data/fidelity_serving.csv (sources: bench/data/FIDELITY_SOURCES.md). Written by",
        "# `python bench/bench_fidelity_serving.py --write-band`; scripts/calibration/fit_bundled.py puts",
        "# it into every bundled calibration as [band] (docs/capacity.md#the-band). One band for every",
        "# GPU: the public runs are too few to give each its own.",
        f"# Series ({len(calibrated)}): {', '.join(calibrated)}.",
        f"# Held out (each series judged on the band of the others): {sum(judged)} of {len(judged)} measured",
        f"# p99s inside ({sum(judged) / len(judged):.0%})." if judged else "# Held out: nothing judged.",
        "",
    ]
    lines += [f"{kind} = [{low:.4g}, {high:.4g}]" for kind, (low, high) in band.items()]
    sources = sorted({r.get("source") for r in results if _calibrated(r)} & set(BAND_SOURCES))
    for source in sources:
        lines += ["", "[[source]]"] + [f"{key} = {json.dumps(value)}" for key, value in BAND_SOURCES[source].items()]
    return "\n".join(lines) + "\n"


def _pct(value: float) -> str:
    return "    -" if value is None or not math.isfinite(value) else f"{value:+6.1%}"


def _abs_pct(value: float) -> str:
    return "    -" if value is None or not math.isfinite(value) else f"{value:5.1%}"


def print_report(results: list[dict]) -> None:
    print(f"{'point':<28} {'req/s':>7} {'ttft mean':>9} {'ttft p50':>8} {'ttft p99':>8} {'tpot mean':>9} "
          f"{'tpot p50':>8} {'tpot p99':>8} {'e2e mean':>8} {'band p99':>9}  sat")
    for r in results:
        band = "".join({True: "y", False: "n", None: "."}[r[f"covered_{f}"]] for f in BANDS)
        print(f"{r['point_id']:<28} {_pct(r['err_req_s']):>7} {_pct(r['err_ttft_mean']):>9} {_pct(r['err_ttft_p50']):>8} "
              f"{_pct(r['err_ttft_p99']):>8} {_pct(r['err_tpot_mean']):>9} {_pct(r['err_tpot_p50']):>8} "
              f"{_pct(r['err_tpot_p99']):>8} {_pct(r['err_e2e_mean']):>8} {band:>9}  {'*' if r['source_saturated'] else ''}")
    print("\n(signed errors, kvtwin vs measured; band: ttft/tpot/itl p99 inside the band of the other series "
          "y/n, '.' not measured or no band (uncalibrated); sat *: past the source's knee)\n")
    print(f"{'source':<6} {'points':>6} {'ttft mean':>9} {'ttft p50':>8} {'ttft p99':>8} {'tpot mean':>9} {'tpot p50':>8} "
          f"{'tpot p99':>8} {'e2e mean':>8} {'req/s':>6} {'sat':>6} {'band':>6}")
    for s in by_source(results):
        print(f"{s['source']:<6} {s['points']:>6} {_abs_pct(s['ttft_mean']):>9} {_abs_pct(s['ttft_p50']):>8} "
              f"{_abs_pct(s['ttft_p99']):>8} {_abs_pct(s['tpot_mean']):>9} {_abs_pct(s['tpot_p50']):>8} "
              f"{_abs_pct(s['tpot_p99']):>8} {_abs_pct(s['e2e_mean']):>8} {_abs_pct(s['req_s']):>6} "
              f"{_abs_pct(s['saturation']):>6} {_abs_pct(s['coverage']):>6}")
    print("(median |error| per figure; sat: median |req/s error| at saturated points; band: share of p99s held)\n")
    sides = sorted({r["latency_side"] for r in results})
    print(f"latencies compared: {', '.join(sides)}-side (client-side where a calibration sets client_overhead_s)")
    for series in sorted({r["series"] for r in results}):
        sat = [r for r in results if r["series"] == series and r["source_saturated"]]
        if sat:
            peak = max(sat, key=lambda r: r["measured_req_s"])
            print(f"saturation {series}: measured {peak['measured_req_s']:.2f} req/s, kvtwin {peak['kvtwin_req_s']:.2f} "
                  f"({_pct(peak['err_req_s']).strip()}) at {peak['point_id']}")
    print()
    for v in verdicts(results):
        value = "-" if not math.isfinite(v["value"]) else f"{v['value']:.1%}"
        within = f" ({v['within']} within)" if "within" in v else ""
        print(f"target {v['target']:<58} {value:>7} over {v['points']:>3}  {'PASS' if v['holds'] else 'FAIL'}{within}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=Path, default=POINTS_CSV)
    parser.add_argument("--cap", type=int, default=1000, help="most requests replayed per Poisson point")
    parser.add_argument("--only", default=None, help="replay only these points (comma-separated ids, or a source: S4)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "fidelity_serving.parquet")
    parser.add_argument("--write-band", action="store_true",
                        help=f"write the band of every calibrated point to {BAND_FILE.relative_to(REPO)}")
    args = parser.parse_args(argv)
    with args.points.open() as f:
        points = parse_points(f)
    if args.only:
        chosen = set(args.only.split(","))
        points = [p for p in points if p["point_id"] in chosen or p["source"] in chosen]
        if not points:
            parser.error(f"--only {args.only}: no such point id or source in {args.points}")
    hardware = tomllib.loads(HARDWARE_TOML.read_text())
    results = []
    started = time.perf_counter()
    for i, point in enumerate(points, 1):
        t = time.perf_counter()
        results.append(compare(point, replay_point(point, hardware, args.cap)))
        print(f"[{i}/{len(points)}] {point['point_id']} {time.perf_counter() - t:.1f} s", file=sys.stderr)
    print(f"replayed {len(points)} points in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    band = judge_bands(results)
    print_report(results)
    print("band (measured / replayed p99, 5th-95th percentile over the calibrated points): "
          + ", ".join(f"{kind} x{low:.2f}-x{high:.2f}" for kind, (low, high) in band.items()))
    if args.write_band:
        if args.only:
            parser.error("--write-band measures the band on every point: not with --only")
        BAND_FILE.write_text(band_file_text(band, results))
        print(f"wrote the band to {BAND_FILE.relative_to(REPO)}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(results), args.out)
    print(f"wrote {len(results)} points to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
