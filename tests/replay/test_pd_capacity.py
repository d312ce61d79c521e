"""P/D in the capacity sweep: ``disaggregation.<field>`` and ``disaggregation.shape`` sweep
keys, xPyD beside the aggregated deployment at equal GPUs, ``--find-max-rate`` on them, and
bad input (zero prefill instances, an unknown link) as one error line."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.sweep_keys import apply_values, parse_shape, parse_side_shape, parse_sweeps
from tests.replay.test_capacity import _app

SCENARIO = """
description = "chat on Llama-3.1-8B / H100, 3 GPUs: 2P1D, or 3 aggregated replicas"
[model]
preset = "llama-3.1-8b"
[hardware]
gpu = "h100"
[engine]
max_model_len = 8192
replicas = 3
router = "prefix_aware"
[disaggregation]
prefill_replicas = 2
decode_replicas = 1
link = "rdma"
[workload]
kind = "chat"
seed = 3
num_requests = 60
block_tokens = 16
arrival = { process = "poisson", rate_per_s = 4.0 }
shared_prefix = { count = 3, tokens = 400, zipf_s = 1.0 }
turns = { dist = "fixed", value = 3 }
user_tokens = { dist = "lognormal", mean = 300, sigma = 0.5 }
output_tokens = { dist = "lognormal", mean = 40, sigma = 0.5 }
turn_gap_s = { dist = "exponential", mean = 1 }
[slo]
ttft_s = 2.0
"""


@pytest.fixture
def scenario(tmp_path) -> Path:
    path = tmp_path / "pd.toml"
    path.write_text(SCENARIO)
    return path


def _invoke(*args):
    return CliRunner().invoke(_app(), ["capacity", *map(str, args)])


def test_shape_values():
    assert parse_shape("2P1D", "w") == (2, 1) and parse_shape("1p12d", "w") == (1, 12)
    for bad in ("2P", "P1D", "2D1P", "2P1Dx", "aggregated"):
        with pytest.raises(ConfigError):
            parse_shape(bad, "w")
    data = {"engine": {"replicas": 3}, "disaggregation": {"link": "nvlink"}}
    assert apply_values(data, {"disaggregation.shape": "1P2D"})["disaggregation"] == {
        "link": "nvlink", "prefill_replicas": 1, "decode_replicas": 2}
    assert "disaggregation" not in apply_values(data, {"disaggregation.shape": None})
    assert parse_sweeps(["disaggregation.shape=2P1D,none"])[0].values == ("2P1D", None)


def test_xpyd_beside_aggregated_at_equal_gpus(scenario, tmp_path):
    out = tmp_path / "cap"
    result = _invoke(scenario, "--sweep", "disaggregation.shape=2P1D,1P2D,none", "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["disaggregation.shape"] for r in rows] == ["2P1D", "1P2D", None]
    assert all(r["status"] == "ok" and r["num_gpus"] == 3 and r["num_requests"] == 60 for r in rows)
    assert [r["pd_prefill_replicas"] for r in rows] == [2, 1, None]
    assert rows[2]["router"] == "prefix_aware" and rows[0]["router"].startswith("pd:")
    assert 0 < rows[0]["pd_transfer_share_of_ttft"] < 1 and rows[2]["pd_transfer_share_of_ttft"] is None
    assert "Disaggregated against aggregated" in (out / "report.html").read_text()


def test_find_max_rate_on_pd_points(scenario, tmp_path):
    out = tmp_path / "cap"
    result = _invoke(scenario, "--sweep", "disaggregation.link=rdma,nvlink", "--find-max-rate",
                     "--max-replays", 4, "--rate-tolerance", 0.5, "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["pd_link"] for r in rows] == ["rdma", "nvlink"]
    for r in rows:
        assert r["status"] == "ok"
        # 60 requests leave too short a steady window to judge (docs/capacity.md#enough-load):
        # a point has a rate, or says what it needs instead.
        assert (r["max_request_rate"] is None) == bool(r["rate_search_refusal"])
        if r["max_request_rate"] is not None:
            # Per replica: over the 3 replicas of the 2P1D point.
            assert r["max_request_rate_per_replica"] == pytest.approx(r["max_request_rate"] / 3)


@pytest.mark.parametrize("flag, message", [
    ("disaggregation.prefill_replicas=0,1", "--sweep disaggregation.prefill_replicas: expected a positive integer"),
    ("disaggregation.link=rdma,infiniband", "--sweep disaggregation.link: expected one of nvlink, rdma"),
    ("disaggregation.shape=0P1D", "--sweep disaggregation.shape: expected a positive integer"),
    ("disaggregation.shape=3x", "--sweep disaggregation.shape: expected xPyD"),
])
def test_bad_pd_sweep_is_one_error_line(scenario, tmp_path, flag, message):
    out = tmp_path / "cap"
    result = _invoke(scenario, "--sweep", flag, "--out", out)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvtwin: error: {message}"), lines


@pytest.mark.parametrize("table, message", [
    ("prefill_replicas = 0", "disaggregation.prefill_replicas: expected a positive integer"),
    ('link = "infiniband"', "disaggregation.link: expected one of nvlink, rdma"),
])
def test_bad_pd_scenario_is_one_error_line(tmp_path, table, message):
    from kvtwin.cli import app

    path = tmp_path / "bad.toml"
    path.write_text(SCENARIO.replace('link = "rdma"', table) if "link" in table else
                    SCENARIO.replace("prefill_replicas = 2", table))
    result = CliRunner().invoke(app, ["replay", str(path), "--out", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "kvtwin: error:" in lines[0] and message in lines[0], lines
    assert str(path) in lines[0]


def test_validate_refuses_a_disaggregated_scenario(scenario, tmp_path):
    pytest.importorskip("torch")  # validate reads its checks' names from the executor, which needs torch
    from kvtwin.cli import app

    result = CliRunner().invoke(app, ["validate", str(scenario), "--out", str(tmp_path / "val")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "disaggregation" in lines[0] and str(scenario) in lines[0], lines


def test_wide_ep_shapes_name_dp_sides():
    """``p<N>[dp]-d<M>[dp]`` (docs/semantics.md#data-parallel-pd-sides): a ``dp`` side is one DP
    engine of that many ranks, a bare count that many replicas; a shape drops a DP size it
    does not give, so the points of one sweep differ only by their shapes."""
    assert parse_side_shape("p8dp-d16dp", "w") == ((1, 8), (1, 16))
    assert parse_side_shape("P2-D4DP", "w") == ((2, 1), (1, 4))
    for bad in ("p8dp", "d1-p1", "p2x-d1", "p-d1", "8dp-16dp", "p2-d1-"):
        with pytest.raises(ConfigError) as err:
            parse_side_shape(bad, "w")
        assert "p8dp-d16dp" in err.value.expected
    data = {"disaggregation": {"link": "nvlink", "decode_data_parallel_size": 4}}
    assert apply_values(data, {"disaggregation.shape": "p2dp-d1"})["disaggregation"] == {
        "link": "nvlink", "prefill_replicas": 1, "decode_replicas": 1, "prefill_data_parallel_size": 2}
    assert apply_values(data, {"disaggregation.shape": "2P1D"})["disaggregation"] == {
        "link": "nvlink", "prefill_replicas": 2, "decode_replicas": 1}


def test_a_sweep_of_wide_ep_shapes_counts_every_rank(tmp_path):
    """The same chat workload on gpt-oss-20b (MoE) at two wide-EP shapes: each point runs its
    sides' DP groups, and its GPUs are every rank's (TP 1: one GPU a rank)."""
    scenario = tmp_path / "wide.toml"
    scenario.write_text(SCENARIO.replace('preset = "llama-3.1-8b"', 'preset = "gpt-oss-20b"'))
    out = tmp_path / "cap"
    result = _invoke(scenario, "--sweep", "disaggregation.shape=p2dp-d2dp,p1-d2dp", "--jobs", 1, "--out", out, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["disaggregation.shape"] for r in rows] == ["p2dp-d2dp", "p1-d2dp"]
    assert all(r["status"] == "ok" and r["num_requests"] == 60 for r in rows)
    assert [r["num_gpus"] for r in rows] == [4, 3]
    assert all(r["completed"] + r["rejected"] == 60 for r in rows)
