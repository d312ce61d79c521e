"""How close the clock is to real GPUs, on public measurements no fit has seen.

    python bench/bench_fidelity.py                     # the table, and bench/out/fidelity.parquet
    python bench/bench_fidelity.py --out PATH

Two kinds of points, each with its source (one line each in
``sim/replay/data/measurements/SOURCES.toml`` and ``bench/data/FIDELITY_SOURCES.md``):

* **Steps, from kernels.** aiconfigurator's vLLM kernel timings, split in three folds:
  the bundled calibration's factors are refitted on two (``scripts/calibration/fit_bundled.py``'s
  fits) and predict the third, in turn. "prefill step" is GEMMs of 512+ rows and prefill
  attention; "decode step" is GEMMs of 256 rows or fewer and decode attention.
* **Serving, from `vllm bench serve` runs.** Lambda Labs' runs of Llama-3-8B-Instruct on
  one H100 SXM and one A100 80GB (10 ShareGPT prompts at once, vLLM 0.6.x with multi-step
  scheduling), request by request (``bench/data/fidelity_requests.csv``): kvtwin replays
  the same prompt and output lengths and compares TTFT, TPOT and E2E per request.

"before" is the default factors (``Efficiency()``, what every replay ran on before the
bundled calibrations), "after" the bundled calibration of the GPU. Errors are absolute
relative errors; the table gives their median and worst per category.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts" / "calibration"))

import fit_bundled  # noqa: E402  (the fits the bundled files come from)

from kvtwin.sim.planner.engine_config import EngineConfig  # noqa: E402
from kvtwin.sim.planner.hardware import get_gpu  # noqa: E402
from kvtwin.sim.planner.models import get_model  # noqa: E402
from kvtwin.sim.planner.plan import plan  # noqa: E402
from kvtwin.sim.calibration.file import bundled_calibration  # noqa: E402
from kvtwin.sim.calibration.efficiency import Efficiency  # noqa: E402
from kvtwin.sim.calibration.fit.kernels import gemm_model_s, relative_errors  # noqa: E402
from kvtwin.sim.replay.run import run_replay  # noqa: E402
from kvtwin.traces import schema as col  # noqa: E402

REQUESTS = REPO / "bench" / "data" / "fidelity_requests.csv"
SERVING_RUNS = {"lambda-h100-llama3-8b-10": ("h100", "llama-3.1-8b"),
                "lambda-a100-llama3-8b-10": ("a100-80gb", "llama-3.1-8b")}
CATEGORIES = ("prefill step", "decode step", "TTFT", "TPOT", "E2E")


def kernel_points(gpu: str) -> list[dict]:
    """Held-out kernel predictions of one measurement GPU (``fit_bundled``'s folds), with
    what the default factors predict for the same kernels ("before")."""
    preset = get_gpu(fit_bundled.PRESETS[gpu][0])
    peak_flops, peak_bytes = preset.bf16_flops, preset.hbm_bandwidth_bytes_per_s
    default = Efficiency()
    gemm, gemm_kernels = fit_bundled.fit_gemms(gpu, peak_flops, peak_bytes)
    _, prefill_kernels, _, decode_kernels = fit_bundled.fit_attention_rows(gpu, peak_flops, peak_bytes,
                                                                           gemm.hbm_bandwidth_fraction)
    gemm_rows = fit_bundled.rows(fit_bundled.MEASUREMENTS / f"gemm_{gpu}.csv")
    m, n, k = (np.array([r[c] for r in gemm_rows]) for c in ("m", "n", "k"))
    attention = fit_bundled.rows(fit_bundled.MEASUREMENTS / f"attention_{gpu}.csv")
    before = {"gemm": gemm_model_s(m, n, k, peak_flops, peak_bytes, default.matmul_flops_fraction, 0.0,
                                   default.hbm_bandwidth_fraction)}
    for phase in ("context", "generation"):
        flops, kv, _, _ = fit_bundled.attention_terms([r for r in attention if r["phase"] == phase])
        before[phase] = np.maximum(flops / (peak_flops * default.attention_flops_fraction),
                                   kv / (peak_bytes * default.hbm_bandwidth_fraction))
    out = []
    for kernels, default_s in ((gemm_kernels, before["gemm"]), (prefill_kernels, before["context"]),
                               (decode_kernels, before["generation"])):
        for i, category in enumerate(kernels.categories):
            if category:
                out.append({"category": category, "gpu": gpu, "source": kernels.sources[i], "point": kernels.names[i],
                            "measured_s": float(kernels.measured_s[i]), "before_s": float(default_s[i]),
                            "after_s": float(kernels.held_out_s[i])})
    return out


def serving_points() -> list[dict]:
    with REQUESTS.open() as f:
        requests = list(csv.DictReader(f))
    out = []
    for run, (gpu_name, model_name) in SERVING_RUNS.items():
        rows = [r for r in requests if r["run"] == run]
        trace = col.build_table({col.REQUEST_ID: [f"{run}-{r['index']}" for r in rows],
                                 col.ARRIVAL_TIME_S: [0.0] * len(rows),  # request rate inf: all at once
                                 col.PROMPT_TOKENS: [int(r["input_len"]) for r in rows],
                                 col.OUTPUT_TOKENS: [int(r["output_len"]) for r in rows]},
                                col.TraceMeta(source_format="bench_fidelity"))
        planned = plan(get_model(model_name), get_gpu(gpu_name), EngineConfig(max_model_len=8192))
        predicted = {}
        for label, efficiency in (("before", Efficiency()),
                                  ("after", bundled_calibration(gpu_name, model_name).efficiency)):
            table = run_replay(planned, trace, efficiency=efficiency).requests
            predicted[label] = {rid: row for rid, row in zip(table.column("request_id").to_pylist(),
                                                             table.to_pylist())}
        for r in rows:
            rid = f"{run}-{r['index']}"
            ttft, e2e, generated = float(r["ttft_s"]), float(r["e2e_s"]), int(r["output_len"])
            measured = {"TTFT": ttft, "E2E": e2e,
                        "TPOT": (e2e - ttft) / (generated - 1) if generated > 1 else math.nan}
            # `vllm bench serve` measured them as a client: the replay's client-side columns
            # (docs/capacity.md#client-side-latency).
            for category, column in (("TTFT", "ttft_client_s"), ("TPOT", "tpot_s"), ("E2E", "e2el_client_s")):
                if math.isnan(measured[category]):
                    continue
                out.append({"category": category, "gpu": gpu_name, "source": run, "point": f"request {r['index']}",
                            "measured_s": measured[category], "before_s": predicted["before"][rid][column],
                            "after_s": predicted["after"][rid][column]})
    return out


def table(points: list[dict]) -> list[dict]:
    rows = []
    for category in CATEGORIES:
        chosen = [p for p in points if p["category"] == category]
        if not chosen:
            continue
        measured = np.array([p["measured_s"] for p in chosen])
        row = {"category": category, "points": len(chosen)}
        for label in ("before", "after"):
            errors = relative_errors(np.array([p[f"{label}_s"] for p in chosen]), measured)
            signed = (np.array([p[f"{label}_s"] for p in chosen]) - measured) / measured
            row[f"{label}_median"] = float(np.median(errors))
            row[f"{label}_worst"] = float(errors.max())
            row[f"{label}_bias"] = float(np.median(signed))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "fidelity.parquet")
    args = parser.parse_args(argv)
    points = [p for gpu in fit_bundled.PRESETS for p in kernel_points(gpu)] + serving_points()
    rows = table(points)
    print(f"{'category':<13} {'points':>6}  {'before: median':>15} {'worst':>8} {'bias':>7}  "
          f"{'after: median':>14} {'worst':>8} {'bias':>7}")
    for r in rows:
        print(f"{r['category']:<13} {r['points']:>6}  {r['before_median']:>15.1%} {r['before_worst']:>8.0%} "
              f"{r['before_bias']:>+7.1%}  {r['after_median']:>14.1%} {r['after_worst']:>8.0%} "
              f"{r['after_bias']:>+7.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(points), args.out)
    print(f"wrote {len(points)} points to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
