"""Fit the bundled calibrations from the public kernel measurements, and write them.

    python scripts/calibration/fit_bundled.py            # writes sim/replay/data/calibration/*.toml
    python scripts/calibration/fit_bundled.py --check    # fits and prints, writes nothing

Reads ``sim/replay/data/measurements`` (each CSV row names its source in SOURCES.toml) and,
per GPU preset, fits on aiconfigurator's vLLM kernel timings (all measured in CUDA graphs,
as vLLM runs them):

* GEMMs -> ``matmul_flops_fraction``, ``matmul_half_tokens``, ``hbm_bandwidth_fraction``
  and the GEMM launch floor (``kernel_fit.fit_gemm``; held out: a third of the (n, k)
  shapes at a time);
* context (prefill) attention -> ``attention_flops_fraction``,
  ``attention_half_query_tokens`` and the attention floor (held out: a third of the rows
  at a time);
* generation (decode) attention, with its KV read at the GEMMs' HBM fraction ->
  ``decode_attention_s_per_head`` (held out likewise);
* all-reduce -> one curve per TP degree, the fastest implementation at each size (held
  out: each inner point, predicted from its neighbours);
* ``layer_fixed_s`` = every kernel floor of a layer (``kernel_fit.layer_fixed_s``);
  ``step_gpu_fixed_s`` = three more (embedding, LM head, sampler).

Vidur's per-op profiles (``layer_ops_*.csv``) are not fitted on: ``bench/bench_fidelity.py``
checks the fitted steps against them.

The ``[error]`` of each file is the p90 of the held-out relative errors: ``prefill_step``
over GEMMs of 512+ rows and context attention, ``decode_step`` over GEMMs of 256 rows or
fewer and generation attention.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.replay.calibration import write_calibration
from kvtwin.sim.replay.cost_model import AllReduceCurve, Efficiency
from kvtwin.sim.replay.kernel_fit import (allreduce_points, fit_attention, fit_decode_attention, fit_gemm, interpolate_s, layer_fixed_s,
                                          relative_errors)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "sim" / "replay" / "data"
MEASUREMENTS = DATA / "measurements"
OUT = DATA / "calibration"
# Measurement folder GPU -> the presets it calibrates.
PRESETS = {"h100": ("h100",), "h200": ("h200",), "b200": ("b200",), "a100": ("a100-80gb", "a100-40gb"),
           "l40s": ("l40s",)}
STEP_KERNELS = 3  # outside the layers: embedding, LM head, sampler


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return [{k: (float(v) if _is_number(v) else v) for k, v in row.items()} for row in csv.DictReader(f)]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def fit_gemms(gpu: str, peak_flops: float, peak_bytes: float):
    data = rows(MEASUREMENTS / f"gemm_{gpu}.csv")
    m, n, k, t = (np.array([r[c] for r in data]) for c in ("m", "n", "k", "latency_s"))
    shapes = {shape: i for i, shape in enumerate(sorted(set(zip(n, k))))}
    folds = np.array([shapes[s] % 3 for s in zip(n, k)])

    def fit(mask):
        return fit_gemm(m[mask], n[mask], k[mask], t[mask], flops_per_s=peak_flops, bytes_per_s=peak_bytes)

    held_errors = np.zeros(len(t))
    for fold in range(3):
        held = folds == fold
        model = fit(~held)
        held_errors[held] = relative_errors(model.predict_s(m[held], n[held], k[held], peak_flops, peak_bytes),
                                            t[held])
    whole = fit(np.ones(len(t), dtype=bool))
    return whole, {"prefill": held_errors[m >= 512], "decode": held_errors[m <= 256], "all": held_errors}, len(t)


def attention_terms(data: list[dict]):
    batch, q, past, heads, kv_heads, hd, t = (np.array([r[c] for r in data]) for c in
                                              ("batch", "q_len", "past_len", "num_heads", "num_kv_heads",
                                               "head_dim", "latency_s"))
    attended = batch * (q * past + q * (q + 1) / 2)
    flops = 4.0 * heads * hd * attended  # QK^T and PV, as the cost model counts them
    kv_bytes = batch * (past + q) * 2 * kv_heads * hd * 2  # K and V, 16-bit
    return flops, kv_bytes, q, t


def fit_attention_rows(gpu: str, peak_flops: float, peak_bytes: float, hbm_fraction: float):
    data = rows(MEASUREMENTS / f"attention_{gpu}.csv")
    context = [r for r in data if r["phase"] == "context"]
    generation = [r for r in data if r["phase"] == "generation"]
    flops, kv_bytes, q, t = attention_terms(context)
    achieved = peak_bytes * hbm_fraction

    def fit(mask):
        return fit_attention(flops[mask], kv_bytes[mask], q[mask], t[mask], flops_per_s=peak_flops,
                             bytes_per_s=achieved)

    folds = np.arange(len(t)) % 3
    errors = []
    for fold in range(3):
        held = folds == fold
        errors.append(relative_errors(fit(~held).predict_s(flops[held], kv_bytes[held], q[held], peak_flops,
                                                           achieved), t[held]))
    whole = fit(np.ones(len(t), dtype=bool))
    # Decode attention: its floor, the KV read at the GEMMs' HBM fraction, and a time per
    # (sequence, query head); held out a third of the rows at a time.
    _, g_bytes, _, g_t = attention_terms(generation)
    g_work = np.array([r["batch"] * r["num_heads"] for r in generation])
    g_folds = np.arange(len(g_t)) % 3
    g_errors = []
    for fold in range(3):
        held = g_folds == fold
        model = fit_decode_attention(g_bytes[~held], g_work[~held], g_t[~held], bytes_per_s=achieved)
        g_errors.append(relative_errors(model.predict_s(g_bytes[held], g_work[held], achieved), g_t[held]))
    decode = fit_decode_attention(g_bytes, g_work, g_t, bytes_per_s=achieved)
    return whole, np.concatenate(errors), decode, np.concatenate(g_errors)


def fit_allreduce(gpu: str):
    # aiconfigurator's (vLLM's all-reduce in CUDA graphs, and nccl-tests); Vidur's are
    # eager NCCL calls at other sizes, a slower path than vLLM takes.
    data = [r for r in rows(MEASUREMENTS / f"allreduce_{gpu}.csv") if r["source"].startswith("aic-")]
    curves, errors = [], []
    by_tp = defaultdict(list)
    for r in data:
        by_tp[int(r["tp"])].append((r["message_bytes"], r["latency_s"]))
    for tp in sorted(by_tp):
        sizes, times = allreduce_points(*zip(*by_tp[tp]))
        if len(sizes) < 3:
            continue
        curves.append(AllReduceCurve(tp, sizes, times))
        s, t = np.array(sizes), np.array(times)
        for i in range(1, len(s) - 1):  # each inner point from the others
            keep = np.arange(len(s)) != i
            errors.append(float(relative_errors(interpolate_s(s[keep], t[keep], s[i:i + 1]), t[i:i + 1])[0]))
    return tuple(curves), np.array(errors)


def sources_for(gpu: str) -> list[dict]:
    table = tomllib.loads((MEASUREMENTS / "SOURCES.toml").read_text())
    keys = set()
    for name in (f"gemm_{gpu}.csv", f"attention_{gpu}.csv", f"allreduce_{gpu}.csv"):
        keys |= {r["source"] for r in rows(MEASUREMENTS / name) if r["source"].startswith("aic-")}
    wanted = ("repository", "path", "commit", "licence", "engine", "gpu", "notes")
    return [{k: str(table[key][k]) for k in wanted if k in table[key]} for key in sorted(keys)]


def p90(values: np.ndarray) -> float:
    return float(np.percentile(values, 90)) if len(values) else math.nan


def calibrate(gpu: str, write: bool) -> list[str]:
    preset = get_gpu(PRESETS[gpu][0])
    peak_flops, peak_bytes = preset.bf16_flops, preset.hbm_bandwidth_bytes_per_s
    gemm, gemm_errors, gemm_count = fit_gemms(gpu, peak_flops, peak_bytes)
    attention, context_errors, decode_attention, generation_errors = fit_attention_rows(
        gpu, peak_flops, peak_bytes, gemm.hbm_bandwidth_fraction)
    curves, allreduce_errors = fit_allreduce(gpu)
    fixed_s = layer_fixed_s(gemm.launch_s, attention.launch_s)
    efficiency = Efficiency(matmul_flops_fraction=round(gemm.matmul_flops_fraction, 4),
                            matmul_half_tokens=round(gemm.matmul_half_tokens, 1),
                            attention_flops_fraction=round(attention.attention_flops_fraction, 4),
                            attention_half_query_tokens=round(attention.attention_half_query_tokens, 1),
                            hbm_bandwidth_fraction=round(gemm.hbm_bandwidth_fraction, 4),
                            decode_attention_s_per_head=float(f"{decode_attention.seconds_per_head:.4g}"),
                            layer_fixed_s=round(fixed_s, 9), step_gpu_fixed_s=round(STEP_KERNELS * gemm.launch_s, 9),
                            allreduce=curves)
    prefill = np.concatenate([gemm_errors["prefill"], context_errors])
    decode = np.concatenate([gemm_errors["decode"], generation_errors])
    errors = {"prefill_step": round(p90(prefill), 4), "decode_step": round(p90(decode), 4)}
    lines = [
        f"{gpu}: GEMM f={gemm.matmul_flops_fraction:.3f} half={gemm.matmul_half_tokens:.0f} tokens "
        f"hbm={gemm.hbm_bandwidth_fraction:.3f} floor={gemm.launch_s * 1e6:.2f} us ({gemm_count} GEMMs; held-out "
        f"median {np.median(gemm_errors['all']):.1%}, p90 {p90(gemm_errors['all']):.1%})",
        f"{gpu}: prefill attention fraction {attention.attention_flops_fraction:.3f}, half at "
        f"{attention.attention_half_query_tokens:.0f} query tokens, floor {attention.launch_s * 1e6:.2f} us "
        f"(held-out median {np.median(context_errors):.1%}, p90 {p90(context_errors):.1%})",
        f"{gpu}: decode attention {decode_attention.seconds_per_head * 1e9:.2f} ns per sequence and query head, floor "
        f"{decode_attention.launch_s * 1e6:.2f} us (held-out median {np.median(generation_errors):.1%}, "
        f"p90 {p90(generation_errors):.1%} over {len(generation_errors)} kernels)",
        f"{gpu}: all-reduce curves for TP {', '.join(str(c.tensor_parallel_size) for c in curves)} "
        f"(leave-one-out median {np.median(allreduce_errors):.1%}, p90 {p90(allreduce_errors):.1%})",
        f"{gpu}: layer_fixed_s {fixed_s * 1e6:.1f} us (9 kernel floors at {gemm.launch_s * 1e6:.2f} us and the "
        f"attention's), step_gpu_fixed_s {STEP_KERNELS * gemm.launch_s * 1e6:.1f} us",
        f"{gpu}: held-out p90: prefill_step {errors['prefill_step']:.1%} ({len(prefill)} kernels), "
        f"decode_step {errors['decode_step']:.1%} ({len(decode)} kernels)",
    ]
    if write:
        for name in PRESETS[gpu]:
            write_calibration(OUT / f"{name}.toml", efficiency, errors=errors, sources=sources_for(gpu),
                              label=f"bundled {name} (public vLLM kernel timings; "
                                    f"scripts/calibration/fit_bundled.py)",
                              comment_lines=["Written by scripts/calibration/fit_bundled.py; do not edit by hand.",
                                             *lines, "step_overhead_s and per_request_overhead_s (CPU) are the "
                                             "defaults: kernel timings do not measure them."])
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fit and print; write nothing")
    parser.add_argument("gpus", nargs="*", default=list(PRESETS), help="measurement GPUs (default: all)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for gpu in args.gpus:
        if gpu not in PRESETS:
            print(f"fit_bundled: error: unknown GPU {gpu!r}; expected one of {', '.join(PRESETS)}", file=sys.stderr)
            return 2
        for line in calibrate(gpu, write=not args.check):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
