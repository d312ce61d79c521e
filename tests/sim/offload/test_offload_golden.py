"""The offload golden cases (vLLM 0.33's own scheduler with its OffloadingConnector and
CPUOffloadingManager, produced by scripts/oracle/gen_offload_golden.py) hold for the
block-table contract too: an executor that keeps tables from the scheduler output alone
matches the KV cache manager after every step of every case (BLOCK-TABLE-MIRROR), while
the run still reproduces the expected steps (the tier's loads, stores, evictions and
flushes included). The cases themselves are compared field by field in test_golden.py."""

from pathlib import Path

import pytest

from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.lockstep.golden import load_case, read_jsonl
from kvtwin.sim.lockstep.runner import ScriptedModel, build_engine, step_record
from tests.sim.block_table_mirror import BlockTableMirror

CASES_DIR = Path(__file__).resolve().parents[2] / "golden" / "cases"
# Every case with a CPU tier (a ``kv_offload`` table): ``offload_*`` and ``retention_offload_*``.
OFFLOAD_CASES = sorted(p.name for p in CASES_DIR.iterdir()
                       if (p / "config.json").exists() and '"kv_offload"' in (p / "config.json").read_text())


def test_the_offload_cases_cover_full_swa_and_mamba_with_both_policies_and_both_schedulers():
    kinds = set()
    for name in OFFLOAD_CASES:
        case = load_case(CASES_DIR / name)
        groups = tuple(type(g.spec).__name__ for g in case.kv_cache_config.groups)
        kinds.add((groups, case.offload.eviction_policy, case.scheduler_config.async_scheduling))
    for groups in (("FullAttentionSpec",), ("FullAttentionSpec", "SlidingWindowSpec"),
                   ("FullAttentionSpec", "MambaSpec")):
        for policy in ("lru", "arc"):
            assert (groups, policy, False) in kinds
        assert any((groups, policy, True) in kinds for policy in ("lru", "arc"))


@pytest.mark.parametrize("name", OFFLOAD_CASES)
def test_tables_kept_from_the_output_match_the_manager(name):
    case = load_case(CASES_DIR / name)
    engine, _ = build_engine(case)
    step = engine.step_async if case.scheduler_config.async_scheduling else engine.step
    mirror = BlockTableMirror(ScriptedModel({r.request_id: r.output_token_ids for r in case.requests}))
    expected = read_jsonl(CASES_DIR / name / "expected_steps.jsonl")
    pending = list(case.requests)
    arrived = index = 0
    loads = stores = 0
    while True:
        while arrived < len(pending) and pending[arrived].arrival_step == index:
            spec = pending[arrived]
            assert engine.add_request(Request(spec.request_id, TokenPrompt(spec.prompt_token_ids),
                                              len(spec.output_token_ids), arrival_time=float(arrived),
                                              priority=spec.priority))
            arrived += 1
        result = step(mirror)
        mirror.check(engine, result)
        meta = result.output.kv_connector_metadata
        if meta is not None:  # (an async step may only apply a batch)
            loads += len(meta.load_jobs)
            stores += len(meta.store_jobs)
        line = step_record(index, result, engine.kv_cache_manager.block_pool)
        assert {k: line[k] for k in ("scheduled", "num_free_blocks", "num_cached_blocks")} == \
            {k: expected[index][k] for k in ("scheduled", "num_free_blocks", "num_cached_blocks")}
        index += 1
        if arrived == len(pending) and not engine.has_unfinished_requests() and not engine.has_pending_transfers() \
                and not engine.scheduler.finished_req_ids and not engine.batch_queue:
            break
    assert index == len(expected)
    # A Mamba hybrid with prefix caching off stores but never loads (vLLM: no hit there).
    no_hits = "mamba" in name and not case.cache_config.enable_prefix_caching
    assert stores > 0 and (loads == 0 if no_hits else loads > 0)
