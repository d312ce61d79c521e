"""capacity.parquet's rate, replica and cost columns recomputed from first principles.

The seam is the replay of one point at one rate scale (``PointReplays.replay``): it is
replaced by a stub whose outcome is a known function of the load, so the threshold the
rate search must find is known exactly. The stub's load is the rate scale times the step
slowdown it is given (1 for the plain search; the pessimistic edge hands it an efficiency
whose step overhead is ``1 + step_error`` times the scenario's), and

* its client-side p99 TTFT is ``SLO_TTFT_MS * load / P99_THRESHOLD`` (the server's is
  ``CLIENT_OVERHEAD_MS`` less): the p99 criterion, on the client's TTFT, holds iff
  ``load <= P99_THRESHOLD``;
* it kept pace with its arrivals (``sustained``, not ``saturated``) iff ``load <=
  SUSTAINED_THRESHOLD``, above which it fell behind (``falling_behind``); with ``SHORT_ABOVE``
  set, its steady window is too short to judge above that scale (``short_window``);
* its SLO attainment is ``1 - (1 - GOODPUT) * load / GOODPUT_THRESHOLD``: a ``--goodput
  GOODPUT`` criterion holds iff ``load <= GOODPUT_THRESHOLD``;
* its trace has ``N`` arrivals evenly ``1 / (BASE_RATE * scale)`` apart (``BASE_RATE *
  scale`` requests per second), and its token throughput is ``TOKENS_PER_REQUEST`` times that.

Everything else runs for real through ``kvtwin capacity`` (scenario resolution, the point's
replicas and GPUs, its price and calibration, the search, the table, the printed rows). The
test then recomputes each column from those definitions and the documented search
(``sim/replay/rate_search.py``'s docstring: double or halve from the scenario's own rate
scale, then bisect at the geometric midpoint until ``hi / lo - 1 <= tolerance``), and
walks the list of columns in ``reports/SCHEMA.md`` so none is left unchecked.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kvtwin.sim.replay import capacity_points
from kvtwin.sim.replay.capacity_points import MAX_RATE_COLUMNS
from kvtwin.sim.replay.capacity_table import CAPACITY_METADATA_KEY
from kvtwin.sim.replay.load_curve import LOAD_CURVE_COLUMNS
from kvtwin.sim.replay.rate_search import slo_holds
from kvtwin.sim.scenario.slo import SLO
from tests.replay.test_capacity import _app

ROOT = Path(__file__).resolve().parents[2]

BASE_RATE = 10.0          # requests/s of the stub's trace at rate scale 1
N = 1000                  # requests of the stub's trace: enough to judge a p99 (docs/capacity.md#enough-load)
TOKENS_PER_REQUEST = 250  # the stub's token throughput per request/s
SLO_TTFT_MS = 15.0        # the scenario's [slo] ttft_s, in ms
P99_THRESHOLD = 0.55      # load up to which the p99 TTFT holds the SLO
CLIENT_OVERHEAD_MS = 2.0  # the server's TTFT is the client's less this
SUSTAINED_THRESHOLD = 0.5  # load up to which the deployment keeps pace with arrivals
GOODPUT = 0.9
GOODPUT_THRESHOLD = 0.37  # load up to which GOODPUT of the requests meet the SLO
START = 1.25              # the scenario's own workload.rate_scale: where the search starts
PRICE = 3.5               # $/GPU-hour
TP, REPLICAS = 2, 3
STEP_ERROR = 0.25         # the calibration's largest held-out step error (decode)
SEARCH_START_SCALE_FLOOR = 1 / 1024  # halving gives up below this fraction of the start

SCENARIO = f"""
description = "a point whose replays a test replaces"
[model]
preset = "llama-3.1-8b"
[hardware]
name = "fast"
memory_gib = 80
hbm_bandwidth_bytes_per_s = 1e18
bf16_flops = 1e20
price_per_hour = {PRICE}
[engine]
max_model_len = 1024
max_num_seqs = 4
max_num_batched_tokens = 64
kv_cache_memory_bytes = 268435456
tensor_parallel_size = {TP}
replicas = {REPLICAS}
[workload]
kind = "requests"
seed = 1
num_requests = 20
arrival = {{ process = "poisson", rate_per_s = 10.0 }}
prompt_tokens = 16
output_tokens = 1
rate_scale = {START}
[slo]
ttft_s = {SLO_TTFT_MS / 1000}
[cost_model]
step_overhead_s = 0.01
"""
CALIBRATION = 'label = "test"\n[cost_model]\n[error]\nprefill_step = 0.1\ndecode_step = 0.25\n'


SHORT_ABOVE: float | None = None  # scales above it have too short a window (the short fixtures)


def _stub_replay(self, scale, efficiency=None):
    """One replay, its outcome a known function of the load (module docstring)."""
    scale = START if scale is None else scale
    slow = 1.0 if efficiency is None else efficiency.step_overhead_s / self.resolved.efficiency.step_overhead_s
    load = scale * slow
    rate = BASE_RATE * scale
    attainment = 1.0 - (1.0 - GOODPUT) * load / GOODPUT_THRESHOLD
    kept_pace = load <= SUSTAINED_THRESHOLD
    short = SHORT_ABOVE is not None and scale > SHORT_ABOVE
    reason = "short_window" if short else "" if kept_pace else "falling_behind"
    summary = {"num_requests": N, "completed": N, "rejected": 0, "unfinished": 0,
               "sustained": reason == "", "sustained_reason": reason,
               "saturated": reason == "falling_behind", "steady_window_s": 2.0, "steady_arrival_rate": 30.0,
               "steady_median_service_s": 1.5,
               # The SLO judges the client's TTFT (docs/capacity.md#client-side-latency).
               "p99_ttft_client_ms": SLO_TTFT_MS * load / P99_THRESHOLD, "client_overhead_ms": CLIENT_OVERHEAD_MS,
               "p99_ttft_ms": SLO_TTFT_MS * load / P99_THRESHOLD - CLIENT_OVERHEAD_MS, "p99_tpot_ms": math.nan,
               "slo_attainment": attainment, "rejected_share": 0.0,
               # Past the threshold it completes what it can: the threshold's rate.
               "request_throughput": rate if kept_pace else BASE_RATE * SUSTAINED_THRESHOLD / slow,
               "total_token_throughput": TOKENS_PER_REQUEST * rate}
    if self.resolved.disaggregation is not None:
        summary["pd_link"] = self.resolved.disaggregation.link  # what puts num_gpus in the table
    return summary, _stub_cut_at(self, scale)


def _stub_cut_at(self, scale):
    """The stub's trace at ``scale``: ``N`` arrivals evenly ``1 / (BASE_RATE * scale)`` apart."""
    scale = START if scale is None else scale
    return pa.table({"arrival_time_s": np.arange(N) / (BASE_RATE * scale)})


def _stub_unscaled(self):
    """The point's whole trace before any rate scale: the stub's, at scale 1."""
    return pa.table({"arrival_time_s": np.arange(N) / BASE_RATE})


@pytest.fixture
def stubbed(monkeypatch):
    monkeypatch.setattr(capacity_points.PointReplays, "replay", _stub_replay)
    monkeypatch.setattr(capacity_points.PointReplays, "unscaled", _stub_unscaled)
    monkeypatch.setattr(capacity_points.PointReplays, "cut_at", _stub_cut_at)


@pytest.fixture
def short_stub(stubbed, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SHORT_ABOVE", 0.0)


@pytest.fixture
def short_above_stub(stubbed, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SHORT_ABOVE", 0.3)


def _run(tmp_path: Path, *args, calibrated: bool = True, scenario: str = SCENARIO):
    (tmp_path / "cal.toml").write_text(CALIBRATION)
    path = tmp_path / "point.toml"
    path.write_text(scenario.replace("[cost_model]\n", '[cost_model]\ncalibration = "cal.toml"\n') if calibrated
                    else scenario)
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(path), "--find-max-rate", "--jobs", "1", "--no-report",
                                         "--out", str(out), *map(str, args)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out / "capacity.parquet")
    return table, table.to_pylist()[0], result.output


def _documented_search(holds, start: float, tolerance: float, max_replays: int) -> list[tuple[float, bool]]:
    """The scales the documented search tries, in order, written out from its docstring."""
    tried = []

    def test(x):
        tried.append((x, holds(x)))
        return tried[-1][1]

    lo = hi = None
    if test(start):
        lo = x = start
        while len(tried) < max_replays:
            x = 2 * x
            if not test(x):
                hi = x
                break
            lo = x
    else:
        hi = x = start
        while len(tried) < max_replays and x / 2 >= start * SEARCH_START_SCALE_FLOOR:
            x = x / 2
            if test(x):
                lo = x
                break
            hi = x
    while lo is not None and hi is not None and hi / lo > 1 + tolerance and len(tried) < max_replays:
        mid = (lo * hi) ** 0.5
        if test(mid):
            lo = mid
        else:
            hi = mid
    return tried


def _expected_columns(lo: float, lo_edge: float | None, target_rate: float | None) -> dict:
    """Every rate, replica and cost column from the found scales, by their definitions."""
    trace_rate = BASE_RATE * START  # the point's own trace: (N - 1) arrivals over their span
    rate = BASE_RATE * lo
    per_replica = rate / REPLICAS
    cost_per_hour = PRICE * TP * REPLICAS
    tokens_per_hour = TOKENS_PER_REQUEST * rate * 3600
    expected = {"max_rate_scale": lo, "max_request_rate": rate, "max_request_rate_per_replica": per_replica,
                # No limit: the answer was judged on the whole trace, at the rate it states.
                "judged_request_rate": rate,
                "replicas_needed_trace_rate": math.ceil(trace_rate / per_replica),
                "replicas_needed_target_rate": None if target_rate is None else math.ceil(target_rate / per_replica),
                "cost_per_hour": cost_per_hour, "cost_per_million_tokens": cost_per_hour / tokens_per_hour * 1e6,
                "step_error": None, "max_rate_scale_pessimistic": None, "max_request_rate_pessimistic": None,
                "replicas_needed_trace_rate_pessimistic": None, "replicas_needed_target_rate_pessimistic": None,
                # Every scale's window was long enough to judge (the stub's, unless SHORT).
                "rate_search_refusal": None}
    if lo_edge is not None:
        edge_per_replica = BASE_RATE * lo_edge / REPLICAS
        expected.update(step_error=STEP_ERROR, max_rate_scale_pessimistic=lo_edge,
                        max_request_rate_pessimistic=BASE_RATE * lo_edge,
                        replicas_needed_trace_rate_pessimistic=math.ceil(trace_rate / edge_per_replica),
                        replicas_needed_target_rate_pessimistic=None if target_rate is None
                        else math.ceil(target_rate / edge_per_replica))
    return expected


def _assert_columns(row: dict, expected: dict) -> None:
    for name, value in expected.items():
        if value is None or isinstance(value, int):
            assert row[name] == value, name
        else:
            assert row[name] == pytest.approx(value, rel=1e-9), name


@pytest.mark.parametrize("goodput", [None, GOODPUT])
def test_the_search_finds_the_known_threshold_and_every_column_follows(stubbed, tmp_path, goodput):
    tolerance, target = 0.02, 40.0
    flags = ["--rate-tolerance", tolerance, "--target-rate", target] + (["--goodput", goodput] if goodput else [])
    table, row, output = _run(tmp_path, *flags)
    # The first bound the load crosses: keeping pace, or the SLO's own.
    threshold = min(P99_THRESHOLD if goodput is None else GOODPUT_THRESHOLD, SUSTAINED_THRESHOLD)
    # The slow edge: every step 1.25x as long, so the load reaches the threshold 1.25x sooner.
    edge_threshold = threshold / (1 + STEP_ERROR)
    tried = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]["tried"]
    expected_tried = _documented_search(lambda x: x <= threshold, START, tolerance, 24)
    assert [ok for _, ok in tried] == [ok for _, ok in expected_tried]
    assert [x for x, _ in tried] == pytest.approx([x for x, _ in expected_tried], rel=1e-12)
    lo = max(x for x, ok in expected_tried if ok)
    hi = min(x for x, ok in expected_tried if not ok and x > lo)
    assert lo <= threshold < hi and hi / lo - 1 <= tolerance
    edge_tried = _documented_search(lambda x: x * (1 + STEP_ERROR) <= threshold, START, tolerance, 24)
    lo_edge = max(x for x, ok in edge_tried if ok)
    assert edge_threshold / (1 + tolerance) <= lo_edge <= edge_threshold
    _assert_columns(row, _expected_columns(lo, lo_edge, target))
    # The summary columns are the replay's at lo (its p99 TTFT is a known function of lo).
    assert row["p99_ttft_client_ms"] == pytest.approx(SLO_TTFT_MS * lo / P99_THRESHOLD)
    assert row["p99_ttft_ms"] == pytest.approx(SLO_TTFT_MS * lo / P99_THRESHOLD - CLIENT_OVERHEAD_MS)
    assert row["request_throughput"] == pytest.approx(BASE_RATE * lo)
    # The printed row shows the same figures (four significant digits, "," thousands).
    printed = next(line for line in output.splitlines() if line.strip().startswith("│ 0"))
    cells = [c.strip() for c in printed.strip().strip("│").split("│")]
    assert f"{BASE_RATE * lo:,.4g}" in cells and f"{lo:,.4g}" in cells
    assert str(math.ceil(BASE_RATE * START / (BASE_RATE * lo / REPLICAS))) in cells
    assert f"{BASE_RATE * lo_edge:,.4g}" in cells and f"{STEP_ERROR * 100:.1f} %" in cells


def test_a_threshold_above_the_start_is_bracketed_by_doubling(stubbed, tmp_path):
    # Loads up to 0.55 hold with a start at 0.2: 0.2, 0.4, 0.8 (fails), then bisect.
    table, row, _ = _run(tmp_path, "--rate-tolerance", 0.1, calibrated=False,
                         scenario=SCENARIO.replace(f"rate_scale = {START}", "rate_scale = 0.2"))
    tried = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]["tried"]
    assert [x for x, _ in tried[:3]] == [0.2, 0.4, 0.8] and [ok for _, ok in tried[:3]] == [True, True, False]
    lo = row["max_rate_scale"]
    threshold = min(P99_THRESHOLD, SUSTAINED_THRESHOLD)
    assert threshold / 1.1 <= lo <= threshold
    # The search ends on a scale that failed; the summary is still the replay's at lo.
    assert not tried[-1][1] and tried[-1][0] > lo
    assert row["request_throughput"] == pytest.approx(BASE_RATE * lo)
    assert row["p99_ttft_client_ms"] == pytest.approx(SLO_TTFT_MS * lo / P99_THRESHOLD)
    # Uncalibrated: no slow edge, and the trace rate is the point's own (at 0.2).
    assert row["step_error"] is None and row["max_rate_scale_pessimistic"] is None
    assert row["replicas_needed_trace_rate"] == math.ceil(BASE_RATE * 0.2 / (BASE_RATE * lo / REPLICAS))
    assert row["replicas_needed_target_rate"] is None


def test_no_scale_holds_down_to_the_floor(stubbed, tmp_path):
    # Nothing holds at any load: the search halves from 1.25 down to 1.25 / 1024 (11 replays)
    # and gives up; the rate columns are null, the price is still known.
    never = SCENARIO.replace(f"ttft_s = {SLO_TTFT_MS / 1000}", "ttft_s = 0.000000001")
    table, row, _ = _run(tmp_path, "--max-replays", 40, calibrated=False, scenario=never)
    search = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]
    assert [x for x, _ in search["tried"]] == pytest.approx([START / 2 ** k for k in range(11)])
    assert not search["converged"] and not any(ok for _, ok in search["tried"])
    assert all(row[name] is None for name in MAX_RATE_COLUMNS if name != "cost_per_hour")
    assert row["cost_per_hour"] == PRICE * TP * REPLICAS
    # The summary is the last replay's (the smallest scale tried).
    assert row["request_throughput"] == pytest.approx(BASE_RATE * START / 1024)


def test_a_point_too_short_to_judge_is_refused_with_what_it_needs(short_stub, tmp_path):
    # Every scale's steady window is too short: no scale holds, nothing is printed as a
    # sustainable rate, and one line says what the point needs (from the summary's figures:
    # 2 s at 30 requests/s is 60 arrivals; 5 median service times of 1.5 s is 7.5 s).
    table, row, output = _run(tmp_path, "--max-replays", 40, calibrated=False)
    assert all(row[name] is None for name in MAX_RATE_COLUMNS if name not in ("cost_per_hour", "rate_search_refusal"))
    # The scenario is synthetic, drawn for a duration: its start was doubled 6 times before
    # the search began where it would have (docs/capacity.md#enough-load).
    search = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]
    assert search["too_short"] == [START * 2 ** k for k in range(7)]
    assert search["start_rate_scale"] == START
    largest = max(x for x, _ in search["tried"] + [(x, False) for x in search["too_short"]])
    line = (f"point 0: no rate judged to hold: at rate scale {largest:g} the replay needs a steady window of at "
            f"least 200 arrivals and 7.5 s (5 median service times); it had 60 in 2.0 s; raise --limit (or "
            f"workload.limit) or replay more of the trace")
    assert line in output.splitlines()
    assert row["rate_search_refusal"] == line.removeprefix("point 0: ")


def test_an_answer_bracketed_by_a_window_too_short_is_a_lower_bound(short_above_stub, tmp_path):
    # From 0.2, scales above 0.3 cannot be judged (as a whole trace compressed too far):
    # the search brackets [0.2, 0.4] and bisects onto 0.3 from below; the largest scale
    # that held is reported, and the row says it is only a lower bound.
    table, row, output = _run(tmp_path, "--rate-tolerance", 0.05, calibrated=False,
                              scenario=SCENARIO.replace(f"rate_scale = {START}", "rate_scale = 0.2"))
    tried = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]["tried"]
    lo = max(x for x, ok in tried if ok)
    hi = min(x for x, ok in tried if not ok)
    assert 0.3 / 1.05 <= lo <= 0.3 < hi and row["max_rate_scale"] == lo
    line = (f"{lo:g} is a lower bound: rate scale {hi:g} could not be judged, it needs a steady window of at "
            f"least 200 arrivals and 7.5 s (5 median service times); it had 60 in 2.0 s")
    assert row["rate_search_refusal"] == line and f"point 0: {line}" in output.splitlines()


def test_the_replay_budget_stops_the_search(stubbed, tmp_path):
    # Three replays: 1.25 fails, 0.625 fails, 0.3125 holds; no bisection is left.
    table, row, _ = _run(tmp_path, "--max-replays", 3, calibrated=False)
    search = json.loads(table.schema.metadata[CAPACITY_METADATA_KEY])["0"]
    assert [x for x, _ in search["tried"]] == [START, START / 2, START / 4] and not search["converged"]
    assert row["max_rate_scale"] == START / 4


def test_disaggregated_points_count_prefill_and_decode_replicas(stubbed, tmp_path):
    # 2P2D: 4 replicas of TP 2 (8 GPUs), beside the aggregated 3 replicas of TP 2 (6 GPUs).
    pd = SCENARIO + '[disaggregation]\nprefill_replicas = 1\ndecode_replicas = 1\nlink = "rdma"\n'
    (tmp_path / "pd.toml").write_text(pd)
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(tmp_path / "pd.toml"), "--find-max-rate", "--jobs", "1",
                                         "--no-report", "--sweep", "disaggregation.shape=2P2D,none", "--out",
                                         str(out)])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    for row, replicas in zip(rows, (2 + 2, REPLICAS)):
        assert row["num_gpus"] == TP * replicas
        assert row["cost_per_hour"] == PRICE * TP * replicas
        assert row["max_request_rate_per_replica"] == pytest.approx(BASE_RATE * row["max_rate_scale"] / replicas)
        assert row["replicas_needed_trace_rate"] == math.ceil(BASE_RATE * START / (BASE_RATE * row["max_rate_scale"]
                                                                                  / replicas))


def _schema_capacity_columns() -> list[str]:
    """The columns reports/SCHEMA.md lists for capacity.parquet's rate search."""
    text = (ROOT / "reports" / "SCHEMA.md").read_text()
    section = text.split("## capacity.parquet", 1)[1].split("\n## ", 1)[0]
    # A row that begins in words is a group of summary.parquet's columns (documented there).
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for line in rows for name in re.findall(r"`([a-z0-9_*]+)`", line.split("|")[1])]


# Columns of the section checked elsewhere, with why.
EXEMPT = {"calibration", "calibration_note",  # the point's clock: tests/replay/test_capacity.py
          # The point's identity: tests/replay/test_capacity.py.
          "point", "status", "error",
          # P/D: the summary's (tests/replay/test_pd.py); num_gpus in
          # test_disaggregated_points_count_prefill_and_decode_replicas above.
          "num_gpus", "pd_prefill_replicas", "pd_decode_replicas", "pd_link", "pd_transfer_mean_ms",
          "pd_transfer_bytes_mean", "pd_transfer_share_of_ttft", "pd_transfer_share_of_ttft_total"}


LOAD_RATES = (1.0, 3.0, 4.5, 6.0, 9.0)  # requests/s: scales 0.1 .. 0.9 of the stub's trace


def _expected_load_curve(rate: float) -> dict:
    """A load-curve row's columns by their definitions (docs/capacity.md#load-curve), from
    the stub's known outcome at the scale that offers ``rate``."""
    scale = rate / BASE_RATE  # the stub's trace arrives at BASE_RATE x scale, exactly
    slow = 1 + STEP_ERROR
    sustained = [r / BASE_RATE <= SUSTAINED_THRESHOLD for r in LOAD_RATES]
    first_failed = sustained.index(False)
    return {"offered_request_rate": rate, "load_rate_scale": scale,
            "achieved_request_rate": rate if scale <= SUSTAINED_THRESHOLD else BASE_RATE * SUSTAINED_THRESHOLD,
            "knee_request_rate": LOAD_RATES[first_failed - 1], "past_knee": rate >= LOAD_RATES[first_failed],
            "step_error": STEP_ERROR,
            "achieved_request_rate_pessimistic": rate if scale * slow <= SUSTAINED_THRESHOLD
            else BASE_RATE * SUSTAINED_THRESHOLD / slow,
            "p99_ttft_ms_pessimistic": SLO_TTFT_MS * scale * slow / P99_THRESHOLD - CLIENT_OVERHEAD_MS,
            "p99_ttft_client_ms_pessimistic": SLO_TTFT_MS * scale * slow / P99_THRESHOLD,
            "p99_tpot_ms_pessimistic": None,  # the stub has no TPOT: NaN, written as null
            "sustained_pessimistic": scale * slow <= SUSTAINED_THRESHOLD}


def test_every_load_curve_column_follows_its_definition(stubbed, tmp_path):
    (tmp_path / "cal.toml").write_text(CALIBRATION)
    path = tmp_path / "point.toml"
    path.write_text(SCENARIO.replace("[cost_model]\n", '[cost_model]\ncalibration = "cal.toml"\n'))
    out = tmp_path / "cap"
    result = CliRunner().invoke(_app(), ["capacity", str(path), "--load-curve", ",".join(map(str, LOAD_RATES)),
                                         "--sweep", "engine.replicas=1,2", "--jobs", "1", "--no-report",
                                         "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out / "capacity.parquet").to_pylist()
    # One curve per replicas value, the rate varying fastest; the stub ignores replicas.
    assert [(r["engine.replicas"], r["offered_request_rate"]) for r in rows] == [
        (replicas, pytest.approx(rate)) for replicas in (1, 2) for rate in LOAD_RATES]
    for row in rows:
        _assert_columns(row, _expected_load_curve(row["offered_request_rate"]))
    knee, above = LOAD_RATES[2], LOAD_RATES[3]
    assert result.output.count(f"knee between {knee:g} and {above:g} req/s offered; at most "
                               f"{BASE_RATE * SUSTAINED_THRESHOLD:g} req/s achieved") == 2


def test_every_schema_column_is_recomputed():
    listed = _schema_capacity_columns()
    checked = set(_expected_columns(1.0, 1.0, 1.0)) | set(_expected_load_curve(1.0))
    assert set(MAX_RATE_COLUMNS) <= set(listed), "a rate-search column SCHEMA.md does not list"
    assert set(LOAD_CURVE_COLUMNS) <= set(listed), "a load-curve column SCHEMA.md does not list"
    for name in listed:
        assert name in checked or name in EXEMPT, f"{name}: no oracle in this module and no exemption"


def test_the_slo_criterion_holds_at_its_bounds():
    # Bounds in seconds, p99s in ms: a p99 equal to its bound holds, one just above fails.
    slo = SLO(ttft_s=0.25, tpot_s=0.125)
    row = {"num_requests": 2000, "completed": 2000, "rejected": 0, "unfinished": 0, "p99_ttft_ms": 250.0,
           "p99_tpot_ms": 125.0, "slo_attainment": 0.75, "sustained": True, "saturated": False}
    assert slo_holds(row, slo)
    # A load not sustained (a burst, a window too short) or saturated holds nothing, goodput or not.
    for bad in ({"sustained": False}, {"saturated": True}):
        assert not slo_holds({**row, **bad}, slo) and not slo_holds({**row, **bad}, slo, goodput=0.5)
    assert not slo_holds({**row, "p99_ttft_ms": 250.001}, slo)
    assert not slo_holds({**row, "p99_tpot_ms": 125.001}, slo)
    # The TTFT bound judges the client's p99 where the summary has it
    # (docs/capacity.md#client-side-latency): 8 ms outside the engine fails a server p99 that passes.
    assert not slo_holds({**row, "p99_ttft_ms": 242.0, "p99_ttft_client_ms": 250.001}, slo)
    assert slo_holds({**row, "p99_ttft_ms": 251.0, "p99_ttft_client_ms": 250.0}, slo)
    # A goodput judged over the admitted requests: 1,500 of 2,000 arrived met it, 500 were
    # rejected, so 1,500 of the 1,500 admitted did: 100 %; exactly at the goodput holds.
    rejected = {**row, "rejected": 500, "completed": 1500}
    assert slo_holds(rejected, slo, goodput=1.0)
    assert slo_holds(row, slo, goodput=0.75) and not slo_holds(row, slo, goodput=0.76)

    # Enough admitted requests to judge (docs/capacity.md#enough-load): ten beyond the quantile.
    for goodput, needed in ((None, 1000), (0.9, 100), (0.75, 40), (1.0, 1000)):
        edge = {**row, "num_requests": needed + 5, "rejected": 5, "completed": needed, "slo_attainment": 1.0}
        assert slo_holds(edge, slo, goodput)
        assert not slo_holds({**edge, "rejected": 6, "completed": needed - 1}, slo, goodput)