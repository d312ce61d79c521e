"""Speculative decoding (docs/semantics.md#speculative-decoding): the acceptance model, the
configuration's bad input, and the SPEC-* invariants (docs/invariants.md) as properties over
random workloads, synchronous and asynchronous."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.scenario.acceptance import AcceptanceConfig, AcceptanceModel
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.spec import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec,
                                  cdiv, with_prefill_lookahead)
from kvtwin.sim.lockstep.golden import CaseRequest, GoldenCase, load_case
from kvtwin.sim.lockstep.runner import SpecScriptedModel, run_case
from tests.sim.test_invariants import COMMON, Scenario, examples, run_scenario

CASES = Path(__file__).parent.parent / "golden" / "cases"
BS = 16


# -- the acceptance model ------------------------------------------------------------------------

def test_acceptance_constant_rate_matches_its_mean():
    config = AcceptanceConfig(num_speculative_tokens=3, acceptance=0.7, seed=5)
    model = AcceptanceModel(config)
    draws = [model.num_accepted(3) for _ in range(20_000)]
    assert set(draws) == {0, 1, 2, 3}
    assert config.mean_accepted() == pytest.approx(0.7 + 0.49 + 0.343)
    assert sum(draws) / len(draws) == pytest.approx(config.mean_accepted(), abs=0.03)


def test_acceptance_table_first_rejection_stops_the_run():
    model = AcceptanceModel(AcceptanceConfig(num_speculative_tokens=3, acceptance=(1.0, 0.0, 1.0)))
    assert {model.num_accepted(3) for _ in range(100)} == {1}  # position 1 always rejects
    model = AcceptanceModel(AcceptanceConfig(num_speculative_tokens=4, acceptance=1.0))
    assert model.num_accepted(4) == 4 and model.num_accepted(2) == 2  # clipped drafts: at most what was sent
    assert AcceptanceModel(AcceptanceConfig(2, 0.0)).num_accepted(2) == 0


def test_acceptance_is_seeded():
    def draws(seed):
        model = AcceptanceModel(AcceptanceConfig(num_speculative_tokens=5, acceptance=0.6, seed=seed))
        return [model.num_accepted(5) for _ in range(200)]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=3, acceptance=1.5), "acceptance"),
    (dict(num_speculative_tokens=3, acceptance=-0.1), "acceptance"),
    (dict(num_speculative_tokens=2, acceptance=(0.5, 1.2)), "acceptance"),
    (dict(num_speculative_tokens=2, acceptance=(0.5,)), "acceptance"),
    (dict(num_speculative_tokens=3, acceptance="high"), "acceptance"),
    (dict(num_speculative_tokens=0, acceptance=0.5), "num_speculative_tokens"),
    (dict(num_speculative_tokens=True, acceptance=0.5), "num_speculative_tokens"),
])
def test_bad_acceptance_is_one_clear_error(kwargs, field):
    with pytest.raises(ConfigError) as err:
        AcceptanceConfig(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_speculative_tokens=64, max_num_batched_tokens=64), "num_speculative_tokens"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_lookahead_tokens=2), "num_lookahead_tokens"),
    # lookahead hashes need a draft head; multi-module MTP's k-token hashes are not modelled
    (dict(num_speculative_tokens=3, num_hash_lookahead_tokens=1), "num_hash_lookahead_tokens"),
    (dict(num_speculative_tokens=3, num_lookahead_tokens=3, num_hash_lookahead_tokens=2),
     "num_hash_lookahead_tokens"),
])
def test_bad_speculative_scheduler_settings(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(max_model_len=512, async_scheduling=False, **kwargs)
    assert err.value.field == field
    SchedulerConfig(max_model_len=512, max_num_batched_tokens=64, num_speculative_tokens=63,
                    async_scheduling=False)  # the largest k


def test_a_draft_head_with_caching_on_needs_lookahead_hashes():
    """vLLM's legacy trailing-block drop (disable_lookahead_block_hashes) is not modelled:
    a draft head with caching on and plain hashes is refused, naming the field."""
    kv = KVCacheConfig(num_blocks=32, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=16)),),
                       hash_block_size=16)
    head = SchedulerConfig(max_model_len=256, num_speculative_tokens=3, num_lookahead_tokens=3, async_scheduling=False)
    with pytest.raises(ConfigError) as err:
        EngineCore(kv, head, CacheConfig(enable_prefix_caching=True))
    assert err.value.field == "num_hash_lookahead_tokens"
    EngineCore(kv, head, CacheConfig(enable_prefix_caching=False))
    hashed = SchedulerConfig(max_model_len=256, num_speculative_tokens=3, num_lookahead_tokens=3,
                             num_hash_lookahead_tokens=1, async_scheduling=False)
    assert EngineCore(kv, hashed, CacheConfig(enable_prefix_caching=True)).scheduler.hasher.lookahead == 1


def test_multi_module_mtp_limits_are_refused_naming_the_field():
    """Multi-module MTP (prefill lookahead k > 1): not modelled with Mamba groups; with
    caching on vLLM needs a scheduler block of at least k tokens."""
    def kv(block_size, mamba=False):
        groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=block_size))]
        if mamba:
            groups.append(KVCacheGroupSpec(("m",), MambaSpec(block_size=block_size, shapes=((4, 8),), dtype_bytes=(2,),
                                                             mamba_cache_mode="align", num_speculative_blocks=5)))
        return KVCacheConfig(num_blocks=64, groups=tuple(groups), hash_block_size=block_size)
    mtp = SchedulerConfig(max_model_len=256, num_speculative_tokens=5, num_lookahead_tokens=5,
                          num_prefill_lookahead_tokens=5, num_hash_lookahead_tokens=5, async_scheduling=False)
    for config, cache in ((kv(4), CacheConfig(enable_prefix_caching=True)), (kv(16, mamba=True), CacheConfig())):
        with pytest.raises(ConfigError) as err:
            EngineCore(config, mtp, cache)
        assert err.value.field == "num_prefill_lookahead_tokens"
    EngineCore(kv(4), dataclasses.replace(mtp, num_hash_lookahead_tokens=0), CacheConfig(enable_prefix_caching=False))
    engine = EngineCore(kv(16), mtp, CacheConfig())
    assert engine.scheduler.hasher.lookahead == 5 and engine.kv_cache_manager.coordinator.num_reprefillable_tokens == 4


def test_multi_module_mtp_sliding_windows_retain_the_re_prefillable_tail(tmp_path):
    """docs/semantics.md#sliding-window: a case's sliding-window groups retain k - 1 tokens
    below the window for multi-module MTP, as vLLM's planner sets them; a group that states
    another value, or a scheduler built on a window without the tail, is refused naming the field."""
    case = tmp_path / "case"
    shutil.copytree(CASES / "spec_mtp3_swa_only_nocache_k3", case)
    loaded = load_case(case)
    assert loaded.scheduler_config.num_prefill_lookahead_tokens == 3
    assert loaded.kv_cache_config.groups[0].spec.extra_retained_tokens == 2
    config = json.loads((case / "config.json").read_text())
    config["kv_cache_groups"][0]["extra_retained_tokens"] = 2
    (case / "config.json").write_text(json.dumps(config))
    assert load_case(case).kv_cache_config == loaded.kv_cache_config
    config["kv_cache_groups"][0]["extra_retained_tokens"] = 0
    (case / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["lockstep", str(case), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"kvtwin: error: {case / 'config.json'}: kv_cache_groups[0].extra_retained_tokens"), lines
    # Single-module heads and n-gram retain nothing extra.
    for name in ("spec_eagle_cache_swa_full_k3", "spec_swa_full_k3"):
        spec = load_case(CASES / name).kv_cache_config.groups[0].spec
        assert isinstance(spec, SlidingWindowSpec) and spec.extra_retained_tokens == 0
    plain = dataclasses.replace(loaded.kv_cache_config, groups=(
        KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=BS, sliding_window=32)),))
    with pytest.raises(ConfigError) as err:
        EngineCore(plain, loaded.scheduler_config, loaded.cache_config)
    assert err.value.field == "extra_retained_tokens"


def test_mtp_modules_must_divide_k_and_the_cli_says_so_in_one_line(tmp_path):
    """vLLM 0.33 (``config/speculative.py``) refuses an MTP k above the module count that is
    not a multiple of it; k at most the modules, or a multiple, is accepted."""
    case = tmp_path / "case"
    shutil.copytree(CASES / "spec_mtp3_cache_k3", case)
    config = json.loads((case / "config.json").read_text())
    for layers, k in ((3, 1), (3, 2), (2, 4), (2, 6), (4, 3)):
        config["speculative"].update(num_nextn_predict_layers=layers, num_speculative_tokens=k)
        (case / "config.json").write_text(json.dumps(config))
        assert load_case(case).scheduler_config.num_speculative_tokens == k
    config["speculative"].update(num_nextn_predict_layers=2, num_speculative_tokens=3)
    (case / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["lockstep", str(case), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"kvtwin: error: {case / 'config.json'}: speculative.num_speculative_tokens"), lines
    assert "num_nextn_predict_layers (2)" in lines[0]


def test_a_padded_admission_cut_by_the_long_prefill_threshold(tmp_path):
    """docs/semantics.md#scheduling-drafts: a one-token admission padded to 1 + k rows and cut
    by a long-prefill threshold below 1 + k. On a Mamba align-mode layout vLLM 0.33 drops the
    padding and schedules the one token (golden case spec_mamba_long_prefill2_k3); without
    Mamba it fails an assertion, so kvtwin stops there with one error line naming the setting."""
    case = load_case(CASES / "spec_mamba_long_prefill2_k3")
    result = run_case(case)
    admitted_with_hit = {(a["step"], r["request_id"]) for r in result.requests for a in r["admissions"]
                         if a["hit_tokens"]}
    cut = [(s["scheduled"][rid], s["spec_decode_tokens"].get(rid, 0)) for s in result.steps
           for rid in s["scheduled"] if (s["step"], rid) in admitted_with_hit]
    # One-token admissions went unpadded; none kept a shortened padded row.
    assert (1, 0) in cut and all(n == 1 + d == 4 for n, d in cut if d)
    full_only = tmp_path / "case"
    shutil.copytree(CASES / "spec_mamba_long_prefill2_k3", full_only)
    config = json.loads((full_only / "config.json").read_text())
    config["kv_cache_groups"] = [{"kind": "full_attention"}]
    (full_only / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        run_case(load_case(full_only))
    assert err.value.field == "long_prefill_token_threshold" and err.value.got == 2
    res = CliRunner().invoke(app, ["lockstep", str(full_only), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "long_prefill_token_threshold: expected 0 or at least 1 + num_speculative_tokens = 4" \
        in lines[0] and lines[0].startswith("kvtwin: error:"), lines


@pytest.mark.parametrize("async_scheduling, prompt_tokens", [(False, 10), (True, 10), (False, 3)])
def test_a_livelock_is_one_error_line_not_a_crash(tmp_path, async_scheduling, prompt_tokens):
    """docs/semantics.md#no-progress: multi-module MTP (k = 3) under a long-prefill threshold
    of 2 livelocks, in vLLM 0.33 too (checked with the oracle: no end after 20000 steps).
    Running (10-token prompts stop 3 tokens short) or set aside while waiting (3-token
    prompts), the requests are never scheduled again; the lockstep run stops with one
    error line naming the threshold and a stuck request."""
    case = tmp_path / "case"
    shutil.copytree(CASES / "spec_mtp3_nocache_k3", case, ignore=shutil.ignore_patterns("expected_*"))
    config = json.loads((case / "config.json").read_text())
    config.update(long_prefill_token_threshold=2, async_scheduling=async_scheduling)
    (case / "config.json").write_text(json.dumps(config))
    rows = [dict(request_id=f"r{i}", arrival_step=0, output_token_ids=[5, 6, 7], priority=0,
                 prompt_token_ids=list(range(100 * i + 1, 100 * i + 1 + prompt_tokens))) for i in range(2)]
    (case / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as err:
        run_case(load_case(case), max_idle_steps=20)
    assert err.value.field == "long_prefill_token_threshold" and err.value.got == 2
    stuck = 7 if prompt_tokens == 10 else 0
    assert f"request r0 {'is running' if stuck else 'waits'} with {stuck} of its {prompt_tokens} tokens" \
        in str(err.value)
    res = CliRunner().invoke(app, ["lockstep", str(case), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvtwin: error: case: long_prefill_token_threshold"), lines


def test_no_progress_without_a_known_cause_blames_the_workload():
    """The no-progress error names the first stuck request and, with no known cause, the
    workload (here a waiting request stuck behind a full pool, set up by hand)."""
    kv = KVCacheConfig(num_blocks=8, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=BS)),),
                       hash_block_size=BS)
    engine = EngineCore(kv, SchedulerConfig(max_model_len=256, async_scheduling=False))
    engine.add_request(Request("w", TokenPrompt(tuple(range(1, 41))), 4))
    err = engine.no_progress_error("requests.jsonl")
    assert err.field == "requests.jsonl"
    assert "request w waits with 0 of its 40 tokens computed and is never scheduled again" in str(err)


def test_cli_refuses_k_over_the_budget_in_one_line(tmp_path):
    case = tmp_path / "case"
    shutil.copytree(CASES / "spec_full_k3", case)
    config = json.loads((case / "config.json").read_text())
    config["speculative"]["num_speculative_tokens"] = config["max_num_batched_tokens"]
    (case / "config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["lockstep", str(case), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"kvtwin: error: {case / 'config.json'}: num_speculative_tokens")


@pytest.mark.parametrize("speculative, field", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative"),
    # vLLM reuses the MTP modules in turn: k must be at most their number or a multiple of it.
    ({"method": "mtp", "num_speculative_tokens": 3, "num_nextn_predict_layers": 2},
     "speculative.num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 5, "num_nextn_predict_layers": 3},
     "speculative.num_speculative_tokens"),
])
def test_bad_speculative_table_in_a_case(tmp_path, speculative, field):
    case = tmp_path / "case"
    shutil.copytree(CASES / "spec_full_k3", case)
    config = json.loads((case / "config.json").read_text())
    config["speculative"] = speculative
    (case / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_case(case)
    assert err.value.field == field


@pytest.mark.parametrize("mode", ["align", "none"])
def test_mamba_with_drafts_needs_k_speculative_state_blocks(mode):
    """vLLM 0.33 sizes a Mamba spec with num_speculative_blocks = k when drafting; a spec
    without them is refused naming the field, one with them runs a verify step."""
    from kvtwin.sim.core.spec import MambaSpec

    def config(num_speculative_blocks: int) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=64, hash_block_size=BS, groups=(
            KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=BS)),
            KVCacheGroupSpec(("m",), MambaSpec(block_size=BS if mode == "align" else 256, shapes=((4, 8),),
                                               dtype_bytes=(2,), mamba_cache_mode=mode,
                                               num_speculative_blocks=num_speculative_blocks))))
    sched = SchedulerConfig(max_model_len=256, num_speculative_tokens=2, async_scheduling=False)
    with pytest.raises(ConfigError) as err:
        EngineCore(config(0), sched)
    assert err.value.field == "num_speculative_blocks"
    engine = EngineCore(config(2), sched, CacheConfig(enable_prefix_caching=mode == "align"))
    engine.add_request(Request("r", TokenPrompt(tuple(range(1, 41))), 8))
    engine.scheduler.schedule()
    # Admitted without a hit, the Mamba group holds its running state and k speculative state
    # blocks (align mode: the skipped positions before them are null blocks, id 0).
    mamba_blocks = engine.scheduler.kv_cache_manager.get_block_ids("r")[1]
    assert sum(1 for b in mamba_blocks if b) == 1 + 2


def test_drafts_off_leaves_the_output_without_drafts():
    case = load_case(CASES / "full_basic")
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    r = case.requests[0]
    engine.add_request(Request(r.request_id, TokenPrompt(r.prompt_token_ids), len(r.output_token_ids)))
    assert engine.scheduler.schedule().scheduled_spec_decode_tokens is None


# -- SPEC-* invariants as properties ----------------------------------------------------------------

@st.composite
def spec_scenarios(draw) -> Scenario:
    k = draw(st.integers(1, 5))
    is_async = draw(st.booleans())
    max_model_len = draw(st.integers(48, 160))
    budget = draw(st.integers(k + 1, 96))
    swa = draw(st.booleans())
    sched = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=draw(st.integers(1, 8)),
                            max_num_batched_tokens=budget, async_scheduling=is_async,
                            scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
                            num_speculative_tokens=k)
    cache = CacheConfig(enable_prefix_caching=draw(st.booleans()))
    if draw(st.booleans()):
        # A draft head: k lookahead slots and, with caching on, lookahead block hashes.
        # Multi-module MTP (k > 1) reads k tokens ahead: chunk rule, k-token hashes, re-prefillable tail,
        # and sliding windows that retain k - 1 more tokens.
        prefill = k if k > 1 and draw(st.booleans()) else 1
        sched = dataclasses.replace(sched, num_lookahead_tokens=k, num_prefill_lookahead_tokens=prefill,
                                    num_hash_lookahead_tokens=prefill if cache.enable_prefix_caching else 0)
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=BS))]
    if swa:
        window = SlidingWindowSpec(block_size=BS, sliding_window=draw(st.sampled_from([8, 16, 33])))
        groups.append(KVCacheGroupSpec(("swa",), with_prefill_lookahead(window, sched.num_prefill_lookahead_tokens)))
    worst = cdiv(max_model_len, BS) * len(groups) + 4 * len(groups)
    num_blocks = draw(st.integers(worst + 1, worst + 40))
    kv = KVCacheConfig(num_blocks=num_blocks, groups=tuple(groups), hash_block_size=BS)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    base = [rng.randrange(3) for _ in range(max_model_len)]
    requests = []
    arrival = 0
    for i in range(draw(st.integers(1, 10))):
        arrival += rng.choice([0, 0, 1, 3])
        length = rng.randint(1, max_model_len - 2)
        shared = rng.randint(0, length)
        prompt = base[:shared] + [rng.randrange(3) for _ in range(length - shared)]
        num_out = min(rng.choice([1, 3, 9, 30, 80]), max_model_len - len(prompt))
        accepted = tuple(rng.randint(0, k) for _ in range(rng.randint(0, num_out)))
        requests.append(CaseRequest(f"r{i}", arrival, tuple(prompt), tuple(rng.randrange(3) for _ in range(num_out)),
                                    rng.randint(0, 2), accepted))
    return Scenario(kv, sched, cache, tuple(requests))


@settings(max_examples=examples(150), **COMMON)
@given(spec_scenarios())
def test_engine_invariants_hold_with_drafts(scenario):
    """Every engine invariant (and the block-table mirror) holds with drafts on."""
    run_scenario(scenario, check=True)


def test_a_heads_lookahead_may_reach_past_the_sliding_window_admission_cap():
    """Found by the test above: with a 4-token budget and an EAGLE head's 3 lookahead slots,
    a request holds 3 sliding-window blocks where vLLM's admission cap (window plus the
    batches' tokens in flight, lookahead not counted) gives 2. SWA-BOUND counts the draft
    slots past the computed tokens, as TABLE-LEN does; the invariants hold."""
    page = dict(block_size=16, num_kv_heads=1, head_size=128, dtype_bytes=2)
    kv = KVCacheConfig(num_blocks=15, groups=(
        KVCacheGroupSpec(("full",), FullAttentionSpec(**page)),
        KVCacheGroupSpec(("swa",), SlidingWindowSpec(**page, sliding_window=8))), hash_block_size=16)
    scheduler = SchedulerConfig(max_model_len=48, max_num_seqs=1, max_num_batched_tokens=4,
                                enable_chunked_prefill=True, async_scheduling=True, num_speculative_tokens=3,
                                num_lookahead_tokens=3, num_prefill_lookahead_tokens=1)
    digits = "1101211111202010021222010202112011122021122021"
    requests = (
        CaseRequest("r0", 3, tuple(int(d) for d in digits), (2, 1), priority=2),
        CaseRequest("r1", 3, tuple(int(d) for d in "1101211110002"),
                    tuple(int(d) for d in "210121202120222110211201000022"), priority=1,
                    num_accepted_tokens=(0, 2)),
    )
    run_scenario(Scenario(kv, scheduler, CacheConfig(enable_prefix_caching=False), requests), check=True)


def _admit_arrivals(engine: EngineCore, pending: list[CaseRequest], step: int) -> None:
    """Add the requests that arrive at ``step`` (``pending`` in arrival order)."""
    while pending and pending[0].arrival_step == step:
        r = pending.pop(0)
        engine.add_request(Request(r.request_id, TokenPrompt(r.prompt_token_ids), len(r.output_token_ids),
                                   priority=r.priority, arrival_time=float(step)))


def _drive_with_spec_checks(s: Scenario) -> int:
    """Step the engine, checking SPEC-SLOTS after every schedule and SPEC-ROLLBACK after every
    update; returns the drafts rejected (so a test can see rollbacks happened)."""
    engine = EngineCore(s.kv_cache_config, s.scheduler_config, s.cache_config)
    sched = engine.scheduler
    kvm = engine.kv_cache_manager
    case = GoldenCase("s", s.kv_cache_config, s.scheduler_config, s.cache_config, s.requests)
    model = SpecScriptedModel(case)
    max_len = s.scheduler_config.max_model_len
    high_water: dict[str, int] = {}  # request -> highest position scheduled since its admission
    starts: dict[int, dict[str, tuple[int, int, int]]] = {}  # batch -> request -> (start, tokens, drafts)
    rejected: dict[tuple[int, str], int] = {}  # (batch, request) -> drafts the model rejected
    rejected_total = 0
    is_async = s.scheduler_config.async_scheduling
    k = s.scheduler_config.num_speculative_tokens
    lookahead = s.scheduler_config.num_lookahead_tokens
    pending = list(s.requests)
    step = 0
    step_fn = engine.step_async if s.scheduler_config.async_scheduling else engine.step

    class Watch:
        def execute(self, output):
            spec = output.scheduled_spec_decode_tokens or {}
            for new in output.scheduled_new_reqs:
                high_water[new.req_id] = 0
            batch = {}
            for (rid, n), start in zip(output.num_scheduled_tokens.items(), output.num_computed_tokens):
                # (a draft head's lookahead slots past them too)
                high_water[rid] = max(high_water[rid], min(start + n + lookahead, max_len))
                batch[rid] = (start, n, len(spec.get(rid, ())))
                # SPEC-SLOTS: the table holds exactly the slots of the highest position scheduled.
                for gid, ids in enumerate(kvm.get_block_ids(rid)):
                    assert len(ids) == cdiv(high_water[rid], BS), (rid, gid, len(ids), high_water[rid])
            starts[id(output)] = batch
            execution = model.execute(output)
            for rid, tokens in execution.sampled.items():
                rejected[id(output), rid] = batch[rid][2] - (len(tokens) - 1) if batch[rid][2] else 0
            return execution

    watch = Watch()
    while True:
        _admit_arrivals(engine, pending, step)
        result = step_fn(watch)
        applied = result.output if not s.scheduler_config.async_scheduling else result.updated
        finished = {r.request_id for r in result.finished}
        for rid, (start, n, drafts) in (starts.pop(id(applied), {}) if applied is not None else {}).items():
            request = sched.requests.get(rid)
            if request is None or rid in finished or request.status is not RequestStatus.RUNNING:
                continue
            # SPEC-ROLLBACK: exactly the rejected drafts are rolled back, never what was
            # verified. Async: the batch started before the previous batch's rollback (at
            # most k more).
            processed = request.num_computed_tokens - request.num_in_flight_tokens
            rejected_here = rejected.pop((id(applied), rid), 0)
            if is_async:
                assert start + n - drafts - k <= processed <= start + n, (rid, start, n, drafts, processed)
            else:
                assert processed == start + n - rejected_here, (rid, start, n, rejected_here, processed)
            rejected_total += rejected_here
            assert processed >= min(request.num_prompt_tokens, start + n - drafts)
        if not pending and not engine.has_unfinished_requests() and not engine.batch_queue:
            return rejected_total
        step += 1
        assert step < 5000


@settings(max_examples=examples(150), **COMMON)
@given(spec_scenarios())
def test_spec_slots_and_rollback(scenario):
    _drive_with_spec_checks(scenario)


@pytest.mark.parametrize("name", ["spec_full_k3", "spec_async_pressure_k3", "spec_swa_full_k3"])
def test_spec_invariants_on_golden_cases_see_rollbacks(name):
    case = load_case(CASES / name)
    s = Scenario(case.kv_cache_config, case.scheduler_config, case.cache_config, case.requests)
    assert _drive_with_spec_checks(s) > 0


def test_no_decode_window_with_drafts():
    """Decode windows assume one token per decode: never opened with drafts on."""
    from kvtwin.sim.core.window_opening import open_decode_window
    from kvtwin.sim.core.scheduler_output import SchedulerOutput
    kv = KVCacheConfig(num_blocks=64, hash_block_size=BS, groups=(KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=BS)),))
    engine = EngineCore(kv, SchedulerConfig(max_model_len=256, async_scheduling=True, num_speculative_tokens=2))
    engine.add_request(Request("a", TokenPrompt(tuple(range(20))), 50))
    out = engine.scheduler.schedule()
    assert open_decode_window(engine.scheduler, out, {"a": [1]}, [1 << 24]) is None


@pytest.mark.parametrize("name", ["spec_full_k3", "spec_async_pressure_k3", "spec_swa_full_k3"])
def test_the_scheduler_counts_verified_drafts_into_the_record(name):
    """A batch's record carries what its update verified (``SpecDecodingStats``: drafts,
    accepted, accepted by position, a draft counting only behind accepted ones) and each
    finished request's own totals, recounted here from the batches and the model's output;
    a request that finished while a batch holding it was in flight counts nothing of it."""
    case = load_case(CASES / name)
    engine = EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config)
    model = SpecScriptedModel(case)
    k = case.scheduler_config.num_speculative_tokens
    step_fn = engine.step_async if case.scheduler_config.async_scheduling else engine.step
    pending = list(case.requests)
    finished: set[str] = set()
    per_request: dict[str, list[int]] = {}  # request -> [verify steps, drafts, accepted]
    totals = [0, 0, 0]
    step = 0
    while True:
        _admit_arrivals(engine, pending, step)
        result = step_fn(model)
        applied = result.output if not case.scheduler_config.async_scheduling else result.updated
        expected_by_pos = [0] * k
        expected = [0, 0, 0]
        if applied is not None and applied.scheduled_spec_decode_tokens:
            for rid, tokens in result.execution.sampled.items():
                drafts = applied.scheduled_spec_decode_tokens.get(rid)
                if not drafts or not tokens or rid in finished:
                    continue
                accepted = len(tokens) - 1
                counts = per_request.setdefault(rid, [0, 0, 0])
                for i, n in enumerate((1, len(drafts), accepted)):
                    counts[i] += n
                    expected[i] += n
                for position in range(accepted):
                    expected_by_pos[position] += 1
        stats = result.stats.spec_decoding_stats
        got = [0, 0, 0] if stats is None else [stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens]
        assert got == expected, (step, got, expected)
        assert (stats.num_accepted_tokens_per_pos if stats is not None else [0] * k) == expected_by_pos
        for i in range(3):
            totals[i] += got[i]
        for snapshot in result.finished:
            finished.add(snapshot.request_id)
            assert list(snapshot.spec_decode) == per_request.get(snapshot.request_id, [0, 0, 0])
        if not pending and not engine.has_unfinished_requests() and not engine.batch_queue:
            break
        step += 1
        assert step < 5000
    assert totals[0] > 0 and totals[2] < totals[1]  # drafts were verified, and some rejected
