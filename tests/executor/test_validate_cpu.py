"""``kvtwin validate`` end to end on a CPU: the scaled model through the torch reference.

Checks 1 (prefix hits are real) and 2 (predicted hits are executed) pass on every layout
the executor runs — full attention, sliding window, chunked local, MLA (a latent cache
read as full attention), Mamba-2 with prefill checkpoints, Mamba-1 without, and the
five-group sliding + full + Mamba layout — under asynchronous and synchronous scheduling,
on workloads whose prefix hits, evictions and preemptions are asserted to have happened
(a pass on a run that never reused, evicted or resumed anything would prove little).
Check 3 (memory) is skipped on a CPU; check 4 (step latency) is informational and writes
a calibration that ``read_calibration`` reads.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtwin.executor.shapes import MIXER_LATENT, MIXER_STATE
from kvtwin.executor.validate import CHECKS, VALIDATION_COLUMNS, ValidateOptions
from kvtwin.sim.calibration.file import read_calibration
from kvtwin.sim.calibration.efficiency import SCALAR_EFFICIENCY_FIELDS, Efficiency
from kvtwin.sim.replay.run import run_replay
from tests.executor.toys import scenario, validate_with_runs

CHECKS_1_2 = ValidateOptions(checks=("prefix_hits_are_real", "predicted_hits_are_executed"))

# kind -> the plan's group kinds, in group order
LAYOUTS = {
    "full": ["full_attention"],
    "swa": ["sliding_window"] * 3 + ["full_attention"],
    "chunked": ["chunked_local"] * 3 + ["full_attention"],
    "mla": ["mla"],
    "mamba2": ["mamba"] * 3 + ["full_attention"],
    "mamba1": ["mamba"] * 3 + ["full_attention"],
    "three": ["sliding_window", "sliding_window", "full_attention", "full_attention", "mamba"],
}

CASES = [("full", True), ("swa", True), ("chunked", True), ("mla", True), ("mamba2", True), ("mamba1", True),
         ("three", True), ("swa", False), ("mla", False), ("mamba2", False), ("mamba1", False), ("three", False)]


def _summary(run) -> dict:
    return run.result.summary.to_pylist()[0]


@pytest.mark.parametrize("kind, async_scheduling", CASES,
                         ids=[f"{k}-{'async' if a else 'sync'}" for k, a in CASES])
def test_checks_1_and_2_pass(kind, async_scheduling, tmp_path):
    resolved = scenario(kind, tmp_path, async_scheduling=async_scheduling)
    config = resolved.plan().require_fits()
    assert [g.spec.kind for g in config.groups] == LAYOUTS[kind]
    assert resolved.plan().engine.async_scheduling is async_scheduling
    state_specs = [g.spec for g in config.groups if g.spec.kind == "mamba"]
    if kind in ("mamba2", "three"):
        assert {(s.mamba_cache_mode, s.num_prefill_checkpoint_blocks) for s in state_specs} == {("align", 1)}
    if kind == "mamba1":
        assert {(s.mamba_cache_mode, s.num_prefill_checkpoint_blocks) for s in state_specs} == {("align", 0)}

    validation, runs = validate_with_runs(resolved, CHECKS_1_2)

    assert [(v.check, v.status) for v in validation.verdicts] == [
        ("prefix_hits_are_real", "pass"), ("predicted_hits_are_executed", "pass")], validation.verdicts
    on, off = runs["on"], runs["off"]
    assert on.kernels.name == "torch" and on.shape.scaled
    mixers = {layer.mixer for layer in on.shape.layers}
    assert (MIXER_STATE in mixers) == ("mamba" in LAYOUTS[kind])
    assert (MIXER_LATENT in mixers) == (kind == "mla")
    # The run under test reused, evicted and resumed; the reference recomputed everything.
    summary = _summary(on)
    assert summary["prefix_cache_hits"] > 0
    assert summary["num_evictions"] > 0
    assert summary["num_preemptions"] > 0
    assert _summary(off)["prefix_cache_hits"] == 0
    assert on.state.faults_fired == []

    num_requests = resolved.workload.load().num_rows
    rows = [r for r in validation.rows if r["check"] == "prefix_hits_are_real"]
    # Every request ran in both runs and was compared at every generated position.
    assert sorted(r["item"] for r in rows) == sorted(on.result.requests.column("request_id").to_pylist())
    assert len(rows) == num_requests and all(r["passed"] is True for r in rows), rows
    hits = {r["item"]: r for r in validation.rows
            if r["check"] == "predicted_hits_are_executed" and r["metric"] == "prefix_cache_hits"}
    assert len(hits) == num_requests and all(r["passed"] is True for r in hits.values())
    assert sum(r["observed"] for r in hits.values()) == summary["prefix_cache_hits"]
    preemptions = next(r for r in validation.rows if r["metric"] == "num_preemptions")
    assert preemptions["passed"] is True
    assert preemptions["observed"] == preemptions["expected"] == summary["num_preemptions"]


def test_all_four_checks_on_cpu_rows_and_calibration(tmp_path):
    resolved = scenario("full", tmp_path, async_scheduling=False)
    validation, _ = validate_with_runs(resolved, ValidateOptions())

    assert [(v.check, v.status) for v in validation.verdicts] == [
        ("prefix_hits_are_real", "pass"), ("predicted_hits_are_executed", "pass"), ("memory", "skipped"),
        ("step_latency", "info")], validation.verdicts

    # validation.parquet: the documented columns and types, every check present.
    table = validation.table()
    assert table.schema == pa.schema(list(VALIDATION_COLUMNS.items()))
    pq.write_table(table, tmp_path / "validation.parquet")
    back = pq.read_table(tmp_path / "validation.parquet")
    assert back.schema.names == list(VALIDATION_COLUMNS) and back.num_rows == len(validation.rows) > 0
    assert set(back.column("check").to_pylist()) == set(CHECKS)
    latency = [r for r in validation.rows if r["check"] == "step_latency"]
    assert latency and all(r["passed"] is None for r in latency)  # no goal on a CPU
    assert {r["metric"] for r in latency if r["item"] == "held_out"} == {
        "ttft_s_median_ape", "tpot_s_median_ape", "e2el_s_median_ape"}

    # calibration.toml: what read_calibration reads is the fit the rows report.
    assert validation.calibration_toml
    path = tmp_path / "calibration.toml"
    path.write_text(validation.calibration_toml)
    loaded = read_calibration(path).efficiency
    fitted = {r["metric"]: r["observed"] for r in latency if r["item"] == "calibration"}
    assert fitted.keys() == set(SCALAR_EFFICIENCY_FIELDS)
    assert {name: getattr(loaded, name) for name in fitted} == pytest.approx(fitted, rel=1e-12)
    assert loaded != Efficiency()  # something was fitted
    # ... and a replay runs with it.
    replayed = run_replay(resolved.plan(), resolved.workload.load(), deployment=resolved.deployment, efficiency=loaded)
    assert replayed.requests.num_rows == resolved.workload.load().num_rows
