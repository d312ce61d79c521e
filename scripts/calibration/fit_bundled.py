"""Fit the bundled calibrations from the public kernel measurements, and write them.

    python scripts/calibration/fit_bundled.py            # writes sim/replay/data/calibration/*.toml
    python scripts/calibration/fit_bundled.py --check    # fits and prints, writes nothing

Reads ``sim/replay/data/measurements`` (each CSV row names its source in SOURCES.toml) and,
per GPU preset, fits on aiconfigurator's vLLM kernel timings (all measured in CUDA graphs,
as vLLM runs them):

* GEMMs -> ``matmul_flops_fraction``, ``matmul_half_tokens``, ``hbm_bandwidth_fraction``
  and the GEMM launch floor (``kernels.fit_gemm``; held out: a third of the (n, k)
  shapes at a time);
* context (prefill) attention -> ``attention_flops_fraction``,
  ``attention_half_query_tokens`` and the attention floor (held out: a third of the rows
  at a time);
* generation (decode) attention, with its KV read at the GEMMs' HBM fraction ->
  ``decode_attention_s_per_head`` (held out likewise);
* all-reduce -> one curve per TP degree, the fastest implementation at each size (held
  out: each inner point, predicted from its neighbours);
* fused MoE layers (``moe_<gpu>.csv``, where aiconfigurator has them: H100, H200, B200) ->
  ``moe_flops_fraction``, ``moe_expert_half_tokens``, ``moe_hbm_bandwidth_fraction``,
  ``moe_floor_s``, ``moe_s_per_token_value`` on the balanced rows (held out: a third of the
  configurations at a time), and ``moe_ep_imbalance`` / ``moe_tp_imbalance`` from the
  ``power_law_1.01`` rows (``moe_kernels.fit_measured``); not in ``[error]``: DP MoE groups
  only;
* NCCL all-gather, reduce-scatter and all-to-all -> one curve per op and GPU count, and
  DeepEP's dispatch and combine -> one table per kernel and node count, for a DP group's
  MoE collectives (held out: each inner point, predicted from its neighbours);
* ``layer_fixed_s`` = every kernel floor of a layer (``kernels.layer_fixed_s``);
  ``step_gpu_fixed_s`` = three more (embedding, LM head, sampler).

``[band]``, how far real servers' p99s lay from kvtwin's replays, is no kernel's either: every
file gets ``measurements/serving_band.toml`` (``bench/bench_fidelity_serving.py --write-band``,
docs/capacity.md#the-band), the same on every GPU.

``client_overhead_s``, the time outside the engine a benchmark client also measures, is no
kernel's: every file gets the default of ``measurements/client_overhead.toml``, the same on
every GPU (a host-CPU cost), with its sources (docs/capacity.md#client-side-latency).

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.calibration.fit.step_model import write_calibration
from kvtwin.sim.replay.client_side import default_client_overhead
from kvtwin.sim.calibration.efficiency import AllReduceCurve, CollectiveCurve, DeepEPTable, Efficiency
from kvtwin.sim.calibration.fit.moe_kernels import DEFAULT_SKEW, fit_measured
from kvtwin.sim.calibration.fit.kernels import (allreduce_points, fit_attention, fit_decode_attention, fit_gemm,
                                          holdout_predictions, interpolate_s, layer_fixed_s, relative_errors)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "sim" / "replay" / "data"
MEASUREMENTS = DATA / "measurements"
OUT = DATA / "calibration"
SERVING_BAND = MEASUREMENTS / "serving_band.toml"
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


@dataclass
class KernelSet:
    """Measured kernels of one kind and what a fit predicts for each, held out: every row
    predicted by a fit that did not see its fold."""

    names: list[str]
    sources: list[str]
    categories: list[str]  # "prefill step", "decode step" or "" (neither)
    measured_s: np.ndarray
    held_out_s: np.ndarray

    def errors(self, category: str) -> np.ndarray:
        chosen = np.array([c == category for c in self.categories])
        return relative_errors(self.held_out_s[chosen], self.measured_s[chosen])


def fit_gemms(gpu: str, peak_flops: float, peak_bytes: float):
    """The GEMM fit on every row, and the rows held out a third of the (n, k) shapes at a time."""
    data = rows(MEASUREMENTS / f"gemm_{gpu}.csv")
    m, n, k, t = (np.array([r[c] for r in data]) for c in ("m", "n", "k", "latency_s"))
    shapes = {shape: i for i, shape in enumerate(sorted(set(zip(n, k))))}
    folds = np.array([shapes[s] % 3 for s in zip(n, k)])

    def fit(mask):
        return fit_gemm(m[mask], n[mask], k[mask], t[mask], flops_per_s=peak_flops, bytes_per_s=peak_bytes)

    held = holdout_predictions(fit, lambda model, mask: model.predict_s(m[mask], n[mask], k[mask], peak_flops,
                                                                        peak_bytes), folds)
    categories = ["prefill step" if rows_ >= 512 else "decode step" if rows_ <= 256 else "" for rows_ in m]
    kernels = KernelSet([f"gemm m={int(a)} n={int(b)} k={int(c)}" for a, b, c in zip(m, n, k)],
                        [r["source"] for r in data], categories, t, held)
    return fit(np.ones(len(t), dtype=bool)), kernels


def attention_terms(data: list[dict]):
    batch, q, past, heads, kv_heads, hd, t = (np.array([r[c] for r in data]) for c in
                                              ("batch", "q_len", "past_len", "num_heads", "num_kv_heads",
                                               "head_dim", "latency_s"))
    attended = batch * (q * past + q * (q + 1) / 2)
    flops = 4.0 * heads * hd * attended  # QK^T and PV, as the cost model counts them
    kv_bytes = batch * (past + q) * 2 * kv_heads * hd * 2  # K and V, 16-bit
    return flops, kv_bytes, q, t


def _attention_names(data: list[dict]) -> list[str]:
    return [f"{r['phase']} attention batch={int(r['batch'])} q={int(r['q_len'])} past={int(r['past_len'])} "
            f"heads={int(r['num_heads'])}/{int(r['num_kv_heads'])}" for r in data]


def fit_attention_rows(gpu: str, peak_flops: float, peak_bytes: float, hbm_fraction: float):
    """Prefill attention (fraction, chunk curve, floor) and decode attention (per-head time,
    with the KV read at the GEMMs' HBM fraction), each on every row and held out by thirds."""
    data = rows(MEASUREMENTS / f"attention_{gpu}.csv")
    context = [r for r in data if r["phase"] == "context"]
    generation = [r for r in data if r["phase"] == "generation"]
    achieved = peak_bytes * hbm_fraction

    flops, kv_bytes, q, t = attention_terms(context)

    def fit(mask):
        return fit_attention(flops[mask], kv_bytes[mask], q[mask], t[mask], flops_per_s=peak_flops,
                             bytes_per_s=achieved)

    held = holdout_predictions(fit, lambda model, mask: model.predict_s(flops[mask], kv_bytes[mask], q[mask],
                                                                        peak_flops, achieved),
                               np.arange(len(t)) % 3)
    prefill = KernelSet(_attention_names(context), [r["source"] for r in context], ["prefill step"] * len(t), t, held)

    _, g_bytes, _, g_t = attention_terms(generation)
    g_work = np.array([r["batch"] * r["num_heads"] for r in generation])

    def fit_decode(mask):
        return fit_decode_attention(g_bytes[mask], g_work[mask], g_t[mask], bytes_per_s=achieved)

    g_held = holdout_predictions(fit_decode, lambda model, mask: model.predict_s(g_bytes[mask], g_work[mask],
                                                                                 achieved), np.arange(len(g_t)) % 3)
    decode = KernelSet(_attention_names(generation), [r["source"] for r in generation],
                       ["decode step"] * len(g_t), g_t, g_held)
    everything = np.ones(len(t), dtype=bool)
    return fit(everything), prefill, fit_decode(np.ones(len(g_t), dtype=bool)), decode


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


def fit_moe_layers(gpu: str, peak_flops: float, peak_bytes: float):
    """The MoE fit of a GPU with measured fused-MoE layers, else None."""
    path = MEASUREMENTS / f"moe_{gpu}.csv"
    return fit_measured(rows(path), flops_per_s=peak_flops, bytes_per_s=peak_bytes) if path.exists() else None


def moe_fields(moe) -> dict:
    """The ``[cost_model]`` keys of a MoE fit, rounded as the file writes them."""
    if moe is None:
        return {}
    fit = moe.fit
    return {"moe_flops_fraction": round(fit.moe_flops_fraction, 4),
            "moe_expert_half_tokens": round(fit.moe_half_rows_per_expert, 2),
            "moe_hbm_bandwidth_fraction": round(fit.moe_hbm_bandwidth_fraction, 4),
            "moe_floor_s": float(f"{fit.moe_floor_s:.4g}"),
            "moe_s_per_token_value": float(f"{fit.moe_s_per_token_value:.4g}"),
            "moe_ep_imbalance": round(moe.ep_imbalance, 3), "moe_tp_imbalance": round(moe.tp_imbalance, 3)}


def moe_line(gpu: str, moe) -> str:
    """The header line of a MoE fit (tests/calibration/test_moe_kernels.py reads its p90)."""
    fit, errors = moe.fit, moe.held_out_errors
    return (f"{gpu}: MoE experts f={fit.moe_flops_fraction:.3f} half at {fit.moe_half_rows_per_expert:.2f} tokens "
            f"per expert hbm={fit.moe_hbm_bandwidth_fraction:.3f} floor={fit.moe_floor_s * 1e6:.2f} us "
            f"per-token {fit.moe_s_per_token_value * 1e12:.2f} ps per hidden value ({len(errors)} balanced "
            f"layers; held-out median {np.median(errors):.1%}, p90 {p90(errors):.1%}); {DEFAULT_SKEW} load "
            f"factor EP x{moe.ep_imbalance:.3f}, TP x{moe.tp_imbalance:.3f} (median {np.median(moe.skew_errors):.1%}, "
            f"p90 {p90(moe.skew_errors):.1%} over {len(moe.skew_errors)} skewed layers)")


def _leave_one_out(sizes: Sequence[float], times: Sequence[float]) -> list[float]:
    """The relative error of each inner point of a curve, predicted from the others."""
    s, t = np.array(sizes, dtype=float), np.array(times, dtype=float)
    errors = []
    for i in range(1, len(s) - 1):
        keep = np.arange(len(s)) != i
        errors.append(float(relative_errors(interpolate_s(s[keep], t[keep], s[i:i + 1]), t[i:i + 1])[0]))
    return errors


# collectives_<gpu>.csv op -> the Efficiency field of its curves.
COLLECTIVE_FIELDS = {"all_gather": "allgather", "reduce_scatter": "reducescatter", "alltoall": "alltoall"}
# deepep_<gpu>.csv mode -> DeepEPTable.mode; the one shape extract_measurements.py keeps.
DEEPEP_MODES = {"ll": "low_latency", "normal": "high_throughput"}
DEEPEP_HIDDEN_SIZE, DEEPEP_TOP_K = 7168, 8


def fit_collectives(gpu: str) -> tuple[dict[str, tuple[CollectiveCurve, ...]], np.ndarray]:
    """nccl-tests' all-gather, reduce-scatter and all-to-all: one curve per op and GPU
    count (``allreduce_points``' rule), and the leave-one-out errors of all of them."""
    path = MEASUREMENTS / f"collectives_{gpu}.csv"
    if not path.exists():
        return {}, np.zeros(0)
    points = defaultdict(list)
    for r in rows(path):
        points[(r["op"], int(r["num_gpus"]))].append((r["message_bytes"], r["seconds"]))
    curves: dict[str, list[CollectiveCurve]] = defaultdict(list)
    errors: list[float] = []
    for (op, num_gpus) in sorted(points):
        sizes, times = allreduce_points(*zip(*points[(op, num_gpus)]))
        if len(sizes) < 3:
            continue
        curves[COLLECTIVE_FIELDS[op]].append(CollectiveCurve(num_gpus, sizes, times))
        errors += _leave_one_out(sizes, times)
    return {op: tuple(c) for op, c in curves.items()}, np.array(errors)


def fit_deepep(gpu: str) -> tuple[tuple[DeepEPTable, ...], np.ndarray]:
    """DeepEP's dispatch and combine: one table per mode and node count, each time made
    non-decreasing in tokens (as ``allreduce_points``), and the leave-one-out errors of
    their sums."""
    path = MEASUREMENTS / f"deepep_{gpu}.csv"
    if not path.exists():
        return (), np.zeros(0)
    points = defaultdict(dict)
    for r in rows(path):
        points[(r["mode"], int(r["nodes"]))][float(r["tokens_per_rank"])] = (r["dispatch_s"], r["combine_s"])
    tables, errors = [], []
    for (mode, nodes) in sorted(points):
        by_tokens = points[(mode, nodes)]
        tokens = tuple(sorted(by_tokens))
        dispatch = tuple(float(t) for t in np.maximum.accumulate([by_tokens[n][0] for n in tokens]))
        combine = tuple(float(t) for t in np.maximum.accumulate([by_tokens[n][1] for n in tokens]))
        tables.append(DeepEPTable(DEEPEP_MODES[mode], nodes, DEEPEP_HIDDEN_SIZE, DEEPEP_TOP_K, tokens, dispatch,
                                  combine))
        errors += _leave_one_out(tokens, [d + c for d, c in zip(dispatch, combine)])
    return tuple(tables), np.array(errors)


def sources_for(gpu: str) -> list[dict]:
    table = tomllib.loads((MEASUREMENTS / "SOURCES.toml").read_text())
    keys = set()
    for name in (f"gemm_{gpu}.csv", f"attention_{gpu}.csv", f"allreduce_{gpu}.csv", f"moe_{gpu}.csv",
                 f"collectives_{gpu}.csv", f"deepep_{gpu}.csv"):
        if not (MEASUREMENTS / name).exists():
            continue
        keys |= {r["source"] for r in rows(MEASUREMENTS / name) if r["source"].startswith("aic-")}
    wanted = ("repository", "path", "commit", "licence", "engine", "gpu", "notes")
    return [{k: str(table[key][k]) for k in wanted if k in table[key]} for key in sorted(keys)]


def serving_band(path: Path | None = None) -> tuple[dict[str, tuple[float, float]], list[dict]]:
    """The ``[band]`` of every bundled file (kind -> (low, high)) and its sources, from
    ``serving_band.toml``."""
    table = tomllib.loads((path or SERVING_BAND).read_text())
    sources = [{k: str(v) for k, v in source.items()} for source in table.pop("source", [])]
    return {kind: (float(pair[0]), float(pair[1])) for kind, pair in table.items()}, sources


def p90(values: np.ndarray) -> float:
    return float(np.percentile(values, 90)) if len(values) else math.nan


def calibrate(gpu: str, write: bool) -> list[str]:
    preset = get_gpu(PRESETS[gpu][0])
    peak_flops, peak_bytes = preset.bf16_flops, preset.hbm_bandwidth_bytes_per_s
    gemm, gemm_kernels = fit_gemms(gpu, peak_flops, peak_bytes)
    attention, prefill_kernels, decode_attention, decode_kernels = fit_attention_rows(
        gpu, peak_flops, peak_bytes, gemm.hbm_bandwidth_fraction)
    curves, allreduce_errors = fit_allreduce(gpu)
    collectives, collective_errors = fit_collectives(gpu)
    deepep, deepep_errors = fit_deepep(gpu)
    fixed_s = layer_fixed_s(gemm.launch_s, attention.launch_s)
    moe = fit_moe_layers(gpu, peak_flops, peak_bytes)
    client = default_client_overhead()
    band, band_sources = serving_band()
    efficiency = Efficiency(matmul_flops_fraction=round(gemm.matmul_flops_fraction, 4),
                            matmul_half_tokens=round(gemm.matmul_half_tokens, 1),
                            attention_flops_fraction=round(attention.attention_flops_fraction, 4),
                            attention_half_query_tokens=round(attention.attention_half_query_tokens, 1),
                            hbm_bandwidth_fraction=round(gemm.hbm_bandwidth_fraction, 4),
                            decode_attention_s_per_head=float(f"{decode_attention.seconds_per_head:.4g}"),
                            layer_fixed_s=round(fixed_s, 9), step_gpu_fixed_s=round(STEP_KERNELS * gemm.launch_s, 9),
                            client_overhead_s=client.seconds, allreduce=curves, **collectives, deepep=deepep,
                            **moe_fields(moe))
    gemm_errors = relative_errors(gemm_kernels.held_out_s, gemm_kernels.measured_s)
    context_errors = prefill_kernels.errors("prefill step")
    generation_errors = decode_kernels.errors("decode step")
    prefill = np.concatenate([gemm_kernels.errors("prefill step"), context_errors])
    decode = np.concatenate([gemm_kernels.errors("decode step"), generation_errors])
    errors = {"prefill_step": round(p90(prefill), 4), "decode_step": round(p90(decode), 4)}
    lines = [
        f"{gpu}: GEMM f={gemm.matmul_flops_fraction:.3f} half={gemm.matmul_half_tokens:.0f} tokens "
        f"hbm={gemm.hbm_bandwidth_fraction:.3f} floor={gemm.launch_s * 1e6:.2f} us ({len(gemm_errors)} GEMMs; held-out "
        f"median {np.median(gemm_errors):.1%}, p90 {p90(gemm_errors):.1%})",
        f"{gpu}: prefill attention fraction {attention.attention_flops_fraction:.3f}, half at "
        f"{attention.attention_half_query_tokens:.0f} query tokens, floor {attention.launch_s * 1e6:.2f} us "
        f"(held-out median {np.median(context_errors):.1%}, p90 {p90(context_errors):.1%})",
        f"{gpu}: decode attention {decode_attention.seconds_per_head * 1e9:.2f} ns per sequence and query head, floor "
        f"{decode_attention.launch_s * 1e6:.2f} us (held-out median {np.median(generation_errors):.1%}, "
        f"p90 {p90(generation_errors):.1%} over {len(generation_errors)} kernels)",
        f"{gpu}: all-reduce curves for TP {', '.join(str(c.tensor_parallel_size) for c in curves)} "
        f"(leave-one-out median {np.median(allreduce_errors):.1%}, p90 {p90(allreduce_errors):.1%})",
        *([moe_line(gpu, moe)] if moe is not None else []),
        *([f"{gpu}: NCCL collective curves: " + "; ".join(
            f"{op} for {', '.join(str(c.num_gpus) for c in collectives[op])} GPUs" for op in collectives)
           + f" (leave-one-out median {np.median(collective_errors):.1%}, p90 {p90(collective_errors):.1%})"]
          if collectives else []),
        *([f"{gpu}: DeepEP dispatch+combine tables: " + "; ".join(
            f"{t.mode} {t.nodes} node(s)" for t in deepep)
           + f" (leave-one-out median {np.median(deepep_errors):.1%}, p90 {p90(deepep_errors):.1%})"]
          if deepep else []),
        f"{gpu}: layer_fixed_s {fixed_s * 1e6:.1f} us (9 kernel floors at {gemm.launch_s * 1e6:.2f} us and the "
        f"attention's), step_gpu_fixed_s {STEP_KERNELS * gemm.launch_s * 1e6:.1f} us",
        f"{gpu}: held-out p90: prefill_step {errors['prefill_step']:.1%} ({len(prefill)} kernels), "
        f"decode_step {errors['decode_step']:.1%} ({len(decode)} kernels)",
        f"{gpu}: client_overhead_s {client.seconds * 1000:.0f} ms (the sources support {client.low_seconds * 1000:.0f}-"
        f"{client.high_seconds * 1000:.0f} ms): time outside the engine (HTTP, tokenising, detokenising, "
        f"streaming), the same on every GPU; from sim/replay/data/measurements/client_overhead.toml, "
        f"its sources below; `kvtwin calibrate` on client-side measurements fits it",
        f"{gpu}: [band] from {SERVING_BAND.relative_to(REPO)}: " + ", ".join(
            f"{kind} x{low:.2f}-x{high:.2f}" for kind, (low, high) in band.items())
        + " (measured / replayed p99 of public vLLM serving runs, the same on every GPU; "
          "bench/bench_fidelity_serving.py --write-band)",
    ]
    if write:
        for name in PRESETS[gpu]:
            write_calibration(OUT / f"{name}.toml", efficiency, errors=errors, bands=band,
                              sources=[*sources_for(gpu), *client.sources, *band_sources],
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
