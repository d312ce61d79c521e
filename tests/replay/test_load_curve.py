"""``kvtwin capacity --load-curve`` (docs/capacity.md#load-curve): the rates, the knee, the
offered and achieved throughput of a deployment whose capacity is known, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.load_curve import LOAD_CURVE_COLUMNS, RATE_MATCH, knees, offered_scale, parse_load_curve
from tests.cli_run import one_error_line, run
from tests.replay.test_capacity import AZURE, CONSTANT

# The constant workload (tests/replay/test_capacity.py) cut to 100 identical one-token
# requests 0.1 s apart (9.9 s), one per 10 ms step: the engine completes 100 requests/s at
# most. A synthetic workload is drawn anew at each rate for those 9.9 s
# (docs/capacity.md#enough-load): floor(9.9 x rate) + 1 requests.
CAPACITY_PER_S = 100.0
SPAN_S = 9.9
STEP_S = 0.01


def test_rates_from_a_list_and_from_a_geometric_range():
    assert parse_load_curve("8, 2,4").rates_per_s == (2.0, 4.0, 8.0)
    rates = parse_load_curve("1:100:3").rates_per_s
    assert rates == pytest.approx((1.0, 10.0, 100.0))
    assert parse_load_curve("0.5:2:2").rates_per_s == (0.5, 2.0)


@pytest.mark.parametrize("spec, expected", [
    ("5", "at least two rates"),
    ("5,5", "each rate once"),
    ("0,5", "rates above 0"),
    ("-1,5", "rates above 0"),
    ("a,5", "rates in requests/s"),
    ("5,,6", "comma-separated"),
    ("10:5:3", "HI above LO"),
    ("1:10:1", "N from 2 to 64"),
    ("1:10:x", "N a whole number"),
    ("1:10", "R1,R2,... or LO:HI:N"),
    ("inf,5", "rates above 0"),
    (",".join(str(i) for i in range(1, 66)), "at most 64 rates"),
])
def test_bad_rates_are_refused(spec, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        parse_load_curve(spec)
    assert err.value.field == "--load-curve"


def test_knee_is_the_last_sustained_rate_before_the_first_that_is_not():
    # Given out of order: the knee and past_knee follow the rates, not the order.
    (knee, past), = knees([[(20.0, False), (5.0, True), (10.0, True), (40.0, True)]])
    assert knee == 10.0
    # 40 was sustained again (a transient), but it lies past the first failure.
    assert past == [True, False, False, True]
    assert knees([[(1.0, True), (2.0, True)]]) == [(None, [False, False])]
    assert knees([[(1.0, False), (2.0, True)]]) == [(None, [True, True])]
    assert knees([[(3.0, True), (1.0, True), (2.0, False)], [(1.0, False)]]) == [
        (1.0, [True, False, True]), (None, [True])]
    # A rate too short to judge (None) neither holds the knee nor passes it.
    assert knees([[(1.0, None), (2.0, True), (3.0, None), (4.0, False), (5.0, None)]]) == [
        (2.0, [False, False, False, True, True])]
    assert knees([[(1.0, None), (2.0, False)]]) == [(None, [False, True])]
    assert knees([[(1.0, None), (2.0, None)]]) == [(None, [False, False])]


def test_offered_scale_corrects_a_trace_denser_later():
    # A cut whose rate grows faster than its scale (more of a denser trace each time).
    def rate_at(scale: float) -> float:
        return 10.0 * scale ** 1.3

    scale = offered_scale(rate_at, 47.0, 1.0)
    assert abs(rate_at(scale) / 47.0 - 1) <= RATE_MATCH
    # A trace scaled whole lands on the rate at once.
    assert offered_scale(lambda s: 4.0 * s, 10.0, 2.0) == pytest.approx(2.5)
    assert offered_scale(lambda s: math.nan, 10.0, 1.0) is None


@pytest.fixture
def constant(tmp_path):
    path = tmp_path / "constant.toml"
    path.write_text(CONSTANT.replace("num_requests = 400", "num_requests = 100"))
    return path


def test_a_known_capacity_gives_the_knee_and_the_achieved_rates(constant, tmp_path):
    out = tmp_path / "curve"
    rates = (40.0, 80.0, 150.0, 200.0)
    result = run("capacity", constant, "--load-curve", ",".join(map(str, rates)), "--out", out, "-q")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "capacity.parquet")
    assert set(LOAD_CURVE_COLUMNS) <= set(table.column_names)
    rows = table.to_pylist()
    assert [r["point"] for r in rows] == [0, 1, 2, 3]
    for row, rate in zip(rows, rates):
        n = math.floor(SPAN_S * rate + 1e-9) + 1
        assert row["num_requests"] == n
        # The synthetic trace drawn at the scale times its rate (gaps constant to about 1e-6).
        assert row["offered_request_rate"] == pytest.approx(rate, rel=1e-5)
        assert row["load_rate_scale"] == pytest.approx(rate / 10.0, rel=1e-5)
        if rate < CAPACITY_PER_S:
            # Every request served in its own step as it arrives: the last completes a step
            # after the last arrival.
            assert row["achieved_request_rate"] == pytest.approx(n / ((n - 1) / rate + STEP_S), rel=1e-5)
            assert row["sustained"] and not row["past_knee"]
        else:
            # Busy from the first arrival on, a request per step.
            assert row["achieved_request_rate"] == pytest.approx(CAPACITY_PER_S, rel=1e-5)
            assert not row["sustained"] and row["past_knee"]
        assert row["knee_request_rate"] == pytest.approx(80.0)
        assert row["achieved_request_rate"] == row["request_throughput"]
    # No calibration: no slow edge.
    assert table.column("p99_ttft_ms_pessimistic").null_count == table.num_rows
    assert "load curve knee between 80 and 150 req/s offered; at most 100 req/s achieved" in result.stdout
    assert "offered req/s" in result.stdout and "achieved req/s" in result.stdout
    html = (out / "report.html").read_text()
    assert "Latency&#8211;load curve" in html and "the knee (dotted) at 80 requests/s" in html
    # The TTFT drawn is the one the SLO judges, named (no time outside the engine here).
    assert "p99 TTFT as a client sees it (the server&#x27;s +0 ms outside the engine)" in html \
        or "p99 TTFT as a client sees it (the server's +0 ms outside the engine)" in html


def test_one_curve_per_combination_of_the_other_keys(constant, tmp_path):
    out = tmp_path / "curve"
    result = run("capacity", constant, "--load-curve", "50,150", "--sweep", "engine.max_num_seqs=1,2",
                 "--out", out, "-q", "--no-report")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    assert [r["engine.max_num_seqs"] for r in rows] == [1, 1, 2, 2]
    assert [r["offered_request_rate"] for r in rows] == pytest.approx([50.0, 150.0, 50.0, 150.0])
    # Two requests per step with two sequences: 150 requests/s is within reach.
    assert [r["past_knee"] for r in rows] == [False, True, False, False]
    assert [r["knee_request_rate"] for r in rows][2:] == [None, None]
    assert [r["knee_request_rate"] for r in rows][:2] == pytest.approx([50.0, 50.0], rel=1e-5)
    assert "load curve engine.max_num_seqs=2: every rate judged was sustained: the knee is above 150 req/s" in result.stdout


@pytest.mark.parametrize("args, needles", [
    (("--load-curve", "5,10", "--find-max-rate"), ("--load-curve", "not both")),
    (("--load-curve", "5,10", "--sweep", "workload.rate_scale=1,2"), ("--load-curve", "workload.rate_scale")),
    (("--load-curve", "5"), ("--load-curve", "at least two rates")),
    (("--load-curve", "10:1:4"), ("--load-curve", "HI above LO")),
    (("--load-curve", "0,1"), ("--load-curve", "above 0")),
])
def test_bad_load_curve_is_one_error_line_before_any_replay(tmp_path, args, needles):
    out = tmp_path / "curve"
    one_error_line(run("capacity", AZURE, "--limit", 5, *args, "--out", out), *needles)
    assert not out.exists()


def test_the_slow_edge_replays_each_rate_with_slower_steps(tmp_path):
    # The bundled H100 calibration gives the Azure scenario a step error: each rate is
    # replayed again with slower steps, which can only lower what is achieved.
    out = tmp_path / "curve"
    result = run("capacity", AZURE, "--limit", 300, "--load-curve", "5,60", "--out", out, "-q", "--no-report")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    for row, asked in zip(rows, (5.0, 60.0)):
        # The rate replayed: (n - 1) over the arrival span, which the steady window is 60% of
        # (docs/capacity.md#sustained-load); the Azure trace is denser later than its first
        # 300 requests, so the scale that offers it was corrected (within 1% of the rate asked).
        offered = (row["num_requests"] - 1) / (row["steady_window_s"] / 0.6)
        assert row["offered_request_rate"] == pytest.approx(offered, rel=1e-9)
        assert abs(offered / asked - 1) <= RATE_MATCH
        assert row["step_error"] > 0
        assert row["achieved_request_rate_pessimistic"] <= row["achieved_request_rate"] * (1 + 1e-9)
        assert row["p99_ttft_ms_pessimistic"] >= row["p99_ttft_ms"]
        # The slow edge keeps the time outside the engine (it is no step's): the bundled 8 ms.
        assert row["client_overhead_ms"] == pytest.approx(8.0)
        assert row["p99_ttft_client_ms_pessimistic"] == pytest.approx(row["p99_ttft_ms_pessimistic"] + 8.0)
    assert np.isfinite([r["p99_tpot_ms_pessimistic"] for r in rows]).all()
    assert "p99 TTFT (client, slow edge)" in result.stdout and "p99 TTFT (client)" in result.stdout
