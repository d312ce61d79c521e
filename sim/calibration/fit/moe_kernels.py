"""Fit the routed experts' kernel time of one MoE layer on one GPU to measured fused-MoE
layers (docs/clock.md#moe-under-data-parallelism).

The measurements (``sim/replay/data/measurements/moe_<gpu>.csv``, aiconfigurator's vLLM
tables) time one GPU as rank 0 of ``moe_tp x moe_ep``: ``num_tokens`` tokens enter the
layer and each picks ``topk`` of all ``num_experts`` experts; the GPU holds
``ceil(experts / moe_ep)`` experts, each's intermediate width split ``moe_tp`` ways.

The model is the one ``MoEGroupCost.part`` prices a DP group's MoE layer with:

* **compute**: the busiest GPU's (token, expert) pairs at ``2 x 3 x hidden x
  intermediate`` FLOPs each, at a fraction ``f x r / (r + h)`` of the bf16 peak, where
  ``r`` is the rows (tokens) each expert's grouped GEMM gets: a grouped GEMM of few rows
  per expert cannot fill the tensor cores, whatever the layer's total tokens;
* **weights**: the experts the tokens touch on that GPU (their expected number under
  uniform routing, as the cost model counts them), read once at a fraction ``b`` of HBM
  bandwidth, at the weight format's bytes per parameter;
* **tokens**: every token that enters the layer costs time in proportion to its hidden
  values whatever experts it picks (quantizing the activations, permuting the routed
  copies and combining them back: with EP the timed GPU still sees every token), a
  fitted time per value;
* ``seconds = floor + max(compute, weights) + tokens``.

FP8 and MXFP4 experts are priced as the cost model prices them (``weight_format``): fewer
bytes per parameter, FLOPs at the bf16 rate; so ``f`` is a bf16-peak fraction fitted on
every format at once.

The fit runs on the ``balanced`` rows (the busiest GPU is the mean), held out a third of
the (format, shape, moe_tp, moe_ep) configurations at a time. Routing skew is fitted next,
on the ``power_law`` rows against the balanced fit: one load factor on the busiest GPU's
compute with expert parallelism and one without (``fit_imbalance``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvtwin.sim.calibration.fit.kernels import holdout_predictions, relative_errors


# Bytes per routed parameter of each measured format, as the cost model counts a
# ``weight_format`` (``CostModel._experts``): bf16 2, DeepSeek's block FP8 1 (its scales
# are not counted), MXFP4 4.25 bits.
BYTES_PER_PARAM = {"bfloat16": 2.0, "fp8_block": 1.0, "w4a16_mxfp4": 4.25 / 8}


@dataclass(frozen=True)
class MoERows:
    """Per-row terms of measured MoE layers on the GPU that was timed."""

    flops: np.ndarray  # on the busiest GPU
    rows_per_expert: np.ndarray
    weight_bytes: np.ndarray
    token_values: np.ndarray  # tokens entering the layer x hidden size
    expert_parallel: np.ndarray  # bool
    seconds: np.ndarray


def moe_rows(dtype: Sequence[str], num_tokens, hidden, inter, topk, experts, moe_tp, moe_ep, seconds) -> MoERows:
    """The model's terms of each row, for balanced routing: the timed GPU does ``1 / moe_ep``
    of the (token, expert) pairs."""
    t, h, i, k, e, tp, ep, s = (np.asarray(a, dtype=float) for a in
                                (num_tokens, hidden, inter, topk, experts, moe_tp, moe_ep, seconds))
    inter_local = i / tp
    flops = t * k / ep * 2.0 * 3 * h * inter_local
    touched = np.ceil(e / ep) * (1.0 - (1.0 - k / e) ** t)
    bpp = np.array([BYTES_PER_PARAM[d] for d in dtype])
    return MoERows(flops, t * k / e, touched * 3 * h * inter_local * bpp, t * h, ep > 1, s)


def moe_model_s(flops, rows_per_expert, weight_bytes, token_values, flops_per_s: float, bytes_per_s: float,
                fraction, half_rows, hbm_fraction, floor_s, s_per_token_value, imbalance=1.0):
    """Seconds of one MoE layer's experts on one GPU (broadcasts over parameter arrays)."""
    compute = imbalance * flops * (rows_per_expert + half_rows) / (rows_per_expert * flops_per_s * fraction)
    return floor_s + np.maximum(compute, weight_bytes / (bytes_per_s * hbm_fraction)) + s_per_token_value * token_values


@dataclass(frozen=True)
class MoEKernelFit:
    moe_flops_fraction: float
    moe_half_rows_per_expert: float
    moe_hbm_bandwidth_fraction: float
    moe_floor_s: float
    moe_s_per_token_value: float

    def predict_s(self, rows: MoERows, flops_per_s: float, bytes_per_s: float, imbalance=1.0) -> np.ndarray:
        return moe_model_s(rows.flops, rows.rows_per_expert, rows.weight_bytes, rows.token_values, flops_per_s,
                           bytes_per_s, self.moe_flops_fraction, self.moe_half_rows_per_expert,
                           self.moe_hbm_bandwidth_fraction, self.moe_floor_s, self.moe_s_per_token_value, imbalance)


def fit_moe(rows: MoERows, *, flops_per_s: float, bytes_per_s: float) -> MoEKernelFit:
    """(f, h, b, floor, per-token time) closest to the rows' seconds in squared log error: a
    grid over (f, h, b) with the floor at half the fastest layer and no per-token time, then
    a pattern search over all five from there and from starts with a per-token time (the
    floor within [0, fastest layer], the fractions within (0, 1])."""
    t = rows.seconds
    if len(t) < 5 or np.any(t <= 0) or np.any(rows.rows_per_expert <= 0):
        raise ValueError("fit_moe needs at least five layers with positive times and tokens")
    log_t = np.log(t)
    floor = float(t.min())

    def losses(f, h, b, g, c):
        predicted = moe_model_s(rows.flops[None, :], rows.rows_per_expert[None, :], rows.weight_bytes[None, :],
                                rows.token_values[None, :], flops_per_s, bytes_per_s, f[:, None], h[:, None],
                                b[:, None], g, c)
        return np.mean((np.log(predicted) - log_t[None, :]) ** 2, axis=1)

    ff, hh, bb = (g.ravel() for g in np.meshgrid(np.linspace(0.1, 1.0, 19),
                                                 np.concatenate([[0.0], np.geomspace(0.5, 1024, 23)]),
                                                 np.linspace(0.2, 1.0, 17), indexing="ij"))
    values = np.concatenate([losses(ff[j:j + 2048], hh[j:j + 2048], bb[j:j + 2048], floor / 2, 0.0)
                             for j in range(0, len(ff), 2048)])
    best = int(np.argmin(values))
    # The per-token time is searched in log space: its scale is unknown within decades.
    # Starting points: none, and a token's values streamed at a fraction of HBM bandwidth.
    lows = np.array([0.02, 0.0, 0.02, 0.0, -40.0])
    highs = np.array([1.0, np.log1p(1e5), 1.0, floor, -15.0])

    def loss(x: np.ndarray) -> float:
        per_value = 0.0 if x[4] <= lows[4] else float(np.exp(x[4]))
        return float(losses(np.array([x[0]]), np.array([np.expm1(x[1])]), np.array([x[2]]), x[3], per_value)[0])

    result = None
    for start_c in (lows[4], np.log(2.0 / bytes_per_s), np.log(20.0 / bytes_per_s)):
        x = np.array([ff[best], np.log1p(hh[best]), bb[best], floor / 2, start_c])
        x, value = _pattern_search(loss, x, np.array([0.02, 0.2, 0.02, floor / 20, 1.0]), lows, highs)
        if result is None or value < result[1]:
            result = (x, value)
    x = result[0]
    return MoEKernelFit(float(x[0]), float(np.expm1(x[1])), float(x[2]), float(x[3]),
                        0.0 if x[4] <= lows[4] else float(np.exp(x[4])))


def _pattern_search(loss, x: np.ndarray, step: np.ndarray, lows: np.ndarray, highs: np.ndarray):
    """A coordinate pattern search within [lows, highs], halving the steps until they are
    tiny; returns the point and its loss."""
    value = loss(x)
    while step.max() > 1e-6 * max(1.0, float(np.abs(step).max())) and step[[0, 1, 2, 4]].max() > 1e-6:
        moved = False
        for i in range(len(x)):
            for sign in (1.0, -1.0):
                trial = x.copy()
                trial[i] = min(max(trial[i] + sign * step[i], lows[i]), highs[i])
                trial_value = loss(trial)
                if trial_value < value:
                    x, value, moved = trial, trial_value, True
                    break
        if not moved:
            step = step / 2
    return x, value


def fit_imbalance(fit: MoEKernelFit, rows: MoERows, balanced_s: np.ndarray, *, flops_per_s: float,
                  bytes_per_s: float) -> float:
    """The load factor (at least 1) on the busiest GPU's compute that skewed routing puts
    on ``fit``: the factor whose predicted slowdown, ``fit`` with it over ``fit`` without,
    is closest in squared log error to the measured one, each skewed row's seconds over
    ``balanced_s``, the same layer's under balanced routing. On ratios, so that the
    balanced fit's own misfit is not taken for skew. A golden-section search on [1, 8]."""
    if not len(rows.seconds):
        return 1.0
    measured = np.log(rows.seconds / np.asarray(balanced_s, float))
    base = np.log(fit.predict_s(rows, flops_per_s, bytes_per_s))

    def loss(factor: float) -> float:
        return float(np.mean((np.log(fit.predict_s(rows, flops_per_s, bytes_per_s, factor)) - base - measured) ** 2))

    lo, hi = 1.0, 8.0
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    while hi - lo > 1e-5:
        if loss(a) < loss(b):
            hi, b = b, a
            a = hi - ratio * (hi - lo)
        else:
            lo, a = a, b
            b = lo + ratio * (hi - lo)
    best = (lo + hi) / 2
    return 1.0 if loss(1.0) <= loss(best) else best


def subset(rows: MoERows, mask: np.ndarray) -> MoERows:
    return MoERows(rows.flops[mask], rows.rows_per_expert[mask], rows.weight_bytes[mask], rows.token_values[mask],
                   rows.expert_parallel[mask], rows.seconds[mask])


# The routing skew the bundled calibrations take: aiconfigurator's own default workload is
# ``power_law`` (aiconfigurator_core/sdk/config.py ``workload_distribution``) with
# alpha 1.01 for the DeepSeek family (sdk/models/deepseek.py) and 1.2 for its generic MoE
# model (sdk/models/moe.py); DeepSeek-V3 and Kimi-K2 are the models kvtwin's DP/EP
# presets are, so 1.01.
DEFAULT_SKEW = "power_law_1.01"
BALANCED = "balanced"


@dataclass(frozen=True)
class MeasuredMoEFit:
    """A GPU's MoE fit from its measured layers, with what it is judged on."""

    fit: MoEKernelFit
    held_out_errors: np.ndarray  # |relative error| of each balanced row, predicted by a fit without its fold
    ep_imbalance: float
    tp_imbalance: float
    skew_errors: np.ndarray  # |relative error| of the skewed rows with the load factors applied


def _configuration(record: dict) -> tuple:
    return tuple(str(record[c]) for c in ("dtype", "hidden_size", "inter_size", "topk", "num_experts", "moe_tp",
                                          "moe_ep"))


def rows_of(records: Sequence[dict]) -> MoERows:
    """``MoERows`` of measurement records (``moe_<gpu>.csv`` rows as dicts)."""
    return moe_rows([str(r["dtype"]) for r in records],
                    *([float(r[c]) for r in records] for c in ("num_tokens", "hidden_size", "inter_size", "topk",
                                                              "num_experts", "moe_tp", "moe_ep", "latency_s")))


def fit_measured(records: Sequence[dict], *, flops_per_s: float, bytes_per_s: float,
                 skew: str = DEFAULT_SKEW) -> MeasuredMoEFit:
    """The fit on the balanced records, its held-out errors (a third of the configurations
    -- format, shape, moe_tp, moe_ep -- held out at a time, in the order they first
    appear), and the load factors of ``skew``'s records against the same layers balanced,
    with EP and without."""
    balanced = [r for r in records if r["distribution"] == BALANCED]
    rows = rows_of(balanced)
    order: dict[tuple, int] = {}
    folds = np.array([order.setdefault(_configuration(r), len(order)) % 3 for r in balanced])
    held = holdout_predictions(lambda mask: fit_moe(subset(rows, mask), flops_per_s=flops_per_s,
                                                    bytes_per_s=bytes_per_s),
                               lambda model, mask: model.predict_s(subset(rows, mask), flops_per_s, bytes_per_s),
                               folds)
    fit = fit_moe(rows, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s)
    balanced_s = {(*_configuration(r), str(r["num_tokens"])): float(r["latency_s"]) for r in balanced}
    skewed = [r for r in records if r["distribution"] == skew
              and (*_configuration(r), str(r["num_tokens"])) in balanced_s]
    skew_rows = rows_of(skewed)
    reference = np.array([balanced_s[(*_configuration(r), str(r["num_tokens"]))] for r in skewed])
    factors = {}
    predicted = np.zeros(len(skewed))
    for ep in (True, False):
        mask = skew_rows.expert_parallel == ep
        factors[ep] = fit_imbalance(fit, subset(skew_rows, mask), reference[mask], flops_per_s=flops_per_s,
                                    bytes_per_s=bytes_per_s)
        predicted[mask] = fit.predict_s(subset(skew_rows, mask), flops_per_s, bytes_per_s, factors[ep])
    return MeasuredMoEFit(fit, relative_errors(held, rows.seconds), factors[True], factors[False],
                          relative_errors(predicted, skew_rows.seconds))
