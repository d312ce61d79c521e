"""bench/bench_convergence.py's check: a limited search's answer over the whole trace's
x (1 + tolerance) is flagged, one within it passes, refusals are not answers, and what cannot
be judged fails ``--check`` rather than passing it; and the script runs end to end."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_convergence.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_convergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _row(scenario, limit, rate, slow=None, status="ok", error=None):
    return {"scenario": scenario, "limit": limit, "status": status, "error": error,
            "max_request_rate": rate, "max_request_rate_pessimistic": slow}


def test_a_clean_set_passes(bench):
    rows = [_row("a", None, 10.0, 8.0), _row("a", 100, None), _row("a", 200, 10.4, 8.3), _row("a", 400, 9.0, 7.0)]
    verdicts = bench.convergence(rows, 0.05)
    # Limit 100 refused: no verdict. 200 and 400, central and slow edge each.
    assert [(v["limit"], v["column"], v["holds"]) for v in verdicts] == [
        (200, "max_request_rate", True), (200, "max_request_rate_pessimistic", True),
        (400, "max_request_rate", True), (400, "max_request_rate_pessimistic", True)]
    assert verdicts[0]["bound"] == pytest.approx(10.5)
    assert verdicts[1]["bound"] == pytest.approx(8.4)
    assert bench.check_failures(rows, verdicts) == []


def test_an_answer_over_the_bound_is_flagged(bench):
    rows = [_row("a", None, 10.0, 8.0), _row("a", 200, 10.6, 8.0), _row("a", 400, 10.2, 8.5)]
    verdicts = bench.convergence(rows, 0.05)
    held = {(v["limit"], v["column"]): v["holds"] for v in verdicts}
    assert held == {(200, "max_request_rate"): False, (200, "max_request_rate_pessimistic"): True,
                    (400, "max_request_rate"): True, (400, "max_request_rate_pessimistic"): False}
    failures = bench.check_failures(rows, verdicts)
    assert len(failures) == 2
    # 10.6 / 10 - 1 = +6.0%; 8.5 / 8 - 1 = +6.2% (6.25 rounds to even).
    assert "--limit 200 max_request_rate = 10.6" in failures[0] and "+6.0%" in failures[0]
    assert "--limit 400 max_request_rate_pessimistic = 8.5" in failures[1] and "+6.2%" in failures[1]


def test_the_tolerance_decides(bench):
    rows = [_row("a", None, 10.0), _row("a", 200, 10.6)]
    assert [v["holds"] for v in bench.convergence(rows, 0.05)] == [False]
    assert [v["holds"] for v in bench.convergence(rows, 0.1)] == [True]


def test_each_scenario_is_held_to_its_own_whole_trace(bench):
    rows = [_row("a", None, 10.0), _row("b", None, 30.0), _row("a", 200, 20.0), _row("b", 200, 20.0)]
    held = {v["scenario"]: v["holds"] for v in bench.convergence(rows, 0.05)}
    assert held == {"a": False, "b": True}


def test_what_cannot_be_judged_fails_the_check(bench):
    rows = [_row("a", None, None), _row("a", 200, 10.0),           # the whole trace found no rate
            _row("b", None, None, status="failed", error="boom"), _row("b", 200, 10.0),
            _row("c", 200, 10.0),                                   # no whole-trace search
            _row("d", None, 10.0), _row("d", 400, None, status="failed", error="bad")]
    verdicts = bench.convergence(rows, 0.05)
    assert {(v["scenario"], v["holds"]) for v in verdicts} == {("a", None), ("b", None), ("c", None)}
    failures = bench.check_failures(rows, verdicts)
    assert len(failures) == 5  # two failed searches, three answers not judged
    assert any("b whole trace: the search failed: boom" in line for line in failures)
    assert any("d --limit 400: the search failed: bad" in line for line in failures)
    assert any(line.startswith("c --limit 200") and "no whole-trace search" in line for line in failures)


def test_bad_flags_exit_2(bench, capsys):
    for argv in (["--limits", "100,x"], ["--tolerance", "1.5"], ["--jobs", "0"], ["--check", "--no-whole"]):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2
    assert "needs the whole-trace answers to check against; drop --no-whole" in capsys.readouterr().err


def test_a_smoke_run_writes_its_rows(bench, tmp_path, capsys):
    """Two short searches of the Azure trace (about a second each): the window of 100 or 150
    requests at scale 1 is too short to judge, so each is a refusal, never a rate."""
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "convergence.parquet"
    assert bench.main(["--scenarios", "azure-conv-llama8b", "--limits", "100,150", "--no-whole", "--jobs", "1",
                       "--out", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [(r["scenario"], r["limit"]) for r in rows] == [("azure-conv-llama8b", 100), ("azure-conv-llama8b", 150)]
    assert all(r["max_request_rate"] is None and r["rate_search_refusal"].startswith("no rate judged to hold")
               for r in rows)
    assert all(r["replays"] >= 1 and r["tolerance"] == 0.05 for r in rows)
    printed = capsys.readouterr()
    assert "--limit 150: no rate judged to hold" in printed.out
    assert "2 rate searches on 1 jobs" in printed.err
