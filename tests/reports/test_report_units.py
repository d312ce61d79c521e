"""The report's plots carry their data in the unit their axis names, and every printed
figure is formatted from its value.

Plots: the figures are drawn for real, from tiny hand-made tables whose values are known
(one step per time bin, a few requests), and the drawn Matplotlib artists are read back
(the PNG encoder is replaced by a catcher of the figure): each line's data is compared
with the value recomputed here in the unit the axis label says (ms on a "(ms)" axis, %
on a "(%)" axis, minutes on a "(min)" axis, GB/s, M tokens).

Text: the key metrics of a capacity report are chosen from a known table (the best point
by each figure, failed points left out); the replay report's key metrics and the printed
capacity rows come from known summary values; each formatter is fed values whose text is
written out here by hand.
"""

from __future__ import annotations

import html
import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.commands.capacity import print_points
from kvtwin.reports import capacity_report, diff_plots, figure_jobs, plots, replay_report
from kvtwin.reports.capacity_report import render_capacity_report
from kvtwin.reports.diff import FigureChange, format_change, format_relative, format_value
from kvtwin.reports.html_tables import fmt_cell
from kvtwin.reports.replay_plots import replay_figures
from kvtwin.reports.replay_report import render_replay_report
from kvtwin.reports.summary_text import (format_bytes, format_duration_ms, format_duration_s, format_percent,
                                         slo_verdict)
from kvtwin.sim.scenario.sweep_keys import parse_sweeps

BINS = 400          # the replay report's time bins (one step in each here)
BIN_S = 2.0         # so the run lasts 800 s: a minutes axis
HIT_BINS = 100      # the hit-rate plot's bins, 8 s each
CHUNK_BYTES = 1e8


@pytest.fixture
def drawn(monkeypatch):
    """The figures drawn, in order (each one's PNG replaced by nothing), drawn in this process."""
    figures = []

    def catch(fig):
        figures.append(fig)
        return b""

    monkeypatch.setattr(plots, "_png", catch)
    monkeypatch.setattr(diff_plots, "_png", catch)
    monkeypatch.setattr(figure_jobs, "_can_fork", lambda: False)
    return figures


def _by_title(figures) -> dict:
    return {ax.get_title(): ax for fig in figures for ax in fig.axes if ax.get_title()}


def _run():
    """A run of 400 steps, one in the middle of each 2 s bin, and five requests."""
    i = np.arange(BINS)
    steps = pa.table({
        "step": i, "time_s": (i + 0.5) * BIN_S - 0.5, "duration_s": np.full(BINS, 1.0),
        "num_running": (i % 5).astype(np.int32), "num_waiting": np.full(BINS, 2, np.int32),
        "num_preempted": (i % 10 == 0).astype(np.int32),
        "kv_cache_usage": np.full(BINS, 0.375),
        "kv_cache_usage_by_group": pa.array([[0.25, 0.125]] * BINS, pa.list_(pa.float64())),
        "offload_cpu_used_chunks": np.full(BINS, 50, np.int64), "offload_disk_used_chunks": np.zeros(BINS, np.int64),
        "offload_load_bytes": np.full(BINS, 2e9).astype(np.int64),
        "offload_store_bytes": np.full(BINS, 1e9).astype(np.int64),
        "offload_disk_loaded_keys": np.full(BINS, 3, np.int64), "offload_disk_stored_keys": np.zeros(BINS, np.int64),
        "num_waiting_for_kv": np.full(BINS, 4, np.int32),
    })
    nan = float("nan")
    requests = pa.table({
        "status": ["finished", "finished", "finished", "finished", "rejected"],
        "arrival_time_s": [0.5, 1.5, 99.0, 700.0, 5.0],
        "first_scheduled_time_s": [1.0, 2.0, 100.0, 799.0, nan],
        "prompt_tokens": [1_000_000, 2_000_000, 500_000, 250_000, 4_000_000],
        "prefix_cache_queries": [100, 300, 200, 50, 0], "prefix_cache_hits": [50, 0, 150, 50, 0],
        "ttft_s": [0.080, 0.010, 0.040, 0.020, nan], "tpot_s": [0.002, 0.004, 0.003, 0.001, nan],
        "e2el_s": [1.5, 0.5, 1.0, 2.0, nan], "replica": [0, 1, 0, 1, 1],
    })
    summary = {"duration_s": 800.0, "slo_ttft_ms": 50.0, "slo_tpot_ms": 3.0, "prefix_cache_hit_rate": 0.3,
               "prefix_reuse_upper_bound": 0.6, "offload_cpu_chunks": 200, "offload_disk_chunks": 0,
               "offload_chunk_bytes": CHUNK_BYTES}
    return requests, steps, summary


def test_replay_plots_are_drawn_in_their_axes_units(drawn):
    requests, steps, summary = _run()
    replay_figures(requests, steps, summary, None)
    axes = _by_title(drawn)
    centers_s = (np.arange(BINS) + 0.5) * BIN_S

    # Latency CDFs: the finished requests' values in ms, sorted; the SLO line in ms.
    for name, values_s, slo_ms in (("TTFT", [0.080, 0.010, 0.040, 0.020], 50.0),
                                   ("TPOT", [0.002, 0.004, 0.003, 0.001], 3.0),
                                   ("E2E latency", [1.5, 0.5, 1.0, 2.0], None)):
        ax = axes[f"{name} CDF"]
        assert ax.get_xlabel() == f"{name} (ms)"
        line = ax.lines[0]
        assert np.allclose(line.get_xdata(), np.sort(values_s) * 1000)
        assert np.allclose(line.get_ydata(), np.linspace(0, 100, 4))
        slo_lines = [ln for ln in ax.lines if ln.get_label() == "SLO"]
        assert [np.asarray(ln.get_xdata(), float)[0] for ln in slo_lines] == ([slo_ms] if slo_ms else [])

    # KV usage: 25 % and 12.5 % stacked, the bin's peak (37.5 %) as a line, minutes on x.
    ax = axes["KV cache usage by group"]
    assert ax.get_xlabel() == "simulated time (min)" and "(%)" in ax.get_ylabel()
    peak = ax.lines[0]
    assert np.allclose(peak.get_xdata(), centers_s / 60) and np.allclose(peak.get_ydata(), 37.5)
    tops = [coll.get_paths()[0].vertices[:, 1].max() for coll in ax.collections]
    assert np.allclose(tops, [25.0, 37.5])

    # Hit rate over time: per 8 s bin, tokens found over tokens looked up, in %.
    ax = axes["Prefix cache hit rate (by first-scheduled time)"]
    per_bin = ax.lines[0]
    expected = np.full(HIT_BINS, np.nan)
    expected[0], expected[100 // 8], expected[799 // 8] = 50 / 400 * 100, 150 / 200 * 100, 50 / 50 * 100
    assert np.allclose(per_bin.get_xdata(), (np.arange(HIT_BINS) + 0.5) * 8 / 60)
    assert np.allclose(per_bin.get_ydata(), expected, equal_nan=True)
    whole_run, bound = (np.asarray(ln.get_ydata(), float)[0] for ln in ax.lines[1:3])
    assert (whole_run, bound) == (pytest.approx(30.0), pytest.approx(60.0))

    # Queues: the one step's values per bin; preemptions: one per 10 steps, per 2 s bin.
    ax = axes["Running and waiting queues"]
    running, waiting = (ln for ln in ax.lines if ln.get_label() in ("running", "waiting"))
    assert np.allclose(running.get_ydata(), np.arange(BINS) % 5) and np.allclose(waiting.get_ydata(), 2)
    ax = axes["Preemptions"]
    assert ax.get_ylabel() == "preemptions per 2 s"
    assert np.allclose(ax.lines[0].get_ydata(), np.arange(BINS) % 10 == 0)

    # Offload: 50 of 200 chunks = 25 %; 2 GB and 1 GB a step over 2 s = 1 and 0.5 GB/s; the
    # disk's 3 chunks of 100 MB a step = 0.15 GB/s; 4 requests waiting for KV.
    ax = axes["Offload tier use"]
    assert "(%)" in ax.get_ylabel() and np.allclose(ax.lines[0].get_ydata(), 25.0)
    pcie, disk = axes["PCIe (GPU ↔ CPU)"], axes["disk (CPU ↔ disk)"]
    assert pcie.get_ylabel() == "GB/s"
    assert [np.asarray(ln.get_ydata(), float).mean() for ln in pcie.lines] == pytest.approx([1.0, 0.5])
    assert np.asarray(disk.lines[0].get_ydata(), float).mean() == pytest.approx(3 * CHUNK_BYTES / BIN_S / 1e9)
    ax = axes["Requests waiting for KV from a tier"]
    assert np.allclose(ax.lines[0].get_ydata(), 4)

    # Per replica: requests routed, and prompt tokens in millions.
    counts, tokens = axes["Requests per replica"], axes["Prompt tokens per replica"]
    assert [p.get_height() for p in counts.patches] == [2, 3]
    assert tokens.get_ylabel() == "prompt tokens (M)"
    assert [p.get_height() for p in tokens.patches] == pytest.approx([1.5, 6.25])


@pytest.mark.parametrize(("t_max_s", "divisor", "unit"), [(599.0, 1.0, "s"), (600.0, 60.0, "min"),
                                                          (7199.0, 60.0, "min"), (7200.0, 3600.0, "h")])
def test_the_time_axis_unit(t_max_s, divisor, unit):
    assert plots.time_unit(t_max_s) == (divisor, f"simulated time ({unit})")


def test_diff_cdfs_are_in_ms_with_each_runs_slo(drawn):
    requests, steps, summary = _run()
    runs = [(name, SimpleNamespace(summary={**summary, "slo_ttft_ms": slo}, directory=name), requests, steps)
            for name, slo in (("A", 50.0), ("B", 80.0))]
    diff_plots.diff_figures(runs)
    axes = _by_title(drawn)
    ax = axes["TTFT CDF"]
    assert ax.get_xlabel() == "TTFT (ms)"
    assert np.allclose(ax.lines[0].get_xdata(), [10, 20, 40, 80])
    assert sorted(float(ln.get_xdata()[0]) for ln in ax.lines if ln.get_label().endswith("SLO")) == [50.0, 80.0]
    usage = axes["KV cache usage, A and B"]
    assert np.nanmax(usage.lines[0].get_ydata()) == pytest.approx(37.5)


def _capacity_table() -> pa.Table:
    """Four points; the failed one has the best numbers, which must not count."""
    return pa.table({
        "point": [0, 1, 2, 3], "status": ["ok", "ok", "ok", "failed"], "error": [None, None, None, "boom"],
        "workload.rate_scale": [0.5, 1.0, 2.0, 4.0],
        "request_throughput": [4.5, 9.0, 11.0, 99.0], "slo_attainment": [0.99, 0.95, 0.625, 1.0],
        "prefix_cache_hit_rate": [0.25, 0.375, 0.125, 0.9],
        "max_rate_scale": [0.75, 1.5, 0.25, 9.0], "max_request_rate": [3.5, 9.25, 1.5, 50.0],
        "max_request_rate_per_replica": [1.75, 2.3125, 0.75, 50.0],
        "replicas_needed_trace_rate": pa.array([4, 2, 7, 1], pa.int64()),
        "replicas_needed_target_rate": pa.array([12, 9, 30, 1], pa.int64()),
        "max_request_rate_pessimistic": [3.0, 8.5, None, 60.0],
        "replicas_needed_trace_rate_pessimistic": pa.array([5, 3, None, 1], pa.int64()),
        "cost_per_million_tokens": [0.5, 0.25, 0.75, 0.01],
    })


def _key_metrics(text: str) -> dict:
    section = text.split("<h2>Key metrics</h2>", 1)[1]
    return {html.unescape(k): html.unescape(v)
            for k, v in re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", section.split("</table>", 1)[0])}


def test_capacity_key_metrics_pick_the_best_ok_point(drawn):
    metrics = _key_metrics(render_capacity_report(_capacity_table(), None, {}, None))
    # The ok points only (0, 1, 2): the largest rates, the fewest replicas, the lowest cost.
    expected = {
        "sweep points": "4 (3 ok, 1 failed)",
        "swept: workload.rate_scale": "0.5, 1, 2, 4",
        "highest sustainable request rate (req/s)": "9.25",
        "highest sustainable rate scale": "1.5",
        "highest rate per replica (req/s)": "2.312",
        "fewest replicas for the trace's rate": "2",
        "fewest replicas for the target rate": "9",
        "highest sustainable request rate, pessimistic edge (req/s)": "8.5",
        "fewest replicas for the trace's rate, pessimistic edge": "3",
        "lowest cost per million tokens": "0.25",
        "best SLO attainment": "99.0 %",
        "best prefix cache hit rate": "37.5 %",
    }
    assert metrics == expected


def test_capacity_rate_plots_in_their_units(drawn):
    render_capacity_report(_capacity_table(), None, {}, None)
    axes = _by_title(drawn)
    ax = axes["Throughput vs rate"]
    assert np.allclose(ax.lines[0].get_xdata(), [0.5, 1.0, 2.0]) and np.allclose(ax.lines[0].get_ydata(),
                                                                                  [4.5, 9.0, 11.0])
    ax = axes["SLO attainment vs rate"]
    assert "(%)" in ax.get_ylabel() and np.allclose(ax.lines[0].get_ydata(), [99.0, 95.0, 62.5])
    # No GPUs per replica in this table: the replicas needed stay in replicas (the ok points:
    # trace rate, target rate, trace rate at the slow edge, which point 2 lacks).
    ax = axes["Replicas needed"]
    assert ax.get_ylabel() == "replicas"
    assert np.allclose([p.get_height() for p in ax.patches], [4, 2, 7, 12, 9, 30, 5, 3, np.nan], equal_nan=True)
    # The answer against the swept key: the largest sustainable rate, and its slow edge dashed
    # where the point has one (point 2 has none), in requests per second.
    ax = axes["Max sustainable rate vs rate_scale"]
    assert ax.get_ylabel() == "requests per second"
    central, edge = ax.lines
    assert np.allclose(central.get_xdata(), [0.5, 1.0, 2.0]) and np.allclose(central.get_ydata(), [3.5, 9.25, 1.5])
    assert np.allclose(edge.get_xdata(), [0.5, 1.0]) and np.allclose(edge.get_ydata(), [3.0, 8.5])
    assert edge.get_linestyle() == "--" and edge.get_color() == central.get_color()


def _heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_the_answer_against_each_swept_key_and_gpus_needed(drawn):
    # engine.replicas 1, 2 by two GPUs, tensor-parallel 2: 2 GPUs a replica.
    replicas, gpus = [1, 1, 2, 2], ["h100", "h200"] * 2
    table = pa.table({
        "point": [0, 1, 2, 3], "status": ["ok"] * 4, "error": pa.array([None] * 4, pa.string()),
        "engine.replicas": replicas, "hardware.gpu": gpus,
        "num_replicas": replicas, "num_gpus": [2 * r for r in replicas],
        "max_request_rate": [10.0, 16.0, 21.0, 30.0], "max_request_rate_pessimistic": [8.0, 14.0, 17.0, 26.0],
        "replicas_needed_trace_rate": pa.array([3, 2, 3, 2], pa.int64()),
        "replicas_needed_target_rate": pa.array([None] * 4, pa.int64()),
        "replicas_needed_trace_rate_pessimistic": pa.array([4, 3, 4, 3], pa.int64()),
    })
    render_capacity_report(table, None, {}, None)
    axes = _by_title(drawn)
    # A number key: one line per GPU, the slow edge dashed beside each.
    ax = axes["Max sustainable rate vs replicas"]
    assert ax.get_xlabel() == "engine.replicas" and ax.get_ylabel() == "requests per second"
    lines = {ln.get_label(): ln for ln in ax.lines}
    assert set(lines) == {"gpu=h100", "gpu=h100 slow edge", "gpu=h200", "gpu=h200 slow edge"}
    assert np.allclose(lines["gpu=h100"].get_xdata(), [1, 2]) and np.allclose(lines["gpu=h100"].get_ydata(), [10, 21])
    assert np.allclose(lines["gpu=h200 slow edge"].get_ydata(), [14, 26])
    # A key of names: a bar per GPU, one per replicas and its slow edge beside it.
    ax = axes["Max sustainable rate vs gpu"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["h100", "h200"]
    assert [h.get_label() for h in ax.containers] == ["replicas=1", "replicas=1 slow edge", "replicas=2",
                                                      "replicas=2 slow edge"]
    assert _heights(ax) == [10, 16, 8, 14, 21, 30, 17, 26]
    # GPUs needed: replicas needed x 2 GPUs per replica (num_gpus / num_replicas).
    ax = axes["GPUs needed"]
    assert ax.get_ylabel() == "GPUs"
    assert _heights(ax) == [6, 4, 6, 4, 8, 6, 8, 6]
    assert "Replicas needed" not in _by_title(drawn)


def test_a_single_point_gets_its_answer_as_bars(drawn):
    table = pa.table({
        "point": [0], "status": ["ok"], "error": pa.array([None], pa.string()), "engine.replicas": [4],
        "num_replicas": [4], "num_gpus": [8], "max_request_rate": [12.5], "max_request_rate_pessimistic": [10.0],
        "replicas_needed_trace_rate": pa.array([1], pa.int64()),
    })
    text = render_capacity_report(table, None, {}, None)
    assert "no sweep key this report plots" not in text
    axes = _by_title(drawn)
    ax = axes["Max sustainable rate"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["replicas=4"]
    assert _heights(ax) == [12.5, 10.0] and ax.get_ylabel() == "requests per second"
    assert _heights(axes["GPUs needed"]) == [2]  # one replica of tensor-parallel 2 (8 GPUs over 4 replicas)


def test_pd_latencies_slo_and_transfer_by_shape(drawn):
    nan = float("nan")
    table = pa.table({
        "point": [0, 1, 2], "status": ["ok"] * 3, "error": pa.array([None] * 3, pa.string()),
        "disaggregation.shape": ["2P2D", "1P3D", "none"],
        "num_replicas": [4, 4, 4], "num_gpus": [4, 4, 4],
        "pd_prefill_replicas": pa.array([2, 1, None], pa.int64()), "pd_decode_replicas": pa.array([2, 3, None],
                                                                                                  pa.int64()),
        "pd_link": ["nvlink", "nvlink", None],
        "median_ttft_ms": [120.0, 300.0, 90.0], "p99_ttft_ms": [800.0, 2500.0, 1500.0],
        "p99_tpot_ms": [20.0, 15.0, 45.0], "slo_ttft_ms": [2000.0] * 3, "slo_tpot_ms": [40.0] * 3,
        "slo_attainment": [0.99, 0.75, 0.5], "pd_transfer_share_of_ttft": [0.125, 0.0625, nan],
        "max_request_rate": [20.0, 12.0, 15.0],
    })
    text = render_capacity_report(table, None, {}, None)
    assert "no sweep key this report plots" not in text
    axes = _by_title(drawn)
    shapes = ["2P2D, 4 GPUs", "1P3D, 4 GPUs", "aggregated x4, 4 GPUs"]
    for title, unit, heights, bound in (("p50 TTFT by shape", "ms", [120, 300, 90], None),
                                        ("p99 TTFT by shape", "ms", [800, 2500, 1500], 2000.0),
                                        ("p99 TPOT by shape", "ms", [20, 15, 45], 40.0),
                                        ("SLO attainment by shape", "%", [99, 75, 50], None),
                                        ("KV transfer share of TTFT by shape", "%", [12.5, 6.25, nan], None)):
        ax = axes[title]
        assert ax.get_ylabel() == unit, title
        assert [t.get_text() for t in ax.get_xticklabels()] == shapes
        assert np.allclose(_heights(ax), heights, equal_nan=True), title
        assert [float(ln.get_ydata()[0]) for ln in ax.lines] == ([bound] if bound else []), title
    # The answer by shape: a bar per value of the key, in sweep order.
    ax = axes["Max sustainable rate vs shape"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2P2D", "1P3D", "none"]
    assert _heights(ax) == [20, 12, 15]


def test_kv_capacity_and_router_plots_in_their_units(drawn):
    # Two KV sizes (1 and 2 GiB of 1 MiB blocks: 1023 and 2047 usable) by two routers.
    gib = 2**30
    table = pa.table({
        "point": [0, 1, 2, 3], "status": ["ok"] * 4, "error": pa.array([None] * 4, pa.string()),
        "engine.kv_cache_memory_bytes": [gib, gib, 2 * gib, 2 * gib],
        "engine.router": ["round_robin", "prefix_aware"] * 2,
        "slo_attainment": [0.9, 0.95, 0.97, 0.99], "prefix_cache_hit_rate": [0.2, 0.25, 0.3, 0.35],
        "p99_ttft_ms": [1500.0, 1200.0, 900.0, 700.0], "request_throughput": [1.0, 2.0, 3.0, 4.0],
    })
    curve = pa.table({"kv_cache_blocks": [100, 1000, 10000], "kv_cache_tokens": [1600, 16000, 160000],
                      "hit_rate": [0.1, 0.3, 0.5]})
    render_capacity_report(table, curve, {}, {"model": "m", "bytes_per_block": 2**20, "groups": []})
    axes = _by_title(drawn)
    ax = axes["Prefix cache hit rate vs KV cache capacity"]
    assert ax.get_xlabel() == "KV cache (tokens)" and "(%)" in ax.get_ylabel()
    line, dots = ax.lines
    assert np.allclose(line.get_xdata(), [1600, 16000, 160000]) and np.allclose(line.get_ydata(), [10, 30, 50])
    # 16 tokens per block (the curve's), the blocks less the null block.
    assert np.allclose(dots.get_xdata(), np.array([1023, 1023, 2047, 2047]) * 16)
    assert np.allclose(dots.get_ydata(), [20, 25, 30, 35])
    # Router comparison: per KV size, a bar per router; fractions in %, TTFT in ms.
    for title, unit, heights in (("SLO attainment", "%", [90, 95, 97, 99]),
                                 ("prefix cache hit rate", "%", [20, 25, 30, 35]),
                                 ("p99 TTFT", "ms", [1500, 1200, 900, 700])):
        ax = axes[title]
        assert ax.get_ylabel() == unit
        assert [p.get_height() for p in ax.patches] == pytest.approx(heights)


def test_replay_key_metrics_from_known_values(monkeypatch):
    monkeypatch.setattr(replay_report, "replay_figures", lambda *args: [])
    summary = {"num_requests": 1000, "completed": 990, "rejected": 7, "unfinished": 3, "duration_s": 3125.0,
               "request_throughput": 0.3168, "output_throughput": 1234.6, "total_token_throughput": 56789.0,
               "mean_ttft_ms": 12.3, "median_ttft_ms": 45.6, "p90_ttft_ms": 789.0, "p99_ttft_ms": 1234.0,
               "mean_tpot_ms": 0.5, "median_tpot_ms": 5.0, "p90_tpot_ms": 9.96, "p99_tpot_ms": 59_000.0,
               "prefix_cache_hit_rate": 0.4321, "prefix_reuse_upper_bound": 0.5,
               "kv_cache_usage_peak": 0.875, "kv_cache_usage_mean": 0.5,
               "slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "slo_attainment": 0.96, "rejected_share": 0.007,
               "request_goodput": 0.30}
    metrics = _key_metrics(render_replay_report(pa.table({}), pa.table({}), summary, {}, {}))
    assert metrics["simulated duration"] == "52.1 min"
    assert metrics["request throughput (req/s)"] == "0.3168"
    assert metrics["output / all tokens per s"] == "1,235 / 56,789"
    assert metrics["TTFT mean / p50 / p90 / p99"] == "12 ms / 46 ms / 789 ms / 1.2 s"
    assert metrics["TPOT mean / p50 / p90 / p99"] == "500 µs / 5.0 ms / 10 ms / 59.0 s"
    assert metrics["prefix cache hit rate (tokens)"] == "43.2 %"
    assert metrics["KV cache usage peak / mean"] == "87.5 % / 50.0 %"
    assert metrics["SLO: TTFT (as a client sees it) / TPOT at most"] == "2.0 s / 100 ms"
    assert metrics["SLO attainment (all requests) / rejected"] == "96.0 % / 0.7 %"


def test_replay_key_metrics_name_the_server_and_the_client_side(monkeypatch):
    """With the client-side columns each TTFT and E2E row says whose figure it is."""
    monkeypatch.setattr(replay_report, "replay_figures", lambda *args: [])
    summary = {"completed": 4, "rejected": 0, "unfinished": 0, "client_overhead_ms": 8.0,
               **{f"{stat}_ttft_ms": v for stat, v in zip(("mean", "median", "p90", "p99"), (20.0, 30.0, 100.0, 120.0))},
               **{f"{stat}_ttft_client_ms": v for stat, v in zip(("mean", "median", "p90", "p99"), (28.0, 38.0, 108.0, 128.0))},
               **{f"{stat}_e2el_ms": 1500.0 for stat in ("mean", "median", "p90", "p99")},
               **{f"{stat}_e2el_client_ms": 1508.0 for stat in ("mean", "median", "p90", "p99")}}
    metrics = _key_metrics(render_replay_report(pa.table({}), pa.table({}), summary, {}, {}))
    assert metrics["TTFT (server) mean / p50 / p90 / p99"] == "20 ms / 30 ms / 100 ms / 120 ms"
    assert metrics["TTFT (client, +8.0 ms) mean / p50 / p90 / p99"] == "28 ms / 38 ms / 108 ms / 128 ms"
    assert metrics["E2E latency (server) mean / p50 / p90 / p99"] == " / ".join(["1.5 s"] * 4)
    assert metrics["E2E latency (client, +8.0 ms) mean / p50 / p90 / p99"] == " / ".join(["1.5 s"] * 4)
    assert "TTFT mean / p50 / p90 / p99" not in metrics


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0123, "12 ms"), (0.00123, "1.2 ms"), (0.000_5, "500 µs"), (5e-6, "5.0 µs"), (0.9996, "1.0 s"),
    (1.5, "1.5 s"), (59.0, "59.0 s"), (90.0, "1.5 min"), (3125.0, "52.1 min"), (3540.0, "59.0 min"),
    (9.96e-3, "10 ms"), (99.96 * 3600, "100 h"), (3599.9, "1.0 h"), (7200.0, "2.0 h"), (360_000.0, "100 h"), (0.0, "0 s"), (-0.25, "-250 ms"),
    (None, "-"), (float("nan"), "-")])
def test_durations_read_in_their_unit(seconds, text):
    assert format_duration_s(seconds) == text
    if seconds is not None:
        assert format_duration_ms(seconds * 1000) == text


@pytest.mark.parametrize(("fraction", "text"), [(0.1234, "12.3 %"), (1.0, "100.0 %"), (0.0005, "0.1 %"),
                                                (0.0, "0.0 %"), (None, "-")])
def test_percentages(fraction, text):
    assert format_percent(fraction) == text


@pytest.mark.parametrize(("num_bytes", "text"), [(1.5e12, "1.5 TB"), (2e11, "200 GB"), (2**30, "1.1 GB"),
                                                 (1.5e6, "1.5 MB"), (99.96e9, "100 GB"), (999, "999 B"), (None, "-")])
def test_bytes_in_decimal_units(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(("value", "text"), [(12.0, "12"), (1234.6, "1,235"), (0.0123456, "0.01235"),
                                             (3, "3"), (12345, "12,345"), (True, "yes"), (None, "-"),
                                             (float("nan"), "-")])
def test_report_cells(value, text):
    assert fmt_cell(value) == text


def test_diff_values_and_changes():
    assert format_value("ms", 1500.0) == "1.5 s" and format_value("s", 90.0) == "1.5 min"
    assert format_value("share", 0.25) == "25.0 %" and format_value("per_s", 12.345) == "12.35"
    assert format_value("count", 1234.0) == "1,234" and format_value("x", 1.5) == "1.50x"
    # A share's change is in percentage points; others in the figure's unit, signed.
    assert format_change("share", 0.30 - 0.25) == "+5.0 pt"
    assert format_change("ms", 12.0 - 20.0) == "−8.0 ms"
    assert format_relative((12.0 - 20.0) / 20.0) == "−40.0 %"
    # The relative change is over A, the run compared from.
    change = FigureChange("p99_ttft_ms", "TTFT p99", "ms", 20.0, 12.0)
    assert (change.change, change.relative_change) == (12.0 - 20.0, (12.0 - 20.0) / 20.0)


def test_slo_verdict_at_the_bound():
    row = {"p99_ttft_ms": 2000.0, "slo_ttft_ms": 2000.0, "p99_tpot_ms": 16.0, "slo_tpot_ms": 100.0,
           "slo_attainment": 0.995, "completed": 10, "rejected": 0, "unfinished": 0}
    assert slo_verdict(row) == "SLO met: p99 TTFT 2.0 s ≤ 2.0 s, p99 TPOT 16 ms ≤ 100 ms (99.5 % of requests " \
                               "within both)"
    over = {**row, "p99_ttft_ms": 2001.0, "p99_tpot_ms": 300.0}
    # The bound exceeded by the largest factor first (TPOT 3x, TTFT 1.0005x).
    assert slo_verdict(over) == ("SLO not met: p99 TPOT 300 ms > 100 ms, p99 TTFT 2.0 s > 2.0 s (99.5 % of "
                                 "requests within both)")


def test_printed_capacity_rows(capsys):
    table = pa.table({
        "point": [0], "workload.rate_scale": [0.5], "status": ["ok"], "error": [None],
        "p99_ttft_ms": [1234.0], "p99_tpot_ms": [8.5], "slo_attainment": [0.875], "rejected_share": [0.0],
        "prefix_cache_hit_rate": [0.4], "request_throughput": [12.5],
        "max_rate_scale": [0.3125], "max_request_rate": [3.125], "replicas_needed_trace_rate": [4],
        "cost_per_million_tokens": [0.123456], "replicas_needed_target_rate": pa.array([None], pa.int64()),
        "max_request_rate_pessimistic": pa.array([None], pa.float64()),
    })
    print_points(table, parse_sweeps(["workload.rate_scale=0.5"]), True)
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(ln for ln in lines if "p99 TTFT" in ln).strip("│┃ ").split("┃")]
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("│ 0")).strip("│ ").split("│")]
    assert dict(zip(header, row)) == {
        "point": "0", "workload.rate_scale": "0.5", "status": "ok", "p99 TTFT": "1.2 s", "p99 TPOT": "8.5 ms",
        "SLO met": "87.5 %", "hit rate": "40.0 %", "served req/s": "12.5", "max rate scale": "0.3125",
        "max sustained req/s": "3.125", "replicas needed": "4", "$/M tok": "0.1235"}
    # A line under the table for each heading that could be read two ways, in its order.
    legend = [ln.split(":", 1)[0] for ln in lines if ln.split(":", 1)[0] in header]
    assert legend == ["served req/s", "max sustained req/s", "replicas needed"]
    assert "of the replay at the max rate" in next(ln for ln in lines if ln.startswith("served req/s:"))
    assert "not the swept engine.replicas" in next(ln for ln in lines if ln.startswith("replicas needed:"))


def test_printed_capacity_slow_edge_and_target_headings(capsys):
    table = pa.table({
        "point": [0], "engine.replicas": [2], "status": ["ok"], "error": [None],
        "p99_ttft_ms": [100.0], "p99_tpot_ms": [8.0], "slo_attainment": [1.0], "rejected_share": [0.0],
        "prefix_cache_hit_rate": [0.5], "request_throughput": [7.0],
        "max_rate_scale": [2.0], "max_request_rate": [8.0], "replicas_needed_trace_rate": [3],
        "cost_per_million_tokens": [0.5], "replicas_needed_target_rate": pa.array([5], pa.int64()),
        "step_error": [0.25], "max_request_rate_pessimistic": [6.0],
        "replicas_needed_trace_rate_pessimistic": pa.array([4], pa.int64()),
    })
    print_points(table, parse_sweeps(["engine.replicas=2"]), True)
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(ln for ln in lines if "p99 TTFT" in ln).strip("│┃ ").split("┃")]
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("│ 0")).strip("│ ").split("│")]
    shown = dict(zip(header, row))
    assert {k: shown[k] for k in ("engine.replicas", "replicas needed", "replicas needed @target", "step err",
                                  "max sustained req/s (slow edge)", "replicas needed (slow edge)")} == {
        "engine.replicas": "2", "replicas needed": "3", "replicas needed @target": "5", "step err": "25.0 %",
        "max sustained req/s (slow edge)": "6", "replicas needed (slow edge)": "4"}
    legend = [ln.split(":", 1)[0] for ln in lines if ln.split(":", 1)[0] in header]
    assert legend == ["served req/s", "max sustained req/s", "replicas needed", "replicas needed @target",
                      "max sustained req/s (slow edge)", "replicas needed (slow edge)"]


def test_printed_capacity_rows_show_the_clients_ttft(capsys):
    """With the client-side columns the point table shows the TTFT the SLO judges, named so."""
    table = pa.table({
        "point": [0], "status": ["ok"], "error": [None], "p99_ttft_ms": [120.0], "p99_ttft_client_ms": [128.0],
        "p99_tpot_ms": [8.5], "slo_attainment": [0.875], "rejected_share": [0.0], "prefix_cache_hit_rate": [0.4],
        "request_throughput": [12.5],
    })
    print_points(table, [], False)
    lines = capsys.readouterr().out.splitlines()
    header = [c.strip() for c in next(ln for ln in lines if "p99 TTFT" in ln).strip("│┃ ").split("┃")]
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("│ 0")).strip("│ ").split("│")]
    shown = dict(zip(header, row))
    assert shown["p99 TTFT (client)"] == "128 ms" and "p99 TTFT" not in shown
