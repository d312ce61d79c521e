"""report.html: every plot is there and renders, strings from data are escaped, the same
directory gives the same bytes, nothing is loaded from outside the file; ``kvtwin report``
on replay, capacity and bad directories; ``kvtwin replay`` writes the report unless
``--no-report``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from matplotlib.lines import Line2D
from typer.testing import CliRunner

from kvtwin.cli import COMMANDS, app as kvtwin_app
from kvtwin.commands.report import report as report_command
from kvtwin.reports import figure_jobs, plots
from kvtwin.reports.binning import minmax_points, state_bins
from kvtwin.reports.capacity_report import render_capacity_report
from kvtwin.reports.html import render_report_dir, write_report
from kvtwin.reports.replay_plots import TIME_BINS
from kvtwin.reports.replay_report import render_replay_report
from kvtwin.reports.run_dir import write_dir

IMG = '<img src="data:image/png;base64,'
REPLAY_CAPTIONS = ("KV cache usage by KV cache group over time", "Prefix cache hit rate over time",
                   "Running and waiting requests", "Preemptions (recompute)", "Cumulative distributions of TTFT")
# The default scenario runs two replicas, so its report adds the per-replica load.
DEFAULT_RUN_CAPTIONS = REPLAY_CAPTIONS + ("Load per replica",)
CAPACITY_CAPTIONS = ("Throughput vs rate", "SLO attainment vs rate", "Prefix cache hit rate vs KV cache capacity",
                     "Replicas needed", "Router comparison")
EVIL = '<script>alert("x")</script>&'


def _app() -> typer.Typer:
    """``kvtwin`` itself once ``report`` is registered there; until then a copy with it."""
    if any(entry.name == "report" for entry in COMMANDS):
        return kvtwin_app
    local = typer.Typer(add_completion=False, rich_markup_mode=None)

    @local.callback()
    def main() -> None:
        """kvtwin (test copy)."""

    local.command("report")(report_command)
    return local


def _invoke(*args: str):
    return CliRunner().invoke(_app(), list(args))


def _replay(out: Path, *extra: str):
    result = CliRunner().invoke(kvtwin_app, ["replay", "--limit", "20", "--quiet", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replay") / "run"
    _replay(out)
    return out


def _synthetic_replay(n_steps: int = 2000, n_requests: int = 200, replicas: int = 1, groups: int = 2):
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 600, n_steps))
    usage = rng.uniform(0, 0.4, (n_steps, groups))
    steps = {
        "step": np.arange(n_steps), "time_s": t, "duration_s": np.full(n_steps, 0.01),
        "num_running": rng.integers(0, 30, n_steps).astype(np.int32),
        "num_waiting": rng.integers(0, 5, n_steps).astype(np.int32),
        "num_preempted": (rng.uniform(size=n_steps) < 0.01).astype(np.int32),
        "kv_cache_usage": usage.sum(axis=1),
        "kv_cache_usage_by_group": pa.array(usage.tolist(), type=pa.list_(pa.float64())),
    }
    arrival = np.sort(rng.uniform(0, 590, n_requests))
    ttft = rng.exponential(0.3, n_requests)
    requests = {
        "request_id": [f"r{i}<b>" for i in range(n_requests)],
        "status": ["finished"] * (n_requests - 2) + ["rejected", "waiting"],
        "arrival_time_s": arrival, "first_scheduled_time_s": arrival + ttft / 2,
        "prompt_tokens": rng.integers(100, 5000, n_requests),
        "prefix_cache_queries": rng.integers(100, 5000, n_requests),
        "ttft_s": ttft, "tpot_s": rng.uniform(0.005, 0.05, n_requests),
        "e2el_s": ttft + rng.uniform(1, 10, n_requests),
    }
    requests["prefix_cache_hits"] = (requests["prefix_cache_queries"] * rng.uniform(0, 0.5, n_requests)).astype(int)
    if replicas > 1:
        steps["replica"] = (np.arange(n_steps) % replicas).astype(np.int64)
        requests["replica"] = (np.arange(n_requests) % replicas).astype(np.int64)
    summary = {"duration_s": 600.0, "num_requests": n_requests, "completed": n_requests - 2, "rejected": 1,
               "unfinished": 1, "prefix_cache_hit_rate": 0.2, "prefix_reuse_upper_bound": 0.4,
               "slo_ttft_ms": 2000.0, "slo_tpot_ms": float("nan"), "mean_ttft_ms": 300.0,
               "rejected_by_reason": json.dumps({"prompt_too_long": 1}), "saturated": False,
               "saturation_reason": ""}
    plan = {"model": "toy<i>", "gpu": "toy", "num_blocks": 1001, "num_groups": groups,
            "groups": [{"group_id": g, "kind": ["full_attention", "sliding_window"][g % 2], "block_size": 16,
                        "num_layers": 4, "layer_indices": [0, 1, 2, 3]} for g in range(groups)]}
    metadata = {"kvtwin_version": "9.9", "scenario": f'description = "{EVIL}"\n[workload]\ntrace = "t.jsonl"\n',
                "scenario_file": "evil<.toml", "overrides": {"trace": "<b>trace</b>.jsonl"}}
    return pa.table(requests), pa.table(steps), pa.table({k: [v] for k, v in summary.items()}), plan, metadata


def _srcs(text: str) -> list[str]:
    return re.findall(r'(?:src|href)\s*=\s*["\']?([^"\'\s>]*)', text)


def test_replay_report_has_every_plot(replay_dir):
    text = (replay_dir / "report.html").read_text()
    assert text.count(IMG) == len(DEFAULT_RUN_CAPTIONS)
    for caption in DEFAULT_RUN_CAPTIONS:
        assert caption in text
    for fact in ("Llama-3.1-8B", "bundled:mooncake_conversation_trace.jsonl", "kvtwin version", "num_blocks",
                 "full_attention", "max concurrency", "Key metrics", "steps.parquet"):
        assert fact in text, fact



def test_replay_report_says_whose_latencies_it_shows(replay_dir):
    """The default scenario's bundled calibration carries 8 ms outside the engine: the key
    metrics name the server's and the client's rows, the CDF caption and the band say whose
    (docs/capacity.md#client-side-latency)."""
    text = (replay_dir / "report.html").read_text()
    for fact in ("TTFT (server) mean / p50 / p90 / p99", "TTFT (client, +8.0 ms) mean / p50 / p90 / p99",
                 "E2E latency (server) mean", "E2E latency (client, +8.0 ms) mean",
                 "a client sees each 8.0 ms later", "p99 band (server-side)",
                 "SLO: TTFT (as a client sees it) / TPOT at most"):
        assert fact.replace("'", "&#x27;") in text or fact in text, fact


def test_report_from_memory_equals_report_from_the_directory(replay_dir):
    assert render_report_dir(replay_dir) == (replay_dir / "report.html").read_text()


def test_report_is_deterministic_and_self_contained(replay_dir):
    first, second = render_report_dir(replay_dir), render_report_dir(replay_dir)
    assert first == second
    sources = _srcs(first)
    assert len(sources) == len(DEFAULT_RUN_CAPTIONS)
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", first)
    assert "<link" not in first and "@import" not in first and "url(" not in first


def test_strings_from_data_are_escaped_and_replicas_plotted():
    requests, steps, summary, plan, metadata = _synthetic_replay(replicas=3)
    text = render_replay_report(requests, steps, summary, plan, metadata)
    assert "<script>alert" not in text and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in text
    assert "<b>trace</b>" not in text and "&lt;b&gt;trace&lt;/b&gt;.jsonl" in text
    assert "toy<i>" not in text and "evil<.toml" not in text
    assert text.count(IMG) == len(REPLAY_CAPTIONS) + 1 and "Load per replica" in text
    assert "averaged over replicas" in text and "summed over replicas" in text
    assert text == render_replay_report(requests, steps, summary, plan, metadata)
    # No replica column, or one naming a single replica: no per-replica plot.
    requests, steps, summary, plan, metadata = _synthetic_replay(replicas=1)
    assert render_replay_report(requests, steps, summary, plan, metadata).count(IMG) == len(REPLAY_CAPTIONS)
    requests = requests.append_column("replica", pa.array([0] * requests.num_rows, pa.int64()))
    steps = steps.append_column("replica", pa.array([0] * steps.num_rows, pa.int64()))
    assert render_replay_report(requests, steps, summary, plan, metadata).count(IMG) == len(REPLAY_CAPTIONS)


def test_empty_run_still_renders():
    requests, steps, summary, plan, metadata = _synthetic_replay()
    text = render_replay_report(requests.slice(0, 0), steps.slice(0, 0), summary, plan, metadata)
    assert text.count(IMG) == len(REPLAY_CAPTIONS)


def _drawn(monkeypatch) -> list:
    """Every figure the plots encode from now on (``plots._png`` still encodes them), all
    drawn in this process (no forked helper draws any)."""
    figures = []
    monkeypatch.setattr(figure_jobs, "_can_fork", lambda: False)
    encode = plots._png

    def keep(fig):
        figures.append(fig)
        return encode(fig)

    monkeypatch.setattr(plots, "_png", keep)
    return figures


def _points(artist) -> int:
    if isinstance(artist, Line2D):
        return len(artist.get_xdata())
    return max((len(path.vertices) for path in artist.get_paths()), default=0)


def test_a_long_run_is_downsampled_and_keeps_its_extremes(monkeypatch):
    # Its time is measured in bench/bench_wall_clocks.py, not asserted here.
    requests, steps, summary, plan, metadata = _synthetic_replay(n_steps=200_000, n_requests=8_000)
    spike_at = 123_457  # one step with far more running requests than any other
    running = steps.column("num_running").to_numpy().copy()
    running[spike_at] = 999
    steps = steps.set_column(steps.schema.get_field_index("num_running"), "num_running",
                             pa.array(running, pa.int32()))
    figures = _drawn(monkeypatch)
    text = render_replay_report(requests, steps, summary, plan, metadata)
    assert text.count(IMG) == len(REPLAY_CAPTIONS) == len(figures)
    for caption in REPLAY_CAPTIONS:
        assert caption in text
    for fig in figures:
        for ax in fig.axes:
            for artist in [*ax.lines, *ax.collections]:
                assert _points(artist) <= plots.MAX_LINE_POINTS, (ax.get_title(), artist)
    queues = next(ax for fig in figures for ax in fig.axes if ax.get_title() == "Running and waiting queues")
    running_line = next(line for line in queues.lines if line.get_label() == "running")
    # The bin's mean hides the spike; the band from the bin's least to its most shows it.
    assert len(running_line.get_xdata()) == TIME_BINS and max(running_line.get_ydata()) < 999
    band_top = max(path.vertices[:, 1].max() for path in queues.collections[0].get_paths())
    assert band_top == 999
    usage = next(ax for fig in figures for ax in fig.axes if ax.get_title() == "KV cache usage by group")
    peak = next(line for line in usage.lines if line.get_label().startswith("peak"))
    total = np.array(steps.column("kv_cache_usage").to_pylist())
    assert max(peak.get_ydata()) == pytest.approx(total.max() * 100)


def test_minmax_points_cuts_a_long_line_and_keeps_its_extremes():
    rng = np.random.default_rng(1)
    x = np.arange(100_000, dtype=float)
    y = rng.normal(size=100_000)
    y[[17, 54_321]] = [50.0, -60.0]  # one spike each way
    y[99_000:] = np.nan
    cut_x, cut_y = minmax_points(x, y, 1000)
    assert len(cut_x) <= 1000 and np.all(np.diff(cut_x) > 0)
    assert {50.0, -60.0} <= set(cut_y.tolist())
    for start in range(0, 99_000, 200):  # each of the 500 stretches keeps its own extremes
        assert np.nanmax(y[start:start + 200]) in cut_y and np.nanmin(y[start:start + 200]) in cut_y
    again = minmax_points(x, y, 1000)
    assert np.array_equal(again[0], cut_x)
    short = minmax_points(x[:10], y[:10], 1000)
    assert np.array_equal(short[1], y[:10])


def test_state_bins_mean_range_and_empty_bins():
    # Bins 0 and 2 hold steps, 1 and 3 none: an empty bin holds the state the last step left.
    idx = np.array([0, 0, 0, 2, 2])
    values = np.array([4.0, 1.0, 7.0, 2.0, 6.0])
    mean, lo, hi = state_bins(idx, values, 4)
    assert mean.tolist() == [4.0, 7.0, 4.0, 6.0]
    assert lo.tolist() == [1.0, 7.0, 2.0, 6.0] and hi.tolist() == [7.0, 7.0, 6.0, 6.0]
    # Before the first step the state is empty.
    mean, lo, hi = state_bins(np.array([2]), np.array([5.0]), 3)
    assert mean.tolist() == lo.tolist() == hi.tolist() == [0.0, 0.0, 5.0]


def _capacity(failed_error: str = "ran out of <memory> & time"):
    rows = []
    point = 0
    for router in ("round_robin", "prefix_aware"):
        for kv in (8 * 2**30, 32 * 2**30):
            for rate in (0.5, 1.0, 2.0):
                ok = point != 11
                rows.append({"point": point, "status": "ok" if ok else "failed", "error": "" if ok else failed_error,
                             "engine.router": router, "engine.kv_cache_memory_bytes": kv,
                             "workload.rate_scale": rate,
                             "request_throughput": rate * 3.0 if ok else float("nan"),
                             "output_throughput": rate * 300.0 if ok else float("nan"),
                             "slo_attainment": max(0.0, 1.0 - 0.3 * rate) if ok else float("nan"),
                             "prefix_cache_hit_rate": (0.1 if kv < 2**34 else 0.3) + (0.05 if router == "prefix_aware"
                                                                                       else 0) if ok else float("nan"),
                             "p99_ttft_ms": 100.0 * rate if ok else float("nan"),
                             "replicas_needed_trace_rate": 1 + int(rate) if ok else None,
                             "replicas_needed_target_rate": 2 + int(rate) if ok else None})
                point += 1
    capacity = pa.Table.from_pylist(rows)
    blocks = np.array([1000, 4000, 8000, 16000, 32000, 64000])
    curve = pa.table({"kv_cache_blocks": blocks, "kv_cache_tokens": blocks * 16,
                      "hit_rate": np.array([0.05, 0.1, 0.15, 0.25, 0.3, 0.32])})
    return capacity, curve


def test_capacity_report_plots_what_was_swept():
    capacity, curve = _capacity()
    plan = {"model": "m", "bytes_per_block": 1 << 20, "groups": []}
    text = render_capacity_report(capacity, curve, {"kvtwin_version": "0.1.0"}, plan)
    assert text.count(IMG) == len(CAPACITY_CAPTIONS)
    for caption in CAPACITY_CAPTIONS:
        assert caption in text, caption
    assert "ran out of &lt;memory&gt; &amp; time" in text and "<memory>" not in text
    assert "All sweep points" in text and "failed" in text
    assert text == render_capacity_report(capacity, curve, {"kvtwin_version": "0.1.0"}, plan)
    # The points' own block counts put them on the curve without a plan.
    blocks = pa.array([8192 if kv < 2**34 else 32768 for kv in capacity.column("engine.kv_cache_memory_bytes")
                       .to_pylist()], pa.int64())
    text = render_capacity_report(capacity.append_column("kv_cache_blocks", blocks), curve, {}, None)
    assert text.count(IMG) == len(CAPACITY_CAPTIONS)
    # Only the rate swept, no curve: throughput and SLO attainment, and the table.
    only_rate = capacity.select(["point", "status", "error", "workload.rate_scale", "request_throughput",
                                 "slo_attainment"]).slice(0, 3)
    text = render_capacity_report(only_rate, None, {}, None)
    assert text.count(IMG) == 2 and "Router comparison" not in text and "Replicas needed" not in text


def _cli_ok(directory: Path):
    result = _invoke("report", str(directory))
    assert result.exit_code == 0, result.output
    assert str(directory / "report.html") in result.stdout
    return (directory / "report.html").read_text()


def test_report_command_on_a_replay_dir(tmp_path):
    out = tmp_path / "run"
    _replay(out, "--no-report")
    assert not (out / "report.html").exists()
    text = _cli_ok(out)
    assert text.count(IMG) == len(DEFAULT_RUN_CAPTIONS)
    assert not any(p.name.startswith(".") for p in out.iterdir())


def test_report_command_on_a_capacity_dir(tmp_path):
    capacity, curve = _capacity()
    out = tmp_path / "sweep"
    write_dir(out, tables={"capacity": capacity, "hit_curve": curve}, run_metadata={"kvtwin_version": "0.1.0"})
    text = _cli_ok(out)
    # No plan: the replayed points cannot go on the curve's token axis, so curve and points apart.
    assert text.count(IMG) == len(CAPACITY_CAPTIONS) + 1
    assert "hit_curve.parquet" in text


@pytest.mark.parametrize("kind", ["empty", "missing", "half a run", "corrupt capacity"])
def test_report_command_refuses_other_directories(tmp_path, kind):
    target = tmp_path / "d"
    if kind != "missing":
        target.mkdir()
    if kind == "half a run":
        pq.write_table(pa.table({"a": [1]}), target / "steps.parquet")
    if kind == "corrupt capacity":
        (target / "capacity.parquet").write_text("not parquet")
    result = _invoke("report", str(target))
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: ") and str(target) in lines[0], result.stderr
    assert not (target / "report.html").exists()


def test_replay_writes_the_report_unless_told_not_to(tmp_path, replay_dir):
    assert (replay_dir / "report.html").is_file()
    out = tmp_path / "no-report"
    _replay(out, "--no-report")
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "replicas.parquet", "requests.parquet",
                                                     "steps.parquet", "summary.parquet"]
    # A run directory holding a report is still a run directory: it is replaced whole.
    _replay(replay_dir)
    assert (replay_dir / "report.html").is_file()


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "headless_shell"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _rendered(browser: str, page: Path, profile: Path) -> tuple[list[str], str]:
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    body = re.search(r'data-plots-rendered="([^"]*)"', dom)
    return re.findall(r'data-loaded="([01])"', dom), body.group(1) if body else ""


def test_every_plot_renders_in_a_browser(tmp_path, replay_dir):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium found (chromium, chromium-browser, google-chrome, headless_shell not on PATH); "
                    "install the Debian package `chromium` to run this test")
    capacity_dir = tmp_path / "sweep"
    capacity, curve = _capacity()
    write_dir(capacity_dir, tables={"capacity": capacity, "hit_curve": curve}, run_metadata={})
    write_report(capacity_dir)
    for page, expected in ((replay_dir / "report.html", len(DEFAULT_RUN_CAPTIONS)),
                           (capacity_dir / "report.html", len(CAPACITY_CAPTIONS) + 1)):
        loaded, summary = _rendered(browser, page, tmp_path / "profile")
        assert loaded == ["1"] * expected, (page, loaded)
        assert summary == f"{expected}/{expected}"
    # The check can fail: an image whose data is not a PNG is marked as not loaded.
    broken = tmp_path / "broken.html"
    text = (replay_dir / "report.html").read_text()
    broken.write_text(text.replace(IMG, '<img src="data:image/png;base64,AAAA', 1))
    loaded, summary = _rendered(browser, broken, tmp_path / "profile")
    assert loaded.count("0") == 1 and summary == f"{len(DEFAULT_RUN_CAPTIONS) - 1}/{len(DEFAULT_RUN_CAPTIONS)}"


def test_capacity_report_plots_hit_rate_and_ttft_against_the_offload_size():
    """A sweep of offload.cpu_bytes (with replicas beside it): hit rate per tier and TTFT
    against the CPU tier's size, one line per replica count; a point without a tier
    (0 bytes) counts its GPU hit rate as its total."""
    rows = []
    for point, (replicas, cpu) in enumerate((r, c) for r in (1, 2) for c in (0, 500 * 10**9, 10**12)):
        offloads = cpu > 0
        rows.append({"point": point, "status": "ok", "error": "", "engine.replicas": replicas,
                     "offload.cpu_bytes": cpu, "prefix_cache_hit_rate": 0.11, "slo_attainment": 0.95,
                     "median_ttft_ms": 135.0 - cpu / 10**10, "p99_ttft_ms": 3200.0 - replicas * 100,
                     "hit_rate_total": 0.11 + cpu / 10**13 if offloads else None,
                     "hit_rate_cpu": cpu / 10**13 if offloads else None})
    text = render_capacity_report(pa.Table.from_pylist(rows), None, {}, None)
    for caption in ("Prompt tokens served from a cache against offload.cpu_bytes",
                    "Time to first token (median, p99) against offload.cpu_bytes (one line per engine.replicas)"):
        assert caption in text, caption
    # Without an offload sweep there are no such figures: the offload ones are two more.
    plain = render_capacity_report(pa.Table.from_pylist([{k: v for k, v in r.items() if not k.startswith(("offload",
                                                          "hit_rate_"))} for r in rows]), None, {}, None)
    assert "offload" not in plain.lower()
    assert text.count(IMG) == plain.count(IMG) + 2


def _with_offload(steps: pa.Table, summary: pa.Table, replicas: int = 1):
    """The synthetic replay with a CPU and a disk tier's step columns and summary figures."""
    rng = np.random.default_rng(2)
    n = steps.num_rows
    columns = {"offload_cpu_used_chunks": rng.integers(0, 1000, n), "offload_disk_used_chunks": rng.integers(0, 4000, n),
               "offload_load_bytes": rng.integers(0, 10**9, n), "offload_store_bytes": rng.integers(0, 10**9, n),
               "offload_disk_loaded_keys": rng.integers(0, 50, n), "offload_disk_stored_keys": rng.integers(0, 50, n),
               "num_waiting_for_kv": rng.integers(0, 6, n)}
    for name, values in columns.items():
        steps = steps.append_column(name, pa.array(values.astype(np.int64)))
    for name, value in (("offload_cpu_chunks", 1000), ("offload_disk_chunks", 4000), ("offload_chunk_bytes", 2**21),
                        ("hit_rate_total", 0.3)):
        summary = summary.append_column(name, pa.array([value]))
    return steps, summary


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_offload_run_plots_tier_use_traffic_and_waits_for_kv(monkeypatch, replicas):
    """Three more figures with offload tiers, drawn from the steps' offload columns: each
    tier's chunks in use over its chunks, the bytes moved per second of each bin, and the
    requests waiting for KV (summed over replicas)."""
    requests, steps, summary, plan, metadata = _synthetic_replay(replicas=replicas)
    plain = render_replay_report(requests, steps, summary, plan, metadata)
    assert "Offload" not in plain and "waiting for KV" not in plain
    steps, summary = _with_offload(steps, summary)
    figures = _drawn(monkeypatch)
    text = render_replay_report(requests, steps, summary, plan, metadata)
    assert text.count(IMG) == plain.count(IMG) + 3
    for caption in ("Offload tiers: chunks holding a key", "Offload traffic per", "Requests waiting for KV"):
        assert caption in text
    axes = {ax.get_title(): ax for fig in figures for ax in fig.axes}
    t = steps.column("time_s").to_numpy()
    t_end = max(600.0, float((t + steps.column("duration_s").to_numpy()).max()))
    bin_s = t_end / TIME_BINS
    idx = np.clip((t / bin_s).astype(np.int64), 0, TIME_BINS - 1)
    replica = steps.column("replica").to_numpy() if replicas > 1 else np.zeros(len(t), np.int64)

    def column(name):
        return steps.column(name).to_numpy().astype(float)

    def line(title, label):
        return np.asarray(next(ln for ln in axes[title].lines if ln.get_label() == label).get_ydata())

    for label, name, scale in (("loaded CPU → GPU", "offload_load_bytes", 1), ("stored GPU → CPU", "offload_store_bytes", 1),
                               ("promoted disk → CPU", "offload_disk_loaded_keys", 2**21),
                               ("written CPU → disk", "offload_disk_stored_keys", 2**21)):
        expected = np.bincount(idx, weights=column(name) * scale, minlength=TIME_BINS) / bin_s / 1e9
        np.testing.assert_allclose(line("disk (CPU ↔ disk)" if "disk" in label else "PCIe (GPU ↔ CPU)", label),
                                   expected)
    # Means per bin over the bins every replica has a step in (the others hold the last state).
    every = np.all([np.bincount(idx[replica == r], minlength=TIME_BINS) > 0 for r in np.unique(replica)], axis=0)

    def mean_per_bin(name):
        return np.array([[column(name)[(idx == b) & (replica == r)].mean() for b in np.flatnonzero(every)]
                         for r in np.unique(replica)])

    np.testing.assert_allclose(line("Requests waiting for KV from a tier", "waiting for KV")[every],
                               mean_per_bin("num_waiting_for_kv").sum(axis=0))
    for label, name, chunks in (("CPU tier", "offload_cpu_used_chunks", 1000),
                                ("disk tier", "offload_disk_used_chunks", 4000)):
        np.testing.assert_allclose(line("Offload tier use", label)[every],
                                   mean_per_bin(name).mean(axis=0) * 100 / chunks)
