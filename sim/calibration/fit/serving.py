"""Fit the replay clock to a server's measured latencies: `vllm bench serve` runs or a
`/metrics` scrape.

Serving measurements see a request, not a step, so the fit does not solve for the
roofline's factors one by one. It replays the measured workload on the cost model and
moves three knobs until the replay's latencies match the measured ones:

* ``prefill_scale`` divides the GEMM and attention efficiency fractions (prefill is
  compute-bound: this moves TTFT and the prefill part of a mixed step);
* ``decode_scale`` divides the HBM fraction and multiplies the fixed GPU times (decode is
  bound by weights, KV and launch gaps: this moves TPOT). A fraction stops at 1, so a
  server faster than the base's HBM allows shows up as fixed times below the base's;
* ``client_overhead_s`` adds to the client-side TTFT and E2E (`vllm bench serve` times
  around HTTP; vLLM's own histograms do not, so a scrape leaves it at 0).

The objective is the mean squared log error over the fitted fold. A pattern search walks
the two scales, each evaluation a replay; the overhead changes no step, so each replay
gets its best overhead by a one-dimensional search on its output. The search is local,
and a replay's latencies are not smooth in the clock (a slightly faster step reorders a
few prefills that arrive together), so the fit is good to about a percent on the scales.
The error is then reported on a fold the fit never saw:
with several runs, the last run; with one, every other request (bench serve) or the
quantiles not fitted (a scrape).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from kvtwin.sim.calibration.fit.bench_serve import BenchServeResult
from kvtwin.sim.calibration.fit.prometheus import Histogram, ServerMetrics
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.replay.run import run_replay
from kvtwin.traces import schema as col

# Quantiles a scrape's histograms are fitted on, and those held out.
FIT_QUANTILES = (0.5, 0.9)
HELD_OUT_QUANTILES = (0.75, 0.99)


@dataclass(frozen=True)
class Knobs:
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    client_overhead_s: float = 0.0

    def apply(self, base: Efficiency) -> Efficiency:
        return dataclasses.replace(
            base,
            matmul_flops_fraction=min(1.0, base.matmul_flops_fraction / self.prefill_scale),
            attention_flops_fraction=min(1.0, base.attention_flops_fraction / self.prefill_scale),
            hbm_bandwidth_fraction=min(1.0, base.hbm_bandwidth_fraction / self.decode_scale),
            layer_fixed_s=base.layer_fixed_s * self.decode_scale,
            step_gpu_fixed_s=base.step_gpu_fixed_s * self.decode_scale,
            decode_attention_s_per_head=base.decode_attention_s_per_head * self.decode_scale,
            client_overhead_s=self.client_overhead_s)


@dataclass(frozen=True)
class ServingFit:
    """The fitted efficiency, its knobs, and the error on the fold it was not fitted on:
    ``held_out[kind] = (median, p90, count)`` of absolute relative errors, kind in ttft,
    tpot, e2e."""

    efficiency: Efficiency
    knobs: Knobs
    replays: int
    fitted_error: float  # the objective at the optimum (mean squared log error)
    held_out: dict[str, tuple[float, float, int]]
    fold: str  # what was held out, in words

    def p90_errors(self) -> dict[str, float]:
        return {kind: p90 for kind, (_, p90, count) in self.held_out.items() if count}


# -- from vllm bench serve ----------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredRequests:
    """Successful requests of the benchmark runs: a trace to replay and what was measured."""

    trace: pa.Table
    run: np.ndarray  # index of the run each row came from
    ttft_s: np.ndarray  # client-side
    tpot_s: np.ndarray  # NaN for a single-token output
    e2e_s: np.ndarray


def measured_requests(results: Sequence[BenchServeResult], trace: pa.Table | None = None) -> MeasuredRequests:
    """The replayable workload of ``results``: each run's successful requests arrive at
    their send time (runs one after another, an hour apart, so they never overlap), with
    their prompt and output lengths. ``trace``, when given (the dataset the benchmark ran
    as a kvtwin trace, in the benchmark's order), supplies the prompts' content so prefix
    caching can hit; without it every prompt is unique."""
    rows: dict[str, list] = {k: [] for k in ("id", "arrival", "prompt", "output", "hashes", "block")}
    run_of, ttft, tpot, e2e = [], [], [], []
    offset_s = 0.0
    position = 0
    for r, result in enumerate(results):
        if not result.requests:
            raise ConfigError("requests", "per-request rows (run `vllm bench serve` with --save-detailed)",
                              "a summary-only result", source=result.source)
        starts = [q.start_s for q in result.requests]
        if any(s is None for s in starts):
            raise ConfigError("start_times", "each request's send time (vLLM 0.33 writes start_times with "
                              "--save-detailed)", "no start_times", source=result.source)
        first = min(starts)
        for i, request in enumerate(result.requests):
            if trace is not None and position + i >= trace.num_rows:
                raise ConfigError("trace", f"at least as many rows as the benchmark's requests "
                                  f"({sum(len(x.requests) for x in results)})", trace.num_rows)
            if not request.success:
                continue
            if trace is not None:
                prompt = trace.column(col.PROMPT_TOKENS)[position + i].as_py()
                if prompt != request.input_tokens:
                    raise ConfigError(f"trace row {position + i}", f"the benchmark's prompt length "
                                      f"({request.input_tokens} tokens: the same dataset, in the same order)",
                                      prompt)
                rows["hashes"].append(trace.column(col.BLOCK_HASHES)[position + i].as_py())
                rows["block"].append(trace.column(col.HASH_BLOCK_TOKENS)[position + i].as_py())
            rows["id"].append(f"run{r}-{i}")
            rows["arrival"].append(offset_s + request.start_s - first)
            rows["prompt"].append(request.input_tokens)
            rows["output"].append(request.output_tokens)
            run_of.append(r)
            ttft.append(request.ttft_s)
            e2e.append(request.e2e_s)
            tpot.append((request.e2e_s - request.ttft_s) / (request.output_tokens - 1)
                        if request.output_tokens > 1 else math.nan)
        position += len(result.requests)
        offset_s = (max(rows["arrival"]) if rows["arrival"] else offset_s) + 3600.0
    if not rows["id"]:
        raise ConfigError("requests", "at least one successful request", "none", source=results[0].source)
    columns = {col.REQUEST_ID: rows["id"], col.ARRIVAL_TIME_S: rows["arrival"], col.PROMPT_TOKENS: rows["prompt"],
               col.OUTPUT_TOKENS: rows["output"]}
    if trace is not None:
        columns[col.BLOCK_HASHES] = rows["hashes"]
        columns[col.HASH_BLOCK_TOKENS] = rows["block"]
    meta = col.TraceMeta(source_format="vllm bench serve", source_file=", ".join(r.source for r in results),
                         content_identity=col.IDENTITY_HASHES if trace is not None else col.IDENTITY_NONE)
    table = col.build_table(columns, meta)
    order = np.argsort(np.asarray(rows["arrival"]), kind="stable")
    return MeasuredRequests(table, np.asarray(run_of)[order], np.asarray(ttft, float)[order],
                            np.asarray(tpot, float)[order], np.asarray(e2e, float)[order])


def _request_errors(simulated: pa.Table, measured: MeasuredRequests, mask: np.ndarray,
                    client_overhead_s: float) -> dict[str, np.ndarray]:
    """Relative errors per kind over the rows ``mask`` selects (replay rows are in trace order)."""
    status = simulated.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    ttft = simulated.column("ttft_s").to_numpy(zero_copy_only=False).astype(float) + client_overhead_s
    e2e = simulated.column("e2el_s").to_numpy(zero_copy_only=False).astype(float) + client_overhead_s
    tpot = simulated.column("tpot_s").to_numpy(zero_copy_only=False).astype(float)
    out = {}
    for kind, sim, meas in (("ttft", ttft, measured.ttft_s), ("tpot", tpot, measured.tpot_s),
                            ("e2e", e2e, measured.e2e_s)):
        ok = mask & done & np.isfinite(sim) & np.isfinite(meas) & (meas > 0) & (sim > 0)
        out[kind] = (sim[ok] - meas[ok]) / meas[ok]
    return out


def fit_bench_serve(plan: Plan, measured: MeasuredRequests, base: Efficiency, *,
                    deployment: Deployment = Deployment(),
                    on_replay: Callable[[int, float], None] | None = None) -> ServingFit:
    """Fit the three knobs to the benchmark's TTFT and TPOT, and report the held-out error."""
    runs = np.unique(measured.run)
    if len(runs) > 1:
        held = measured.run == runs[-1]
        fold = f"the last run ({int(held.sum())} requests), fitted on the {len(runs) - 1} before it"
    else:
        held = np.arange(len(measured.run)) % 2 == 1
        fold = f"every other request ({int(held.sum())}), fitted on the rest"
    fitted = ~held

    def loss_at(requests: pa.Table, overhead_s: float) -> float:
        errors = _request_errors(requests, measured, fitted, overhead_s)
        logs = [np.log1p(errors[k]) for k in ("ttft", "tpot") if errors[k].size]
        return float(np.mean(np.concatenate(logs) ** 2)) if logs else math.inf

    def evaluate(knobs: Knobs):
        # The client's overhead changes no step: one replay per (prefill, decode), and the
        # best overhead for it by a search along that one axis.
        requests = run_replay(plan, measured.trace, deployment=deployment, efficiency=knobs.apply(base)).requests
        overhead_s = _best_overhead_s(lambda o: loss_at(requests, o), float(np.nanmin(measured.ttft_s)))
        return loss_at(requests, overhead_s), (requests, overhead_s)

    knobs, loss, replays, (requests, overhead_s) = _pattern_search(evaluate, on_replay)
    knobs = dataclasses.replace(knobs, client_overhead_s=overhead_s)
    held_errors = _request_errors(requests, measured, held, overhead_s)
    return ServingFit(knobs.apply(base), knobs, replays, loss, _summaries(held_errors), fold)


def _best_overhead_s(loss: Callable[[float], float], upper_s: float) -> float:
    """The overhead in [0, upper_s) (no request's TTFT is shorter) minimising ``loss``: a
    grid, then a golden-section search around its best point."""
    grid = np.linspace(0.0, upper_s * 0.999, 41)
    values = [loss(o) for o in grid]
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loss(a) <= loss(b):
            hi = b
        else:
            lo = a
    return float((lo + hi) / 2)


# -- from a /metrics scrape ---------------------------------------------------------------


def fit_scrape(plan: Plan, trace: pa.Table, metrics: ServerMetrics, base: Efficiency, *,
               deployment: Deployment = Deployment(),
               on_replay: Callable[[int, float], None] | None = None) -> ServingFit:
    """Fit the prefill and decode knobs to the scrape's TTFT and ITL quantiles (the server's
    own, so no client overhead: the base's stays), replaying ``trace``: the load the scrape
    measured.
    Held out: the other quantiles of TTFT and ITL, and E2E's."""
    targets = {"ttft": metrics.ttft_s, "tpot": metrics.itl_s, "e2e": metrics.e2e_s}
    for kind, histogram in targets.items():
        if histogram is None or histogram.count <= 0:
            raise ConfigError(f"{kind} histogram", "observations between the two scrapes", "none")

    def simulated_quantiles(requests: pa.Table, itl_s: np.ndarray, qs: Sequence[float]) -> dict[str, np.ndarray]:
        done = requests.column("status").to_numpy(zero_copy_only=False) == "finished"
        values = {"ttft": requests.column("ttft_s").to_numpy(zero_copy_only=False)[done],
                  "tpot": itl_s, "e2e": requests.column("e2el_s").to_numpy(zero_copy_only=False)[done]}
        return {k: np.quantile(np.asarray(v, float), qs) if len(v) else np.full(len(qs), math.nan)
                for k, v in values.items()}

    def errors(result, kinds, qs) -> dict[str, np.ndarray]:
        sim = simulated_quantiles(result.requests, result.itl_s, qs)
        out = {}
        for kind in kinds:
            measured = np.array([targets[kind].quantile(q) for q in qs])
            ok = np.isfinite(measured) & (measured > 0) & np.isfinite(sim[kind])
            out[kind] = (sim[kind][ok] - measured[ok]) / measured[ok]
        return out

    def evaluate(knobs: Knobs):
        result = _replay_with_itl(plan, trace, knobs.apply(base), deployment)
        e = errors(result, ("ttft", "tpot"), FIT_QUANTILES)
        logs = np.concatenate([np.log1p(v) for v in e.values()])
        return (float(np.mean(logs ** 2)) if logs.size else math.inf), result

    knobs, loss, replays, result = _pattern_search(evaluate, on_replay)
    held = errors(result, ("ttft", "tpot"), HELD_OUT_QUANTILES)
    held["e2e"] = errors(result, ("e2e",), FIT_QUANTILES + HELD_OUT_QUANTILES)["e2e"]
    fold = (f"quantiles {', '.join(map(str, HELD_OUT_QUANTILES))} of TTFT and ITL and every E2E quantile; fitted "
            f"on TTFT and ITL at {', '.join(map(str, FIT_QUANTILES))}")
    # A server's histograms leave the time outside the engine out, so they cannot fit it:
    # the base's (a bundled calibration's default) stays (docs/capacity.md#client-side-latency).
    efficiency = dataclasses.replace(knobs.apply(base), client_overhead_s=base.client_overhead_s)
    return ServingFit(efficiency, knobs, replays, loss, _summaries(held), fold)


@dataclass
class _ReplayWithItl:
    requests: pa.Table
    itl_s: np.ndarray


def _replay_with_itl(plan: Plan, trace: pa.Table, efficiency: Efficiency,
                     deployment: Deployment = Deployment()) -> _ReplayWithItl:
    """A replay's requests and every inter-token gap (the scrape's ITL histogram counts
    gaps, not per-request means)."""
    requests = run_replay(plan, trace, deployment=deployment, efficiency=efficiency).requests
    done = requests.column("status").to_numpy(zero_copy_only=False) == "finished"
    tpot = requests.column("tpot_s").to_numpy(zero_copy_only=False).astype(float)[done]
    generated = requests.column("generated_tokens").to_numpy(zero_copy_only=False)[done]
    # A request's gaps average to its TPOT; repeat it once per gap. The histogram's
    # quantiles then weigh each request by its gaps, as the server's histogram does.
    gaps = np.repeat(tpot, np.maximum(generated - 1, 0))
    return _ReplayWithItl(requests, gaps[np.isfinite(gaps)])


# -- the search --------------------------------------------------------------------------


def _pattern_search(evaluate, on_replay, *, min_step: float = 0.002, restarts: int = 3):
    """Minimise ``evaluate(knobs)[0]`` over (log prefill_scale, log decode_scale): try a
    step each way along each axis, take the first improvement, halve the steps when none
    improves. Then start again from the best point with the first steps (a ridge between
    the two knobs stalls a search at small steps), until a restart finds nothing better.
    Returns the knobs (client overhead 0: ``evaluate`` chooses it), the loss, the replays
    run and ``evaluate``'s payload at the best point."""
    replays = 0

    def knobs_at(v) -> Knobs:
        return Knobs(math.exp(v[0]), math.exp(v[1]))

    def run(v):
        nonlocal replays
        replays += 1
        loss, payload = evaluate(knobs_at(v))
        if on_replay is not None:
            on_replay(replays, loss)
        return loss, payload

    x = np.zeros(2)
    best, payload = run(x)
    for _ in range(restarts + 1):
        start_loss = best
        step = np.array([0.4, 0.4])
        while step.max() >= min_step:
            moved = False
            for i in range(2):
                for sign in (1.0, -1.0):
                    trial = x.copy()
                    trial[i] += sign * step[i]
                    loss, trial_payload = run(trial)
                    if loss < best:
                        x, best, payload, moved = trial, loss, trial_payload, True
                        break
                if moved:
                    break
            if not moved:
                step = step / 2
        if best >= start_loss:
            break
    return knobs_at(x), best, replays, payload


def _summaries(errors: dict[str, np.ndarray]) -> dict[str, tuple[float, float, int]]:
    out = {}
    for kind, values in errors.items():
        absolute = np.abs(values)
        out[kind] = ((float(np.median(absolute)), float(np.percentile(absolute, 90)), int(absolute.size))
                     if absolute.size else (math.nan, math.nan, 0))
    return out
