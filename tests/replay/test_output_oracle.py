"""requests.parquet, steps.parquet and summary.parquet, computed a second time.

Tiny replays (``output_oracle.replay``: a handful of requests on a 4-token-block engine,
a known executor) in the configurations where a figure is easy to get wrong — prefix hits,
a rejection, a one-token output (TPOT undefined), a prompt whose last chunk is one token,
preemption with a re-admission that carries outputs, a run cut by a time limit, with
asynchronous scheduling on and off — and every column recomputed from the log of what the
recorder was handed (``output_oracle.OracleRun``): token times from the batches that
sampled, TPOT as (last − first) / (generated − 1), queries as the request's length at
each admitting lookup (vLLM's ``PrefixCacheStats``), percentiles by interpolation between
order statistics, time-weighted KV usage from step durations, the SLO rule of SCHEMA.md.
A last test walks SCHEMA.md's column lists so that a new column without an oracle fails.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from tests.replay.output_oracle import OracleRun, TraceRequest, assert_same, replay

SCHEMA = Path(__file__).parents[2] / "reports" / "SCHEMA.md"


def _prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _mixed_trace() -> list[TraceRequest]:
    """Prefix sharing, a one-token output, prompts of 17 (chunks of 16 then 1 under a
    budget of 16), a rejection (longer than max_model_len), arrivals spread out."""
    shared = _prompt(0, 12)
    return [
        TraceRequest("r0", 0.000, shared + _prompt(500, 5), 6),  # 16 + a one-token chunk
        TraceRequest("r1", 0.004, shared + _prompt(600, 3), 1),  # one output token: no TPOT
        TraceRequest("r2", 0.030, _prompt(1000, 17), 4),
        TraceRequest("r3", 0.031, _prompt(2000, 120), 4),  # rejected: over max_model_len
        TraceRequest("r4", 0.090, shared + _prompt(700, 9), 5),
    ]


def _pressure_trace() -> list[TraceRequest]:
    """Three long-running requests with a shared prefix in a pool too small for all of
    them: preemptions, and a re-admission whose lookup includes the outputs it had
    generated and hits again."""
    shared = _prompt(0, 8)
    return [TraceRequest(f"r{i}", 0.002 * i, shared + _prompt(1000 * (i + 1), 6), 14) for i in range(3)]


CLIENT_OVERHEAD_S = 0.045
CONFIGS = {
    "mixed-async": dict(trace=_mixed_trace, async_scheduling=True, max_num_batched_tokens=16),
    "mixed-sync": dict(trace=_mixed_trace, async_scheduling=False, max_num_batched_tokens=16),
    # Time outside the engine that takes some requests past the SLO's TTFT as a client sees it.
    "mixed-client": dict(trace=_mixed_trace, async_scheduling=True, max_num_batched_tokens=16,
                         client_overhead_s=CLIENT_OVERHEAD_S),
    "pressure-async": dict(trace=_pressure_trace, async_scheduling=True, num_blocks=14),
    "pressure-sync": dict(trace=_pressure_trace, async_scheduling=False, num_blocks=14),
    "time-limit": dict(trace=_mixed_trace, async_scheduling=True, max_num_batched_tokens=16, time_limit_s=0.08),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request):
    config = dict(CONFIGS[request.param])
    trace = config.pop("trace")()
    return replay(trace, **config), request.param


REQUEST_ORACLE = ("request_id", "session_id", "status", "reject_reason", "arrival_time_s", "first_scheduled_time_s",
                  "first_token_time_s", "finish_time_s", "prompt_tokens", "output_tokens", "generated_tokens",
                  "prefix_hit_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                  "scheduled_tokens", "recomputed_tokens", "ttft_s", "tpot_s", "e2el_s", "replica",
                  "ttft_client_s", "e2el_client_s")
STEP_ORACLE = ("step", "time_s", "duration_s", "num_running", "num_waiting", "num_scheduled_reqs", "prefill_tokens",
               "decode_tokens", "num_admitted", "num_preempted", "num_finished", "num_free_blocks",
               "num_cached_blocks", "kv_cache_usage", "kv_cache_usage_by_group", "num_evictions", "compute_s",
               "memory_s", "communication_s", "overhead_s", "replica")
SUMMARY_ORACLE = (
    "duration_s", "num_requests", "completed", "rejected", "unfinished", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el", "queue_delay") for s in ("mean", "median", "p90", "p99")),
    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "num_preemptions", "recomputed_tokens",
    "num_evictions", "num_steps", "prefill_tokens", "decode_tokens", "busy_time_s", "kv_cache_usage_peak",
    "kv_cache_usage_mean", "slo_ttft_ms", "slo_tpot_ms", "slo_attainment", "rejected_share", "request_goodput",
    "last_arrival_s", "num_trace_requests", "not_arrived", "prefix_reuse_upper_bound", "saturated", "saturation_reason", "num_replicas",
    "sustained", "sustained_reason", "steady_window_s", "steady_arrival_rate", "steady_completion_rate",
    "steady_queue_growth", "drain_s", "steady_median_service_s",
    "router", "load_imbalance")

# Cluster summary only: the replica rows judge the SLO the same way but carry no client columns.
CLIENT_SUMMARY = ("client_overhead_ms",
                  *(f"{s}_{m}_client_ms" for m in ("ttft", "e2el") for s in ("mean", "median", "p90", "p99")))


def test_the_replays_exercise_what_they_are_meant_to(run):
    """Preconditions: without them a comparison below could pass vacuously."""
    result, name = run
    oracle = OracleRun(result)
    rows = {r["request_id"]: r for r in oracle.request_rows}
    if name == "mixed-client":
        # The overhead decides: a request within the TTFT bound server-side misses it as a client.
        slo_s = result.slo.ttft_s
        assert any(r["ttft_s"] <= slo_s < r["ttft_client_s"] for r in oracle.request_rows)
    if name.startswith("mixed"):
        assert rows["r3"]["status"] == "rejected" and rows["r1"]["generated_tokens"] == 1
        assert any(r["prefix_hit_tokens"] > 0 for r in oracle.request_rows)
        # r0's prompt of 17 ends in a one-token chunk (16 + 1), which is prefill, not a decode.
        assert any(rid == "r0" and n == 1 and c == 16 for b in result.batches
                   for (rid, n), c in zip(b.num_scheduled.items(), b.num_computed))
        assert all(r["status"] in ("finished", "rejected") for r in oracle.request_rows)
    elif name.startswith("pressure"):
        assert sum(r["num_preemptions"] for r in oracle.request_rows) > 0
        # A re-admission's lookup covers the outputs generated before its preemption.
        assert any(len(lengths) > 1 and lengths[1] > lengths[0] for lengths in result.admitted_lengths.values())
        assert any(r["recomputed_tokens"] > 0 for r in oracle.request_rows)
        # A request hit at its first admission and again at its re-admission.
        assert any(0 < r["prefix_hit_tokens"] < r["prefix_cache_hits"] for r in oracle.request_rows)
    else:
        assert {"waiting", "running"} & {r["status"] for r in oracle.request_rows}
        assert len(oracle.request_rows) < len(result.trace)  # a request never arrived
    assert 0 < oracle.reuse_upper_bound() < 1 or name.startswith("pressure")


def test_every_request_column_is_recomputed(run):
    result, _ = run
    actual = result.requests.to_pylist()
    expected = OracleRun(result).request_rows
    assert [a["request_id"] for a in actual] == [e["request_id"] for e in expected]
    for a, e in zip(actual, expected):
        assert_same(a, e, REQUEST_ORACLE, f"{e['request_id']}.")


def test_every_step_column_is_recomputed(run):
    result, _ = run
    actual = result.steps.to_pylist()
    expected = OracleRun(result).step_rows
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_same(a, e, STEP_ORACLE, f"step {e['step']}.")


def test_every_summary_column_is_recomputed(run):
    result, _ = run
    actual = result.summary.to_pylist()[0]
    expected = OracleRun(result).summary()
    actual["rejected_by_reason"] = json.loads(actual["rejected_by_reason"])
    assert_same(actual, expected, SUMMARY_ORACLE + CLIENT_SUMMARY + ("rejected_by_reason",))


def test_itl_gaps_are_the_gaps_between_a_requests_tokens(run):
    """The ITL list itself (the summary only shows its percentiles)."""
    result, _ = run
    assert sorted(result.itl_s.tolist()) == pytest.approx(sorted(OracleRun(result).itl_s().tolist()), rel=1e-12)


def test_the_one_replica_row_is_the_summary(run):
    result, _ = run
    row = result.replicas.to_pylist()[0]
    # The replica's share: every request that arrived (those a time limit cut off are not its).
    summary = OracleRun(result, replica=0).summary()
    assert result.replicas.num_rows == 1 and row["replica"] == 0
    row["rejected_by_reason"] = json.loads(row["rejected_by_reason"])
    names = [n for n in SUMMARY_ORACLE if n not in ("num_replicas", "router", "load_imbalance")]
    assert_same(row, summary, names + ["rejected_by_reason"])
    expected_ratio = 1.0
    assert row["load_ratio"] == expected_ratio
    assert not {"num_replicas", "router", "load_imbalance"} & set(row)


def test_time_weighted_kv_usage_differs_from_the_per_step_mean():
    """The mean usage weights each step by its duration: the replay's steps last different
    times, so a plain mean over steps would read differently."""
    result = replay(_pressure_trace(), num_blocks=14)
    steps = result.steps
    usage = np.array(steps.column("kv_cache_usage").to_pylist())
    durations = np.array(steps.column("duration_s").to_pylist())
    weighted = float((usage * durations).sum() / durations.sum())
    assert abs(weighted - usage.mean()) > 1e-6
    assert result.summary.column("kv_cache_usage_mean")[0].as_py() == pytest.approx(weighted, rel=1e-12)


def test_a_single_token_request_meets_an_slo_on_its_ttft_alone():
    """One output token: TPOT is undefined (NaN) and only the TTFT bound applies."""
    result = replay([TraceRequest("r0", 0.0, _prompt(0, 8), 1)], async_scheduling=False)
    row = result.requests.to_pylist()[0]
    assert row["generated_tokens"] == 1 and math.isnan(row["tpot_s"])
    summary = result.summary.to_pylist()[0]
    assert row["ttft_s"] <= result.slo.ttft_s
    assert summary["slo_attainment"] == 1.0 and summary["request_goodput"] == pytest.approx(1 / result.end_s)


# -- every documented column has an oracle ---------------------------------------------------

# Columns documented for these tables that the tests above do not recompute, and why.
EXEMPT = {
    "prefix_cache_retention",  # the engine's setting echoed as a string (tests/replay/test_retention_cli.py)
    "reject_detail",  # the refusal in words (tests/replay/test_replay.py checks the numbers in it)
    # The calibration band: tests/replay/test_clock_band.py and the calibration tests.
    "calibration", "calibration_note", "error_ttft", "error_tpot", "error_itl", "error_e2el",
    *(f"p99_{m}_ms_{side}" for m in ("ttft", "tpot", "itl", "e2el") for side in ("low", "high")),
    # A data-parallel group's steps, waves and dummy batches: tests/replay/test_dp_lockstep.py
    # recounts them from the group's step rows and works them out by hand.
    "dp_group_steps", "dp_waves", "dummy_steps",
    # A DP MoE group's collective seconds: tests/replay/test_moe_group_cost.py prices them by
    # hand and checks the replay's step rows and share carry them, and which table priced
    # them (moe_communication_pricing).
    "moe_communication_s", "moe_communication_share", "moe_communication_pricing",
}
CLIENT_ORACLE = {"ttft_client_s", "e2el_client_s", "client_overhead_ms",
                 *(f"{s}_{m}_client_ms" for m in ("ttft", "e2el") for s in ("mean", "median", "p90", "p99"))}
SPEC_ORACLE = {"draft_tokens", "accepted_draft_tokens", "verify_steps", "spec_accepted_by_position",
               "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate", "mean_acceptance_length",
               "spec_acceptance_by_position"}
REPLICA_ORACLE = {"replica", "load_ratio"}
# The offload and P/D columns have oracles of their own (tests/replay/test_offload.py, test_pd.py).
OTHER_SECTIONS = ("With offload tiers", "With disaggregated prefill/decode")


def _documented_columns(section: str) -> set[str]:
    """Backquoted names in the first cell of the section's tables, skipping the offload
    and P/D tables (their own tests) and the tables' header rows."""
    text = SCHEMA.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    skipping = False
    previous = ""
    for line in body.splitlines():
        if not line.startswith("|"):
            # A paragraph's first line says whose table follows.
            if line.strip() and (not previous.strip() or previous.startswith("|")):
                skipping = line.startswith(OTHER_SECTIONS)
            previous = line
            continue
        previous = line
        if skipping:
            continue
        first = line.split("|")[1]
        names.update(re.findall(r"`([a-z0-9_]+)`", first))
    return names


@pytest.mark.parametrize("section", ["requests.parquet", "steps.parquet", "summary.parquet"])
def test_every_documented_column_has_an_oracle(section):
    documented = _documented_columns(section)
    assert len(documented) > 15  # the parse found the tables
    checked = (set(REQUEST_ORACLE) | set(STEP_ORACLE) | set(SUMMARY_ORACLE) | {"rejected_by_reason"}
               | CLIENT_ORACLE | SPEC_ORACLE | EXEMPT)
    assert documented - checked == set()

