"""The retention setting as users reach it (docs/semantics.md#retention-setting): a scenario
key, a flag and a sweep key whose default is vLLM's engine default (0), shown by the plan
and the replay, and recorded in the summary."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from tests.cli_run import run

GEMMA = SCENARIOS_DIR / "replay-gemma3-27b.toml"


def test_the_default_is_vllms_engine_default():
    resolved = resolve_scenario(GEMMA, Overrides(limit=10))
    planned = resolved.plan()
    assert planned.engine.cache.prefix_cache_retention_interval == 0
    assert planned.require_fits().prefix_cache_retention_interval == 0


@pytest.mark.parametrize("value, interval, words", [("0", 0, "semantic checkpoints (interval 0)"),
                                                    ("dense", None, "dense"),
                                                    ("512", 512, "semantic checkpoints + every 512 tokens")])
def test_plan_shows_the_mode(value, interval, words):
    text = run("plan", "--model", "gemma-3-27b", "--gpu", "h100", "--prefix-cache-retention-interval", value)
    assert text.exit_code == 0, text.output
    assert f"prefix-cache retention {words}" in text.output
    as_json = json.loads(run("plan", "--model", "gemma-3-27b", "--gpu", "h100", "--json",
                             "--prefix-cache-retention-interval", value).output)
    assert as_json["prefix_cache_retention_interval"] == interval
    assert as_json["prefix_cache_retention"] == words


def test_a_full_attention_model_says_every_block_is_cached():
    as_json = json.loads(run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--json").output)
    assert as_json["prefix_cache_retention"] == "every block (no sliding-window or Mamba group to thin)"


def test_the_replay_says_which_mode_ran_and_records_it(tmp_path):
    out = tmp_path / "run"
    result = run("replay", GEMMA, "--limit", 30, "--no-report", "--out", out, "--prefix-cache-retention-interval",
                 "dense")
    assert result.exit_code == 0, result.output
    assert "prefix-cache retention: dense" in result.output
    assert pq.read_table(out / "summary.parquet").column("prefix_cache_retention").to_pylist() == ["dense"]


def test_a_sweep_compares_the_modes(tmp_path):
    out = tmp_path / "cap"
    result = run("capacity", GEMMA, "--limit", 150, "--sweep", "engine.prefix_cache_retention_interval=0,64,dense",
                 "--jobs", 1, "--no-report", "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["engine.prefix_cache_retention_interval"] for r in rows] == ["0", "64", "dense"]
    assert [r["prefix_cache_retention"] for r in rows] == ["0", "64", "dense"]
    hits = [r["prefix_cache_hits"] for r in rows]
    # A window of 1,024 tokens covers every 64-token segment: 64 keeps every block, as dense.
    assert hits[1] == hits[2] and hits[0] < hits[2]


@pytest.mark.parametrize("value, expected", [
    ("40", "a multiple of the scheduler block size (16)"),
    ("-16", "0 (vLLM's default: semantic checkpoints only), a positive multiple of the block size, or dense"),
    ("sparse", "0 (vLLM's default: semantic checkpoints only), a positive multiple of the block size, or dense"),
])
def test_a_bad_interval_is_one_error_line(tmp_path, value, expected):
    result = run("replay", GEMMA, "--limit", 5, "--no-report", "--out", tmp_path / "r",
                 "--prefix-cache-retention-interval", value)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error:") and expected in lines[0], result.output


def test_a_positive_interval_without_a_thinnable_group_is_refused():
    result = run("plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--prefix-cache-retention-interval", "64")
    assert result.exit_code == 2
    assert "0 or dense for a model without sliding-window or Mamba layers" in result.output
