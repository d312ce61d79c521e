"""The sustained-load rule (docs/capacity.md#sustained-load) at the edges of its thresholds.

Requests tables are built by hand around one base: 334 requests a second apart (span
333 s, steady window (66.6 s, 266.4 s], 199.8 s long), each scheduled on arrival and
finished 1 s later, so exactly one request is in the system at any time, 200 arrive in the
window and 200 finish in it. Each test adds requests that move one figure across its
threshold and leaves the others well inside theirs; the expected counts are worked out in
the comments, not read from the module.
"""

from __future__ import annotations

from pathlib import Path

import math

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.replay.rate_search import slo_holds
from kvtwin.sim.replay.sustained import sustained_load
from kvtwin.sim.scenario.slo import SLO

N = 334
LO, HI = 0.2 * 333, 0.8 * 333  # the steady window's edges
QUARTER = (HI - LO) / 4


def _table(arrival, finish, scheduled=None, status=None) -> pa.Table:
    arrival = np.asarray(arrival, dtype=float)
    finish = np.asarray(finish, dtype=float)
    return pa.table({"status": status if status is not None else ["finished"] * len(arrival),
                     "arrival_time_s": arrival, "finish_time_s": finish,
                     "first_scheduled_time_s": arrival if scheduled is None else np.asarray(scheduled, dtype=float)})


def _base(n: int = N, service_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    arrival = np.arange(n, dtype=float)
    return arrival, arrival + service_s


def _judge(arrival, finish, end_s=None, **kw):
    end_s = float(np.max(finish)) if end_s is None else end_s
    return sustained_load(_table(arrival, finish, **kw), end_s)


def test_a_steady_load_is_sustained():
    load = _judge(*_base())
    assert load.reasons == () and load.sustained
    assert load.window_s == pytest.approx(199.8)
    assert load.arrivals == 200 and load.completions == 200  # arrivals 67..266, finishes of 66..265
    assert load.arrival_rate == pytest.approx(200 / 199.8) and load.completion_rate == pytest.approx(200 / 199.8)
    assert load.queue_growth == pytest.approx(0.0, abs=1e-9)  # one request in the system throughout
    assert load.drain_s == 1.0 and load.median_service_s == 1.0


def test_fewer_than_200_arrivals_in_the_window_is_too_short_to_judge():
    # 333 requests: span 332, window (66.4, 265.6]: arrivals 67..265, 199 of them.
    load = _judge(*_base(N - 1))
    assert load.arrivals == 199 and load.reasons == ("short_window",) and not load.sustained
    assert _judge(*_base(N)).arrivals == 200


@pytest.mark.parametrize("factor, judged", [(1 - 1e-6, True), (1 + 1e-6, False)])
def test_a_window_under_five_median_service_times_is_too_short(factor, judged):
    # Every request takes a fifth of the window (199.8 / 5 = 39.96 s), a hair less or more.
    service_s = 199.8 / 5 * factor
    load = _judge(*_base(service_s=service_s))
    assert load.median_service_s == pytest.approx(service_s)
    assert load.judged == judged
    assert load.sustained == judged  # judged, a steady load keeps pace


@pytest.mark.parametrize("extra, holds", [(22, True), (23, False)])
def test_completions_under_nine_tenths_of_arrivals_fall_behind(extra, holds):
    # `extra` requests arrive just after the window opens and finish after it closes: they
    # add to the window's arrivals (200 + extra) but not its completions (200); in the
    # system through both quarters, they barely move its growth. 200 >= 0.9 * 222 holds,
    # 200 < 0.9 * 223 does not.
    arrival, finish = _base()
    late = LO + 0.001 * np.arange(1, extra + 1)
    load = _judge(np.r_[arrival, late], np.r_[finish, np.full(extra, HI + 1)])
    assert load.arrivals == 200 + extra and load.completions == 200
    assert load.queue_growth < 0.1
    assert load.reasons == (() if holds else ("falling_behind",))


@pytest.mark.parametrize("extra, holds", [(22, True), (23, False)])
def test_requests_in_the_system_growing_by_a_tenth_of_the_arrivals_is_queue_growth(extra, holds):
    # `extra` requests arrive just before the window's last quarter and stay past its end
    # (in the system for the whole last quarter: growth `extra`), and as many requests
    # that arrived before the window finish just after it opens (completions 200 + extra,
    # in the first quarter for a negligible time): completions keep pace with arrivals,
    # and the growth alone crosses 0.1 x (200 + extra): 22 <= 22.2, 23 > 22.3.
    arrival, finish = _base()
    stay = HI - QUARTER - 0.001 * np.arange(1, extra + 1)
    early = LO - 1 - 0.001 * np.arange(1, extra + 1)
    load = _judge(np.r_[arrival, stay, early], np.r_[finish, np.full(extra, HI + 1), np.full(extra, LO + 1e-6)])
    assert load.arrivals == 200 + extra and load.completions == 200 + extra
    assert load.queue_growth == pytest.approx(extra, abs=1e-3)
    assert load.reasons == (() if holds else ("queue_growth",))


@pytest.mark.parametrize("drain_s, holds", [(0.25 * 333, True), (0.25 * 333 + 1e-6, False)])
def test_a_drain_over_a_quarter_of_the_arrival_span_is_long(drain_s, holds):
    arrival, finish = _base()
    load = _judge(arrival, finish, end_s=333 + drain_s)
    assert load.drain_s == pytest.approx(drain_s)
    assert load.reasons == (() if holds else ("long_drain",))


def test_unfinished_requests_stay_in_the_system_and_rejected_ones_never_enter():
    # The last 40 arrivals never finish (in the system to the end, 340 s), and 50 rejected
    # requests arrive in the window: they change nothing about it.
    arrival, finish = _base()
    status = ["finished"] * N
    for i in range(N - 40, N):
        status[i], finish[i] = "running", math.nan
    rejected = np.linspace(LO + 1, HI - 1, 50)
    load = _judge(np.r_[arrival, rejected], np.r_[finish, np.full(50, math.nan)], end_s=340.0,
                  status=status + ["rejected"] * 50)
    assert load.arrivals == 200 and load.completions == 200
    # The window's last quarter ends at 266.4, before the unfinished ones (from 294) arrive.
    assert load.queue_growth == pytest.approx(0.0, abs=1e-9) and load.drain_s == 7.0


def test_a_burst_is_not_judged_and_holds_no_slo():
    # 400 requests in 1.7 s, each taking 5-15 s: the p99s may pass, the load is a burst.
    rng = np.random.default_rng(3)
    arrival = np.sort(rng.uniform(0, 1.7, 400))
    finish = arrival + rng.uniform(5, 15, 400)
    load = _judge(arrival, finish)
    assert load.reasons == ("short_window",)
    # The row counts 1,000 requests, enough for a p99, so that the window alone decides.
    row = {"num_requests": 1000, "rejected": 0, "completed": 1000, "unfinished": 0, "p99_ttft_ms": 100.0,
           "p99_tpot_ms": 10.0, "saturated": False, **load.columns()}
    assert not slo_holds(row, SLO(ttft_s=1.0, tpot_s=0.05))
    assert slo_holds({**row, **_judge(*_base()).columns()}, SLO(ttft_s=1.0, tpot_s=0.05))


def test_the_rate_search_answers_the_sustained_rate_not_the_bursts(tmp_path):
    # tests/replay/test_capacity.py's constant workload: 400 one-token requests on an engine
    # that serves 100 requests/s (rate scale 10). With a TTFT bound of a minute, 400 requests
    # compressed into any burst are worked off within it (the last waits 4 s): the p99
    # criterion alone holds at every scale. Above 100 requests/s completions stay at 100/s,
    # so the steady window falls behind once 100 < 0.9 x the arrival rate (scale 100 / 9).
    from typer.testing import CliRunner

    import pyarrow.parquet as pq
    from tests.replay.test_capacity import CONSTANT, _app

    path = tmp_path / "loose.toml"
    path.write_text(CONSTANT.replace("ttft_s = 0.015", "ttft_s = 60.0"))
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(path), "--find-max-rate", "--rate-tolerance", "0.02",
                                         "--jobs", "1", "--no-report", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    row = pq.read_table(out / "capacity.parquet").to_pylist()[0]
    assert 10.0 <= row["max_rate_scale"] <= 100 / 9 and row["rate_search_refusal"] is None
    assert row["sustained"] and row["p99_ttft_ms"] < 60_000


def _constant_csv(tmp_path, count: int) -> Path:
    """The constant workload's requests as a recorded trace: ``count`` one-token requests
    0.1 s apart, on the same fast GPU (a request per 10 ms step)."""
    from tests.replay.test_capacity import CONSTANT

    trace = tmp_path / "constant.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{i / 10!r},16,1\n" for i in range(count)))
    path = tmp_path / "recorded.toml"
    path.write_text(CONSTANT.split("[workload]")[0] + '[workload]\ntrace = "constant.csv"\n'
                    + "[slo]" + CONSTANT.split("[slo]")[1])
    return path


def test_a_recorded_point_whose_window_is_too_short_at_every_rate_is_refused_in_one_line(tmp_path):
    # 200 recorded requests 0.1 s apart, scaled whole (no limit): the window from 20% to 80%
    # of the 19.9 s span holds requests 40..159, 120 of them, under the 200 asked; no rate
    # adds a request. No rate is printed; one line says what the point needs.
    from typer.testing import CliRunner

    import pyarrow.parquet as pq
    from tests.replay.test_capacity import _app

    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(_constant_csv(tmp_path, 200)), "--find-max-rate",
                                         "--jobs", "1", "--no-report", "-q", "--out", str(out)])
    assert result.exit_code == 0, result.output
    row = pq.read_table(out / "capacity.parquet").to_pylist()[0]
    assert row["max_rate_scale"] is None and row["max_request_rate"] is None
    lines = [line for line in result.output.splitlines() if line.startswith("point 0: ")]
    assert len(lines) == 1 and lines[0] == f"point 0: {row['rate_search_refusal']}"
    assert lines[0].startswith("point 0: no rate judged to hold: at rate scale 1 the replay needs a steady window "
                               "of at least 200 arrivals and ")
    assert "it had 120 in 11.9 s; raise --limit" in lines[0]


def test_a_synthetic_point_too_short_at_its_own_rate_is_drawn_for_longer_at_a_higher_one(tmp_path):
    # The same 200 requests drawn from a spec: a p99 needs 1,000 (docs/capacity.md#enough-load),
    # and at eight times the rate the spec gives 1,593 in the same 19.9 s; the search starts
    # there and finds the engine's 100 requests/s (scale 10) as with more requests.
    import json

    from typer.testing import CliRunner

    import pyarrow.parquet as pq
    from tests.replay.test_capacity import CONSTANT, _app

    path = tmp_path / "short.toml"
    path.write_text(CONSTANT.replace("num_requests = 400", "num_requests = 200").replace("ttft_s = 0.015",
                                                                                          "ttft_s = 60.0"))
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(path), "--find-max-rate", "--jobs", "1", "--no-report",
                                         "-q", "--rate-tolerance", "0.02", "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "capacity.parquet")
    row = table.to_pylist()[0]
    search = json.loads(table.schema.metadata[b"kvtwin.capacity"])["0"]
    assert search["too_short"] == [1.0, 2.0, 4.0] and search["start_rate_scale"] == 8.0
    assert 10.0 * 0.98 <= row["max_rate_scale"] <= 100 / 9 and row["rate_search_refusal"] is None
    assert row["max_request_rate"] == pytest.approx(row["judged_request_rate"])
    assert row["max_request_rate"] == pytest.approx(10.0 * row["max_rate_scale"], rel=1e-4)


@pytest.mark.parametrize("recorded, scale, expected", [
    (True, 1.0, 100), (True, 0.5, 50), (True, 2.5, 248), (True, 3.5, 347), (True, 5.0, 400),
    (False, 1.0, 100), (False, 0.5, 50), (False, 2.5, 248), (False, 4.5, 446)])
def test_a_limit_is_read_as_the_time_its_requests_span(tmp_path, recorded, scale, expected):
    # 400 requests 0.1 s apart with limit 100: the first 100 span 9.9 s; at scale s the
    # requests are 0.1 / s apart, and those within 9.9 s number floor(9.9 s / 0.1) + 1: a
    # recorded trace until its 400 run out, a synthetic one drawn for as long as it takes
    # (docs/capacity.md#enough-load).
    from kvtwin.sim.replay.capacity_points import PointReplays
    from kvtwin.sim.scenario.parse import load_scenario_data
    from kvtwin.sim.scenario.resolve import resolve_scenario
    from kvtwin.sim.scenario.sweep_keys import with_limit
    from tests.replay.test_capacity import CONSTANT

    if recorded:
        path = _constant_csv(tmp_path, 400)
    else:
        path = tmp_path / "constant.toml"
        path.write_text(CONSTANT)
    resolved = resolve_scenario(path, data=with_limit(load_scenario_data(path), 100))
    workload = resolved.require_workload()
    replays = PointReplays(resolved, None, None, workload.load_source())
    assert replays.stretch().duration_s == pytest.approx(9.9, rel=1e-4)
    assert replays.cut_at(scale).num_rows == expected
    assert replays.cut_at(None).num_rows == 100  # a plain point replays its first 100


def test_a_limit_is_the_shortest_time_that_many_requests_take_and_the_busiest_stretch_is_replayed():
    # docs/capacity.md#enough-load: 3 requests take at least 0.2 s (3.1 to 3.3); at twice the
    # point's own scale of 2, 0.1 s of simulated time is 0.4 s of trace time, and the window
    # of 0.4 s holding the most arrivals starts at 3.0 (3.0 to 3.3: four). At scale 2, 0.2 s
    # hold three from 3.0 as from 3.1: the earliest.
    from kvtwin.sim.replay.capacity_points import Stretch

    arrivals = np.array([0.0, 1.0, 2.0, 3.0, 3.1, 3.2, 3.3, 10.0])
    stretch = Stretch.of(arrivals, 3, start_scale=2.0)
    assert stretch.duration_s == pytest.approx(0.1)
    assert stretch.window(arrivals, 2.0) == pytest.approx((3.0, 3.2))
    assert stretch.window(arrivals, 4.0) == pytest.approx((3.0, 3.4))
    # Longer than the trace: all of it, from its first arrival.
    assert stretch.window(arrivals, 400.0) == pytest.approx((0.0, 40.0))
    # More requests than the trace has: its whole span.
    assert Stretch.of(arrivals, 50, 1.0).duration_s == pytest.approx(10.0)


def test_the_search_judges_the_busiest_stretch_and_states_the_whole_traces_rate(tmp_path):
    # 3,000 requests 0.1 s apart, then 3,000 at 0.025 s (four times as dense), then 3,000 at
    # 0.1 s again, one 10 ms step each: 100 requests/s at most. With --limit 3000 the shortest
    # time 3,000 requests take is the dense part's 74.975 s; each scale replays the 74.975 s
    # of the scaled trace that hold the most arrivals, so the answer is well under the first
    # 3,000's (10 requests/s, holding to about scale 10), and it is stated as the whole
    # trace's rate.
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from tests.replay.test_capacity import CONSTANT, _app

    gaps = np.concatenate([np.full(3000, 0.1), np.full(3000, 0.025), np.full(2999, 0.1)])
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    trace = tmp_path / "dense.csv"
    trace.write_text("arrival_time_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{float(t)!r},16,1\n" for t in arrivals))
    scenario = CONSTANT.split("[workload]")[0] + '[workload]\ntrace = "dense.csv"\n' \
        + "[slo]" + CONSTANT.split("[slo]")[1]
    path = tmp_path / "dense.toml"
    path.write_text(scenario.replace("ttft_s = 0.015", "ttft_s = 60.0"))
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(path), "--find-max-rate", "--limit", "3000",
                                         "--rate-tolerance", "0.02", "--jobs", "1", "--no-report", "-q",
                                         "--out", str(out)])
    assert result.exit_code == 0, result.output
    row = pq.read_table(out / "capacity.parquet").to_pylist()[0]
    lo = row["max_rate_scale"]
    assert 1.0 < lo < 5.0
    assert row["max_request_rate"] == pytest.approx((len(arrivals) - 1) / arrivals[-1] * lo)
    # The replay judged at lo, found by brute force: the earliest window of 74.975 s x lo of
    # trace time holding the most arrivals.
    length = 2999 * 0.025 * lo
    counts = [int(((arrivals >= t) & (arrivals <= t + length + 1e-9)).sum()) for t in arrivals]
    first = arrivals[counts.index(max(counts))]
    kept = arrivals[(arrivals >= first) & (arrivals <= first + length + 1e-9)] / lo
    assert row["judged_request_rate"] == pytest.approx((len(kept) - 1) / (kept[-1] - kept[0]))
    assert row["judged_request_rate"] > row["max_request_rate"]
