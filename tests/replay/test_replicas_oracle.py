"""replicas.parquet (and a cluster's summary), computed a second time.

Two data-parallel replicas behind round robin (``output_oracle.replay``), with prefix
sharing, a rejection and a one-token chunk: each replica's row is recomputed from that
replica's own batches and requests (``OracleRun(run, replica=k)``: its requests' latencies
and prefix-cache counts, its steps' tokens and time-weighted usage, its requests'
inter-token gaps), with ``load_ratio`` = requests routed there over the mean per replica,
``num_trace_requests`` = the requests routed there and ``prefix_reuse_upper_bound`` the
reuse within them; the cluster summary over both, with
``load_imbalance`` = the most routed to one replica over the mean.
"""

from __future__ import annotations

import json

import pytest

from tests.replay.output_oracle import OracleRun, TraceRequest, assert_same, replay
from tests.replay.test_output_oracle import REQUEST_ORACLE, STEP_ORACLE, SUMMARY_ORACLE

CLUSTER_ONLY = ("num_replicas", "router", "load_imbalance")


def _trace() -> list[TraceRequest]:
    shared = list(range(12))
    return [
        TraceRequest("r0", 0.000, shared + list(range(500, 505)), 6),
        TraceRequest("r1", 0.002, list(range(800, 817)), 3),
        TraceRequest("r2", 0.004, shared + list(range(600, 603)), 1),
        TraceRequest("r3", 0.006, list(range(2000, 2120)), 4),  # rejected
        TraceRequest("r4", 0.040, shared + list(range(700, 709)), 5),
        TraceRequest("r5", 0.050, list(range(900, 910)), 7),
        TraceRequest("r6", 0.051, shared + list(range(750, 755)), 2),
    ]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def run(request):
    return replay(_trace(), num_replicas=2, async_scheduling=request.param, max_num_batched_tokens=16)


def test_both_replicas_work(run):
    routed = [sum(1 for r in run.replica_of.values() if r == k) for k in range(2)]
    assert routed == [4, 3]
    assert {b.replica for b in run.batches} == {0, 1}
    assert any(r["prefix_hit_tokens"] > 0 for r in OracleRun(run).request_rows)


def test_cluster_tables_are_recomputed(run):
    oracle = OracleRun(run)
    for a, e in zip(run.requests.to_pylist(), oracle.request_rows, strict=True):
        assert_same(a, e, REQUEST_ORACLE, f"{e['request_id']}.")
    actual_steps = run.steps.to_pylist()
    assert len(actual_steps) == len(oracle.step_rows)
    for a, e in zip(actual_steps, oracle.step_rows):
        assert_same(a, e, STEP_ORACLE, f"step {e['step']}.")
    summary = run.summary.to_pylist()[0]
    summary["rejected_by_reason"] = json.loads(summary["rejected_by_reason"])
    expected = oracle.summary()
    assert_same(summary, expected, SUMMARY_ORACLE + ("rejected_by_reason",))
    assert summary["load_imbalance"] == pytest.approx(4 / 3.5, rel=1e-12)


def test_each_replica_row_is_recomputed_from_its_share(run):
    rows = run.replicas.to_pylist()
    assert [row["replica"] for row in rows] == [0, 1]
    routed = [4, 3]
    for k, row in enumerate(rows):
        expected = OracleRun(run, replica=k).summary()
        assert expected["num_trace_requests"] == routed[k]
        row["rejected_by_reason"] = json.loads(row["rejected_by_reason"])
        names = [n for n in SUMMARY_ORACLE if n not in CLUSTER_ONLY]
        assert_same(row, expected, names + ["rejected_by_reason"], f"replica {k}.")
        assert row["load_ratio"] == pytest.approx(routed[k] / (sum(routed) / 2), rel=1e-12)
        assert not set(CLUSTER_ONLY) & set(row)


def test_replica_counts_add_up_to_the_cluster(run):
    summary = run.summary.to_pylist()[0]
    rows = run.replicas.to_pylist()
    for name in ("num_requests", "completed", "rejected", "unfinished", "total_input_tokens", "total_output_tokens",
                 "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "recomputed_tokens",
                 "num_evictions", "num_steps", "prefill_tokens", "decode_tokens"):
        assert sum(row[name] for row in rows) == summary[name], name
    assert sum(row["busy_time_s"] for row in rows) == pytest.approx(summary["busy_time_s"], rel=1e-12)
