"""The verdict after every replay (issue 37, 10a): one line saying whether the run met its
SLO and, if not, what binds, the bound exceeded by the largest factor first."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.reports.summary_text import slo_verdict

SCENARIOS = Path(__file__).parents[2] / "scenarios"
NAN = float("nan")
MET = {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0, "p99_ttft_ms": 1400.0, "p99_tpot_ms": 16.0,
       "slo_attainment": 0.995, "rejected_share": 0.0, "completed": 200, "rejected": 0, "unfinished": 0,
       "saturated": False}


def test_a_met_slo_names_both_bounds_and_the_share_within_them():
    assert slo_verdict(MET) == "SLO met: p99 TTFT 1.4 s ≤ 2.0 s, p99 TPOT 16 ms ≤ 100 ms (99.5 % of requests within both)"
    only_ttft = {**MET, "slo_tpot_ms": NAN}
    assert slo_verdict(only_ttft) == "SLO met: p99 TTFT 1.4 s ≤ 2.0 s (99.5 % of requests within it)"


def test_the_bound_exceeded_by_the_largest_factor_comes_first():
    ttft_binds = {**MET, "p99_ttft_ms": 2600.0, "slo_attainment": 0.9}
    assert slo_verdict(ttft_binds) == "SLO not met: p99 TTFT 2.6 s > 2.0 s (90.0 % of requests within both)"
    # TTFT 1.3x over, TPOT 2.5x over: TPOT binds hardest.
    both = {**ttft_binds, "p99_tpot_ms": 250.0}
    assert slo_verdict(both).startswith("SLO not met: p99 TPOT 250 ms > 100 ms, p99 TTFT 2.6 s > 2.0 s (")
    both = {**ttft_binds, "p99_ttft_ms": 60_000.0, "p99_tpot_ms": 250.0, "saturated": True}
    assert slo_verdict(both) == ("SLO not met: p99 TTFT 1.0 min > 2.0 s, p99 TPOT 250 ms > 100 ms (90.0 % of "
                                 "requests within both); the deployment is saturated")


def test_refused_and_unfinished_requests_are_misses():
    rejected = {**MET, "rejected": 1, "rejected_share": 0.02, "slo_attainment": 0.98}
    assert slo_verdict(rejected) == "SLO not met: 1 rejected (2.0 %) (98.0 % of requests within both)"
    cut = {**MET, "unfinished": 12, "slo_attainment": 0.5}
    assert slo_verdict(cut) == "SLO not met: 12 unfinished at the time limit (50.0 % of requests within both)"
    nothing = {**MET, "completed": 0, "unfinished": 3, "p99_ttft_ms": NAN, "p99_tpot_ms": NAN, "slo_attainment": 0.0}
    assert slo_verdict(nothing) == ("SLO not met: 3 unfinished at the time limit, no request completed (0.0 % of "
                                    "requests within both)")


def test_no_slo():
    assert slo_verdict({**MET, "slo_ttft_ms": NAN, "slo_tpot_ms": NAN}) == "no SLO set"
    assert slo_verdict({**MET, "slo_ttft_ms": NAN, "slo_tpot_ms": NAN, "saturated": True}) == \
        "no SLO set; the deployment is saturated"


def _verdict_of(row: dict) -> str:
    """The line recomputed from the summary's own figures, by this test's reading of the rule."""
    over = sorted(((row[f"p99_{k}_ms"] / row[f"slo_{k}_ms"], name) for name, k in (("TTFT", "ttft"), ("TPOT", "tpot"))
                   if row[f"p99_{k}_ms"] > row[f"slo_{k}_ms"]), reverse=True)
    return "SLO met" if not over and not row["rejected"] and not row["unfinished"] else \
        f"SLO not met: p99 {over[0][1]}" if over else "SLO not met"


def test_every_replay_ends_with_its_verdict(tmp_path):
    for name, args in (("default", ("--limit", "100")),
                       ("overload", (str(SCENARIOS / "mooncake-llama8b-h100-overload.toml"), "--limit", "400"))):
        out = tmp_path / name
        result = CliRunner().invoke(app, ["replay", *args, "--quiet", "--no-report", "--out", str(out)])
        assert result.exit_code == 0, result.output
        row = pq.read_table(out / "summary.parquet").to_pylist()[0]
        last = result.stdout.rstrip("\n").splitlines()[-1]
        assert last.startswith(_verdict_of(row)), (name, last)
        assert f"({row['slo_attainment'] * 100:.1f} % of requests within both)" in last
        assert last.endswith("; the deployment is saturated") == row["saturated"]
        assert not math.isnan(row["slo_ttft_ms"])
    assert row["saturated"] and last.startswith("SLO not met: p99 TTFT")


def test_the_verdict_judges_and_names_the_clients_ttft():
    """The TTFT bound is judged on the client's p99, with the server's beside it
    (docs/capacity.md#client-side-latency): here the server's passes and the client's fails."""
    row = {**MET, "p99_ttft_ms": 1995.0, "p99_ttft_client_ms": 2003.0, "client_overhead_ms": 8.0}
    assert slo_verdict(row) == ("SLO not met: p99 TTFT 2.0 s > 2.0 s as a client sees it (server 2.0 s, +8.0 ms "
                                "outside the engine) (99.5 % of requests within both)")
    row = {**MET, "p99_ttft_ms": 1392.0, "p99_ttft_client_ms": 1400.0, "client_overhead_ms": 8.0}
    assert slo_verdict(row) == ("SLO met: p99 TTFT 1.4 s ≤ 2.0 s as a client sees it (server 1.4 s, +8.0 ms outside "
                                "the engine), p99 TPOT 16 ms ≤ 100 ms (99.5 % of requests within both)")
    none = {**MET, "p99_ttft_client_ms": MET["p99_ttft_ms"], "client_overhead_ms": 0.0}
    assert "as a client sees it (server 1.4 s, no time outside the engine)" in slo_verdict(none)
