"""Fit the cost model's efficiency factors to measured step times (``kvtwin validate``'s step_latency check).

The roofline in ``cost_model`` predicts a step from raw terms (FLOPs, bytes, requests)
and seven ``Efficiency`` factors whose defaults are guesses. Given steps measured on a
real engine, each with the cost model's breakdown of the same batch, this module fits
five of them — ``matmul_flops_fraction``, ``attention_flops_fraction``,
``hbm_bandwidth_fraction``, ``step_overhead_s``, ``per_request_overhead_s`` — reports
which ones the measurements actually determine and how well the fitted model predicts
the steps, per batch kind, and writes a calibration file that ``kvtwin.sim.calibration.file.read_calibration`` reads.
``interconnect_fraction``, ``allreduce_latency_s``, the all-reduce curves, the fixed GPU
times and ``matmul_half_tokens`` are not fitted: each sample's ``communication_s`` and
``serial_s`` (element-wise and fixed GPU seconds) are taken as they are, and the GEMM
seconds keep the base's size curve.

The step time is piecewise linear in x = (1/matmul, 1/attention, 1/hbm, step overhead,
per-request overhead):

    gpu_s     = max(gemm_s_at_peak * x1, weight_bytes/BW * x3)
                + max(attention_work/P * x2, kv_bytes/BW * x3) + serial_s + communication_s
    overhead_s = x4 + x5 * num_requests
    total_s   = max(gpu_s, overhead_s) (async) or gpu_s + overhead_s (sync)

so once each sample's active branch of the maxima is known, the fit is a linear least
squares. ``fit_efficiency`` alternates the two (an active-set iteration): assign
branches under the current parameters, solve, reassign, until the branches stop moving.

Standard library and numpy only.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kvtwin.sim.replay.cost_model import StepCost, gemm_s
from kvtwin.sim.calibration.efficiency import (COLLECTIVE_OPS, SCALAR_EFFICIENCY_FIELDS, TABLE_EFFICIENCY_FIELDS,
                                                Efficiency)

# Fitted columns, in the order of x above. The order also decides which of two
# collinear columns the fit keeps (the earlier one).
_COLUMNS = ("matmul_flops_fraction", "attention_flops_fraction", "hbm_bandwidth_fraction",
            "step_overhead_s", "per_request_overhead_s")
_KINDS = ("decode-only", "mixed", "prefill-heavy")


@dataclass(frozen=True)
class StepSample:
    """One measured step.

    ``cost`` is the cost model's breakdown of the step's batch under whatever efficiency
    it was built with; only its raw terms (linear_flops, attention_flops, weight_bytes,
    kv_bytes, communication_s, num_requests) are used, never its times.
    """

    cost: StepCost
    measured_s: float
    kind: str  # batch_kind(...) of the step


def batch_kind(num_decode_tokens: int, num_prefill_tokens: int, *, prefill_heavy_share: float = 0.9) -> str:
    """The kind of a step's batch, by where its tokens go.

    * "decode-only": no prefill tokens;
    * "prefill-heavy": prefill tokens are at least ``prefill_heavy_share`` (90%) of the
      step's tokens (a pure prefill step included);
    * "mixed": anything else (prefill tokens present, but under that share).

    These are the regimes the roofline treats differently: decode steps are bound by
    reading weights and KV, prefill steps by matmul FLOPs, mixed steps sit in between.
    """
    if num_decode_tokens < 0 or num_prefill_tokens < 0 or num_decode_tokens + num_prefill_tokens == 0:
        raise ValueError(f"a step needs a non-negative, non-zero token count, got "
                         f"{num_decode_tokens} decode and {num_prefill_tokens} prefill tokens")
    if num_prefill_tokens == 0:
        return "decode-only"
    if num_prefill_tokens >= prefill_heavy_share * (num_decode_tokens + num_prefill_tokens):
        return "prefill-heavy"
    return "mixed"


def predict_s(cost: StepCost, efficiency: Efficiency, *, flops_per_s: float, bytes_per_s: float,
              async_scheduling: bool) -> float:
    """Seconds of a step recomputed from ``cost``'s raw terms with ``efficiency``.

    Written exactly as ``CostModel.split_step_cost`` writes it, so that both agree to the
    last bit for the same efficiency; ``bytes_per_s`` is the raw HBM peak.
    """
    gemm_compute_s = gemm_s(efficiency, flops_per_s, cost.body_flops, cost.num_tokens, cost.head_flops,
                            cost.num_requests)
    attention_compute_s = cost.attention_work / (flops_per_s * efficiency.attention_flops_fraction)
    hbm_bytes_per_s = bytes_per_s * efficiency.hbm_bandwidth_fraction
    weights_s = cost.weight_bytes / hbm_bytes_per_s
    kv_s = cost.kv_bytes / hbm_bytes_per_s
    overhead_s = efficiency.step_overhead_s + efficiency.per_request_overhead_s * cost.num_requests
    gpu_s = (max(gemm_compute_s, weights_s) + max(attention_compute_s, kv_s) + cost.elementwise_bytes / hbm_bytes_per_s
             + cost.extra_gpu_s + cost.communication_s)
    return max(gpu_s, overhead_s) if async_scheduling else gpu_s + overhead_s


@dataclass(frozen=True)
class Fit:
    """A fitted efficiency and how far to trust it.

    ``identified`` names the Efficiency fields the samples determined; every other field
    is the base value. ``median_ape`` and ``p90_ape`` are the fitted model's absolute
    percentage errors on the samples, as fractions (0.03 is 3%).
    """

    efficiency: Efficiency
    identified: tuple[str, ...]
    notes: tuple[str, ...]
    iterations: int
    median_ape: float
    p90_ape: float
    flops_per_s: float
    bytes_per_s: float
    async_scheduling: bool

    def predict_s(self, cost: StepCost) -> float:
        return predict_s(cost, self.efficiency, flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s,
                         async_scheduling=self.async_scheduling)


@dataclass(frozen=True)
class _Terms:
    """The samples' raw terms as arrays, in seconds at the datasheet peaks."""

    linear_s: np.ndarray  # linear_flops / P
    attention_s: np.ndarray  # attention_work / P
    weights_s: np.ndarray  # weight_bytes / BW
    kv_s: np.ndarray  # kv_bytes / BW
    elementwise_s: np.ndarray  # elementwise_bytes / BW: serial, scaled by 1/hbm like the reads
    given_s: np.ndarray  # communication and fixed GPU seconds, as the cost model gave them
    num_requests: np.ndarray
    measured_s: np.ndarray

    def gpu_s(self, x: np.ndarray) -> np.ndarray:
        """The GPU seconds under parameters x: the GEMMs and the attention each on its roofline."""
        return (np.maximum(self.linear_s * x[0], self.weights_s * x[2])
                + np.maximum(self.attention_s * x[1], self.kv_s * x[2]) + self.elementwise_s * x[2] + self.given_s)

    def overhead_s(self, x: np.ndarray) -> np.ndarray:
        return x[3] + x[4] * self.num_requests

    def total_s(self, x: np.ndarray, async_scheduling: bool) -> np.ndarray:
        gpu_s, overhead_s = self.gpu_s(x), self.overhead_s(x)
        return np.maximum(gpu_s, overhead_s) if async_scheduling else gpu_s + overhead_s


def _terms(samples: Sequence[StepSample], flops_per_s: float, bytes_per_s: float, base: Efficiency) -> _Terms:
    costs = [s.cost for s in samples]
    # GEMM seconds at a fraction of 1 with base's size curve: the fit scales them by
    # 1/matmul_flops_fraction and keeps matmul_half_tokens.
    at_peak = replace(base, matmul_flops_fraction=1.0)
    return _Terms(
        linear_s=np.array([gemm_s(at_peak, flops_per_s, c.body_flops, c.num_tokens, c.head_flops, c.num_requests)
                           for c in costs], dtype=float),
        attention_s=np.array([c.attention_work for c in costs], dtype=float) / flops_per_s,
        weights_s=np.array([c.weight_bytes for c in costs], dtype=float) / bytes_per_s,
        kv_s=np.array([c.kv_bytes for c in costs], dtype=float) / bytes_per_s,
        elementwise_s=np.array([c.elementwise_bytes for c in costs], dtype=float) / bytes_per_s,
        given_s=np.array([c.communication_s + c.extra_gpu_s for c in costs], dtype=float),
        num_requests=np.array([c.num_requests for c in costs], dtype=float),
        measured_s=np.array([s.measured_s for s in samples], dtype=float),
    )


def _branches(terms: _Terms, x: np.ndarray,
              async_scheduling: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample: are the GEMMs bound by their FLOPs (not the weights' read), is the
    attention bound by its FLOPs (not the KV read), and (async) is the GPU (not the CPU
    overhead) the step's bound. Ties go to the first; either gives the same time."""
    gemm_bound = terms.linear_s * x[0] >= terms.weights_s * x[2]
    attention_bound = terms.attention_s * x[1] >= terms.kv_s * x[2]
    gpu_bound = terms.gpu_s(x) >= terms.overhead_s(x)
    if not async_scheduling:
        gpu_bound = np.ones_like(gpu_bound)
    return gemm_bound, attention_bound, gpu_bound


def _design(terms: _Terms, gemm_bound: np.ndarray, attention_bound: np.ndarray, gpu_bound: np.ndarray,
            async_scheduling: bool) -> tuple[np.ndarray, np.ndarray]:
    """The linear system of the active branches, rows divided by measured_s so that each
    step counts by its relative error (a 1 ms decode as much as a 1 s prefill)."""
    n = len(terms.measured_s)
    a = np.zeros((n, len(_COLUMNS)))
    on_gpu = gpu_bound.astype(float)
    a[:, 0] = terms.linear_s * gemm_bound * on_gpu
    a[:, 1] = terms.attention_s * attention_bound * on_gpu
    # Element-wise traffic streams from HBM whatever bounds the GEMMs and the attention.
    a[:, 2] = (terms.weights_s * ~gemm_bound + terms.kv_s * ~attention_bound + terms.elementwise_s) * on_gpu
    # Synchronous: the overhead always adds. Asynchronous: it is the step only where it
    # outlasts the GPU.
    on_cpu = (~gpu_bound).astype(float) if async_scheduling else np.ones(n)
    a[:, 3] = on_cpu
    a[:, 4] = terms.num_requests * on_cpu
    target = terms.measured_s - terms.given_s * on_gpu
    return a / terms.measured_s[:, None], target / terms.measured_s


def _identifiable(a: np.ndarray, candidates: Iterable[int]) -> tuple[list[int], dict[int, str]]:
    """Columns the active rows determine, in _COLUMNS order: a column counts if it adds
    to the rank of those kept before it. Why the others do not, by column."""
    kept: list[int] = []
    why: dict[int, str] = {}
    for j in candidates:
        column = a[:, j]
        if not np.any(column):
            why[j] = "no sample's active branch has this term"
            continue
        trial = a[:, kept + [j]]
        trial = trial / np.linalg.norm(trial, axis=0)  # unit columns: rank by shape, not scale
        if np.linalg.matrix_rank(trial, tol=1e-6 * np.sqrt(len(kept) + 1)) == len(kept) + 1:
            kept.append(j)
        else:
            why[j] = "collinear with " + ", ".join(_COLUMNS[k] for k in kept) + " in the samples"
    return kept, why


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """min |a y - b| over y >= 0 by dropping the most negative coefficient and solving
    again (a few columns only, so this simple loop is enough). Returns y and the columns
    the bound held at zero."""
    free = list(range(a.shape[1]))
    y = np.zeros(a.shape[1])
    dropped: list[int] = []
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    while free:
        # Unit columns keep lstsq well conditioned across terms that differ by 10^6.
        sol = np.linalg.lstsq(a[:, free] / scale[free], b, rcond=None)[0] / scale[free]
        if np.all(sol >= 0):
            y[free] = sol
            break
        worst = free[int(np.argmin(sol))]
        free.remove(worst)
        dropped.append(worst)
    return y, dropped


def _solve(terms: _Terms, x: np.ndarray, branches: tuple[np.ndarray, np.ndarray, np.ndarray],
           candidates: list[int], async_scheduling: bool):
    """One least-squares solve on fixed branches; the columns it cannot identify keep
    their value in x. Returns the new x, the identified columns, why the other
    candidates are not, and the columns clamped at their bound."""
    a, b = _design(terms, *branches, async_scheduling)
    kept, why = _identifiable(a, candidates)
    # Inverse fractions are at least 1 (a fraction is at most 1), overheads at least 0:
    # solve for the excess over that bound, which must be non-negative.
    lower = np.array([1.0, 1.0, 1.0, 0.0, 0.0])
    fixed = [j for j in range(len(_COLUMNS)) if j not in kept]
    rhs = b - a[:, fixed] @ x[fixed] - a[:, kept] @ lower[kept]
    excess, dropped = _nonnegative_lstsq(a[:, kept], rhs)
    new_x = x.copy()
    new_x[kept] = lower[kept] + excess
    return new_x, kept, why, [kept[i] for i in dropped]


def _objective(terms: _Terms, x: np.ndarray, async_scheduling: bool) -> float:
    residual = terms.total_s(x, async_scheduling) / terms.measured_s - 1.0
    return float(residual @ residual)


def _ape(predicted_s: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    return np.abs(predicted_s - measured_s) / measured_s


def fit_efficiency(samples: Sequence[StepSample], *, flops_per_s: float, bytes_per_s: float,
                   async_scheduling: bool, base: Efficiency = Efficiency(), fit_overhead: bool = True,
                   max_iterations: int = 50) -> Fit:
    """Least-squares fit of the efficiency factors to measured steps.

    ``flops_per_s`` and ``bytes_per_s`` are the raw datasheet peaks (gpu.bf16_flops,
    gpu.hbm_bandwidth_bytes_per_s); ``async_scheduling`` as the measured engine ran.
    Errors are relative (each step weighs by its relative error). Fields the samples do
    not determine, and the overheads when ``fit_overhead`` is false, keep ``base``'s value;
    so do interconnect_fraction and allreduce_latency_s always.
    """
    if not samples:
        raise ValueError("fit_efficiency needs at least one sample")
    measured = [s.measured_s for s in samples]
    if not all(math.isfinite(m) and m > 0 for m in measured):
        raise ValueError("every sample's measured_s must be a positive, finite number of seconds")
    if not (flops_per_s > 0 and bytes_per_s > 0):
        raise ValueError(f"peaks must be positive, got flops_per_s={flops_per_s}, bytes_per_s={bytes_per_s}")
    terms = _terms(samples, flops_per_s, bytes_per_s, base)
    base_x = np.array([1.0 / base.matmul_flops_fraction, 1.0 / base.attention_flops_fraction,
                       1.0 / base.hbm_bandwidth_fraction, base.step_overhead_s, base.per_request_overhead_s])
    candidates = list(range(len(_COLUMNS))) if fit_overhead else [0, 1, 2]

    # A column that drops out of a solve keeps its last fitted value while iterating, not
    # the base one: resetting it would move the very branches that made it drop out
    # (async: the base overhead claims steps back from the GPU), and the set would cycle.
    x = base_x
    best = None  # (objective, x, kept, why, clamped)
    branches = _branches(terms, x, async_scheduling)
    converged = False
    iterations = 0
    while iterations < max_iterations:
        iterations += 1
        x, kept, why, clamped = _solve(terms, x, branches, candidates, async_scheduling)
        objective = _objective(terms, x, async_scheduling)
        if best is None or objective < best[0]:
            best = (objective, x, kept, why, clamped)
        new_branches = _branches(terms, x, async_scheduling)
        if all(np.array_equal(old, new) for old, new in zip(branches, new_branches)):
            converged = True
            break
        branches = new_branches
    # Without convergence the branches may cycle; the best iterate is the answer then.
    _, fitted_x, kept, why, clamped = best
    # What the samples did not determine is the base's, as promised.
    x = np.where(np.isin(np.arange(len(_COLUMNS)), kept), fitted_x, base_x)

    notes = []
    for j, reason in sorted(why.items()):
        notes.append(f"{_COLUMNS[j]}: not identified ({reason}); kept {getattr(base, _COLUMNS[j])!r} from base")
    if not fit_overhead:
        notes.append("step_overhead_s, per_request_overhead_s: not fitted (fit_overhead=False); kept from base")
    for j in clamped:
        if j < 3:
            notes.append(f"{_COLUMNS[j]}: the samples ask for more than the datasheet peak; clamped to 1.0")
        else:
            notes.append(f"{_COLUMNS[j]}: the samples ask for a negative overhead; clamped to 0.0")
    if not converged:
        notes.append(f"branches did not settle in {max_iterations} iterations; the best iterate is returned")
    moved = sum(int(np.sum(old != new)) for old, new in
                zip(_branches(terms, fitted_x, async_scheduling), _branches(terms, x, async_scheduling)))
    if moved:
        notes.append(f"the base values of the fields not identified contradict the samples: they move "
                     f"{moved} step branch(es), and median_ape and p90_ape include that")

    values = {name: float(1.0 / x[j] if j < 3 else x[j]) for j, name in enumerate(_COLUMNS) if j in kept}
    efficiency = replace(base, **values)
    ape = _ape(terms.total_s(x, async_scheduling), terms.measured_s)
    return Fit(efficiency=efficiency, identified=tuple(_COLUMNS[j] for j in sorted(kept)), notes=tuple(notes),
               iterations=iterations, median_ape=float(np.percentile(ape, 50, method="linear")),
               p90_ape=float(np.percentile(ape, 90, method="linear")), flops_per_s=flops_per_s,
               bytes_per_s=bytes_per_s, async_scheduling=async_scheduling)


def ape_by_kind(predicted_s: Sequence[float], measured_s: Sequence[float], kinds: Sequence[str]) -> list[dict]:
    """Absolute percentage errors (fractions) over all steps, then per batch kind present:
    ``{"kind", "count", "median_ape", "p90_ape"}`` each, "all" first, kinds in a fixed order."""
    predicted = np.asarray(predicted_s, dtype=float)
    measured = np.asarray(measured_s, dtype=float)
    kinds_array = np.asarray(list(kinds), dtype=object)
    if not (len(predicted) == len(measured) == len(kinds_array)):
        raise ValueError(f"predicted_s, measured_s and kinds differ in length: "
                         f"{len(predicted)}, {len(measured)}, {len(kinds_array)}")
    if not np.all(measured > 0):
        raise ValueError("measured_s must be positive to be a denominator")
    unknown = set(kinds_array) - set(_KINDS)
    if unknown:
        raise ValueError(f"unknown batch kinds {sorted(unknown)}; expected {', '.join(_KINDS)}")
    ape = _ape(predicted, measured)

    def row(kind: str, values: np.ndarray) -> dict:
        if not len(values):
            return {"kind": kind, "count": 0, "median_ape": math.nan, "p90_ape": math.nan}
        return {"kind": kind, "count": int(len(values)),
                "median_ape": float(np.percentile(values, 50, method="linear")),
                "p90_ape": float(np.percentile(values, 90, method="linear"))}

    return [row("all", ape)] + [row(kind, ape[kinds_array == kind]) for kind in _KINDS if np.any(kinds_array == kind)]


def _toml_float(value: float) -> str:
    # repr is the shortest string that reads back to the same float, and its forms
    # ("0.6", "1.5e-05", "inf") are all valid TOML floats; float() keeps ints as floats.
    return repr(float(value))


def _comment(line: str) -> str:
    # A TOML comment may not hold control characters other than tab.
    return "# " + "".join(ch if ch == "\t" or ord(ch) >= 0x20 and ch != "\x7f" else " " for ch in line)


def calibration_text(fit_or_efficiency: Fit | Efficiency, *, comment_lines: Iterable[str] = (),
                     label: str | None = None, errors: dict[str, float] | None = None,
                     sources: Sequence[dict[str, str]] = (), warning: str | None = None,
                     bands: dict[str, tuple[float, float]] | None = None) -> str:
    """The calibration TOML ``write_calibration`` writes, as text: ``label``, a ``warning``
    about the measurements, the ``[cost_model]`` factors, the held-out ``errors``
    (``[error]``: kind -> p90 absolute relative error, as ``kvtwin.sim.calibration.band`` reads them),
    the held-out ``bands`` (``[band]``: kind -> (low, high) ratios of measured to replayed
    p99s) and the ``sources`` measured."""
    if isinstance(fit_or_efficiency, Fit):
        fit, efficiency = fit_or_efficiency, fit_or_efficiency.efficiency
    else:
        fit, efficiency = None, fit_or_efficiency
    header = ["kvtwin cost-model calibration: efficiency factors for kvtwin.sim.replay.cost_model,",
              "written by kvtwin.sim.calibration.fit.step_model.write_calibration."]
    if fit is not None:
        header += [f"Fitted to measured steps ({'asynchronous' if fit.async_scheduling else 'synchronous'} "
                   f"scheduling) in {fit.iterations} iteration(s):",
                   f"identified: {', '.join(fit.identified) or 'nothing'}",
                   f"absolute percentage error on the samples: median {fit.median_ape:.3%}, p90 {fit.p90_ape:.3%}"]
        header += [f"note: {note}" for note in fit.notes]
    for line in comment_lines:
        header += str(line).splitlines() or [""]
    text = "\n".join(_comment(line) for line in header) + "\n\n"
    if label:
        text += f"label = {_toml_string(label)}\n"
    if warning:
        text += f"warning = {_toml_string(warning)}\n"
    if label or warning:
        text += "\n"
    text += "[cost_model]\n"
    text += "".join(f"{name} = {_toml_float(getattr(efficiency, name))}\n" for name in SCALAR_EFFICIENCY_FIELDS)
    # An empty list is written, so that no base's curves leak into a load; before any
    # [[...]] table, which would take it in.
    for name in TABLE_EFFICIENCY_FIELDS:
        if not getattr(efficiency, name):
            text += f"{name} = []\n"
    for curve in efficiency.allreduce:
        text += (f"\n[[cost_model.allreduce]]\ntensor_parallel_size = {curve.tensor_parallel_size}\n"
                 f"message_bytes = [{', '.join(_toml_float(b) for b in curve.message_bytes)}]\n"
                 f"seconds = [{', '.join(_toml_float(t) for t in curve.seconds)}]\n")
    for op in COLLECTIVE_OPS:
        for c in getattr(efficiency, op):
            text += (f"\n[[cost_model.{op}]]\nnum_gpus = {c.num_gpus}\n"
                     f"message_bytes = [{', '.join(_toml_float(b) for b in c.message_bytes)}]\n"
                     f"seconds = [{', '.join(_toml_float(t) for t in c.seconds)}]\n")
    for table in efficiency.deepep:
        text += (f"\n[[cost_model.deepep]]\nmode = {_toml_string(table.mode)}\nnodes = {table.nodes}\n"
                 f"hidden_size = {table.hidden_size}\ntop_k = {table.top_k}\n"
                 + "".join(f"{name} = [{', '.join(_toml_float(v) for v in getattr(table, name))}]\n"
                           for name in ("tokens_per_rank", "dispatch_s", "combine_s")))
    finite = {kind: value for kind, value in (errors or {}).items() if math.isfinite(value)}
    if finite:
        text += "\n[error]  # p90 absolute relative error on a held-out fold\n"
        text += "".join(f"{kind} = {_toml_float(value)}\n" for kind, value in finite.items())
    if bands:
        text += "\n[band]  # held-out ratios of a measured p99 to the replay's: [low, high]\n"
        text += "".join(f"{kind} = [{_toml_float(low)}, {_toml_float(high)}]\n" for kind, (low, high) in bands.items())
    for source in sources:
        text += "\n[[source]]\n" + "".join(f"{key} = {_toml_string(str(value))}\n" for key, value in source.items())
    return text


def _toml_string(value: str) -> str:
    # A TOML basic string: JSON's escapes are TOML's for every character JSON escapes.
    import json

    return json.dumps(value, ensure_ascii=False)


def write_calibration(path: Path | str, fit_or_efficiency: Fit | Efficiency, *,
                      comment_lines: Iterable[str] = (), label: str | None = None,
                      errors: dict[str, float] | None = None, sources: Sequence[dict[str, str]] = (),
                      warning: str | None = None, bands: dict[str, tuple[float, float]] | None = None) -> Path:
    """Write a calibration TOML (``[cost_model]``, every Efficiency field) that
    ``kvtwin.sim.calibration.file.read_calibration`` reads back to the same Efficiency. The file is replaced whole or
    not at all. Returns the path written."""
    path = Path(path)
    text = calibration_text(fit_or_efficiency, comment_lines=comment_lines, label=label, errors=errors,
                            sources=sources, warning=warning, bands=bands)

    # A temporary file in the same directory, so that os.replace is a rename on one
    # file system; os.open with 0o666 lets the umask decide the mode, as for any file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# A step's raw cost terms as columns (kvtwin validate's steps.parquet carries them, so
# that `kvtwin calibrate --steps` can refit without the batches): StepCost field -> column.
STEP_TERM_COLUMNS = {"num_tokens": "cost_num_tokens", "num_requests": "cost_num_requests",
                     "body_flops": "cost_body_flops", "head_flops": "cost_head_flops",
                     "attention_flops": "cost_attention_flops", "attention_work": "cost_attention_work",
                     "weight_bytes": "cost_weight_bytes",
                     "kv_bytes": "cost_kv_bytes", "elementwise_bytes": "cost_elementwise_bytes",
                     "communication_s": "cost_communication_s", "extra_gpu_s": "cost_extra_gpu_s"}


def step_terms(cost: StepCost | None) -> dict[str, float]:
    """``STEP_TERM_COLUMNS`` of one step (NaN for a step without a prediction)."""
    return {column: (float(getattr(cost, name)) if cost is not None else math.nan)
            for name, column in STEP_TERM_COLUMNS.items()}


def step_cost_from_terms(terms: dict[str, float]) -> StepCost:
    """The raw terms of a step back as a ``StepCost`` (times zero: a fit reads only terms)."""
    get = {name: terms[column] for name, column in STEP_TERM_COLUMNS.items()}
    linear = get["body_flops"] + get["head_flops"]
    return StepCost(0.0, 0.0, 0.0, get["communication_s"], 0.0, linear + get["attention_flops"], get["weight_bytes"],
                    get["kv_bytes"], linear, get["attention_flops"], int(get["num_requests"]),
                    int(get["num_tokens"]), get["body_flops"], get["head_flops"], get["elementwise_bytes"],
                    get["extra_gpu_s"], get["attention_work"])
