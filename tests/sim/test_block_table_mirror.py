"""BLOCK-TABLE-MIRROR: the scheduler output alone lets an executor keep exact block tables.

Every golden case is stepped with a ``BlockTableMirror`` around the scripted model and the
mirror is compared with the KV cache manager after every step (the same run also matches
the golden records). The property tests in ``test_invariants.py`` do the same on random
layouts and workloads. The last tests corrupt one output and expect the mirror to notice,
so the check can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import FullAttentionSpec
from kvtwin.sim.lockstep.golden import GoldenCase, load_case, read_jsonl
from kvtwin.sim.lockstep.runner import ScriptedModel
from tests.sim.block_table_mirror import BlockTableMirror
from tests.sim.test_invariants import Scenario, run_scenario

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"
# Offload cases carry their own mirror test (tests/sim/offload/test_offload_golden.py): the
# invariant runner here steps engines without an offload tier.
CASES = sorted(p.name for p in CASES_DIR.iterdir()
               if (p / "config.json").exists() and '"kv_offload"' not in (p / "config.json").read_text())
def _replaces_in_place(case) -> bool:
    """Layouts whose tables change in place (windowed blocks nulled, Mamba states moved/released)."""
    return any(type(g.spec) is not FullAttentionSpec for g in case.kv_cache_config.groups)


@pytest.mark.parametrize("name", CASES)
def test_mirror_matches_the_manager_after_every_step_of_every_golden_case(name):
    case = load_case(CASES_DIR / name)
    scenario = Scenario(case.kv_cache_config, case.scheduler_config, case.cache_config, case.requests)
    result = run_scenario(scenario, check=False)
    assert result.steps == read_jsonl(CASES_DIR / name / "expected_steps.jsonl")
    mirror = result.mirror
    assert mirror.num_appends > 0
    assert (mirror.num_replacements > 0) == _replaces_in_place(case), mirror.num_replacements


# -- the check can fail -------------------------------------------------------------------------

class _Corrupting:
    """Passes each output to the mirror after ``corrupt`` had a go at it (once it returns True)."""

    def __init__(self, mirror: BlockTableMirror, corrupt: Callable[[SchedulerOutput], bool]):
        self.mirror = mirror
        self.corrupt = corrupt
        self.done = False

    def execute(self, output: SchedulerOutput) -> Execution:
        if not self.done:
            self.done = self.corrupt(output)
        return self.mirror.execute(output)


def _drive(case: GoldenCase, corrupt: Callable[[SchedulerOutput], bool]) -> bool:
    """Step the case with the mirror checked after every step; True if ``corrupt`` fired."""
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    mirror = BlockTableMirror(ScriptedModel({r.request_id: r.output_token_ids for r in case.requests}))
    executor = _Corrupting(mirror, corrupt)
    pending = list(case.requests)
    arrived = 0
    step = 0
    while True:
        while arrived < len(pending) and pending[arrived].arrival_step == step:
            spec = pending[arrived]
            engine.add_request(Request(spec.request_id, TokenPrompt(spec.prompt_token_ids),
                                       len(spec.output_token_ids), arrival_time=float(arrived),
                                       priority=spec.priority))
            arrived += 1
        result = engine.step(executor)
        mirror.check(engine, result)
        if arrived == len(pending) and not engine.has_unfinished_requests():
            return executor.done
        step += 1


def _drop_a_replacement(output: SchedulerOutput) -> bool:
    for changes in output.scheduled_cached_reqs.replaced_block_ids.values():
        if changes:
            del changes[0]
            return True
    return False


def _drop_an_append(output: SchedulerOutput) -> bool:
    for per_group in output.scheduled_cached_reqs.new_block_ids.values():
        for ids in per_group:
            if ids:
                ids.pop()
                return True
    return False


def _shift_a_new_table(output: SchedulerOutput) -> bool:
    for new in output.scheduled_new_reqs:
        table = new.blocks[0]  # the output's own snapshot: the manager's table is not touched
        if len(table) > 1:
            table[0], table[1] = table[1], table[0]
            return True
    return False


def _hide_a_preemption(output: SchedulerOutput) -> bool:
    if output.preempted:
        output.preempted.pop()
        return True
    return False


@pytest.mark.parametrize("name, corrupt", [
    ("swa128", _drop_a_replacement),
    ("chunked64", _drop_a_replacement),
    ("mamba_align", _drop_a_replacement),
    ("full_basic", _drop_an_append),
    ("mamba_align", _drop_an_append),
    ("multiturn", _shift_a_new_table),
    ("full_pressure", _hide_a_preemption),
])
def test_a_corrupted_output_makes_the_mirror_fail(name, corrupt):
    fired = []

    def once(output):
        hit = corrupt(output)
        fired.append(hit)
        return hit

    with pytest.raises(AssertionError, match="BLOCK-TABLE-MIRROR"):
        _drive(load_case(CASES_DIR / name), once)
    assert any(fired)


def test_uncorrupted_drive_passes():
    assert not _drive(load_case(CASES_DIR / "swa128"), lambda output: False)


def test_an_idle_step_still_delivers_finished_requests_to_the_executor():
    from tests.sim.builders import EchoModel, engine, full, new_request, tokens

    eng = engine(full(), num_blocks=16)
    mirror = BlockTableMirror(EchoModel())
    seen = []

    class Watch:
        def execute(self, output):
            seen.append((dict(output.num_scheduled_tokens), list(output.finished_req_ids)))
            return mirror.execute(output)

    eng.add_request(new_request("a", tokens(0, 20), max_tokens=2))
    while eng.has_unfinished_requests():
        mirror.check(eng, eng.step(Watch()))
    assert mirror.tables == {"a": mirror.tables["a"]}  # finished, reported with the next output
    result = eng.step(Watch())  # nothing to run: the executor still hears that "a" finished
    assert seen[-1] == ({}, ["a"]) and result.execution.sampled == {}
    mirror.check(eng, result)
    assert mirror.tables == {}
