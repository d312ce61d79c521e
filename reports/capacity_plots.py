"""The capacity report's plots. First the answer of a rate search: the largest sustainable
request rate (and its slow edge) against each swept key, and the GPUs needed; then one kind
per swept key: throughput and SLO attainment against the rate, the hit rate against the KV
cache (the one-pass curve and the replayed points), what a CPU offload tier buys, routers
side by side, and disaggregated shapes (xPyD) beside aggregated points."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import numpy as np
import pyarrow as pa

from kvtwin.reports import plots
from kvtwin.reports.figure_jobs import PendingFigure, render_figures
from kvtwin.reports.load_curve_plots import load_curve_figures
from kvtwin.reports.summary_text import missing
from kvtwin.reports.sweep_frame import (KV_KEY, OFFLOAD_KEY, RATE_KEY, ROUTER_KEY, column_values, combo_label,
                                        finite, finite_mask, key_value, lines_by_combo, numbers, records,
                                        rows_where, sweep_keys, texts, varying, with_column)

_X_LABELS = {"kv_cache_tokens": "KV cache (tokens)", "kv_cache_blocks": "KV cache (blocks)"}


def capacity_figures(frame: pa.Table, hit_curve: pa.Table | None, plan: dict | None) -> list[str]:
    """The plots of a sweep (``reports.sweep_frame.sweep_table``), from its ``ok`` points."""
    keys = sweep_keys(frame)
    ok = rows_where(frame, [t == "ok" for t in texts(frame, "status")]) if "status" in frame.column_names else frame
    varied = varying(ok, keys) if ok.num_rows else []
    out = load_curve_figures(ok, varied)
    out += _answer_figures(ok, keys, varied)
    out += _needed_figures(ok, varied)
    out += _rate_figures(ok, varied) if RATE_KEY in keys else []
    out += _kv_capacity_figures(ok, hit_curve, _kv_points(ok, hit_curve, plan) if KV_KEY in keys else None)
    out += _offload_figures(ok, varied) if OFFLOAD_KEY in keys else []
    out += _router_figures(ok, varied) if ROUTER_KEY in keys and ok.num_rows else []
    out += _pd_figures(ok, varied)
    return render_figures(out)


ANSWER = "max_request_rate"
EDGE = "max_request_rate_pessimistic"
_ANSWER_WHAT = (f"the largest sustainable request rate ({ANSWER}: the trace's requests/s at the largest rate "
                "scale that held the SLO with the load sustained, docs/capacity.md#sustained-load)")
_EDGE_WHAT = (f"the slow edge ({EDGE}: the same search with every step slower by the calibration's held-out "
              "step error)")


def _answer_figures(ok: pa.Table, keys: Sequence[str], varied: Sequence[str]) -> list[PendingFigure]:
    """With ``--find-max-rate``: the answer against each varying key (one figure per key), or
    per point when no key varies (a single point is one bar)."""
    if ANSWER not in ok.column_names or not finite_mask(ok, ANSWER).any():
        return []
    edge = EDGE in ok.column_names and bool(finite_mask(ok, EDGE).any())
    if not varied:
        return [_answer_by_point(ok, keys, edge)]
    return [_answer_against(ok, key, [k for k in varied if k != key], edge) for key in varied]


def _numeric_key(ok: pa.Table, key: str) -> bool:
    kind = ok.column(key).type
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _answer_against(ok: pa.Table, key: str, others: list[str], edge: bool) -> PendingFigure:
    numeric = _numeric_key(ok, key)
    by = (" (one " + ("line" if numeric else "bar") + " per " + ", ".join(others) + ")") if others else ""
    title = f"Max sustainable rate vs {key.split('.')[-1]}"
    caption = f"The answer: {_ANSWER_WHAT} against {key}{by}"
    if edge:
        caption += f"; {'dashed' if numeric else 'beside it'}, {_EDGE_WHAT}"
    caption += ". A point where no rate held has no " + ("marker" if numeric else "bar") + \
               " (rate_search_refusal says why)."
    if numeric:
        x, xlabel = key, key
        if key.endswith("_bytes"):  # sizes read in GiB, as the sweep's labels show them
            x, xlabel = "__x_gib", f"{key} (GiB)"
            ok = with_column(ok, x, numbers(ok, key) / 2**30)
        series = lines_by_combo(ok, x, ANSWER, others)
        edges = lines_by_combo(ok, x, EDGE, others) if edge else []
        draw = partial(plots.lines_with_edge, series, edges, xlabel=xlabel, ylabel="requests per second",
                       title=title)
        return PendingFigure(draw, caption, title)
    # A key of names (GPU, model, router, P/D shape, a flag): a bar per value, in sweep order.
    key_of = column_values(ok, key)
    values = list(dict.fromkeys(v for v in key_of if not missing(v)))
    combo_of = [combo_label(r, others) if others else "" for r in records(ok)]
    groups = []
    for combo in dict.fromkeys(combo_of):
        for column, suffix in ((ANSWER, ""), (EDGE, "slow edge"))[:2 if edge else 1]:
            heights = numbers(ok, column)
            per_value = []
            for value in values:
                match = heights[np.array([k == value and c == combo for k, c in zip(key_of, combo_of)], dtype=bool)]
                match = match[np.isfinite(match)]
                per_value.append(float(match.mean()) if len(match) else np.nan)
            label = " ".join(part for part in (combo, suffix) if part) or ("central" if edge else "")
            groups.append((label, np.array(per_value, dtype=float)))
    categories = [key_value(key, v) for v in values]
    return PendingFigure(partial(plots.bars, categories, groups, ylabel="requests per second", title=title),
                         caption, title)


def _answer_by_point(ok: pa.Table, keys: Sequence[str], edge: bool) -> PendingFigure:
    rows = records(ok)
    labels = [combo_label(r, keys) if keys else f"point {r.get('point', i)}" for i, r in enumerate(rows)]
    groups = [("central" if edge else "", numbers(ok, ANSWER))]
    if edge:
        groups.append(("slow edge", numbers(ok, EDGE)))
    title = "Max sustainable rate"
    caption = f"The answer: {_ANSWER_WHAT}" + (f", and beside it {_EDGE_WHAT}." if edge else ".")
    return PendingFigure(partial(plots.bars, labels, groups, ylabel="requests per second", title=title), caption,
                         title)


def _gpus_per_replica(data: pa.Table) -> np.ndarray | None:
    """Each point's GPUs per engine replica (``num_gpus / num_replicas``; a table written
    before ``num_gpus`` was, aggregated: a swept ``engine.tensor_parallel_size``), or None."""
    if {"num_gpus", "num_replicas"} <= set(data.column_names):
        per = numbers(data, "num_gpus") / numbers(data, "num_replicas")
        if np.isfinite(per).all():
            return per
    if "engine.tensor_parallel_size" in data.column_names and "pd_link" not in data.column_names:
        return numbers(data, "engine.tensor_parallel_size")
    return None


_NEEDED = (("replicas_needed_trace_rate", "for the trace's rate"),
           ("replicas_needed_target_rate", "for the target rate"),
           ("replicas_needed_trace_rate_pessimistic", "for the trace's rate, slow edge"))


def _needed_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    """The replicas a rate search says are needed, in GPUs where each point's GPUs per
    replica are known (else in replicas)."""
    needed = [(c, label) for c, label in _NEEDED if c in ok.column_names and finite_mask(ok, c).any()]
    if not needed:
        return []
    data = rows_where(ok, np.logical_or.reduce([finite_mask(ok, c) for c, _ in needed]))
    labels = [combo_label(r, varied) if varied else f"point {r.get('point', i)}"
              for i, r in enumerate(records(data))]
    per_replica = _gpus_per_replica(data)
    names = ", ".join(c for c, _ in needed)
    if per_replica is None:
        groups = [(label, numbers(data, c)) for c, label in needed]
        return [PendingFigure(partial(plots.bars, labels, groups, ylabel="replicas", title="Replicas needed"),
                              "Replicas needed: engine replicas of each point's shape to serve the trace's rate "
                              f"(and the target rate) within the SLO with the load sustained ({names}).",
                              "replicas needed")]
    groups = [(label, numbers(data, c) * per_replica) for c, label in needed]
    return [PendingFigure(partial(plots.bars, labels, groups, ylabel="GPUs", title="GPUs needed"),
                          "GPUs needed: to serve the trace's rate (and the target rate) within the SLO with the load "
                          f"sustained, the replicas needed ({names}: engine replicas of the point's own shape) times "
                          "the point's GPUs per replica (num_gpus / num_replicas, its tensor_parallel_size).",
                          "GPUs needed")]


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


PD_KEY_PREFIX = "disaggregation."


def _shape_label(row: dict, others: Sequence[str]) -> str:
    """A point's deployment as xPyD (or ``aggregated xN``), its GPUs, and the other varying keys."""
    prefill, decode = row.get("pd_prefill_replicas"), row.get("pd_decode_replicas")
    if not missing(prefill) and not missing(decode):
        shape = f"{int(prefill)}P{int(decode)}D"
    else:
        replicas = row.get("num_replicas")
        shape = "aggregated" + ("" if missing(replicas) else f" x{int(replicas)}")
    gpus = row.get("num_gpus")
    parts = [shape] + ([] if missing(gpus) else [f"{int(gpus)} GPUs"])
    if others:
        parts.append(combo_label(row, others))
    return ", ".join(parts)


def _first_finite(ok: pa.Table, column: str) -> float | None:
    if column not in ok.column_names:
        return None
    values = numbers(ok, column)
    values = values[np.isfinite(values)]
    return float(values[0]) if len(values) else None


def _pd_figures(ok: pa.Table, varied: Sequence[str]) -> list[PendingFigure]:
    """A sweep with a disaggregated point: latencies, SLO attainment and the KV transfer's
    share of TTFT per shape, aggregated points beside (one bar per point)."""
    if "pd_link" not in ok.column_names or not ok.num_rows:
        return []
    # The shape keys are in the label already (xPyD); other varying keys follow it.
    others = [k for k in varied if not k.startswith(PD_KEY_PREFIX)]
    labels = [_shape_label(r, others) for r in records(ok)]
    slo_ttft, slo_tpot = _first_finite(ok, "slo_ttft_ms"), _first_finite(ok, "slo_tpot_ms")
    latency = [(f"{title} by shape", "ms", column, bound) for title, column, bound in (
        ("p50 TTFT", "median_ttft_ms", None), ("p99 TTFT", "p99_ttft_ms", slo_ttft),
        ("p99 TPOT", "p99_tpot_ms", slo_tpot)) if column in ok.column_names]
    shares = [(f"{title} by shape", "%", column, None) for title, column in (
        ("SLO attainment", "slo_attainment"), ("KV transfer share of TTFT", "pd_transfer_share_of_ttft"))
        if column in ok.column_names]
    out = []
    for specs, scale, alt, caption in (
            (latency, 1.0, "latency by shape",
             "Latency per deployment shape (xPyD: x prefill and y decode replicas; aggregated points beside, with "
             "their GPUs): p50 and p99 TTFT, p99 TPOT, in ms; the dotted line is the SLO bound. A P/D point's TTFT "
             "is the decode side's first token (prefill, KV read and the decode step)."),
            (shares, 100.0, "SLO and transfer by shape",
             "Per deployment shape: requests within the SLO (slo_attainment, over every request that arrived), "
             "and the KV transfer's share of TTFT (pd_transfer_share_of_ttft, the mean of transfer_s / ttft_s; "
             "none for aggregated points), in %.")):
        if not specs:
            continue
        panels = [(title, unit, [("", numbers(ok, column) * scale)]) for title, unit, column, _ in specs]
        references = [bound for _, _, _, bound in specs]
        out.append(PendingFigure(partial(plots.bars, labels, [], ylabel="", title="", panels=panels,
                                         references=references), caption, alt))
    return out
