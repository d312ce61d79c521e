"""A first run that reads well: the default scenario, the summary, progress, help, exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import kvtwin.commands.replay as replay_command
from kvtwin.cli import app
from kvtwin.reports.run_dir import read_run_metadata, run_metadata
from kvtwin.reports.summary_text import format_duration_s
from kvtwin.scenarios import DEFAULT_SCENARIO
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu, gpu_names
from kvtwin.sim.planner.models import get_model, model_names
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.traces import stats, transforms
from kvtwin.traces.bundled import bundled_path
from kvtwin.traces.load import load_trace

SCENARIOS = Path(__file__).parents[2] / "scenarios"
OVERLOAD = str(SCENARIOS / "mooncake-llama8b-h100-overload.toml")


def _replay(tmp_path: Path, *args: str):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["replay", *args, "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    return result, summary, out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return _replay(tmp_path_factory.mktemp("default"), "--limit", "300")


def test_default_scenario_mostly_holds_its_slo(default_run):
    result, summary, _ = default_run
    assert summary["slo_ttft_ms"] == 2000 and summary["slo_tpot_ms"] == 100
    assert summary["slo_attainment"] >= 0.9
    assert not summary["saturated"] and summary["saturation_reason"] == ""
    assert "saturated" not in result.stdout


def test_summary_times_read_in_their_best_unit(default_run):
    assert [format_duration_s(s) for s in (3126.0, 3.21, 0.041, 0.0032, 7200.0, 0.9996)] == \
        ["52.1 min", "3.2 s", "41 ms", "3.2 ms", "2.0 h", "1.0 s"]
    result, summary, _ = default_run
    ttft = next(line for line in result.stdout.splitlines() if "TTFT" in line)
    assert format_duration_s(summary["mean_ttft_ms"] / 1000) in ttft
    assert "(ms)" not in result.stdout and not re.search(r"\d{1,3},\d{3}\.\d ", ttft)


def test_summary_puts_the_hit_rate_next_to_the_traces_upper_bound(default_run):
    result, summary, _ = default_run
    arrived = transforms.limit(load_trace(bundled_path("mooncake_conversation_trace.jsonl")), 300)
    bound = stats.summarize(arrived).prefix_reuse.token_fraction
    assert summary["prefix_reuse_upper_bound"] == pytest.approx(bound)
    assert summary["prefix_cache_hit_rate"] <= bound
    assert f"{summary['prefix_cache_hit_rate'] * 100:.1f} % of {bound * 100:.1f} % possible" in result.stdout


def test_summary_prints_the_plan_in_one_line(default_run):
    result, _, out = default_run
    planned = json.loads((out / "plan.json").read_text())
    line = next(line for line in result.stdout.splitlines() if line.startswith("plan: "))
    assert f"{planned['num_blocks'] - 1:,} KV blocks" in line
    assert f"{planned['kv_cache_tokens']:,} KV cache tokens" in line
    assert f"max concurrency {planned['max_concurrency']:,.2f}x" in line


def test_rejections_are_grouped_by_reason_code(tmp_path):
    result, summary, out = _replay(tmp_path, "--limit", "100", "--max-model-len", "8192")
    requests = pq.read_table(out / "requests.parquet")
    # A code per request, stored once per distinct code (SCHEMA.md; pandas reads it as a category).
    assert requests.schema.field("reject_reason").type == pa.dictionary(pa.int32(), pa.string())
    codes = [c for c in requests.column("reject_reason").to_pylist() if c is not None]
    details = [d for d in requests.column("reject_detail").to_pylist() if d is not None]
    assert codes and len(details) == len(codes) and all("8192" in d for d in details)
    by_reason = json.loads(summary["rejected_by_reason"])
    assert by_reason == {code: codes.count(code) for code in set(codes)}
    line = next(line for line in result.stdout.splitlines() if line.startswith("rejected "))
    assert line.startswith(f"rejected {len(codes):,}: ") and all(f"{c} {n:,}" in line for c, n in by_reason.items())


def test_saturation_is_a_summary_column_and_the_command_only_prints_it(tmp_path):
    result, summary, _ = _replay(tmp_path, OVERLOAD, "--limit", "800")
    assert summary["saturated"]
    reasons = summary["saturation_reason"].split(",")
    assert {"queueing", "slo"} <= set(reasons)
    assert summary["p90_queue_delay_ms"] > 60_000 and summary["slo_attainment"] < 0.5
    assert any(line.startswith("saturated: p90 wait to be first scheduled") for line in result.stdout.splitlines())


def test_time_limit_says_how_many_requests_never_arrived(tmp_path):
    result, summary, _ = _replay(tmp_path, "--limit", "400", "--time-limit-s", "30")
    assert summary["num_trace_requests"] == 400
    assert summary["not_arrived"] == 400 - summary["num_requests"] > 0
    assert f"{summary['not_arrived']:,} of the trace's 400 requests never arrived" in result.stdout


def test_progress_counts_requests_done_and_is_plain_lines_off_a_terminal(tmp_path, monkeypatch):
    trace = transforms.limit(load_trace(bundled_path("mooncake_conversation_trace.jsonl")), 120)
    short = plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(max_model_len=8192))
    clocks = []
    result = run_replay(short, trace, on_progress=lambda clock: clocks.append((clock.finished, clock.rejected)))
    finished, rejected = clocks[-1]
    assert rejected == result.summary.column("rejected")[0].as_py() > 0
    assert finished + rejected == trace.num_rows  # the bar ends full, and only at the end

    monkeypatch.setattr(replay_command, "PLAIN_PROGRESS_EVERY_S", 0.0)
    out = CliRunner().invoke(app, ["replay", "--limit", "120", "--out", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    lines = [line for line in out.stderr.splitlines() if line.startswith("kvtwin: replay: ")]
    assert lines and lines[-1].startswith("kvtwin: replay: 120/120 requests done")
    assert "\r" not in out.stderr and "\x1b[" not in out.stderr  # no bar drawing in a log


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    # Undo click's wrapping, which breaks names such as gpt-oss-120b at the hyphen.
    return re.sub(r"\s+", " ", re.sub(r"-\n\s+", "-", result.stdout))


@pytest.mark.parametrize("command", [(), ("plan",), ("replay",), ("lockstep",), ("kernels",), ("models",),
                                     ("gpus",), ("trace",), ("trace", "info"), ("trace", "convert"),
                                     ("trace", "synth"), ("trace", "list")], ids=" ".join)
def test_help_survives_markup_and_lists_the_presets(command):
    text = _help(*command)
    assert ", ," not in text and "with ," not in text
    if command == ("plan",):
        assert "Scenario TOML with [model], [hardware], [engine]" in text
    if command in (("plan",), ("replay",)):
        assert all(name in text for name in model_names()) and all(name in text for name in gpu_names())


def test_models_and_gpus_list_every_preset_with_a_line_of_facts():
    models = CliRunner().invoke(app, ["models"]).stdout.splitlines()
    assert [line.split()[0] for line in models] == model_names()
    assert "32 layers (32 full)" in next(line for line in models if line.startswith("llama-3.1-8b "))
    gpus = CliRunner().invoke(app, ["gpus"]).stdout.splitlines()
    assert [line.split()[0] for line in gpus] == gpu_names()
    assert "80 GB HBM3" in next(line for line in gpus if line.startswith("h100 "))


def test_plan_exits_1_when_the_model_does_not_fit():
    result = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-70b", "--gpu", "h100", "--max-model-len",
                                      "131072"])
    assert result.exit_code == 1 and "DOES NOT FIT" in result.stdout
    assert CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "h100"]).exit_code == 0


def test_reports_build_the_run_metadata(default_run):
    _, _, out = default_run
    written = read_run_metadata(out / "summary.parquet")
    resolved = resolve_scenario(DEFAULT_SCENARIO, Overrides(limit=300)).describe()
    assert written == run_metadata(DEFAULT_SCENARIO, written["overrides"], resolved)
    assert written["scenario_file"] == "default.toml" and written["overrides"]["limit"] == 300


def test_every_run_directory_column_is_documented_in_the_schema(default_run):
    _, _, out = default_run
    schema_doc = (Path(__file__).parents[2] / "reports" / "SCHEMA.md").read_text()
    for name in ("requests", "steps", "summary"):
        missing = [c for c in pq.read_schema(out / f"{name}.parquet").names if f"`{c}`" not in schema_doc]
        assert not missing, f"{name}.parquet columns missing from reports/SCHEMA.md: {missing}"
