"""Fit the cost model's GPU factors to measured kernels: GEMMs, all-reduces, small ops.

The bundled calibrations (``sim/replay/data/calibration``) come from public kernel
timings (``sim/replay/data/measurements``, each file with its source). This module holds
the fits, so that ``scripts/calibration/fit_bundled.py`` only reads files and writes
them, and the tests can check each fit recovers known coefficients from synthetic data.

* **GEMM** ``(m, n, k) -> seconds``. The cost model times a step's GEMMs as
  ``max(flops / (peak x f x m / (m + h)), bytes / (bandwidth x b))``: tensor cores reach
  a fraction ``f`` of peak on GEMMs of many rows and half of it at ``h`` rows; a GEMM of
  few rows streams its weights at a fraction ``b`` of HBM bandwidth. ``fit_gemm`` finds
  (f, h, b) minimising the squared log error, on a grid refined twice.
* **All-reduce** ``(TP, message bytes) -> seconds``: the curve is the measured points
  themselves (the fastest implementation at each size, as vLLM picks), interpolated.
* **Attention** (prefill) ``-> seconds``: FLOPs at a fraction of peak that grows with
  the chunk's query tokens, or the KV read, plus a launch floor (``fit_attention``).
* **Fixed time per layer**: the launch floors of a layer's kernels (``layer_fixed_s``).

Every fit reports its error on folds it was not fitted on (``holdout_predictions``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class GemmFit:
    matmul_flops_fraction: float
    matmul_half_tokens: float
    hbm_bandwidth_fraction: float
    launch_s: float = 0.0  # a kernel's floor: in a step, one per GEMM per layer (layer_fixed_s)

    def predict_s(self, m: np.ndarray, n: np.ndarray, k: np.ndarray, flops_per_s: float,
                  bytes_per_s: float, bytes_per_element: int = 2) -> np.ndarray:
        return gemm_model_s(np.asarray(m, float), np.asarray(n, float), np.asarray(k, float), flops_per_s,
                            bytes_per_s, self.matmul_flops_fraction, self.matmul_half_tokens,
                            self.hbm_bandwidth_fraction, bytes_per_element, self.launch_s)


def gemm_model_s(m, n, k, flops_per_s: float, bytes_per_s: float, fraction, half_tokens, hbm_fraction,
                 bytes_per_element: int = 2, launch_s=0.0):
    """The cost model's time of one GEMM (broadcasts over arrays of parameters)."""
    compute = 2.0 * m * n * k * (m + half_tokens) / (m * flops_per_s * fraction)
    memory = bytes_per_element * (m * k + k * n + m * n) / (bytes_per_s * hbm_fraction)
    return launch_s + np.maximum(compute, memory)


def fit_gemm(m: Sequence[float], n: Sequence[float], k: Sequence[float], seconds: Sequence[float], *,
             flops_per_s: float, bytes_per_s: float, bytes_per_element: int = 2, fit_launch: bool = True) -> GemmFit:
    """(f, h, b) and the launch floor of ``gemm_model_s`` closest to ``seconds`` in
    squared log error. The grid runs with the floor at 0; the final search moves all four."""
    m, n, k, t = (np.asarray(a, dtype=float) for a in (m, n, k, seconds))
    if not (len(m) == len(n) == len(k) == len(t)) or len(t) < 3:
        raise ValueError("fit_gemm needs at least three GEMMs, with m, n, k and seconds of one length")
    if np.any(t <= 0) or np.any(m <= 0) or np.any(n <= 0) or np.any(k <= 0):
        raise ValueError("GEMM sizes and times must be positive")
    log_t = np.log(t)

    def loss(f, h, b, launch=0.0):
        predicted = gemm_model_s(m[None, :], n[None, :], k[None, :], flops_per_s, bytes_per_s,
                                 f[:, None], h[:, None], b[:, None], bytes_per_element, launch)
        return np.mean((np.log(predicted) - log_t[None, :]) ** 2, axis=1)

    f_grid = np.linspace(0.2, 1.0, 33)
    h_grid = np.concatenate([[0.0], np.geomspace(1.0, 4096.0, 37)])
    b_grid = np.linspace(0.3, 1.0, 29)
    best = None
    for _ in range(5):
        ff, hh, bb = (g.ravel() for g in np.meshgrid(f_grid, h_grid, b_grid, indexing="ij"))
        losses = np.concatenate([loss(ff[i:i + 4096], hh[i:i + 4096], bb[i:i + 4096])
                                 for i in range(0, len(ff), 4096)])
        i = int(np.argmin(losses))
        best = (float(ff[i]), float(hh[i]), float(bb[i]))
        # Refine around the best point: a finer grid a few steps wide in each direction.
        f_grid = _around(best[0], f_grid, 0.2, 1.0)
        b_grid = _around(best[2], b_grid, 0.05, 1.0)
        # h spans decades: refine by ratio, and keep 0 (no size effect) a candidate.
        width = np.log(h_grid[-1] / h_grid[1]) / (len(h_grid) - 2) if len(h_grid) > 2 and h_grid[1] > 0 else 0.2
        centre = max(best[1], 1.0)
        h_grid = np.concatenate([[0.0], centre * np.exp(np.linspace(-3 * width, 3 * width, 25))])
    floor_s = float(t.min()) if fit_launch else 0.0
    return GemmFit(*_polish((*best, 0.0), lambda f, h, b, g: float(loss(np.array([f]), np.array([h]),
                                                                         np.array([b]), g)[0]),
                            floor_s))


def _polish(start: tuple[float, float, float, float], loss, max_launch_s: float) -> tuple[float, ...]:
    """A pattern search from the grid's best point, in (f, log(1 + h), b, launch): the grid
    finds the basin, this walks its floor, where f and h trade off along a ridge. The launch
    floor stays within [0, max_launch_s] (no kernel is faster than its floor)."""
    bounds = ((0.05, 1.0), (0.0, np.log1p(1e5)), (0.05, 1.0), (0.0, max_launch_s))
    x = np.array([start[0], np.log1p(start[1]), start[2], start[3]])
    value = loss(x[0], np.expm1(x[1]), x[2], x[3])
    step = np.array([0.01, 0.05, 0.01, max_launch_s / 20])
    while step[:3].max() > 1e-7:
        moved = False
        for i in range(4 if max_launch_s > 0 else 3):
            for sign in (1.0, -1.0):
                trial = x.copy()
                trial[i] = min(max(trial[i] + sign * step[i], bounds[i][0]), bounds[i][1])
                trial_value = loss(trial[0], np.expm1(trial[1]), trial[2], trial[3])
                if trial_value < value:
                    x, value, moved = trial, trial_value, True
                    break
        if not moved:
            step = step / 2
    return float(x[0]), float(np.expm1(x[1])), float(x[2]), float(x[3])


def _around(value: float, grid: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """A finer grid three of ``grid``'s steps either side of ``value``."""
    step = float(np.min(np.diff(np.unique(grid))))
    return np.unique(np.clip(np.linspace(value - 3 * step, value + 3 * step, 25), lo, hi))


def relative_errors(predicted_s: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    return np.abs(np.asarray(predicted_s, float) - np.asarray(measured_s, float)) / np.asarray(measured_s, float)


def holdout_predictions(fit: Callable[[np.ndarray], object], predict: Callable[[object, np.ndarray], np.ndarray],
                        folds: np.ndarray) -> np.ndarray:
    """Each row's seconds as predicted by a fit that did not see the row's fold.

    ``fit(mask)`` fits on the rows ``mask`` selects and returns a model; ``predict(model,
    mask)`` predicts those rows. ``folds`` gives each row's fold."""
    predicted = np.zeros(len(folds))
    for fold in np.unique(folds):
        held = folds == fold
        predicted[held] = predict(fit(~held), held)
    return predicted


def allreduce_points(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A curve from measured points: the fastest time at each size, sizes ascending, and
    times made non-decreasing (a larger message never completes sooner; a dip is noise)."""
    by_size: dict[float, float] = {}
    for size, t in zip(sizes_bytes, seconds):
        if size > 0 and t > 0:
            by_size[float(size)] = min(by_size.get(float(size), np.inf), float(t))
    sizes = sorted(by_size)
    times = np.maximum.accumulate([by_size[s] for s in sizes]) if sizes else np.zeros(0)
    return tuple(sizes), tuple(float(t) for t in times)


def interpolate_s(sizes: Sequence[float], times: Sequence[float], query: np.ndarray) -> np.ndarray:
    """The all-reduce curve's rule (``AllReduceCurve.seconds_for``) over an array."""
    sizes_a, times_a = np.asarray(sizes, float), np.asarray(times, float)
    query = np.asarray(query, float)
    out = np.interp(query, sizes_a, times_a)
    above = query > sizes_a[-1]
    if len(sizes_a) > 1:
        slope = (times_a[-1] - times_a[-2]) / (sizes_a[-1] - sizes_a[-2])
        out[above] = times_a[-1] + slope * (query[above] - sizes_a[-1])
    else:  # one point: proportional above it
        out[above] = times_a[0] * query[above] / sizes_a[0]
    return out


# The kernels of one decoder layer in vLLM: four GEMMs (QKV, output, gate-up, down), one
# attention, and five small ones (two fused residual-add + RMSNorm, rotary, SiLU-and-mul,
# the KV-cache write).
GEMMS_PER_LAYER = 4
SMALL_KERNELS_PER_LAYER = 5


def layer_fixed_s(gemm_launch_s: float, attention_launch_s: float) -> float:
    """The fixed GPU time of a layer: every kernel's launch floor. A small kernel's floor is
    taken as a GEMM's (both measured in CUDA graphs, as vLLM runs them)."""
    return (GEMMS_PER_LAYER + SMALL_KERNELS_PER_LAYER) * gemm_launch_s + attention_launch_s


@dataclass(frozen=True)
class AttentionFit:
    attention_flops_fraction: float
    attention_half_query_tokens: float
    launch_s: float

    def predict_s(self, flops: np.ndarray, kv_bytes: np.ndarray, query_tokens: np.ndarray, flops_per_s: float,
                  bytes_per_s: float) -> np.ndarray:
        return attention_model_s(flops, kv_bytes, query_tokens, flops_per_s, bytes_per_s,
                                 self.attention_flops_fraction, self.attention_half_query_tokens, self.launch_s)


def attention_model_s(flops, kv_bytes, query_tokens, flops_per_s: float, bytes_per_s: float, fraction, half,
                      launch_s):
    """The cost model's time of one prefill attention kernel: its FLOPs at ``fraction`` of
    peak, weighed up by ``(q + half) / q`` for chunks of ``q`` query tokens, or its KV
    read (``bytes_per_s`` is the achieved HBM rate), plus a launch floor."""
    compute = flops * (query_tokens + half) / (query_tokens * flops_per_s * fraction)
    return launch_s + np.maximum(compute, kv_bytes / bytes_per_s)


def fit_attention(flops: Sequence[float], kv_bytes: Sequence[float], query_tokens: Sequence[float],
                  seconds: Sequence[float], *, flops_per_s: float, bytes_per_s: float) -> AttentionFit:
    """(fraction, half query tokens, launch floor) closest to ``seconds`` in squared log
    error: a grid over the first two with the floor at the fastest kernel's half, then a
    pattern search over all three."""
    f, b, q, t = (np.asarray(a, dtype=float) for a in (flops, kv_bytes, query_tokens, seconds))
    if len(t) < 3 or np.any(t <= 0) or np.any(q <= 0):
        raise ValueError("fit_attention needs at least three kernels with positive times and query tokens")
    log_t = np.log(t)

    def loss(a, h, g):
        return float(np.mean((np.log(attention_model_s(f, b, q, flops_per_s, bytes_per_s, a, h, g)) - log_t) ** 2))

    floor = float(t.min())
    start = min(((a, h) for a in np.linspace(0.1, 1.0, 19) for h in (0.0, *np.geomspace(16, 16384, 21))),
                key=lambda x: loss(x[0], x[1], floor / 2))
    bounds = ((0.02, 1.0), (0.0, np.log1p(1e6)), (0.0, floor))
    x = np.array([start[0], np.log1p(start[1]), floor / 2])
    value = loss(x[0], np.expm1(x[1]), x[2])
    step = np.array([0.02, 0.2, floor / 20])
    while step[:2].max() > 1e-6:
        moved = False
        for i in range(3):
            for sign in (1.0, -1.0):
                trial = x.copy()
                trial[i] = min(max(trial[i] + sign * step[i], bounds[i][0]), bounds[i][1])
                trial_value = loss(trial[0], np.expm1(trial[1]), trial[2])
                if trial_value < value:
                    x, value, moved = trial, trial_value, True
                    break
        if not moved:
            step = step / 2
    return AttentionFit(float(x[0]), float(np.expm1(x[1])), float(x[2]))


@dataclass(frozen=True)
class DecodeAttentionFit:
    seconds_per_head: float  # per decoding sequence and query head
    launch_s: float

    def predict_s(self, kv_bytes: np.ndarray, heads_work: np.ndarray, bytes_per_s: float) -> np.ndarray:
        return self.launch_s + np.asarray(kv_bytes, float) / bytes_per_s + self.seconds_per_head * heads_work


def fit_decode_attention(kv_bytes: Sequence[float], heads_work: Sequence[float], seconds: Sequence[float], *,
                         bytes_per_s: float) -> DecodeAttentionFit:
    """A decode attention kernel as its floor, its KV read at ``bytes_per_s`` and a time per
    (sequence, query head) — ``heads_work`` is batch x query heads. Linear in the floor and
    the per-head time, so a least squares on relative errors, clamped at zero."""
    kv, work, t = (np.asarray(a, dtype=float) for a in (kv_bytes, heads_work, seconds))
    if len(t) < 2 or np.any(t <= 0):
        raise ValueError("fit_decode_attention needs at least two kernels with positive times")
    a = np.stack([np.ones_like(t), work], axis=1) / t[:, None]
    b = (t - kv / bytes_per_s) / t
    scale = np.linalg.norm(a, axis=0)
    floor, per_head = np.linalg.lstsq(a / scale, b, rcond=None)[0] / scale
    if per_head < 0:
        per_head, floor = 0.0, float(np.sum(b * a[:, 0]) / np.sum(a[:, 0] ** 2))
    if floor < 0:
        floor, per_head = 0.0, float(np.sum(b * a[:, 1]) / np.sum(a[:, 1] ** 2))
    return DecodeAttentionFit(max(0.0, float(per_head)), max(0.0, float(floor)))
