"""The report's plots: each function draws one figure and returns its PNG bytes.

Matplotlib is used through ``Figure`` and the Agg canvas directly, never ``pyplot``: no
global figure manager, no backend switch, nothing that changes how other code in the
process plots. The output is deterministic: a fixed size and dpi, and a PNG written here
from the canvas's pixels with no metadata, so the same data gives the same bytes.

Speed (a replay report is drawn in well under a second): every figure has fixed margins
set in inches (``_figure``), so a figure is drawn exactly once, with no layout engine
measuring text and drawing again; each figure is a local object dropped after its PNG is
encoded (no global registry keeps it); PNGs are encoded with fast zlib settings.

The functions take plain arrays (already binned or downsampled by ``reports.binning``): a
plot never sees a million-row table, and no line has more than ``MAX_LINE_POINTS`` points
(a longer one given to ``lines`` or as the hit-rate curve is cut by ``minmax_points``,
which keeps each stretch's lowest and highest point).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import PIL.Image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter

from kvtwin.reports.binning import minmax_points

__all__ = ["bars", "hit_rate_over_time", "hit_rate_vs_capacity", "kv_usage_by_group", "latency_cdfs", "lines",
           "lines_with_edge",
           "preemptions_over_time", "queues_over_time", "rates_over_time", "replica_load", "states_over_time"]

DPI = 100
WIDTH_IN, HEIGHT_IN = 8.0, 3.6
# The default colour cycle, fixed here so a matplotlib style change elsewhere does not move it.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")


# The most points one drawn line (or band edge) may have; the binning keeps far fewer.
MAX_LINE_POINTS = 4000
# Fixed margins, inches: room for tick labels of up to about seven characters and the axis
# label beside them (left, and between panels), tick labels and the axis label (bottom), the
# title (top). Fixed, so that no layout pass measures text and redraws.
LEFT_IN, RIGHT_IN, TOP_IN, BOTTOM_IN, GAP_IN = 0.9, 0.2, 0.4, 0.6, 0.85
# zlib level 1: a third of level 6's time for a PNG about a fifth larger.
PNG_COMPRESS_LEVEL = 1


def _panel_in(ncols: int, left_in: float = LEFT_IN) -> float:
    """The width of each of ``ncols`` panels side by side, inches."""
    return (WIDTH_IN - left_in - RIGHT_IN - GAP_IN * (ncols - 1)) / ncols


def _text_in(text: str, fontsize: float) -> float:
    """About how wide ``text`` is drawn, inches (an average glyph is some half an em wide):
    margins are sized from this estimate rather than by measuring and drawing again."""
    return len(text) * fontsize * 0.52 / 72


def _figure(ncols: int = 1, height: float = HEIGHT_IN, bottom_in: float = BOTTOM_IN,
            left_in: float = LEFT_IN) -> tuple[Figure, list]:
    fig = Figure(figsize=(WIDTH_IN, height), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    fig.subplots_adjust(left=left_in / WIDTH_IN, right=1 - RIGHT_IN / WIDTH_IN, bottom=bottom_in / height,
                        top=1 - TOP_IN / height, wspace=GAP_IN / _panel_in(ncols, left_in))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _png(fig: Figure) -> bytes:
    """The figure drawn once and encoded as an RGB PNG without metadata."""
    canvas = fig.canvas
    canvas.draw()
    width, height = canvas.get_width_height()
    image = PIL.Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="png", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def _title(ax, text: str, **kwargs) -> None:
    # A title at a fixed height: left to find its own, matplotlib measures the tick labels
    # under it on every draw.
    ax.set_title(text, y=1.0, **kwargs)


def _log_x(ax) -> None:
    """A log x axis with unlabelled minor ticks at 2 and 5 only: each tick is an object to
    lay out and draw, and the default's eight per decade cost more than the plot's lines."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _empty(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#777")


def time_unit(t_max: float) -> tuple[float, str]:
    """Divisor and axis label for times up to ``t_max`` seconds."""
    if t_max >= 2 * 3600:
        return 3600.0, "simulated time (h)"
    if t_max >= 600:
        return 60.0, "simulated time (min)"
    return 1.0, "simulated time (s)"


def _time_axis(ax, t: np.ndarray) -> np.ndarray:
    div, label = time_unit(float(np.nanmax(t)) if len(t) else 0.0)
    ax.set_xlabel(label)
    return np.asarray(t, dtype=float) / div


def kv_usage_by_group(t: np.ndarray, usage: np.ndarray, labels: Sequence[str],
                      peak: np.ndarray | None = None) -> bytes:
    """Stacked KV cache usage: ``usage`` is (bins, groups), fractions of the usable blocks;
    ``peak``, the highest total usage in each bin, is drawn as a thin line over the stack."""
    fig, (ax,) = _figure()
    if len(t) == 0:
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        colors = [COLORS[i % len(COLORS)] for i in range(usage.shape[1])]
        ax.stackplot(x, (usage * 100).T, labels=list(labels), colors=colors, alpha=0.85, linewidth=0)
        if peak is not None:
            ax.plot(x, np.asarray(peak) * 100, color="#333", linewidth=0.7, label="peak in bin (all groups)")
        ax.set_ylim(0, 100)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel("KV cache blocks in use (%)")
    _title(ax, "KV cache usage by group")
    return _png(fig)


def hit_rate_over_time(t: np.ndarray, rate: np.ndarray, overall: float | None = None,
                       bound: float | None = None) -> bytes:
    """Prefix-cache hit rate (tokens) per time bin, with the run's overall rate and the trace's bound."""
    fig, (ax,) = _figure()
    if len(t) == 0:
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        ax.plot(x, np.asarray(rate) * 100, color=COLORS[0], linewidth=1.2, label="per bin")
        if overall is not None and np.isfinite(overall):
            ax.axhline(overall * 100, color=COLORS[1], linestyle="--", linewidth=1, label="whole run")
        if bound is not None and np.isfinite(bound):
            ax.axhline(bound * 100, color=COLORS[2], linestyle=":", linewidth=1, label="infinite-cache bound")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylabel("prefix cache hit rate (%)")
    _title(ax, "Prefix cache hit rate (by first-scheduled time)")
    return _png(fig)


def queues_over_time(t: np.ndarray, running: np.ndarray, waiting: np.ndarray,
                     running_range: tuple[np.ndarray, np.ndarray] | None = None,
                     waiting_range: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """Each queue's mean per bin as a line over a light band from its minimum to its maximum."""
    fig, (ax,) = _figure()
    if len(t) == 0:
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        for values, band, color, label in ((running, running_range, COLORS[0], "running"),
                                           (waiting, waiting_range, COLORS[3], "waiting")):
            if band is not None:
                ax.fill_between(x, band[0], band[1], color=color, alpha=0.18, linewidth=0)
            ax.plot(x, values, color=color, linewidth=1.2, label=label)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel("requests")
    _title(ax, "Running and waiting queues")
    return _png(fig)


def states_over_time(t: np.ndarray, series: Sequence[tuple[str, np.ndarray, np.ndarray, np.ndarray]], *,
                     ylabel: str, title: str, top: float | None = None) -> bytes:
    """Each (label, mean, min, max) per bin as a line over a light band from its minimum
    to its maximum; ``top`` fixes the y axis' upper end (e.g. 100 for percentages)."""
    fig, (ax,) = _figure()
    if len(t) == 0 or not series:
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        for i, (label, values, low, high) in enumerate(series):
            color = COLORS[i % len(COLORS)]
            ax.fill_between(x, low, high, color=color, alpha=0.18, linewidth=0)
            ax.plot(x, values, color=color, linewidth=1.2, label=label)
        ax.set_ylim(0, top)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel(ylabel)
    _title(ax, title)
    return _png(fig)


def rates_over_time(t: np.ndarray, panels: Sequence[tuple[str, Sequence[tuple[str, np.ndarray]]]], *,
                    ylabel: str) -> bytes:
    """Panels side by side, each (title, series): one line per (label, rate per bin), drawn
    as steps (a bin's rate holds over the bin), on one shared y scale."""
    fig, axes = _figure(max(len(panels), 1))
    top = max((float(np.nanmax(values)) for _, series in panels for _, values in series if len(values)),
              default=0.0)
    for ax, (title, series) in zip(axes, panels):
        if len(t) == 0 or not series:
            _empty(ax)
        else:
            x = _time_axis(ax, t)
            for i, (label, values) in enumerate(series):
                ax.plot(x, values, color=COLORS[i % len(COLORS)], linewidth=1.0, drawstyle="steps-mid", label=label)
            ax.set_ylim(0, top * 1.05 if top > 0 else None)
            ax.legend(loc="upper left", fontsize=8)
        _title(ax, title)
    axes[0].set_ylabel(ylabel)
    return _png(fig)


def preemptions_over_time(t: np.ndarray, counts: np.ndarray, bin_s: float) -> bytes:
    fig, (ax,) = _figure()
    if len(t) == 0:
        _empty(ax)
    else:
        x = _time_axis(ax, t)
        ax.plot(x, counts, color=COLORS[3], linewidth=1.2, drawstyle="steps-mid")
        ax.set_ylim(bottom=0)
        total = int(np.sum(counts))
        ax.text(0.99, 0.95, f"total {total:,}", ha="right", va="top", transform=ax.transAxes, fontsize=8)
    ax.set_ylabel(f"preemptions per {bin_s:,.3g} s")
    _title(ax, "Preemptions")
    return _png(fig)


def latency_cdfs(series: Sequence[tuple[str, np.ndarray]], slo: dict[str, float] | None = None,
                 band: dict[str, tuple[float, float]] | None = None) -> bytes:
    """One CDF panel per (name, sorted values in ms); a dashed line at each name's SLO, and
    a shaded band where ``band`` gives the name's (low, high) factors (values x low .. values
    x high: the calibration's held-out band, docs/capacity.md#the-band)."""
    fig, axes = _figure(len(series))
    for ax, (name, values) in zip(axes, series):
        values = np.asarray(values, dtype=float)
        if len(values) == 0:
            _empty(ax)
        else:
            y = np.linspace(0, 1, len(values)) if len(values) > 1 else np.ones(1)
            ratios = (band or {}).get(name)
            if ratios is not None and all(np.isfinite(ratios)):
                low, high = ratios
                label = (f"±{high - 1:.0%} held-out error" if np.isclose(1 - low, high - 1) and low > 0
                         else f"x{low:.2f}-x{high:.2f} held-out error")
                ax.fill_betweenx(y * 100, values * low, values * high, color=COLORS[0], alpha=0.18,
                                 linewidth=0, label=label)
            ax.plot(values, y * 100, color=COLORS[0], linewidth=1.4)
            if values[0] > 0 and values[-1] / values[0] > 100:
                _log_x(ax)
            bound = (slo or {}).get(name)
            if bound is not None and np.isfinite(bound):
                ax.axvline(bound, color=COLORS[3], linestyle="--", linewidth=1, label="SLO")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 100)
        _title(ax, f"{name} CDF")
    axes[0].set_ylabel("requests (%)")
    return _png(fig)


def replica_load(replicas: Sequence[str], requests: np.ndarray, tokens: np.ndarray | None = None) -> bytes:
    ncols = 1 if tokens is None else 2
    fig, axes = _figure(ncols)
    x = np.arange(len(replicas))
    axes[0].bar(x, requests, color=COLORS[0])
    axes[0].set_ylabel("requests routed")
    _title(axes[0], "Requests per replica")
    if tokens is not None:
        axes[1].bar(x, np.asarray(tokens) / 1e6, color=COLORS[1])
        axes[1].set_ylabel("prompt tokens (M)")
        _title(axes[1], "Prompt tokens per replica")
    for ax in axes:
        ax.set_xticks(x, list(replicas))
        ax.set_xlabel("replica")
    return _png(fig)


def lines(series: Sequence[tuple[str, np.ndarray, np.ndarray]], *, xlabel: str, ylabel: str, title: str,
          percent: bool = False, reference: float | None = None) -> bytes:
    """One line with markers per (label, x, y); ``percent`` shows fractions as %."""
    fig, (ax,) = _figure()
    scale = 100.0 if percent else 1.0
    for i, (label, x, y) in enumerate(series):
        x, y = minmax_points(x, y, MAX_LINE_POINTS)
        ax.plot(x, y * scale, marker="o", markersize=4, linewidth=1.3,
                color=COLORS[i % len(COLORS)], label=label or None)
    if reference is not None:
        ax.axhline(reference * scale, color="#777", linestyle=":", linewidth=1)
    if not series:
        _empty(ax)
    elif any(label for label, _, _ in series):
        ax.legend(fontsize=8)
    if percent:
        ax.set_ylim(0, 105)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _title(ax, title)
    return _png(fig)


def lines_with_edge(series: Sequence[tuple[str, np.ndarray, np.ndarray]],
                    edges: Sequence[tuple[str, np.ndarray, np.ndarray]], *, xlabel: str, ylabel: str,
                    title: str, edge_label: str = "slow edge") -> bytes:
    """Like ``lines``, and each series' edge (same label) dashed in its colour beside it:
    an answer and its pessimistic bound read as one."""
    fig, (ax,) = _figure()
    edge_of = {label: (x, y) for label, x, y in edges}
    for i, (label, x, y) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        ax.plot(x, y, marker="o", markersize=4, linewidth=1.3, color=color, label=label or "central")
        if label in edge_of:
            ex, ey = edge_of[label]
            ax.plot(ex, ey, marker="v", markersize=4, linewidth=1.0, linestyle="--", color=color,
                    label=f"{label} {edge_label}".strip())
    if not series:
        _empty(ax)
    elif edges or any(label for label, _, _ in series):
        ax.legend(fontsize=8)
    xs = np.concatenate([np.asarray(x, dtype=float) for _, x, _ in series] or [np.zeros(0)])
    if len(xs) and np.all(xs == np.round(xs)):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts, e.g. replicas: no 1.5 tick
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _title(ax, title)
    return _png(fig)


def hit_rate_vs_capacity(curve: tuple[np.ndarray, np.ndarray] | None,
                         points: tuple[np.ndarray, np.ndarray] | None, *, xlabel: str) -> bytes:
    """The one-pass hit-rate curve (line) with the exactly replayed sweep points over it."""
    fig, (ax,) = _figure()
    if curve is not None and len(curve[0]):
        x, y = minmax_points(curve[0], curve[1], MAX_LINE_POINTS)
        ax.plot(x, y * 100, color=COLORS[0], linewidth=1.4, label="one-pass curve")
    if points is not None and len(points[0]):
        ax.plot(points[0], np.asarray(points[1]) * 100, linestyle="none", marker="o", markersize=6,
                color=COLORS[3], label="replayed sweep points")
    if (curve is None or not len(curve[0])) and (points is None or not len(points[0])):
        _empty(ax)
    else:
        ax.legend(fontsize=8)
        _log_x(ax)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prefix cache hit rate (%)")
    _title(ax, "Prefix cache hit rate vs KV cache capacity")
    return _png(fig)


def bars(categories: Sequence[str], groups: Sequence[tuple[str, np.ndarray]], *, ylabel: str, title: str,
         panels: Sequence[tuple[str, str, Sequence[tuple[str, np.ndarray]]]] | None = None,
         references: Sequence[float | None] | None = None) -> bytes:
    """Grouped bars: one group per category, one bar per (label, values) in ``groups``.

    ``panels`` draws several such charts side by side instead: (title, ylabel, groups) each.
    ``references``: per panel, a bound drawn as a dotted line across it (None: none), e.g.
    an SLO in the panel's unit.
    """
    specs = list(panels) if panels else [(title, ylabel, groups)]
    labels = [label for label, _ in specs[0][2] if label]
    ncol = max(1, min(3, len(labels)))
    rows = -(-len(labels) // ncol)
    long_ticks = len(categories) > 4 or max((len(str(c)) for c in categories), default=0) > 14
    legend_in = 0.22 * rows + (0.1 if labels else 0)
    ticks_in, left_in = 0.0, LEFT_IN
    if long_ticks and len(categories):
        # Labels turned 30 degrees hang below the axis by half their length and reach left
        # of their tick by 0.87 of it: the margins below and left of the first are made to fit.
        ticks_in = max(0.8, 0.5 * max(_text_in(str(c), 7) for c in categories))
        first_tick_in = 0.5 * _panel_in(len(specs)) / len(categories)
        left_in = min(3.0, max(LEFT_IN, 0.87 * _text_in(str(categories[0]), 7) - first_tick_in + 0.1))
    fig, axes = _figure(len(specs), height=HEIGHT_IN + legend_in + ticks_in, bottom_in=BOTTOM_IN + legend_in + ticks_in,
                        left_in=left_in)
    x = np.arange(len(categories))
    bounds = list(references) if references else [None] * len(specs)
    for ax, (panel_title, panel_ylabel, panel_groups), reference in zip(axes, specs, bounds):
        n = max(1, len(panel_groups))
        width = 0.8 / n
        for i, (label, values) in enumerate(panel_groups):
            ax.bar(x - 0.4 + width * (i + 0.5), np.asarray(values, dtype=float), width,
                   color=COLORS[i % len(COLORS)], label=label or None)
        if long_ticks:
            ax.set_xticks(x, list(categories), rotation=30, ha="right", fontsize=7)
        else:
            ax.set_xticks(x, list(categories), fontsize=8)
        _title(ax, panel_title, fontsize=10)
        ax.set_ylabel(panel_ylabel)
        if reference is not None and np.isfinite(reference):
            ax.axhline(reference, color="#777", linestyle=":", linewidth=1)
        heights = np.concatenate([np.asarray(v, dtype=float) for _, v in panel_groups] or [np.zeros(0)])
        heights = heights[np.isfinite(heights)]
        if len(heights) and np.all(heights == np.round(heights)):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts, e.g. replicas
    if labels:
        # One legend for every panel, under them: bars of the same colour mean the same thing.
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", bbox_to_anchor=(0.5, 0.0),
                   ncol=ncol, fontsize=7, frameon=False)
    return _png(fig)
