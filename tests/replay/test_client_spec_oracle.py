"""The client-side and speculative-decoding columns, computed a second time.

Client side (``sim/replay/client_side.py``): each request's ``ttft_client_s`` and
``e2el_client_s`` are the server's plus the overhead (equal with none: every run has
them), and the summary's mean, median and p99 of them are recomputed over the finished
requests with NumPy (a rejected and a still-running request are in the table to be left
out); the SLO is judged on the client's TTFT (docs/capacity.md#client-side-latency).

Speculative decoding: tiny replays whose executor accepts a known, varying number of drafts
per verify step (``output_oracle.KnownExecutor``); the drafts, accepted drafts and verify
steps of each request, the accepted drafts by position of each step, the decode tokens of
verify rows, and the summary's acceptance figures are recomputed from the batches' drafts
and sampled tokens (``output_oracle.OracleRun``), asynchronous scheduling on and off.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtwin.sim.scenario.slo import SLO
from tests.replay.output_oracle import OracleRun, TraceRequest, assert_same, replay
from tests.replay.test_output_oracle import REQUEST_ORACLE, STEP_ORACLE, SUMMARY_ORACLE

OVERHEAD_S = 0.0125


def _trace() -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.003 * i, list(range(100 * i, 100 * i + 9 + 3 * i)), 3 + 2 * i) for i in range(5)]


def test_client_columns_add_the_overhead_and_summarise_the_finished():
    trace = _trace() + [TraceRequest("r5", 0.02, list(range(900, 1020)), 3)]  # rejected (over max_model_len)
    result = replay(trace, time_limit_s=0.25, client_overhead_s=OVERHEAD_S)  # the last request is still running
    rows = result.requests.to_pylist()
    summary = result.summary
    assert {"finished", "rejected"} <= {r["status"] for r in rows} and {"running", "waiting"} & {r["status"] for r in rows}
    for r in rows:
        for server, client in (("ttft_s", "ttft_client_s"), ("e2el_s", "e2el_client_s")):
            if math.isnan(r[server]):
                assert math.isnan(r[client])
            else:
                assert r[client] == pytest.approx(r[server] + OVERHEAD_S, rel=1e-12)
    row = summary.to_pylist()[0]
    assert row["client_overhead_ms"] == pytest.approx(OVERHEAD_S * 1000, rel=1e-12)
    done = [r for r in rows if r["status"] == "finished"]
    assert len(done) >= 4  # enough values for p99, p90, median and mean to differ
    for name in ("ttft", "e2el"):
        ms = np.array([r[f"{name}_s"] for r in done]) * 1000 + OVERHEAD_S * 1000
        assert row[f"mean_{name}_client_ms"] == pytest.approx(ms.sum() / ms.size, rel=1e-12)
        ordered = np.sort(ms)
        assert row[f"median_{name}_client_ms"] == pytest.approx(
            (ordered[(ms.size - 1) // 2] + ordered[ms.size // 2]) / 2, rel=1e-12)
        for stat, q in (("p90", 0.90), ("p99", 0.99)):
            rank = q * (ms.size - 1)
            low = int(rank)
            expected = ordered[low] + (ordered[min(low + 1, ms.size - 1)] - ordered[low]) * (rank - low)
            assert row[f"{stat}_{name}_client_ms"] == pytest.approx(expected, rel=1e-12)
    # The server's figures are the same as a run without the overhead's; only the SLO
    # verdicts may move (judged as a client sees it).
    plain = replay(trace, time_limit_s=0.25).summary.to_pylist()[0]
    verdicts = ("slo_attainment", "request_goodput", "saturated", "saturation_reason")
    assert_same(row, plain, [n for n in SUMMARY_ORACLE if n not in verdicts])


def test_no_overhead_gives_client_columns_equal_to_the_servers():
    """Every run says both: with no time outside the engine the client's figures are the server's."""
    result = replay(_trace()[:3])
    requests, row = result.requests.to_pylist(), result.summary.to_pylist()[0]
    assert requests and all(r["ttft_client_s"] == r["ttft_s"] and r["e2el_client_s"] == r["e2el_s"] for r in requests)
    assert row["client_overhead_ms"] == 0.0
    for name in ("ttft", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert row[f"{stat}_{name}_client_ms"] == pytest.approx(row[f"{stat}_{name}_ms"], rel=1e-12)


def test_the_slo_is_judged_on_the_clients_ttft():
    """A TTFT bound between the server's and the client's TTFT: every request meets it
    server-side and misses it as a client; TPOT, once per token, is not shifted."""
    trace = _trace()[:3]
    overhead_s = 0.1  # more than the spread of these requests' TTFTs
    server = replay(trace).requests.to_pylist()
    ttft_max = max(r["ttft_s"] for r in server)
    ttft_min = min(r["ttft_s"] for r in server)
    assert ttft_max < ttft_min + overhead_s  # so that one bound splits them all
    bound = SLO(ttft_s=ttft_max + overhead_s / 2)
    assert replay(trace, slo=bound).summary.to_pylist()[0]["slo_attainment"] == 1.0
    client = replay(trace, slo=bound, client_overhead_s=overhead_s).summary.to_pylist()[0]
    assert client["slo_attainment"] == 0.0 and client["request_goodput"] == 0.0
    tpot_only = replay(trace, slo=SLO(tpot_s=1.0), client_overhead_s=overhead_s).summary.to_pylist()[0]
    assert tpot_only["slo_attainment"] == 1.0


SPEC_REQUEST = ("draft_tokens", "accepted_draft_tokens", "verify_steps")
SPEC_SUMMARY = ("spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate", "mean_acceptance_length",
                "spec_acceptance_by_position")


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def spec_run(request):
    # r5 repeats r0's prompt of 9 tokens: its 8 cached tokens leave 1 to compute, which the
    # scheduler pads with placeholder drafts to a verify step (counted, never accepted)
    # when no other request is mid-prompt, as at 0.12 s.
    trace = _trace() + [TraceRequest("r5", 0.12, list(range(9)), 4)]
    return replay(trace, async_scheduling=request.param, num_speculative_tokens=3)


def test_the_spec_replay_verifies_and_accepts_at_every_depth(spec_run):
    oracle = OracleRun(spec_run)
    assert sum(r["verify_steps"] for r in oracle.request_rows) > 5
    positions = np.sum([s["_by_position"] for s in oracle.step_rows], axis=0)
    # Every depth accepted at least once, and fewer at deeper positions.
    assert (positions > 0).all() and (np.diff(positions) <= 0).all() and positions[0] > positions[-1]
    assert all(r["status"] == "finished" for r in oracle.request_rows)
    padded = [b for b in spec_run.batches if ("r5", 8) in b.admitted]
    assert padded and padded[0].num_scheduled["r5"] == 4 and len(padded[0].spec["r5"]) == 3


def test_spec_request_columns_are_recomputed(spec_run):
    expected = OracleRun(spec_run).request_rows
    for a, e in zip(spec_run.requests.to_pylist(), expected, strict=True):
        assert_same(a, e, REQUEST_ORACLE + SPEC_REQUEST, f"{e['request_id']}.")


def test_spec_step_columns_are_recomputed(spec_run):
    expected = OracleRun(spec_run).step_rows
    actual = spec_run.steps.to_pylist()
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_same(a, e, STEP_ORACLE, f"step {e['step']}.")
        assert a["spec_accepted_by_position"] == e["_by_position"], e["step"]


def test_spec_summary_columns_are_recomputed(spec_run):
    actual = spec_run.summary.to_pylist()[0]
    expected = OracleRun(spec_run).summary()
    assert_same(actual, expected, SUMMARY_ORACLE + SPEC_SUMMARY)
