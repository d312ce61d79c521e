"""Every golden case produced by vLLM 0.33's own scheduler and KV cache manager must be
reproduced exactly: admissions and hits, preemptions, first/finish steps, and per step the
scheduled tokens, preempted and finished sets, free blocks and cached blocks."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.lockstep.golden import compare_results, load_case, read_jsonl
from kvtwin.sim.lockstep.runner import run_case

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "config.json").exists())


# The cases published in ../shared/golden/cases (produced by vLLM 0.33.0 itself); the
# directory may hold more (cases generated with the oracle for further rules).
PUBLIC_CASES = {"chunked64", "full_basic", "full_nocache", "full_pressure", "mamba_align", "multiturn",
                "no_chunking", "priority", "swa128", "three_groups", "hybrid_priority", "mamba_checkpoint",
                "async_pressure"}


# Asynchronous scheduling (vLLM's default AsyncScheduler, two batches in flight), produced
# with ../shared/oracle/gen_golden_async.py: the public async_pressure plus full + sliding
# window, full + chunked local, full + Mamba (align, no prefill checkpoints), a hybrid
# under the priority policy, the priority policy, chunked prefill off, multi-turn and big
# batches (budget 8192, up to 29 requests and ~3k tokens per batch).
ASYNC_CASES = {"async_pressure", "async_swa128", "async_chunked64", "async_mamba_align", "async_hybrid_priority",
               "async_priority", "async_no_chunking", "async_multiturn", "async_big_batches",
               # vLLM's native CPU offloading under asynchronous scheduling (our own harness,
               # scripts/oracle/gen_offload_golden.py).
               "offload_async_full_lru", "offload_async_swa_arc", "offload_async_mamba_lru",
               "offload_async_full_arc_slow"}

def test_all_thirteen_public_golden_cases_are_listed():
    assert len(PUBLIC_CASES) == 13


def test_every_public_golden_case_is_present():
    assert PUBLIC_CASES <= set(CASES)


def test_every_async_golden_case_is_present_and_async():
    assert len(ASYNC_CASES) >= 9 and ASYNC_CASES <= set(CASES)
    for name in CASES:
        assert load_case(CASES_DIR / name).scheduler_config.async_scheduling == (name in ASYNC_CASES), name


@pytest.mark.parametrize("name", CASES)
def test_golden_case_matches_vllm_exactly(name):
    case_dir = CASES_DIR / name
    result = run_case(load_case(case_dir))
    diffs = compare_results(read_jsonl(case_dir / "expected_requests.jsonl"),
                            read_jsonl(case_dir / "expected_steps.jsonl"), result.requests, result.steps, limit=0)
    assert diffs == []


@pytest.mark.parametrize("name", ["full_pressure", "three_groups", "mamba_align", "mamba_checkpoint"])
def test_results_do_not_depend_on_the_hash_function(name):
    case_dir = CASES_DIR / name
    with_sha = run_case(load_case(case_dir, hash_algo="sha256"))
    with_builtin = run_case(load_case(case_dir, hash_algo="builtin"))
    assert with_sha.steps == with_builtin.steps
    assert with_sha.requests == with_builtin.requests


def test_comparison_reports_the_first_differing_step():
    case_dir = CASES_DIR / "full_basic"
    result = run_case(load_case(case_dir))
    result.steps[7]["num_free_blocks"] += 1
    result.steps[3]["scheduled"] = {"bogus": 1}
    diffs = compare_results(read_jsonl(case_dir / "expected_requests.jsonl"),
                            read_jsonl(case_dir / "expected_steps.jsonl"), result.requests, result.steps)
    assert diffs[0].startswith("step 3: scheduled")
    assert diffs[1].startswith("step 7: num_free_blocks")


def test_lockstep_command_writes_golden_format_and_reports_match(tmp_path):
    case_dir = CASES_DIR / "priority"
    res = CliRunner().invoke(app, ["lockstep", str(case_dir), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "MATCH" in res.output
    assert read_jsonl(tmp_path / "actual_steps.jsonl") == read_jsonl(case_dir / "expected_steps.jsonl")
    actual_requests = read_jsonl(tmp_path / "actual_requests.jsonl")
    assert actual_requests == read_jsonl(case_dir / "expected_requests.jsonl")


def test_lockstep_command_exits_1_on_mismatch(tmp_path):
    case_dir = tmp_path / "case"
    case_dir.mkdir()
    src = CASES_DIR / "full_basic"
    for name in ("config.json", "requests.jsonl", "expected_requests.jsonl"):
        (case_dir / name).write_text((src / name).read_text())
    steps = read_jsonl(src / "expected_steps.jsonl")
    steps[5]["num_cached_blocks"] += 1
    import json
    (case_dir / "expected_steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    res = CliRunner().invoke(app, ["lockstep", str(case_dir), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert "step 5: num_cached_blocks expected" in res.output
