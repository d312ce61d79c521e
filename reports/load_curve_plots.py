"""The latency–load curve of ``kvtwin capacity --load-curve`` (docs/capacity.md#load-curve), drawn
as ``vllm bench serve`` sweeps are read: achieved against offered throughput with the
diagonal it follows until the knee, and median and p99 TTFT and TPOT against the offered
rate with the SLO's bounds. With a calibrated clock the slow edge (every step slower by the
calibration's held-out step error) is drawn dashed and the band between it and the central
p99 is shaded: where the answer could lie given the clock's measured error."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa

from kvtwin.reports.figure_jobs import PendingFigure
from kvtwin.reports.plots import COLORS, _figure, _png, _title
from kvtwin.reports.sweep_frame import combo_label, numbers, records, rows_where

# Curves drawn at most (one figure each); a sweep with more is summarised by its table.
MAX_CURVES = 8


@dataclass(frozen=True)
class Curve:
    """One load curve's columns, sorted by offered rate (NaN where a figure is missing)."""

    label: str
    offered: np.ndarray  # requests/s
    achieved: np.ndarray
    median_ttft_ms: np.ndarray
    p99_ttft_ms: np.ndarray
    median_tpot_ms: np.ndarray
    p99_tpot_ms: np.ndarray
    achieved_slow: np.ndarray
    p99_ttft_ms_slow: np.ndarray
    p99_tpot_ms_slow: np.ndarray
    knee: float  # requests/s, NaN where the knee is outside the curve
    slo_ttft_ms: float
    slo_tpot_ms: float
    # Whose TTFT is drawn: the client's (what the SLO judges; docs/capacity.md#client-side-latency)
    # where the table has it, with the time outside the engine; NaN: the server's.
    client_overhead_ms: float = float("nan")


def curves(ok: pa.Table, others: Sequence[str]) -> list[Curve]:
    """The curves of a load-curve sweep's ``ok`` points, one per combination of ``others``."""
    labels = [combo_label(r, others) if others else "" for r in records(ok)] if ok.num_rows else []
    out = []
    for label in dict.fromkeys(labels):
        part = rows_where(ok, [x == label for x in labels])
        order = np.argsort(numbers(part, "offered_request_rate"), kind="stable")

        def column(name: str) -> np.ndarray:
            values = numbers(part, name) if name in part.column_names else np.full(part.num_rows, np.nan)
            return values[order]

        first = {name: float(column(name)[0]) for name in ("knee_request_rate", "slo_ttft_ms", "slo_tpot_ms",
                                                             "client_overhead_ms")}
        side = "_client" if "p99_ttft_client_ms" in part.column_names else ""
        out.append(Curve(label, column("offered_request_rate"), column("achieved_request_rate"),
                         column(f"median_ttft{side}_ms"), column(f"p99_ttft{side}_ms"), column("median_tpot_ms"),
                         column("p99_tpot_ms"), column("achieved_request_rate_pessimistic"),
                         column(f"p99_ttft{side}_ms_pessimistic"), column("p99_tpot_ms_pessimistic"),
                         first["knee_request_rate"], first["slo_ttft_ms"], first["slo_tpot_ms"],
                         first["client_overhead_ms"] if side else float("nan")))
    return out


def draw_curve(curve: Curve) -> bytes:
    """Three panels against the offered rate: throughput, TTFT and TPOT."""
    fig, axes = _figure(ncols=3)
    x = curve.offered
    throughput, ttft, tpot = axes
    top = np.nanmax(np.concatenate([x, curve.achieved]))
    throughput.plot([0, top], [0, top], color="#999", linestyle=":", linewidth=1, label="offered")
    throughput.plot(x, curve.achieved, marker="o", markersize=4, color=COLORS[0], label="achieved")
    _slow_edge(throughput, x, curve.achieved, curve.achieved_slow, COLORS[0])
    throughput.set_ylabel("requests/s")
    _title(throughput, "Throughput")
    for ax, median, p99, slow, bound, name in ((ttft, curve.median_ttft_ms, curve.p99_ttft_ms, curve.p99_ttft_ms_slow,
                                                curve.slo_ttft_ms, "TTFT"),
                                               (tpot, curve.median_tpot_ms, curve.p99_tpot_ms, curve.p99_tpot_ms_slow,
                                                curve.slo_tpot_ms, "TPOT")):
        ax.plot(x, median, marker="o", markersize=4, color=COLORS[2], label="median")
        ax.plot(x, p99, marker="o", markersize=4, color=COLORS[1], label="p99")
        _slow_edge(ax, x, p99, slow, COLORS[1])
        if np.isfinite(bound):
            ax.axhline(bound, color=COLORS[3], linestyle="--", linewidth=1, label="SLO")
        ax.set_yscale("log")
        ax.set_ylabel(f"{name}, client (ms)" if name == "TTFT" and np.isfinite(curve.client_overhead_ms)
                      else f"{name} (ms)")
        _title(ax, name)
    for ax in axes:
        if np.isfinite(curve.knee):
            ax.axvline(curve.knee, color="#555", linestyle=":", linewidth=1, label="knee")
        ax.set_xlabel("offered requests/s")
        ax.legend(fontsize=7)
    return _png(fig)


def _slow_edge(ax, x: np.ndarray, central: np.ndarray, slow: np.ndarray, color: str) -> None:
    """The slow edge dashed, and the band between it and the central line shaded."""
    if not np.isfinite(slow).any():
        return
    ax.plot(x, slow, linestyle="--", linewidth=1, color=color, label="slow edge")
    ax.fill_between(x, central, slow, color=color, alpha=0.15, linewidth=0)


def load_curve_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    """One figure per curve of a ``--load-curve`` sweep (none without its columns)."""
    if "offered_request_rate" not in ok.column_names or not ok.num_rows:
        return []
    out = []
    for curve in curves(ok, varied)[:MAX_CURVES]:
        where = f" ({curve.label})" if curve.label else ""
        knee = (f"the knee (dotted) at {curve.knee:,.4g} requests/s offered, the highest rate sustained"
                if np.isfinite(curve.knee) else "the knee outside the rates tried")
        side = (f"TTFT as a client sees it (the server's +{curve.client_overhead_ms:.3g} ms outside the engine)"
                if np.isfinite(curve.client_overhead_ms) else "TTFT (the server's)")
        caption = (f"Latency–load curve{where}: achieved against offered throughput (the dotted diagonal is "
                   f"the offered load), median and p99 {side} and TPOT with the SLO (dashed red); {knee}"
                   + ("; the slow edge dashed, shaded to the central p99." if np.isfinite(curve.p99_ttft_ms_slow).any()
                      else "."))
        out.append(PendingFigure(partial(draw_curve, curve), caption, f"latency–load curve{where}"))
    return out
