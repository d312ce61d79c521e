"""``kvtwin diff RUN_A RUN_B`` (issue 37, 10d): two replays' figures side by side with their
change, the settings that differ, ``diff.parquet`` and ``diff.html`` with the plots overlaid;
every figure recomputed here from the runs' own files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.reports.diff import format_change, format_relative, format_value
from kvtwin.reports.summary_text import format_duration_ms
from tests.cli.test_lazy_imports import imported_by

SCENARIOS = Path(__file__).parents[2] / "scenarios"
IMG = '<img src="data:image/png;base64,'


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("diff")
    for name, extra in (("a", ()), ("b", ("--gpu", "h200", "--replicas", "1"))):
        result = _invoke("replay", "--limit", "30", "--quiet", "--no-report", "--out", str(root / name), *extra)
        assert result.exit_code == 0, result.output
    return root / "a", root / "b"


def _recomputed(run: Path) -> dict[str, float]:
    """The figures by this test's own reading of requests, steps and plan."""
    requests = pq.read_table(run / "requests.parquet").to_pydict()
    steps = pq.read_table(run / "steps.parquet").to_pydict()
    plan = json.loads((run / "plan.json").read_text())
    duration = pq.read_table(run / "summary.parquet").column("duration_s")[0].as_py()
    finished = [i for i, s in enumerate(requests["status"]) if s == "finished"]
    ttft = np.array([requests["ttft_s"][i] for i in finished]) * 1000
    met = sum(1 for i in finished if requests["ttft_s"][i] <= 2.0 and not requests["tpot_s"][i] > 0.1)
    return {"p99_ttft_ms": float(np.percentile(ttft, 99)), "median_ttft_ms": float(np.percentile(ttft, 50)),
            "slo_attainment": met / len(requests["status"]),
            "prefix_cache_hit_rate": sum(requests["prefix_cache_hits"]) / sum(requests["prefix_cache_queries"]),
            "num_preemptions": sum(requests["num_preemptions"]),
            "kv_cache_usage_peak": max(steps["kv_cache_usage"]),
            "request_throughput": len(finished) / duration,
            "plan.num_usable_blocks": plan["num_blocks"] - 1,
            "plan.max_concurrency": plan["max_concurrency"]}


def test_every_figure_side_by_side_with_its_change(runs, tmp_path):
    a, b = runs
    result = _invoke("diff", str(a), str(b), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in pq.read_table(tmp_path / "out" / "diff.parquet").to_pylist()}
    assert list(pq.read_schema(tmp_path / "out" / "diff.parquet").names) == \
        ["name", "label", "unit", "a", "b", "change", "relative_change"]
    first, second = _recomputed(a), _recomputed(b)
    for name in first:
        row = rows[name]
        assert row["a"] == pytest.approx(first[name]) and row["b"] == pytest.approx(second[name]), name
        assert row["change"] == pytest.approx(second[name] - first[name]), name
        if first[name]:
            assert row["relative_change"] == pytest.approx((second[name] - first[name]) / abs(first[name])), name
        else:
            assert math.isnan(row["relative_change"])
    # The printed row of each figure holds what diff.parquet holds.
    lines = result.stdout.splitlines()
    for row in rows.values():
        line = next(line for line in lines if re.match(rf"│ {re.escape(row['label'])} +│", line))
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[1:] == [format_value(row["unit"], row["a"]), format_value(row["unit"], row["b"]),
                             format_change(row["unit"], row["change"]), format_relative(row["relative_change"])]
    ttft = rows["p99_ttft_ms"]
    assert format_duration_ms(ttft["a"]) in next(line for line in lines if "TTFT p99" in line)
    settings = next(line for line in lines if line.startswith("settings that differ (A → B): "))
    assert "gpu b200 → h200" in settings and "replicas 2 → 1" in settings
    assert lines[0] == f"A: {a}: llama-3.1-8b on 2 replicas of 2x b200 behind prefix_aware"
    assert lines[1] == f"B: {b}: llama-3.1-8b on 2x h200"


def test_diff_html_overlays_the_plots_and_is_the_same_bytes_twice(runs, tmp_path):
    a, b = runs
    pages = []
    for name in ("one", "two"):
        assert _invoke("diff", str(a), str(b), "--out", str(tmp_path / name)).exit_code == 0
        pages.append((tmp_path / name / "diff.html").read_text())
    assert pages[0] == pages[1]
    page = pages[0]
    assert page.count(IMG) == 3
    for caption in ("finished requests, A and B overlaid", "KV cache usage over time", "Prefix cache hit rate over time"):
        assert caption in page
    assert "Settings that differ" in page and "h200" in page
    assert not re.search(r"(?:src|href)\s*=\s*[\"']?\s*(?:https?:)?//", page)
    # Written again over a previous diff directory.
    assert _invoke("diff", str(b), str(a), "--out", str(tmp_path / "one")).exit_code == 0


def test_a_run_against_itself_changes_nothing(runs):
    a, _ = runs
    result = _invoke("diff", str(a), str(a))
    assert result.exit_code == 0 and "settings: the same" in result.stdout
    assert "+" not in "".join(line.split("│")[3] for line in result.stdout.splitlines() if line.count("│") == 6)


def test_bad_input_is_one_line(runs, tmp_path):
    a, _ = runs
    sweep = tmp_path / "sweep"
    assert _invoke("capacity", str(SCENARIOS / "azure-conv-llama8b.toml"), "--limit", "10", "--sweep",
                   "engine.max_num_seqs=8", "--jobs", "1", "-q", "--no-report", "--out", str(sweep)).exit_code == 0
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for args, expected in (((str(a), str(sweep)), "RUN_B: expected a replay run directory"),
                           ((str(tmp_path / "none"), str(a)), "no such directory"),
                           ((str(tmp_path / "file"), str(a)), "a file"),
                           ((str(tmp_path / "other"), str(a)), "a directory holding notes.txt"),
                           ((str(a), str(a), "--out", str(a)), "--out: expected a new or empty directory")):
        result = _invoke("diff", *args)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, (args, result.output)
        assert lines[0].startswith("kvtwin: error: ") and expected in lines[0], lines[0]
    assert (a / "requests.parquet").is_file() and not (a / "diff.html").exists()


def test_the_console_diff_draws_nothing(runs, tmp_path):
    a, b = runs
    assert "matplotlib" not in imported_by(tmp_path, "diff", str(a), str(b))
