"""Check 1 catches a broken executor and names the block that broke it.

Each test-only fault (``device_executor.Faults``) breaks one rule the way a buggy executor or pool
would: ``corrupt_table`` puts a wrong block in a prefix hit's table, ``stale_block`` hands
out a block without rewriting it, ``drop_state_copy`` skips a recurrent-state copy. Check 1
must fail, and its verdict line and the faulted request's row must name (from the block
audit) the request, group and block the fault really broke, as ``faults_fired`` records
them: the wrong block put at the table position, the block left stale, the destination
of the dropped copy. Without the fault the same scenarios pass (the control).
"""

from __future__ import annotations

import re

import pytest
import torch

from kvtwin.executor.device_executor import Faults
from kvtwin.executor.device_replay import ExecutorOptions, run_executor
from kvtwin.executor.validate import LOGIT_TOLERANCE, ValidateOptions
from tests.executor.toys import scenario, validate_with_runs

RID = r"(?P<request>[^,\s]+)"
FIRED = {
    "corrupt_table": re.compile(rf"corrupt_table: {RID}, group (?P<group>\d+), position (?P<position>\d+): "
                                r"block (?P<good>\d+) -> (?P<block>\d+)$"),
    "stale_block": re.compile(rf"stale_block: {RID}, group (?P<group>\d+), block (?P<block>\d+) "
                              r"\(table position (?P<position>\d+)\)"),
    "drop_state_copy": re.compile(rf"drop_state_copy: the state copy of {RID}, group (?P<group>\d+), "
                                  r"block (?P<src>\d+) -> (?P<block>\d+), was skipped"),
}
AUDIT = re.compile(rf"block audit: step (?P<step>\d+), request {RID}, group (?P<group>\d+), block (?P<block>\d+) "
                   r"\(table position (?P<position>\d+)\)")

CASES = [("corrupt_table", "swa"), ("stale_block", "swa"),
         ("stale_block", "three"), ("drop_state_copy", "mamba2"), ("drop_state_copy", "mamba1")]


def _check_1(kind, tmp_path, faults: Faults):
    options = ValidateOptions(executor=ExecutorOptions(faults=faults), checks=("prefix_hits_are_real",))
    validation, runs = validate_with_runs(scenario(kind, tmp_path), options)
    [verdict] = validation.verdicts
    return verdict, validation.rows, runs


def _named(match: re.Match) -> tuple[str, int, int]:
    return match["request"], int(match["group"]), int(match["block"])


@pytest.mark.parametrize("fault, kind", CASES)
def test_fault_fails_check_1_naming_the_broken_block(fault, kind, tmp_path):
    verdict, rows, runs = _check_1(kind, tmp_path, Faults(**{fault: True}))

    fired = runs["on"].state.faults_fired
    assert len(fired) == 1, fired
    want = FIRED[fault].match(fired[0])
    assert want, fired[0]
    if fault == "corrupt_table":
        assert want["block"] != want["good"]
    assert runs["off"].state.faults_fired == []  # the reference runs unbroken

    assert verdict.status == "fail", verdict.line
    assert f"first: request {want['request']}," in verdict.line
    named = AUDIT.search(verdict.line)
    assert named, verdict.line
    assert _named(named) == _named(want), (verdict.line, fired[0])
    if "position" in want.groupdict():
        assert named["position"] == want["position"]

    by_item = {r["item"]: r for r in rows}
    row = by_item[want["request"]]
    assert row["passed"] is False and row["observed"] > LOGIT_TOLERANCE[torch.float32]  # the CPU runs fp32
    in_row = AUDIT.search(row["detail"])
    assert in_row and _named(in_row) == _named(want), row["detail"]
    # The audit's first finding for that request is the same block, at the step it is read.
    finding = next(f for f in runs["on"].state.findings if f.request_id == want["request"])
    assert (finding.request_id, finding.group_id, finding.block_id) == _named(want)
    assert finding.step == int(named["step"])


@pytest.mark.parametrize("kind", ["swa", "three", "mamba2", "mamba1"])
def test_without_a_fault_the_same_scenario_passes(kind, tmp_path):
    verdict, rows, runs = _check_1(kind, tmp_path, Faults())
    assert verdict.status == "pass", verdict.line
    assert runs["on"].state.faults_fired == []
    assert rows and all(r["passed"] is True for r in rows)


@pytest.mark.parametrize("kind", ["full", "swa", "three", "mamba2", "mamba1"])
def test_a_clean_run_leaves_the_block_audit_empty(kind, tmp_path):
    """Every block a step reads holds the reader's prefix when nothing is broken."""
    resolved = scenario(kind, tmp_path)
    run = run_executor(resolved.plan(), resolved.workload.load())
    assert run.result.summary.column("prefix_cache_hits")[0].as_py() > 0
    assert [f.describe() for f in run.state.findings] == []
