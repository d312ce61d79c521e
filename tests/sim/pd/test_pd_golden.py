"""The P/D golden cases (``tests/golden/pd``, made by ``scripts/oracle/gen_pd_golden.py``
driving vLLM 0.33's real scheduler with the NIXL connector's real scheduler half) run
through ``kvtwin lockstep`` like every other golden case: the twin's prefill and decode
engines, stepped in the same ticks with the same scripted model and worker, must match
every tick's record exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.pd_connector import PDConnector
from kvtwin.sim.lockstep.golden import PDCase, compare_results, expected_results, load_case, read_jsonl
from kvtwin.sim.lockstep.runner import run_case
from tests.cli_run import one_error_line, run as run_cli

CASES = sorted((Path(__file__).resolve().parents[2] / "golden" / "pd").glob("*.json"))


def _raw(stem: str) -> dict:
    return json.loads(next(c for c in CASES if c.stem == stem).read_text())


def _write(tmp_path: Path, stem: str, raw: dict) -> Path:
    path = tmp_path / f"{stem}.json"
    path.write_text(json.dumps(raw))
    return path


def test_cases_exist():
    assert len(CASES) >= 7
    assert sum(json.loads(c.read_text())["config"].get("async_scheduling", False) for c in CASES) >= 2


@pytest.mark.parametrize("path", CASES, ids=[c.stem for c in CASES])
def test_pd_golden_case_matches_vllm_exactly(path):
    case = load_case(path)
    assert isinstance(case, PDCase)
    result = run_case(case)
    assert compare_results(*expected_results(path, case), result.requests, result.steps, limit=0) == []
    # The comparison itself: the ticks equal vLLM's, record for record.
    assert result.steps == json.loads(path.read_text())["expected_ticks"]


@pytest.mark.parametrize("path", CASES, ids=[c.stem for c in CASES])
def test_lockstep_command_runs_the_pd_case_and_reports_match(tmp_path, path):
    res = run_cli("lockstep", path, "--out", tmp_path)
    assert res.exit_code == 0, res.output
    assert f"MATCH: every tick equals {path.name}'s expected results" in res.output
    assert read_jsonl(tmp_path / "actual_ticks.jsonl") == json.loads(path.read_text())["expected_ticks"]


def _first_read(ticks: list[dict]) -> tuple[int, int]:
    """(tick index, read index) of the first decode read of at least one block."""
    return next((t, i) for t, tick in enumerate(ticks) if tick["decode"]
                for i, (_, blocks) in enumerate(tick["decode"]["reads"]) if sum(blocks))


def test_a_corrupted_pd_case_fails_with_the_divergence_named(tmp_path):
    """An expected block count changed in the file: the command exits 1 and names the tick,
    the engine and the field, with the file's (wrong) value and the run's."""
    raw = _raw("pd_hybrid_swa")
    t, i = _first_read(raw["expected_ticks"])
    tick = raw["expected_ticks"][t]
    true_read = list(tick["decode"]["reads"])
    tick["decode"]["reads"][i] = [true_read[i][0], [n + 1 for n in true_read[i][1]]]
    res = run_cli("lockstep", _write(tmp_path, "pd_hybrid_swa", raw), "--out", tmp_path / "out")
    assert res.exit_code == 1, res.output
    assert "MISMATCH: 1 differences" in res.output
    assert f"tick {tick['tick']}: decode.reads expected {tick['decode']['reads']!r}, got {true_read!r}" in res.output


def test_a_changed_block_id_is_the_first_divergence(tmp_path):
    """A block id in a decode block table changed at one tick and a free-block count at a
    later one: the earliest is listed first."""
    raw = _raw("pd_full_basic")
    ticks = raw["expected_ticks"]
    t = next(t for t, tick in enumerate(ticks) if tick["decode"] and tick["decode"]["tables"])
    rid = sorted(ticks[t]["decode"]["tables"])[0]
    ticks[t]["decode"]["tables"][rid][0][0] += 1000
    ticks[t + 2]["prefill"]["free_blocks"] += 1
    res = run_cli("lockstep", _write(tmp_path, "pd_full_basic", raw), "--out", tmp_path / "out")
    assert res.exit_code == 1, res.output
    lines = [line.strip() for line in res.output.splitlines()]
    first = lines[lines.index(next(l for l in lines if l.startswith("MISMATCH"))) + 1]
    assert first.startswith(f"tick {ticks[t]['tick']}: decode.tables expected ")
    assert f"tick {ticks[t + 2]['tick']}: prefill.free_blocks expected {ticks[t + 2]['prefill']['free_blocks']}" \
        in res.output


def test_a_missing_tick_is_a_difference(tmp_path):
    raw = _raw("pd_full_basic")
    del raw["expected_ticks"][-1]
    n = len(raw["expected_ticks"])
    res = run_cli("lockstep", _write(tmp_path, "pd_full_basic", raw), "--out", tmp_path / "out")
    assert res.exit_code == 1, res.output
    assert f"ticks: expected {n}, got {n + 1}" in res.output


@pytest.mark.parametrize("where, key, field", [
    ("config", "read_steps", "config.read_steps"),
    ("config", "decode_num_blocks", "config.decode_num_blocks"),
    ("config", "kv_cache_groups", "config.kv_cache_groups"),
    ("top", "requests", "requests"),
    ("request", "arrival_tick", "requests[0].arrival_tick"),
    ("request", "output_token_ids", "requests[0].output_token_ids"),
])
def test_a_pd_case_missing_a_field_is_refused_in_one_line(tmp_path, where, key, field):
    raw = _raw("pd_full_basic")
    table = {"config": raw["config"], "top": raw, "request": raw["requests"][0]}[where]
    del table[key]
    res = run_cli("lockstep", _write(tmp_path, "pd_full_basic", raw), "--out", tmp_path / "out")
    one_error_line(res, f"{field}: expected")


@pytest.mark.parametrize("where, key", [("config", "read_step"), ("top", "expected_tick"),
                                        ("request", "priority")])
def test_an_unknown_pd_field_is_refused(tmp_path, where, key):
    raw = _raw("pd_full_basic")
    table = {"config": raw["config"], "top": raw, "request": raw["requests"][0]}[where]
    table[key] = 1
    res = run_cli("lockstep", _write(tmp_path, "pd_full_basic", raw), "--out", tmp_path / "out")
    one_error_line(res, key)


def test_mamba_case_needs_the_divergent_local_hit(monkeypatch):
    """vLLM's decode side of a hybrid Mamba model takes the full-attention group's local
    hit where the Mamba group's lags (NIXL brings the state). Without that capability the
    twin takes the hit every group agrees on: the same ticks up to the first such
    admission, which then reads more full-attention blocks than vLLM did."""
    path = next(c for c in CASES if "mamba" in c.stem)
    expected = json.loads(path.read_text())["expected_ticks"]
    # Only the decode side looks up remote hits: the prefill side is unaffected.
    monkeypatch.setattr(PDConnector, "supports_divergent_local_hybrid_hits", False)
    actual = run_case(load_case(path)).steps
    first = next(i for i, (a, e) in enumerate(zip(actual, expected)) if a != e)
    assert first == 5 and actual[:first] == expected[:first]
    ours, theirs = actual[first]["decode"]["reads"], expected[first]["decode"]["reads"]
    assert [r for r, _ in ours] == [r for r, _ in theirs]
    assert ours[0][1][0] > theirs[0][1][0]


@pytest.mark.parametrize("stem, field, blocks", [
    ("pd_hybrid_mamba_short_prompts", "decode_num_blocks", 2),
    ("pd_full_basic", "decode_num_blocks", 5),
    ("pd_async_full_tight_decode", "decode_num_blocks", 6),
    ("pd_full_basic", "prefill_num_blocks", 4),
])
def test_a_pool_too_small_for_one_request_is_refused_up_front(tmp_path, stem, field, blocks, monkeypatch):
    """A pool that cannot hold the case's longest request is refused before the first
    tick with one line naming it, as an engine whose pool cannot hold one request refuses
    to start (the harness used to queue the request, see it rejected, and tick on)."""
    raw = _raw(stem)
    raw["config"][field] = blocks
    path = _write(tmp_path, stem, raw)
    monkeypatch.setattr(EngineCore, "step", lambda *a: pytest.fail("stepped"))
    monkeypatch.setattr(EngineCore, "step_async", lambda *a: pytest.fail("stepped"))
    with pytest.raises(ConfigError) as err:
        run_case(load_case(path))
    assert err.value.field == f"config.{field}" and err.value.got == blocks - 1
    one_error_line(run_cli("lockstep", path, "--out", tmp_path / "out"),
                   f"{path}: config.{field}: expected a KV pool that holds")


def test_a_request_an_engine_rejects_is_refused(tmp_path):
    """A request the decode engine rejects (its prompt and output exceed max_model_len)
    refuses the case at once, naming it, instead of ticking to the limit waiting for it."""
    raw = _raw("pd_full_basic")
    longest = max(raw["requests"], key=lambda r: len(r["prompt_token_ids"]))
    raw["config"]["max_model_len"] = len(longest["prompt_token_ids"]) + 1
    res = run_cli("lockstep", _write(tmp_path, "pd_full_basic", raw), "--out", tmp_path / "out")
    one_error_line(res, f"requests.{longest['request_id']}: expected a request the decode engine can run",
                   "exceeds_max_model_len")
