"""``diff.html``'s plots: two runs drawn over each other, A in the first colour and B in the
second, on one time axis (both binned over the longer run, so their bins coincide).

The drawing helpers are ``reports.plots``' own (fixed margins, one draw, PNG without
metadata), so these figures are as deterministic and as quick as a report's."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from kvtwin.reports.binning import (bin_index, cdf_values, column_array, combined_state, hit_rate_bins, minmax_points,
                                    replica_ids)
from kvtwin.reports.figure_jobs import PendingFigure, render_figures
from kvtwin.reports.plots import COLORS, MAX_LINE_POINTS, _empty, _figure, _log_x, _png, _time_axis, _title
from kvtwin.reports.summary_text import missing

TIME_BINS = 400
HIT_RATE_BINS = 100
_LATENCIES = (("TTFT", "ttft_s", "slo_ttft_ms"), ("TPOT", "tpot_s", "slo_tpot_ms"), ("E2E latency", "e2el_s", None))


def overlaid_cdfs(runs: Sequence[tuple[str, Sequence[tuple[str, np.ndarray]]]],
                  slo: dict[str, dict[str, float]]) -> bytes:
    """One panel per latency, each run's CDF (sorted values in ms) in its colour; a dashed
    line at the SLO bound (one grey line where both runs have the same, else each run's in
    its colour)."""
    names = [name for name, _ in runs[0][1]]
    fig, axes = _figure(len(names))
    for ax, name in zip(axes, names):
        drawn = []
        for i, (label, series) in enumerate(runs):
            values = np.asarray(dict(series)[name], dtype=float)
            if len(values):
                y = np.linspace(0, 1, len(values)) if len(values) > 1 else np.ones(1)
                ax.plot(values, y * 100, color=COLORS[i], linewidth=1.4, label=label)
                drawn.append(values)
        bounds = [(i, label, slo.get(label, {}).get(name)) for i, (label, _) in enumerate(runs)]
        bounds = [(i, label, bound) for i, label, bound in bounds if bound is not None and np.isfinite(bound)]
        if len(bounds) == len(runs) and len({bound for _, _, bound in bounds}) == 1:
            ax.axvline(bounds[0][2], color="#777", linestyle="--", linewidth=1, label="SLO")
        else:
            for i, label, bound in bounds:
                ax.axvline(bound, color=COLORS[i], linestyle="--", linewidth=1, label=f"{label}: SLO")
        if not drawn:
            _empty(ax)
        else:
            values = np.concatenate(drawn)
            if values.min() > 0 and values.max() / values.min() > 100:
                _log_x(ax)
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 100)
        _title(ax, f"{name} CDF")
    axes[0].set_ylabel("requests (%)")
    return _png(fig)


def overlaid_over_time(t: np.ndarray, series: Sequence[tuple[str, np.ndarray]], *, ylabel: str, title: str) -> bytes:
    """A fraction over time per run (drawn in %), each in its colour."""
    fig, (ax,) = _figure()
    if len(t) == 0 or not any(np.isfinite(values).any() for _, values in series):
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        for i, (label, values) in enumerate(series):
            xs, ys = minmax_points(x, np.asarray(values, dtype=float) * 100, MAX_LINE_POINTS)
            # Markers too: a bin between two empty ones (no request scheduled there) is a point.
            ax.plot(xs, ys, color=COLORS[i], linewidth=1.2, marker=".", markersize=3, label=label)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel(ylabel)
    _title(ax, title)
    return _png(fig)


def _end_s(summary: dict, steps: pa.Table) -> float:
    end = float(summary.get("duration_s") or 0.0)
    if steps.num_rows:
        end = max(end, float(np.nanmax(column_array(steps, "time_s") + column_array(steps, "duration_s"))))
    return end


def _usage(steps: pa.Table, t_end: float, run_end: float) -> np.ndarray:
    """Mean KV usage per bin (averaged over replicas), NaN past the run's own end."""
    if not steps.num_rows:
        return np.full(TIME_BINS, np.nan)
    idx = bin_index(column_array(steps, "time_s"), t_end, TIME_BINS)
    usage = combined_state(idx, column_array(steps, "kv_cache_usage"), TIME_BINS, replica_ids(steps), "mean")[0]
    centers = (np.arange(TIME_BINS) + 0.5) * (t_end / TIME_BINS)
    return np.where(centers <= run_end, usage, np.nan)


def diff_figures(runs: Sequence[tuple[str, object, pa.Table, pa.Table]]) -> list[str]:
    """The page's figures for (name, ``diff.Run``, requests, steps) of A and B."""
    ends = [_end_s(run.summary, steps) for _, run, _, steps in runs]
    t_end = max(max(ends), 1e-9)
    labels = [f"{name}: {run.directory}" for name, run, _, _ in runs]
    cdfs = []
    for label, (_, run, requests, _) in zip(labels, runs):
        finished = np.asarray(requests.column("status").to_pylist()) == "finished" if requests.num_rows \
            else np.zeros(0, dtype=bool)
        cdfs.append((label, [(name, cdf_values(column_array(requests, column)[finished] * 1000)
                                  if requests.num_rows else np.zeros(0)) for name, column, _ in _LATENCIES]))
    slo = {label: {name: float(run.summary[key]) for name, _, key in _LATENCIES
                   if key is not None and not missing(run.summary.get(key))}
           for label, (_, run, _, _) in zip(labels, runs)}
    centers = (np.arange(TIME_BINS) + 0.5) * (t_end / TIME_BINS)
    usage = [(label, _usage(steps, t_end, end)) for label, (_, _, _, steps), end in zip(labels, runs, ends)]
    hits = [(label, hit_rate_bins(requests, t_end, HIT_RATE_BINS)[1]) for label, (_, _, requests, _) in
            zip(labels, runs)]
    hit_centers = (np.arange(HIT_RATE_BINS) + 0.5) * (t_end / HIT_RATE_BINS)
    hits = [(label, rate if len(rate) else np.full(HIT_RATE_BINS, np.nan)) for label, rate in hits]
    pending = [
        PendingFigure(partial(overlaid_cdfs, cdfs, slo),
                      "Cumulative distributions of TTFT, TPOT and end-to-end latency over each run's finished "
                      "requests, A and B overlaid (dashed: each run's SLO).", "latency CDFs of both runs"),
        PendingFigure(partial(overlaid_over_time, centers, usage, ylabel="KV cache blocks in use (%)",
                              title="KV cache usage, A and B"),
                      f"KV cache usage over time (steps.parquet kv_cache_usage), mean per {t_end / TIME_BINS:,.3g} s "
                      "bin, averaged over each run's replicas.", "KV cache usage of both runs"),
        PendingFigure(partial(overlaid_over_time, hit_centers, hits, ylabel="prefix cache hit rate (%)",
                              title="Prefix cache hit rate, A and B"),
                      f"Prefix cache hit rate over time: prompt tokens found over tokens looked up, summed over the "
                      f"requests first scheduled in each {t_end / HIT_RATE_BINS:,.3g} s bin.",
                      "prefix cache hit rate of both runs"),
    ]
    return render_figures(pending)
