"""Property tests: random configurations and workloads, invariants after every step.

Each example builds a random KV cache layout (hybrid mixes of full attention, sliding
window, chunked local and Mamba "align" groups at block size 16, or one coarse full-
attention group of block size 32 hashed at 16), a small pool (pressure and preemption,
but every request fits on its own), random scheduler knobs, and a workload drawn from a
tiny token alphabet with shared prefixes and resends so that prefix hits happen. The
engine is stepped with a scripted model and ``check_invariants`` runs after every step.
The invariants and the tests that check them are listed in ``docs/invariants.md``.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.block_pool import BlockPool
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.prefill_throttle import throttles_prefills
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.lockstep.golden import CaseRequest, GoldenCase, load_case
from kvtwin.sim.core.hashing import BlockHasher, TokenPrompt, get_hash_fn
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.lockstep.runner import ScriptedModel, run_case, scripted_model, step_record
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from tests.sim.block_table_mirror import BlockTableMirror
from tests.sim.invariant_checks import check_cache_hit_probe, check_invariants

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# KVTWIN_PROPERTY_SCALE=20 runs 20x the examples (a longer bug hunt; the default keeps CI fast).
SCALE = max(1, int(os.environ.get("KVTWIN_PROPERTY_SCALE", "1")))


def examples(n: int) -> int:
    return n * SCALE


# -- scenarios -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    kv_cache_config: KVCacheConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    requests: tuple[CaseRequest, ...]  # in arrival order; some may be rejected by the engine

    def accepted(self) -> tuple[CaseRequest, ...]:
        max_len = self.scheduler_config.max_model_len
        return tuple(r for r in self.requests if len(r.prompt_token_ids) < max_len and r.output_token_ids)

    def golden_case(self, hash_algo: str | None = None) -> GoldenCase:
        cache = self.cache_config if hash_algo is None else replace(self.cache_config,
                                                                    prefix_caching_hash_algo=hash_algo)
        return GoldenCase("hypothesis", self.kv_cache_config, self.scheduler_config, cache, self.accepted())


BS = 16
SPEC_MAKERS = {
    "full": lambda d: FullAttentionSpec(block_size=BS),
    "swa": lambda d: SlidingWindowSpec(block_size=BS, sliding_window=d(st.sampled_from([1, 8, 16, 17, 31, 32, 48, 64]))),
    "chunked": lambda d: ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=d(st.sampled_from([16, 32, 64]))),
    "mamba": lambda d: MambaSpec(block_size=BS, shapes=((4, 8),), dtype_bytes=(2,), mamba_cache_mode="align"),
    # Mamba-2 / gated DeltaNet: prefill checkpoints on a 1-, 16- or 64-token grid.
    "mamba_ckpt": lambda d: MambaSpec(block_size=BS, shapes=((4, 8),), dtype_bytes=(2,), mamba_cache_mode="align",
                                      num_prefill_checkpoint_blocks=1,
                                      prefill_checkpoint_alignment=d(st.sampled_from([1, 16, 64]))),
}


@st.composite
def kv_layouts(draw) -> tuple[tuple[KVCacheGroupSpec, ...], int]:
    """Groups and hash block size (num_blocks is chosen later, from the scheduler knobs)."""
    if draw(st.integers(0, 5)) == 0:
        # One coarse group: block 32, hashed at 16 (coarse hashes reuse every 2nd fine hash).
        return (KVCacheGroupSpec(("layer0",), FullAttentionSpec(block_size=32)),), 16
    num_groups = draw(st.sampled_from([1, 2, 2, 3, 3, 4]))
    kinds = [draw(st.sampled_from(sorted(SPEC_MAKERS))) for _ in range(num_groups)]
    if draw(st.booleans()) and "full" not in kinds:
        kinds.insert(0, "full")  # the common hybrid shape: full attention + others
    specs = [SPEC_MAKERS[k](draw) for k in kinds]
    return tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs)), BS


@st.composite
def scenarios(draw, *, caching: bool | None = None, rejects: bool = True) -> Scenario:
    groups, hash_block_size = draw(kv_layouts())
    # Half the examples are a burst: many concurrent long requests on a pool that holds one
    # worst-case request and nothing more, so decode growth forces (repeated) preemption.
    burst = draw(st.booleans())
    max_model_len = draw(st.integers(24, 160))
    chunked = draw(st.booleans()) or max_model_len > 128
    if chunked:
        budget = draw(st.sampled_from([1, 5, 16, 24, 32, 64, 100, 256]))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 64))
    sched = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(3, 8) if burst else st.integers(1, 6)),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 0, 8, 20, 48])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.1])),
        # Async: two batches in flight (EngineCore.step_async), and twice the tokens in
        # flight for the windowed admission caps.
        async_scheduling=draw(st.integers(0, 2)) == 0,
    )
    # Small pools: the worst case of one request plus a little, so requests fit alone.
    worst = sum(g.spec.max_admission_blocks_per_request(sched.max_in_flight_tokens, max_model_len) for g in groups)
    if sched.async_scheduling:
        # A Mamba "align" request holds one more state (and checkpoint) block while two
        # batches are in flight (MAMBA-BOUND); with less, vLLM (and this core) preempts it
        # forever.
        worst += sum(1 + g.spec.num_prefill_checkpoint_blocks for g in groups
                     if isinstance(g.spec, MambaSpec) and g.spec.mamba_cache_mode == "align")
    extra = draw(st.sampled_from([0, 1, 2] if burst else [0, 1, 3, 8, worst // 2, 2 * worst]))
    num_blocks = 1 + worst + extra
    # Prefix-cache retention: dense, vLLM's engine default (semantic checkpoints only), or
    # periodic on the hit grid where a sliding-window or Mamba group can be thinned.
    thinnable = any(isinstance(g.spec, (SlidingWindowSpec, MambaSpec)) for g in groups)
    grid = math.lcm(*(g.spec.block_size for g in groups))
    retention = draw(st.sampled_from([None, 0, 0] + ([grid, 2 * grid, 4 * grid] if thinnable else [])))
    kv = KVCacheConfig(num_blocks=num_blocks, groups=groups, hash_block_size=hash_block_size,
                       prefix_cache_retention_interval=retention)
    enable_caching = draw(st.integers(0, 4)) > 0 if caching is None else caching
    cache = CacheConfig(enable_prefix_caching=enable_caching, prefix_caching_hash_algo="builtin",
                        prefix_cache_retention_interval=retention)

    # Workload: tokens from a tiny alphabet, shared prefixes and resends, so hits happen.
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    alphabet = draw(st.integers(1, 4))
    bases = [[rng.randrange(alphabet) for _ in range(max_model_len)] for _ in range(draw(st.integers(1, 3)))]
    num_requests = draw(st.integers(4, 12) if burst else st.integers(1, 12))
    requests: list[CaseRequest] = []
    arrival = 0
    for i in range(num_requests):
        arrival += draw(st.sampled_from([0, 0, 1] if burst else [0, 0, 0, 1, 2, 5, 20]))
        kind = draw(st.sampled_from(["prefix", "prefix", "fresh", "resend", "reject"] if rejects
                                    else ["prefix", "prefix", "fresh", "resend"]))
        if kind == "reject":
            # Either a prompt that leaves no room for output, or no output at all.
            if draw(st.booleans()):
                prompt = bases[0][:max_model_len] + [0] * draw(st.integers(0, 3))
                outputs = (1,)
            else:
                prompt, outputs = bases[0][:draw(st.integers(1, max_model_len - 1))], ()
            requests.append(CaseRequest(f"r{i}", arrival, tuple(prompt), outputs, draw(st.integers(0, 2))))
            continue
        sources = [r for r in requests if r.output_token_ids and len(r.prompt_token_ids) < max_model_len]
        if kind == "resend" and sources:
            src = rng.choice(sources)
            prompt = list(src.prompt_token_ids)
            if draw(st.booleans()):
                # A follow-up turn: the previous prompt, its answer, and a new question.
                prompt = prompt + list(src.output_token_ids)
                prompt += [rng.randrange(alphabet) for _ in range(rng.randint(0, 20))]
        else:
            # Long prompts (and long outputs) make decode growth outrun small pools: preemption.
            low = draw(st.sampled_from([max_model_len // 3, max_model_len // 2] if burst
                                       else [1, 1, max_model_len // 3, max_model_len // 2]))
            length = draw(st.integers(low, max_model_len - 1))
            if kind == "prefix":
                base = rng.choice(bases)
                shared = rng.randint(0, length)
                prompt = base[:shared] + [rng.randrange(alphabet) for _ in range(length - shared)]
            else:
                prompt = [rng.randrange(alphabet) for _ in range(length)]
        prompt = prompt[:max_model_len - 1]
        num_out = min(draw(st.sampled_from([1, 2, 5, 16, 40, 64, 100])), max_model_len - len(prompt))
        outputs = tuple(rng.randrange(alphabet) for _ in range(num_out))
        requests.append(CaseRequest(f"r{i}", arrival, tuple(prompt), outputs, draw(st.integers(0, 2))))
    return Scenario(kv, sched, cache, tuple(requests))


def _describe(s: Scenario) -> str:
    kv = s.kv_cache_config
    return (f"groups={[g.spec for g in kv.groups]} num_blocks={kv.num_blocks} hash_bs={kv.hash_block_size}\n"
            f"{s.scheduler_config}\n{s.cache_config}\n"
            + "\n".join(f"  {r.request_id} t={r.arrival_step} prio={r.priority} prompt({len(r.prompt_token_ids)})="
                        f"{list(r.prompt_token_ids)} out={list(r.output_token_ids)}" for r in s.requests))


# -- the driver -------------------------------------------------------------------------------

@dataclass
class RunResult:
    steps: list[dict]
    admissions: dict[str, list[dict]]
    preemptions: dict[str, int]
    rejected: list[str]
    engine: EngineCore
    mirror: BlockTableMirror | None = None
    # Async only: preempted while their last token was in flight, finished from the waiting
    # queue when it arrived (never re-admitted).
    finished_while_waiting: set[str] = field(default_factory=set)


def step_bound(s: Scenario) -> int:
    """A generous bound on steps: the head of the running list gains >= 1 token per step."""
    accepted = s.accepted()
    work = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in accepted)
    last_arrival = max((r.arrival_step for r in s.requests), default=0)
    return last_arrival + 2 * work + 4 * len(accepted) + 50


def run_scenario(s: Scenario, *, check: bool = True, probe_rng: random.Random | None = None,
                 mirror: bool = True) -> RunResult:
    """Step the engine like ``sim.lockstep.run_case``; check invariants after every step.

    An async configuration is stepped with ``EngineCore.step_async``: a step's update then
    applies the batch scheduled one step earlier, so "it sampled" is read from the
    schedule (``num_output_tokens``) and a request preempted in a step may still receive
    the token of the batch in flight (delivered in the same step: the queue held it).

    With ``mirror``, the scripted model runs inside a ``BlockTableMirror`` whose tables,
    rebuilt from the scheduler outputs alone, are compared with the manager's after every
    step (BLOCK-TABLE-MIRROR). With ``probe_rng``, also probe the prefix-cache finder
    (HIT-AGREE / HIT-MONOTONE) with the hash chains of every request seen so far after
    every step.
    """
    engine = EngineCore(s.kv_cache_config, s.scheduler_config, s.cache_config)
    sched = engine.scheduler
    kvm = engine.kv_cache_manager
    pool = kvm.block_pool
    model = scripted_model(GoldenCase("scenario", s.kv_cache_config, s.scheduler_config, s.cache_config, s.requests))
    num_spec = s.scheduler_config.num_speculative_tokens
    table_mirror = BlockTableMirror(model) if mirror else None
    if table_mirror is not None:
        table_mirror.asynchronous = s.scheduler_config.async_scheduling
        table_mirror.pipelined = engine.async_scheduling and not s.scheduler_config.async_scheduling
        model = table_mirror
    objs: dict[str, Request] = {}
    finished: set[str] = set()
    admissions: dict[str, list[dict]] = {r.request_id: [] for r in s.requests}
    preemptions: dict[str, int] = {r.request_id: 0 for r in s.requests}
    outputs_at_preemption: dict[str, list[int]] = {}
    finished_while_waiting: set[str] = set()
    preempted_waiting: set[str] = set()  # preempted and not re-admitted yet
    # request id -> (num_tokens at admission, hit, tokens scheduled since): until it samples
    recompute: dict[str, list[int]] = {}
    steps: list[dict] = []
    pending = list(s.requests)
    next_arrival = 0
    bound = step_bound(s)
    step = 0
    # A batch queue (asynchronous scheduling, or pipeline stages) is stepped as vLLM's
    # step_with_batch_queue; a prefill cadence as one rank of a DP group in one wave, the
    # step number its step counter (as sim/lockstep/runner.py steps these cases).
    is_async = engine.async_scheduling
    interval = s.scheduler_config.prefill_schedule_interval
    if interval > 1 and s.scheduler_config.data_parallel_size > 1:
        def step_fn(executor):
            return engine.step(executor, throttles_prefills(interval, step))
    else:
        step_fn = engine.step_async if is_async else engine.step
    if check:
        check_invariants(engine)
    while True:
        while next_arrival < len(pending) and pending[next_arrival].arrival_step == step:
            spec = pending[next_arrival]
            request = Request(spec.request_id, TokenPrompt(spec.prompt_token_ids), len(spec.output_token_ids),
                              arrival_time=float(next_arrival), priority=spec.priority)
            objs[spec.request_id] = request
            accepted = engine.add_request(request)
            if accepted != (spec in s.accepted()):
                raise AssertionError(f"REQ-CONSERVE: {spec.request_id} accepted={accepted} "
                                     f"(prompt {len(spec.prompt_token_ids)}, max_tokens {len(spec.output_token_ids)})")
            next_arrival += 1
        num_tokens_before = {rid: r.num_tokens for rid, r in sched.requests.items()}
        in_flight_before = {rid: r.num_in_flight_tokens for rid, r in sched.requests.items()}
        outputs_before = {rid: list(r.output_token_ids) for rid, r in sched.requests.items()}
        result = step_fn(model)
        out = result.output
        for rid in out.preempted:
            preemptions[rid] += 1
            kept = objs[rid].output_token_ids
            # Async: the batch in flight still delivers its tokens (stale output): one, plus
            # the drafts it accepted.
            grew = len(kept) - len(outputs_before[rid])
            if kept[:len(outputs_before[rid])] != outputs_before[rid] or not 0 <= grew <= int(is_async) * (1 + num_spec):
                raise AssertionError(f"PREEMPT-RESUME: preempting {rid} changed its outputs "
                                     f"{outputs_before[rid]} -> {kept}")
            outputs_at_preemption[rid] = list(kept)
            preempted_waiting.add(rid)
            outputs_before[rid] = list(kept)
            recompute.pop(rid, None)
        for adm in out.scheduled_new_reqs:
            preempted_waiting.discard(adm.req_id)
            admissions[adm.req_id].append({"step": step, "hit_tokens": adm.hit_tokens})
            request = objs[adm.req_id]
            if check and adm.resumed:
                # PREEMPT-RESUME: outputs kept; the hit is capped like any other.
                if adm.req_id not in outputs_at_preemption:
                    raise AssertionError(f"PREEMPT-RESUME: {adm.req_id} resumed but was never preempted")
                kept = outputs_at_preemption.pop(adm.req_id)
                if request.output_token_ids[:len(kept)] != kept or outputs_before[adm.req_id] != kept:
                    raise AssertionError(f"PREEMPT-RESUME: {adm.req_id} lost output tokens {kept} -> "
                                         f"{request.output_token_ids}")
                if adm.hit_tokens > num_tokens_before[adm.req_id] - 1:
                    raise AssertionError(f"PREEMPT-RESUME: {adm.req_id} resumed with hit {adm.hit_tokens} of "
                                         f"{num_tokens_before[adm.req_id]} tokens")
            elif check and adm.req_id in outputs_at_preemption:
                raise AssertionError(f"PREEMPT-RESUME: {adm.req_id} re-admitted without resumed=True")
            recompute[adm.req_id] = [num_tokens_before[adm.req_id], adm.hit_tokens, 0]
        for rid, n in out.num_scheduled_tokens.items():
            if rid in recompute:
                recompute[rid][2] += n
                if rid in out.num_output_tokens:
                    # It samples: exactly its tokens minus the hit were (re)computed.
                    num_tokens, hit, done = recompute.pop(rid)
                    # A one-token recompute may be padded with placeholder drafts.
                    done -= len((out.scheduled_spec_decode_tokens or {}).get(rid, ()))
                    if check and done != num_tokens - hit:
                        raise AssertionError(f"PREEMPT-RESUME: {rid} computed {done} tokens before sampling; "
                                             f"expected num_tokens {num_tokens} - hit {hit}")
        for request in result.finished:
            finished.add(request.request_id)
            if request.request_id in preempted_waiting:
                if not is_async:
                    raise AssertionError(f"PREEMPT-RESUME: {request.request_id} finished while preempted")
                finished_while_waiting.add(request.request_id)
            if request.status is not RequestStatus.FINISHED:
                raise AssertionError(f"REQ-CONSERVE: finished {request.request_id} has status {request.status}")
        steps.append(step_record(step, result, pool, num_spec > 0))
        if table_mirror is not None:
            table_mirror.check(engine, result)
        if check:
            check_invariants(engine, result, num_tokens_before, in_flight_before)
            # REQ-CONSERVE over the whole workload: not arrived / waiting / running / finished / rejected.
            arrived = {r.request_id for r in pending[:next_arrival]}
            rejected = {r.request.request_id for r in engine.rejected}
            live = set(sched.requests)
            parts = [arrived - live - finished - rejected, live & finished, live & rejected, finished & rejected]
            if parts[0] or parts[1] or parts[2] or parts[3]:
                raise AssertionError(f"REQ-CONSERVE: lost {parts[0]}, live&finished {parts[1]}, "
                                     f"live&rejected {parts[2]}, finished&rejected {parts[3]}")
            for rid in finished:
                r = objs[rid]
                if r.num_output_tokens != r.max_tokens and r.num_tokens < s.scheduler_config.max_model_len:
                    raise AssertionError(f"REQ-CONSERVE: {rid} finished early with {r.num_output_tokens} tokens")
        if probe_rng is not None:
            for request in objs.values():
                if request.status is RequestStatus.REJECTED:
                    continue
                top = request.num_tokens - 1  # what the scheduler asks (>= 0)
                shorter = [probe_rng.randint(0, max(top, 0)) for _ in range(2)] + [top - 1, top - BS]
                check_cache_hit_probe(kvm.coordinator, request.block_hashes, top, shorter)
        all_arrived = next_arrival == len(pending)
        if all_arrived and not engine.has_unfinished_requests() and not engine.batch_queue:
            break
        step += 1
        if step > bound:
            raise AssertionError(f"PROGRESS: not finished after {bound} steps; running "
                                 f"{[r.request_id for r in sched.running]}, waiting "
                                 f"{[r.request_id for r in sched.waiting]}")
    return RunResult(steps, admissions, preemptions, [r.request.request_id for r in engine.rejected], engine,
                     table_mirror, finished_while_waiting)


# -- engine-level properties -------------------------------------------------------------------------------

@settings(max_examples=examples(300), **COMMON)
@given(scenarios())
def test_invariants_hold_after_every_step(s: Scenario):
    """POOL-*, GROUP-DISJOINT, HIT-CAP, SWA/MAMBA-BOUND, BUDGET, REQ-CONSERVE, PREEMPT-RESUME,
    PROGRESS and FREE-ON-FINISH over random layouts, knobs and workloads."""
    try:
        result = run_scenario(s)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_describe(s)}") from None
    engine = result.engine
    pool = engine.kv_cache_manager.block_pool
    # FREE-ON-FINISH
    assert pool.get_num_free_blocks() == s.kv_cache_config.num_blocks - 1, _describe(s)
    assert engine.kv_cache_manager.usage == 0.0
    assert all(not m.req_to_blocks and not m.num_cached_block for m in engine.kv_cache_manager.coordinator.managers)
    # Coverage of what the workload exercised (shown by --hypothesis-show-statistics).
    for kind in sorted({g.spec.kind for g in s.kv_cache_config.groups}):
        event(f"layout has {kind}")
    event(f"groups: {len(s.kv_cache_config.groups)}")
    event(f"prefix caching: {s.cache_config.enable_prefix_caching}")
    event(f"resumed with a hit: {any(a['hit_tokens'] for v in result.admissions.values() for a in v[1:])}")
    event(f"preemptions: {'yes' if any(result.preemptions.values()) else 'no'}")
    event(f"prefix hits: {'yes' if any(a['hit_tokens'] for v in result.admissions.values() for a in v) else 'no'}")
    event(f"steps: {'>50' if len(result.steps) > 50 else '<=50'}")
    # PREEMPT-RESUME bookkeeping: each preemption is followed by exactly one re-admission,
    # unless (async) the preempted request's last token was in flight and finished it.
    event(f"finished while preempted (async): {'yes' if result.finished_while_waiting else 'no'}")
    for r in s.accepted():
        resumed = result.preemptions[r.request_id] + (r.request_id not in result.finished_while_waiting)
        assert len(result.admissions[r.request_id]) == resumed, r.request_id


@settings(max_examples=examples(80), **COMMON)
@given(scenarios(caching=True, rejects=False), st.integers(0, 2**32 - 1))
def test_cache_hit_fixed_point_and_monotone(s: Scenario, seed: int):
    """HIT-AGREE / HIT-MONOTONE: probe the finder with every known chain after every step."""
    try:
        run_scenario(s, check=False, probe_rng=random.Random(seed))
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_describe(s)}") from None


@settings(max_examples=examples(300), **COMMON)
@given(kv_layouts(), st.integers(0, 2**32 - 1))
def test_cache_hit_on_random_pool_states(layout, seed: int):
    """HIT-AGREE / HIT-MONOTONE on pools built directly: random blocks of one chain cached
    per group (some held, some evictable in the free queue, some evicted), probed at
    random maxima; the hit must be the longest length every group accepts."""
    groups, hash_block_size = layout
    rng = random.Random(seed)
    chain_len = rng.randint(0, 24)
    chain = [rng.getrandbits(60) for _ in range(chain_len)]
    other = chain[:rng.randint(0, chain_len)] + [rng.getrandbits(60) for _ in range(rng.randint(0, 6))]
    kv = KVCacheConfig(num_blocks=2 + 2 * len(groups) * (chain_len + 8), groups=groups,
                       hash_block_size=hash_block_size)
    kvm = KVCacheManager(kv, max_model_len=(chain_len + 8) * hash_block_size, max_in_flight_tokens=64)
    coordinator = kvm.coordinator
    pool = kvm.block_pool
    for gid, manager in enumerate(coordinator.managers):
        density = rng.choice([0.3, 0.7, 0.9, 1.0])
        for chain_hashes in (chain, other):
            hashes = coordinator.hashes_for(chain_hashes, manager)
            for i in range(len(hashes)):
                if rng.random() < density and pool.get_cached_block(hashes[i], [gid]) is None:
                    [block] = pool.get_new_blocks(1)
                    pool.cache_full_blocks([block], [hashes[i]], 0, 1, gid)
                    if rng.random() < 0.5:
                        pool.free_blocks([block])  # evictable, still hittable
    # Reuse a few free blocks: their cache entries are evicted (lazily, now).
    pool.get_new_blocks(rng.randint(0, min(pool.get_num_free_blocks(), 6)))
    top = chain_len * hash_block_size
    # In the scheduler's domain: max = num_tokens - 1 < (len(chain) + 1) * hash_block_size.
    for max_length in {top, max(top - 1, 0), top + hash_block_size - 1, rng.randint(0, top + hash_block_size - 1),
                       rng.randint(0, top)}:
        shorter = [rng.randint(0, max_length) for _ in range(3)] + [max_length - hash_block_size]
        check_cache_hit_probe(coordinator, chain, max_length, shorter, exhaustive=True)


@settings(max_examples=examples(60), **COMMON)
@given(scenarios(rejects=False))
def test_determinism_same_case_twice(s: Scenario):
    """DETERMINISM (scheduler level): the same case gives identical step and request records,
    and this file's driver agrees with the lockstep runner."""
    first, second = run_scenario(s, check=False), run_scenario(s, check=False)
    assert first.steps == second.steps
    assert first.admissions == second.admissions
    a, b = run_case(s.golden_case()), run_case(s.golden_case())
    assert a.steps == b.steps and a.requests == b.requests
    assert a.steps == first.steps, _describe(s)
    assert {r["request_id"]: r["admissions"] for r in a.requests} == first.admissions


GOLDEN_CASES = Path(__file__).resolve().parents[1] / "golden" / "cases"
_RUN_GOLDEN = """
import json, sys
from pathlib import Path
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.lockstep.runner import run_case
out = {}
for d in sorted(Path(sys.argv[1]).iterdir()):
    if (d / "config.json").exists():
        r = run_case(load_case(d, hash_algo="builtin"))
        out[d.name] = {"steps": r.steps, "requests": r.requests}
print(json.dumps(out, sort_keys=True))
"""


def test_determinism_across_processes():
    """DETERMINISM across processes: the golden cases give identical records in a process
    with another PYTHONHASHSEED (no decision may depend on set/str-hash order)."""
    if not GOLDEN_CASES.is_dir():
        pytest.skip("no golden cases")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    proc = subprocess.run([sys.executable, "-c", _RUN_GOLDEN, str(GOLDEN_CASES)], env=env, capture_output=True,
                          text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    other = json.loads(proc.stdout)
    here = {}
    for d in sorted(GOLDEN_CASES.iterdir()):
        if (d / "config.json").exists():
            r = run_case(load_case(d, hash_algo="builtin"))
            here[d.name] = json.loads(json.dumps({"steps": r.steps, "requests": r.requests}, sort_keys=True))
    assert here and here.keys() == other.keys()
    for name in here:
        assert here[name] == other[name], name


@settings(max_examples=examples(60), **COMMON)
@given(scenarios(caching=True, rejects=False))
def test_hash_algo_does_not_change_decisions(s: Scenario):
    """sha256 and builtin hashes give identical step and request records."""
    sha = run_case(s.golden_case("sha256"))
    builtin = run_case(s.golden_case("builtin"))
    assert sha.steps == builtin.steps, _describe(s)
    assert sha.requests == builtin.requests, _describe(s)


def test_unrunnable_requests_are_rejected_or_reported():
    """PROGRESS, second half: a request that can never run (too long, no output, or more
    blocks than the pool holds) is rejected with a reason instead of waiting forever."""
    sched = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, async_scheduling=False)
    kv = KVCacheConfig(num_blocks=3, groups=(KVCacheGroupSpec(("l",), FullAttentionSpec(block_size=16)),))
    engine = EngineCore(kv, sched, CacheConfig())
    too_long = Request("long", TokenPrompt([1] * 64), 4)
    no_output = Request("none", TokenPrompt([1] * 8), 0)
    assert not engine.add_request(too_long) and not engine.add_request(no_output)
    assert too_long.status is RequestStatus.REJECTED and no_output.status is RequestStatus.REJECTED
    assert [r.request for r in engine.rejected] == [too_long, no_output]
    assert [r.code for r in engine.rejected] == ["prompt_too_long", "bad_max_tokens"]
    assert all(r.detail for r in engine.rejected)
    assert not engine.has_unfinished_requests()
    # 40 tokens need 3 blocks; the pool has 2 usable: rejected up front, never left waiting.
    big = Request("big", TokenPrompt([1] * 39), 1)
    assert not engine.add_request(big) and engine.rejected[-1].code == "exceeds_kv_pool"
    assert "more than the pool's 2" in engine.rejected[-1].detail
    # The lockstep runner turns such a rejection into an error naming the request.
    case = GoldenCase("toobig", kv, sched, CacheConfig(), (CaseRequest("big", 0, (1,) * 39, (2,), 0),))
    try:
        run_case(case, max_idle_steps=5)
    except ConfigError as err:
        assert "big" in str(err)
    else:
        raise AssertionError("a request that can never fit the pool was left waiting without an error")


# -- block-pool properties -------------------------------------------------------------------------------

@settings(max_examples=examples(150), **COMMON)
@given(st.integers(2, 24), st.data())
def test_block_pool_free_order(num_blocks: int, data):
    """POOL-ORDER / POOL-HASH / POOL-NULL on the pool alone: freed unhashed blocks go to the
    front (in the given order), hashed ones to the tail; allocation pops the front and
    evicts a reused block's hash (lazy eviction); block 0 is never handed out."""
    pool = BlockPool(num_blocks, 2, enable_caching=True)
    held: list = []
    next_hash = 0
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["alloc", "alloc", "free", "touch", "cache"]))
        queue = pool.free_block_queue.block_ids()
        assert 0 not in queue and len(queue) == pool.get_num_free_blocks()
        if op == "alloc":
            n = data.draw(st.integers(0, pool.get_num_free_blocks()))
            blocks = pool.get_new_blocks(n)
            assert [b.block_id for b in blocks] == queue[:n]
            assert pool.free_block_queue.block_ids() == queue[n:]
            for b in blocks:
                assert b.block_id != 0 and b.ref_cnt == 1 and b.block_hash is None
                assert all(b not in m.values() and all(b not in (v.values() if isinstance(v, dict) else [v])
                                                       for v in m.values())
                           for m in pool.cached_block_hash_to_block)
            held.extend(blocks)
        elif op == "cache" and held:
            block = data.draw(st.sampled_from(held))
            if block.block_hash is None:
                gid = data.draw(st.integers(0, 1))
                key = data.draw(st.sampled_from([next_hash, 0]))  # sometimes a duplicate key
                next_hash += 1
                pool.cache_full_blocks([block], [key], 0, 1, gid)
                assert pool.get_cached_block(key, [gid]) is not None
        elif op == "touch":
            # Revive an evictable cached block (a prefix hit) or add a reference to a held one.
            cached_free = [pool.blocks[i] for i in queue if pool.blocks[i].block_hash is not None]
            candidates = cached_free + held
            if candidates:
                block = data.draw(st.sampled_from(candidates))
                was_free = block.ref_cnt == 0
                pool.touch([block])
                if was_free:
                    assert pool.free_block_queue.block_ids() == [i for i in queue if i != block.block_id]
                held.append(block)
        elif op == "free" and held:
            order = data.draw(st.permutations(held))
            k = data.draw(st.integers(0, len(order)))
            to_free = order[:k]
            before = {b.block_id: b.ref_cnt for b in to_free}
            pool.free_blocks(to_free)
            for b in to_free:
                held.remove(b)
            # Blocks reaching ref 0, in the given order, at the entry that drops the last ref.
            reaching_zero, count = [], dict(before)
            for b in to_free:
                count[b.block_id] -= 1
                if count[b.block_id] == 0:
                    reaching_zero.append(b)
            front = [b.block_id for b in reaching_zero if b.block_hash is None]
            tail = [b.block_id for b in reaching_zero if b.block_hash is not None]
            assert pool.free_block_queue.block_ids() == front + queue + tail
        # Conservation on the pool alone.
        assert pool.get_num_free_blocks() + len({b.block_id for b in held}) == num_blocks - 1
        for block in pool.blocks[1:]:
            assert block.ref_cnt == sum(1 for b in held if b is block)


@settings(max_examples=examples(80), **COMMON)
@given(st.integers(1, 120), st.integers(1, 3), st.integers(0, 2**32 - 1), st.booleans())
def test_request_blocks_freed_last_block_first(prompt_len: int, alphabet: int, seed: int, sliding: bool):
    """POOL-ORDER through the KV cache manager: a request's blocks are freed last-first, so
    its partial (unhashed) block goes to the front and its cached chain joins the tail
    last-block-first (the chain's tail is evicted first)."""
    rng = random.Random(seed)
    spec = SlidingWindowSpec(block_size=BS, sliding_window=1000) if sliding else FullAttentionSpec(block_size=BS)
    kv = KVCacheConfig(num_blocks=2 + cdiv(128, BS), groups=(KVCacheGroupSpec(("l",), spec),))
    kvm = KVCacheManager(kv, max_model_len=128, max_in_flight_tokens=128, enable_caching=True)
    request = Request("a", TokenPrompt([rng.randrange(alphabet) for _ in range(prompt_len)]), 1)
    request.attach_hasher(BlockHasher(get_hash_fn("builtin"), BS))
    before = kvm.block_pool.free_block_queue.block_ids()
    assert kvm.allocate_slots(request, prompt_len, full_sequence_must_fit=True, has_scheduled_reqs=False) is not None
    table = kvm.get_blocks("a")[0]
    assert len(table) == cdiv(prompt_len, BS)
    untouched = before[len(table):]
    kvm.free(request)
    reversed_table = list(reversed(table))
    front = [b.block_id for b in reversed_table if b.block_hash is None]
    tail = [b.block_id for b in reversed_table if b.block_hash is not None]
    assert len(tail) == prompt_len // BS
    assert kvm.block_pool.free_block_queue.block_ids() == front + untouched + tail
