"""The capacity report's plots, one kind per swept key: throughput and SLO attainment
against the rate, the hit rate against the KV cache (the one-pass curve and the replayed
points), what a CPU offload tier buys, the replicas needed, and routers side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from kvtwin.reports import plots
from kvtwin.reports.figure_jobs import PendingFigure, render_figures
from kvtwin.reports.load_curve_plots import load_curve_figures
from kvtwin.reports.sweep_frame import (KV_KEY, OFFLOAD_KEY, RATE_KEY, ROUTER_KEY, combo_label, finite,
                                        finite_mask, lines_by_combo, numbers, records, rows_where, sweep_keys,
                                        texts, varying, with_column)

_X_LABELS = {"kv_cache_tokens": "KV cache (tokens)", "kv_cache_blocks": "KV cache (blocks)"}


def capacity_figures(frame: pa.Table, hit_curve: pa.Table | None, plan: dict | None) -> list[str]:
    """The plots of a sweep (``reports.sweep_frame.sweep_table``), from its ``ok`` points."""
    keys = sweep_keys(frame)
    ok = rows_where(frame, [t == "ok" for t in texts(frame, "status")]) if "status" in frame.column_names else frame
    varied = varying(ok, keys) if ok.num_rows else []
    out = load_curve_figures(ok, varied)
    out += _rate_figures(ok, varied) if RATE_KEY in keys else []
    out += _kv_capacity_figures(ok, hit_curve, _kv_points(ok, hit_curve, plan) if KV_KEY in keys else None)
    out += _offload_figures(ok, varied) if OFFLOAD_KEY in keys else []
    out += _replicas_needed_figures(ok, varied)
    out += _router_figures(ok, varied) if ROUTER_KEY in keys and ok.num_rows else []
    return render_figures(out)


def _rate_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    others = [k for k in varied if k != RATE_KEY]
    by = " (one line per " + ", ".join(others) + ")" if others else ""
    out = []
    for column, ylabel, title, percent in (
            ("request_throughput", "requests per second", "Throughput vs rate", False),
            ("slo_attainment", "requests within the SLO (%)", "SLO attainment vs rate", True)):
        if column not in ok.column_names:
            continue
        series = lines_by_combo(ok, RATE_KEY, column, others)
        if not series:
            continue
        caption = (f"{title}: {column} at each {RATE_KEY} (arrival-rate multiplier){by}."
                   + (" Output token throughput is in the table below." if column == "request_throughput"
                      else ""))
        draw = partial(plots.lines, series, xlabel=f"{RATE_KEY} (x the trace's rate)", ylabel=ylabel, title=title,
                       percent=percent)
        out.append(PendingFigure(draw, caption, title))
    return out


def _tokens_per_block(hit_curve: pa.Table | None) -> float | None:
    if hit_curve is None or not hit_curve.num_rows or not {"kv_cache_blocks", "kv_cache_tokens"} <= set(
            hit_curve.column_names):
        return None
    blocks = hit_curve.column("kv_cache_blocks").to_numpy(zero_copy_only=False).astype(float)
    tokens = hit_curve.column("kv_cache_tokens").to_numpy(zero_copy_only=False).astype(float)
    usable = blocks > 0
    return float(np.median(tokens[usable] / blocks[usable])) if usable.any() else None


def _kv_points(ok: pa.Table, hit_curve: pa.Table | None, plan: dict | None):
    """The sweep's hit rates on the axis the curve uses: (x, y, in_tokens), or None.

    The x is the point's KV cache in tokens: its ``kv_cache_tokens`` column, else its
    ``kv_cache_blocks`` (or ``engine.kv_cache_memory_bytes`` over the plan's
    ``bytes_per_block``, less the null block) times the curve's tokens per block; failing
    those, the memory in GiB (``in_tokens`` False)."""
    if KV_KEY not in ok.column_names or "prefix_cache_hit_rate" not in ok.column_names:
        return None
    data = finite(ok, "prefix_cache_hit_rate")
    hits = numbers(data, "prefix_cache_hit_rate")
    if "kv_cache_tokens" in data.column_names:
        return numbers(data, "kv_cache_tokens"), hits, True
    per_token_block = _tokens_per_block(hit_curve)
    plan = (plan or {}).get("hybrid_on", plan) or {}
    per_block = plan.get("bytes_per_block")
    if per_token_block is not None:
        if "kv_cache_blocks" in data.column_names:
            return numbers(data, "kv_cache_blocks") * per_token_block, hits, True
        if per_block:
            blocks = np.floor(numbers(data, KV_KEY) / per_block) - 1  # less the null block
            return blocks * per_token_block, hits, True
    return numbers(data, KV_KEY) / 2**30, hits, False


def _curve(hit_curve: pa.Table | None):
    """The one-pass curve as (x, hit rate, x column) sorted along x, or None."""
    if hit_curve is None or not hit_curve.num_rows or "hit_rate" not in hit_curve.column_names:
        return None
    x_name = "kv_cache_tokens" if "kv_cache_tokens" in hit_curve.column_names else "kv_cache_blocks"
    order = np.argsort(hit_curve.column(x_name).to_numpy(zero_copy_only=False))
    return (hit_curve.column(x_name).to_numpy(zero_copy_only=False).astype(float)[order],
            hit_curve.column("hit_rate").to_numpy(zero_copy_only=False).astype(float)[order], x_name)


def _kv_capacity_figures(ok: pa.Table, hit_curve: pa.Table | None, points) -> list[PendingFigure]:
    curve = _curve(hit_curve)
    if curve is None and points is None:
        return []
    if points is not None and not points[2]:  # the points' axis is memory: apart from the curve
        out = []
        if curve is not None:
            draw = partial(plots.hit_rate_vs_capacity, curve[:2], None, xlabel=_X_LABELS[curve[2]])
            out.append(PendingFigure(draw, "One-pass prefix-cache hit-rate curve (hit_curve.parquet).",
                                     "hit-rate curve"))
        draw = partial(plots.hit_rate_vs_capacity, None, points[:2], xlabel="KV cache memory (GiB)")
        out.append(PendingFigure(draw, f"Prefix cache hit rate of each replayed sweep point against its {KV_KEY} "
                                       "(no plan to put them on the curve's axis).", "hit rate vs KV capacity"))
        return out
    xlabel = _X_LABELS[curve[2]] if curve is not None else "KV cache (tokens)"
    what = []
    if curve is not None:
        what.append("the line is the one-pass curve (hit_curve.parquet)")
    if points is not None:
        what.append(f"the dots are sweep points replayed exactly at each {KV_KEY}")
    return [PendingFigure(partial(plots.hit_rate_vs_capacity, curve[:2] if curve else None,
                                  points[:2] if points else None, xlabel=xlabel),
                          "Prefix cache hit rate vs KV cache capacity: " + "; ".join(what) + ".",
                          "hit rate vs KV capacity")]


def _nan_as(values: np.ndarray, fill) -> np.ndarray:
    """``values`` with each NaN replaced by ``fill`` (a number or an array alike)."""
    return np.where(np.isnan(values), fill, values)


def _offload_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    """Hit rate per tier and TTFT against the CPU tier's size (one line per other varying
    key), next to the KV-capacity curve: what host memory buys on this trace."""
    data = with_column(ok, "offload_gib", _nan_as(numbers(ok, OFFLOAD_KEY), 0.0) / 2**30)
    others = [k for k in varied if k != OFFLOAD_KEY]
    by = " (one line per " + ", ".join(others) + ")" if others else ""
    out = []
    total = "hit_rate_total" if "hit_rate_total" in data.column_names else "prefix_cache_hit_rate"
    if total in data.column_names:
        # A point without a tier has no tier columns: its total is its GPU hit rate.
        if total == "hit_rate_total" and "prefix_cache_hit_rate" in data.column_names:
            tiered = numbers(data, total)
            data = with_column(data, total, _nan_as(tiered, numbers(data, "prefix_cache_hit_rate")))
        series = [(f"{label} total".strip(), x, y) for label, x, y in lines_by_combo(data, "offload_gib", total, others)]
        if "hit_rate_cpu" in data.column_names:
            data = with_column(data, "hit_rate_cpu", _nan_as(numbers(data, "hit_rate_cpu"), 0.0))
            series += [(f"{label} from CPU".strip(), x, y)
                       for label, x, y in lines_by_combo(data, "offload_gib", "hit_rate_cpu", others)]
        if series:
            draw = partial(plots.lines, series, xlabel="CPU offload tier (GiB)", ylabel="prompt tokens hit (%)",
                           title="Hit rate vs CPU offload size", percent=True)
            out.append(PendingFigure(draw, f"Prompt tokens served from a cache against {OFFLOAD_KEY}: all tiers "
                                           f"together, and the part loaded from the CPU tier{by}. 0 GiB is the run "
                                           "without offloading.", "hit rate vs offload size"))
    ttft = [(c, label) for c, label in (("median_ttft_ms", "median"), ("p99_ttft_ms", "p99")) if c in data.column_names]
    series = [(f"{label} {name}".strip(), x, y) for column, name in ttft
              for label, x, y in lines_by_combo(data, "offload_gib", column, others)]
    if series:
        draw = partial(plots.lines, series, xlabel="CPU offload tier (GiB)", ylabel="TTFT (ms)",
                       title="TTFT vs CPU offload size")
        out.append(PendingFigure(draw, f"Time to first token (median, p99) against {OFFLOAD_KEY}{by}.",
                                 "TTFT vs offload size"))
    return out


def _replicas_needed_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    needed = [c for c in ("replicas_needed_trace_rate", "replicas_needed_target_rate")
              if c in ok.column_names and finite_mask(ok, c).any()]
    if not needed:
        return []
    data = rows_where(ok, np.logical_or.reduce([finite_mask(ok, c) for c in needed]))
    labels = [combo_label(r, varied) if varied else f"point {r.get('point', i)}"
              for i, r in enumerate(records(data))]
    groups = [(c.replace("replicas_needed_", "at the ").replace("_", " "), numbers(data, c)) for c in needed]
    return [PendingFigure(partial(plots.bars, labels, groups, ylabel="replicas", title="Replicas needed"),
                          "Replicas needed to serve the trace's rate and the target rate within the SLO, per sweep "
                          "point (" + ", ".join(needed) + ").", "replicas needed")]


def _router_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    routers = list(dict.fromkeys(_router_of(ok)))
    others = [k for k in varied if k != ROUTER_KEY]
    metrics = [(c, t, y, p) for c, t, y, p in (
        ("slo_attainment", "SLO attainment", "%", True),
        ("prefix_cache_hit_rate", "prefix cache hit rate", "%", True),
        ("p99_ttft_ms", "p99 TTFT", "ms", False),
        ("request_throughput", "throughput", "req/s", False)) if c in ok.column_names and finite_mask(ok, c).any()][:3]
    if not metrics:
        return []
    panels = _router_panels(ok, routers, others, metrics)
    return [PendingFigure(partial(plots.bars, routers, [], ylabel="", title="", panels=panels),
                          "Router comparison: " + ", ".join(m[0] for m in metrics) + f" per {ROUTER_KEY}"
                          + (" (one bar per " + ", ".join(others) + ")" if others else "") + ".",
                          "router comparison")]


def _router_of(ok: pa.Table) -> list:
    """Each point's router; a missing one is one NaN, which matches no point (pandas' text
    of a missing value), so its bars are empty."""
    return [math.nan if t is None else t for t in texts(ok, ROUTER_KEY)]


def _router_panels(ok: pa.Table, routers: list[str], others: list[str], metrics: list[tuple]) -> list[tuple]:
    """Per metric a panel: per combination of the other keys, the mean per router."""
    combo_of = np.array([combo_label(r, others) if others else "" for r in records(ok)], dtype=object)
    router_of = np.array(_router_of(ok), dtype=object)
    combos = list(dict.fromkeys(combo_of.tolist()))
    panels = []
    for column, title, ylabel, percent in metrics:
        column_values = numbers(ok, column)
        groups = []
        for combo in combos:
            values = []
            for router in routers:
                match = column_values[(router_of == router) & (combo_of == combo)]
                match = match[np.isfinite(match)]
                v = float(match.mean()) if len(match) else np.nan
                values.append(v * 100 if percent else v)
            groups.append((combo, np.array(values, dtype=float)))
        panels.append((title, ylabel, groups))
    return panels
