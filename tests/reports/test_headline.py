"""A replay's headline says what ran (issue 37, 6): the model, GPUs, replicas or P/D shape,
offload and drafting after every flag, as recorded with the run, not the scenario file's
description (which the report still shows, labelled as the file's)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.reports.html import render_report_dir
from kvtwin.reports.run_dir import read_run_metadata
from kvtwin.reports.run_facts import run_settings
from kvtwin.reports.summary_text import run_headline

SCENARIOS = Path(__file__).parents[2] / "scenarios"


def _replay(out: Path, *args: str):
    result = CliRunner().invoke(app, ["replay", *args, "--limit", "20", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result


def _title(out: Path) -> str:
    return html.unescape(re.search(r"<title>(.*?)</title>", (out / "report.html").read_text()).group(1))


def _row(out: Path, label: str) -> str:
    text = (out / "report.html").read_text()
    return html.unescape(re.search(rf"<th>{re.escape(html.escape(label))}</th><td>(.*?)</td>", text).group(1))


def _facts(out: Path) -> tuple[dict, dict, dict]:
    plan = json.loads((out / "plan.json").read_text())
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    return plan, summary, read_run_metadata(out / "summary.parquet")


def test_flags_change_the_headline_not_the_files_description(tmp_path):
    out = tmp_path / "run"
    result = _replay(out, "--model", "qwen3-8b", "--gpu", "h200")
    plan, summary, metadata = _facts(out)
    # Recomputed from what the run's own files say ran.
    expected = (f"{plan['model']} on {summary['num_replicas']} replicas of {plan['tensor_parallel_size']}x "
                f"{plan['gpu']} behind {summary['router']}")
    assert expected == "qwen3-8b on 2 replicas of 2x h200 behind prefix_aware"
    assert _title(out) == f"kvtwin replay report: {expected}"
    assert _row(out, "what ran") == expected
    assert _row(out, "scenario file's description").startswith("Llama-3.1-8B, 2 replicas of 2x B200")
    assert f"{expected}, 20 requests" in " ".join(result.stdout.split())
    resolved = metadata["resolved"]
    assert (resolved["model"], resolved["gpu"], resolved["tensor_parallel_size"], resolved["replicas"],
            resolved["router"]) == ("qwen3-8b", "h200", 2, 2, "prefix_aware")
    assert resolved["workload"] == "mooncake_conversation_trace.jsonl"
    assert resolved["workload_cuts"] == {"limit": 20}


@pytest.mark.parametrize("scenario,args,expected", [
    ("mooncake-llama8b-h100-pd.toml", (), "llama-3.1-8b on 2P1D of 1x h100 over rdma"),
    ("mooncake-llama8b-b200-offload.toml", ("--offload-cpu-bytes", "500000000000", "--offload-policy", "arc"),
     "llama-3.1-8b on 2x b200, CPU KV offload 500 GB (arc)"),
    ("mooncake-llama8b-h100-eagle3.toml", ("--num-speculative-tokens", "2"),
     "llama-3.1-8b on 1x h100, speculative eagle3 k=2"),
    ("azure-conv-llama8b.toml", ("--replicas", "3", "--router", "round_robin", "--tp", "2"),
     "llama-3.1-8b on 3 replicas of 2x h100 behind round_robin"),
])
def test_the_headline_names_the_deployment_that_ran(tmp_path, scenario, args, expected):
    out = tmp_path / "run"
    result = _replay(out, str(SCENARIOS / scenario), *args)
    assert _title(out) == f"kvtwin replay report: {expected}"
    assert f"{expected}, 20 requests" in " ".join(result.stdout.split())


def test_a_directory_without_the_record_still_gets_what_its_files_say(tmp_path):
    """Run directories written before the settings were recorded: the plan and summary
    give the model, GPUs, replicas, P/D shape and offload tiers."""
    for name, args in (("default", ("--gpu", "h200")), ("pd", (str(SCENARIOS / "mooncake-llama8b-h100-pd.toml"),)),
                       ("offload", (str(SCENARIOS / "mooncake-llama8b-b200-offload.toml"),))):
        out = tmp_path / name
        _replay(out, *args, "--no-report")
        plan, summary, metadata = _facts(out)
        recorded = run_headline(run_settings(metadata, plan, summary))
        del metadata["resolved"]
        assert run_headline(run_settings(metadata, plan, summary)) == recorded, name
    assert "2P1D of 1x h100" in run_headline(run_settings({}, *_facts(tmp_path / "pd")[:2]))
    assert render_report_dir(tmp_path / "default").count("on 2 replicas of 2x h200 behind prefix_aware") >= 2


@pytest.mark.parametrize("engine,model,expected", [
    ("pipeline_parallel_size = 2", "llama-3.1-8b", "llama-3.1-8b on 2x h100 (TP 1, PP 2)"),
    ("tensor_parallel_size = 2\npipeline_parallel_size = 2", "llama-3.1-8b", "llama-3.1-8b on 4x h100 (TP 2, PP 2)"),
    ("data_parallel_size = 2", "llama-3.1-8b", "llama-3.1-8b on DP 2 (independent ranks) of 1x h100 behind dp_lb"),
    ("data_parallel_size = 4\nasync_scheduling = false", "gpt-oss-20b",
     "gpt-oss-20b on DP 4 (ranks in lockstep) of 1x h100 behind dp_lb"),
    ("data_parallel_size = 2\nenable_expert_parallel = true", "gpt-oss-20b",
     "gpt-oss-20b on DP 2 + EP (ranks in lockstep) of 1x h100 behind dp_lb"),
])
def test_the_headline_names_pipeline_stages_and_data_parallel_ranks(tmp_path, engine, model, expected):
    scenario = tmp_path / "parallel.toml"
    scenario.write_text(f'[model]\npreset = "{model}"\n[hardware]\ngpu = "h100"\n[engine]\n{engine}\n'
                        'max_model_len = 16384\n[workload]\ntrace = "bundled:mooncake_conversation_trace.jsonl"\n')
    out = tmp_path / "run"
    result = _replay(out, str(scenario))
    assert _title(out) == f"kvtwin replay report: {expected}"
    assert f"{expected}, 20 requests" in " ".join(result.stdout.split())
    summary = pq.read_table(out / "summary.parquet").to_pylist()[0]
    # A lockstep group's line says its steps, waves and each rank's dummy batches.
    if "lockstep" in expected:
        assert (f"in lockstep: {summary['dp_group_steps']:,} group steps in {summary['dp_waves']:,} waves"
                in " ".join(result.stdout.split()))
    else:
        assert "in lockstep" not in result.stdout
