"""Every golden case produced by vLLM 0.33's own scheduler and KV cache manager must be
reproduced exactly: admissions and hits, preemptions, first/finish steps, and per step the
scheduled tokens, preempted and finished sets, free blocks and cached blocks."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.lockstep.golden import compare_results, load_case, read_jsonl
from kvtwin.sim.lockstep.runner import run_case

CASES_DIR = Path(__file__).parent.parent / "golden" / "cases"
CASES = sorted(p.name for p in CASES_DIR.iterdir() if (p / "config.json").exists())


# The publicly released cases (produced by vLLM 0.33.0 itself); the
# directory may hold more (cases generated with the oracle for further rules).
PUBLIC_CASES = {"chunked64", "full_basic", "full_nocache", "full_pressure", "mamba_align", "multiturn",
                "no_chunking", "priority", "swa128", "three_groups", "hybrid_priority", "mamba_checkpoint",
                "async_pressure", "offload_nocache_lru",
                # vLLM's engine-default prefix-cache retention (interval 0) and a periodic one.
                "retention_swa_r0", "retention_mamba_r0", "retention_three_groups_r0_async", "retention_swa_r512"}


# Asynchronous scheduling (vLLM's default AsyncScheduler, two batches in flight), produced
# with the vLLM oracle's asynchronous case generator: the public async_pressure plus full + sliding
# window, full + chunked local, full + Mamba (align, no prefill checkpoints), a hybrid
# under the priority policy, the priority policy, chunked prefill off, multi-turn and big
# batches (budget 8192, up to 29 requests and ~3k tokens per batch).
ASYNC_CASES = {"async_pressure", "async_swa128", "async_chunked64", "async_mamba_align", "async_hybrid_priority",
               "async_priority", "async_no_chunking", "async_multiturn", "async_big_batches",
               "retention_three_groups_r0_async",
               # Prefix-cache retention (scripts/oracle/gen_retention_cases.py and the offload
               # and spec harnesses): sparse caching under asynchronous scheduling.
               "retention_swa_r0_async", "retention_mamba_r0_async", "retention_mamba_ckpt_r0_async",
               "retention_three_groups_r0_pressure_async", "retention_offload_swa_r0_async",
               "retention_offload_mamba_r0_async", "retention_spec_async_mtp_swa_r0",
               "retention_spec_async_eagle_mamba_r0", "offload_async_mamba_lru_dense",
               # vLLM's native CPU offloading under asynchronous scheduling (our own harness,
               # scripts/oracle/gen_offload_golden.py).
               "offload_async_full_lru", "offload_async_swa_arc", "offload_async_mamba_lru",
               "offload_async_full_arc_slow",
               # Prefix caching off: Mamba align mode still cuts chunks, a connector still
               # hashes blocks (the vLLM oracle and scripts/oracle on configs with caching off).
               "async_mamba_align_nocache", "offload_nocache_async_full_lru", "offload_nocache_async_mamba_lru",
               # Speculative decoding, asynchronous (scripts/oracle/gen_spec_golden.py).
               "spec_async_k3", "spec_async_pressure_k3", "spec_async_swa_full_k5", "spec_async_padding_k3",
               "spec_async_priority_pressure_k1", "spec_async_eagle_nocache_k5", "spec_async_mamba_full_k3",
               "spec_async_eagle_cache_k3", "spec_async_eagle_cache_pressure_k1", "spec_async_mtp3_cache_pressure_k3",
               "spec_async_eagle_swa8_budget4_k3", "spec_async_mtp3_swa_pressure_nocache_k3",
               # Pipeline parallelism, asynchronous (scripts/oracle/gen_pp_golden.py).
               "pp_async_pressure_pp2", "pp_async_prefix_pp3", "pp_async_swa_pp2"}

# Pipeline parallelism (scripts/oracle/gen_pp_golden.py): vLLM's synchronous scheduler with a
# batch queue of pipeline_parallel_size batches (2, 3, 4): pressure and preemptions, shared
# prefixes, the priority policy with long chunked prompts, sliding window + full; and its
# AsyncScheduler with the V2 runner's pp + 1 batches and decodes pp schedules apart (2, 3):
# pressure, shared prefixes, sliding window + full.
PP_CASES = {"pp_pressure_pp2", "pp_prefix_pp4", "pp_priority_chunked_pp3", "pp_swa_pressure_pp2",
            "pp_async_pressure_pp2", "pp_async_prefix_pp3", "pp_async_swa_pp2"}

# Speculative decoding (n-gram drafts and draft heads, k = 1, 3, 5, and 4 for a 2-module MTP
# head; scripts/oracle/gen_spec_golden.py): full attention, sliding window + full, pressure
# with preemptions (FCFS and priority), drafts clipped by max_model_len and by the budget,
# padded one-token admissions, caching off, chunked prefill off, a long-prefill threshold.
SPEC_CASES = {"spec_full_k1", "spec_full_k3", "spec_full_k5", "spec_swa_full_k3", "spec_pressure_k3",
              "spec_priority_pressure_k5", "spec_max_model_len_k5", "spec_budget_k5", "spec_padding_k3",
              "spec_nocache_k3", "spec_async_k3", "spec_async_pressure_k3", "spec_async_swa_full_k5",
              "spec_async_padding_k3", "spec_async_priority_pressure_k1", "spec_no_chunking_k3",
              "spec_long_prefill_k3", "spec_eagle_nocache_k3", "spec_async_eagle_nocache_k5",
              "spec_eagle_swa_nocache_k3", "spec_mamba_full_k3", "spec_async_mamba_full_k3",
              "spec_mamba_pressure_k3", "spec_mamba_checkpoint_k3", "spec_eagle_mamba_nocache_k3",
              "spec_eagle_mamba_checkpoint_nocache_k3",  # caching off: the trailing-block drop
              "spec_mamba_long_prefill2_k3",  # a padded admission cut by the threshold: padding dropped
              # draft heads with prefix caching on: lookahead block hashes
              "spec_eagle_cache_k1", "spec_eagle_cache_k3", "spec_async_eagle_cache_k3",
              "spec_eagle_cache_pressure_k3", "spec_async_eagle_cache_pressure_k1", "spec_mtp_cache_k3",
              "spec_eagle_cache_swa_full_k3", "spec_eagle_cache_mamba_full_k3", "spec_eagle_cache_mamba_checkpoint_k3",
              # multi-module MTP: k-token hash lookahead, re-prefillable tail, prefill-lookahead chunks
              "spec_mtp3_cache_k3", "spec_async_mtp3_cache_pressure_k3", "spec_mtp2_cache_swa_full_k4",
              "spec_mtp3_nocache_k3",
              # multi-module MTP on sliding windows: the retained re-prefillable tail
              "spec_mtp3_cache_swa_pressure_k3", "spec_async_mtp3_swa_pressure_nocache_k3",
              "spec_mtp3_swa_only_nocache_k3",
              # draft heads with prefix caching under vLLM's default retention (interval 0)
              "retention_spec_eagle_swa_r0", "retention_spec_async_mtp_swa_r0", "retention_spec_mtp_mamba_r0",
              "retention_spec_async_eagle_mamba_r0",
              # a head's lookahead past the sliding window's admission cap (SWA-BOUND)
              "spec_async_eagle_swa8_budget4_k3"}

def test_all_eighteen_public_golden_cases_are_listed():
    assert len(PUBLIC_CASES) == 18


def test_a_case_runs_the_retention_its_config_names():
    """The key sets vLLM's ``CacheConfig`` and ``KVCacheConfig`` alike; a case made before it
    existed ran a dense GPU cache beside ``CacheConfig``'s default 0, which only an offload
    connector reads. Every ``retention_*`` case names its interval."""
    for name in CASES:
        raw = json.loads((CASES_DIR / name / "config.json").read_text())
        case = load_case(CASES_DIR / name)
        assert name.startswith("retention_") <= ("prefix_cache_retention_interval" in raw), name
        expected = raw.get("prefix_cache_retention_interval")
        assert case.kv_cache_config.prefix_cache_retention_interval == expected, name
        assert case.cache_config.prefix_cache_retention_interval == raw.get("prefix_cache_retention_interval", 0)


def test_every_public_golden_case_is_present():
    assert PUBLIC_CASES <= set(CASES)


def test_every_async_golden_case_is_present_and_async():
    assert len(ASYNC_CASES) >= 9 and ASYNC_CASES <= set(CASES)
    for name in CASES:
        assert load_case(CASES_DIR / name).scheduler_config.async_scheduling == (name in ASYNC_CASES), name


def test_every_pp_golden_case_is_present_with_its_batch_queue():
    assert PP_CASES <= set(CASES)
    for name in CASES:
        config = load_case(CASES_DIR / name).scheduler_config
        assert (config.pipeline_parallel_size > 1) == (name in PP_CASES), name
        pp = config.pipeline_parallel_size
        assert config.max_concurrent_batches == (pp + 1 if config.async_scheduling else pp)


def test_every_spec_golden_case_is_present_and_speculative():
    assert SPEC_CASES <= set(CASES)
    for name in CASES:
        k = load_case(CASES_DIR / name).scheduler_config.num_speculative_tokens
        assert (k > 0) == (name in SPEC_CASES), name
    assert {load_case(CASES_DIR / n).scheduler_config.num_speculative_tokens for n in SPEC_CASES} == {1, 3, 4, 5}


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


def _tampered_case(tmp_path, name: str, tamper) -> Path:
    """A copy of golden case ``name`` whose expected files ``tamper(requests, steps)`` edited."""
    import json
    src, case_dir = CASES_DIR / name, tmp_path / name
    case_dir.mkdir()
    for file in ("config.json", "requests.jsonl"):
        (case_dir / file).write_text((src / file).read_text())
    requests = read_jsonl(src / "expected_requests.jsonl")
    steps = read_jsonl(src / "expected_steps.jsonl")
    tamper(requests, steps)
    for file, rows in (("expected_requests.jsonl", requests), ("expected_steps.jsonl", steps)):
        (case_dir / file).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return case_dir


def _first_step_with(steps: list[dict], field: str) -> dict:
    """The first step whose offload record has a non-empty ``field`` (or step 0)."""
    return next((s for s in steps if s["offload"].get(field)), steps[0])


def _bump(value):
    if isinstance(value, list):
        return value + [["bogus", 1]]
    return (value or 0) + 1


# Each offload field the harness records; scheduled_batch and updated_batch only in async cases.
OFFLOAD_STEP_FIELDS = [("offload_full_lru", f) for f in
                       ("loads", "stores", "evicted", "flushed", "completed", "cpu_used_chunks", "waiting_for_kv")] + \
                      [("offload_async_full_lru", f) for f in ("scheduled_batch", "updated_batch", "stores", "loads")]


@pytest.mark.parametrize("name, field", OFFLOAD_STEP_FIELDS)
def test_lockstep_verdict_compares_every_offload_step_field(tmp_path, name, field):
    def tamper(requests, steps):
        step = _first_step_with(steps, field)
        assert field in step["offload"]
        step["offload"][field] = _bump(step["offload"][field])
        tamper.step = step["step"]

    case_dir = _tampered_case(tmp_path, name, tamper)
    res = CliRunner().invoke(app, ["lockstep", str(case_dir), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert f"step {tamper.step}: offload.{field} expected" in res.output


@pytest.mark.parametrize("field", ["external_tokens", "load_step", "hit_tokens", "step"])
def test_lockstep_verdict_compares_every_admission_field(tmp_path, field):
    def tamper(requests, steps):
        index, request = next((i, r) for i, r in enumerate(requests) if r["admissions"][0]["external_tokens"])
        request["admissions"][0][field] = _bump(request["admissions"][0][field])
        tamper.request_id = request["request_id"]

    case_dir = _tampered_case(tmp_path, "offload_full_lru", tamper)
    res = CliRunner().invoke(app, ["lockstep", str(case_dir), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert f"request {tamper.request_id}: admissions[0].{field} expected" in res.output


def test_a_field_on_one_side_only_is_a_difference():
    case_dir = CASES_DIR / "offload_full_lru"
    expected_requests = read_jsonl(case_dir / "expected_requests.jsonl")
    expected_steps = read_jsonl(case_dir / "expected_steps.jsonl")
    result = run_case(load_case(case_dir))
    assert compare_results(expected_requests, expected_steps, result.requests, result.steps) == []
    del expected_steps[4]["offload"]["evicted"]
    del expected_requests[2]["admissions"][0]["load_step"]
    del expected_steps[6]["offload"]
    diffs = compare_results(expected_requests, expected_steps, result.requests, result.steps, limit=0)
    assert any(d.startswith("step 4: offload.evicted expected (absent)") for d in diffs)
    assert any(d.startswith("step 6: offload expected (absent)") for d in diffs)
    assert any(f"request {expected_requests[2]['request_id']}: admissions[0].load_step expected (absent)" in d
               for d in diffs)
