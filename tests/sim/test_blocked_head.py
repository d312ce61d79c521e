"""The blocked waiting head (``KVCacheManager.still_blocked``): skipping the prefix lookup
of a head that provably fails its whole-sequence admission check again changes no
decision. Random pressure workloads with shared prefixes run with the memo and without
it; every step's record (admissions, blocks, preemptions, pool counters) must agree, and
the memo must actually have skipped lookups."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.lockstep.runner import ScriptedModel, step_record

from .builders import full, kv_config


def _run(seed: int, num_blocks: int, watermark: float, async_scheduling: bool, caching: bool,
         memo: bool) -> tuple[list[dict], int]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 5000) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
    arrivals: dict[int, list[Request]] = {}
    outputs = {}
    step = 0
    for i in range(40):
        step += rng.choice((0, 0, 1, 3))
        prompt = rng.choice(prefixes) + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 120))]
        request_id = f"r{i}"
        outputs[request_id] = tuple(rng.randrange(1, 5000) for _ in range(rng.randrange(1, 40)))
        arrivals.setdefault(step, []).append(
            Request(request_id, TokenPrompt(prompt), len(outputs[request_id]), arrival_time=float(i)))
    engine = EngineCore(kv_config(full(), num_blocks=num_blocks),
                        SchedulerConfig(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                                        watermark=watermark, async_scheduling=async_scheduling),
                        CacheConfig(caching, "builtin"))
    engine.kv_cache_manager.remembers_blocked_head = memo
    model = ScriptedModel(outputs)
    pool = engine.kv_cache_manager.block_pool
    step_fn = engine.step_async if async_scheduling else engine.step
    records = []
    for step in range(5000):
        for request in arrivals.pop(step, ()):
            engine.add_request(request)
        if not arrivals and not engine.has_requests() and not engine.batch_queue:
            break
        records.append(step_record(step, step_fn(model), pool))
    return records, engine.scheduler.num_head_lookups_skipped


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(30, 90), watermark=st.sampled_from([0.0, 0.05]),
       async_scheduling=st.booleans(), caching=st.booleans())
def test_skipping_the_blocked_heads_lookup_changes_no_decision(seed, num_blocks, watermark, async_scheduling,
                                                               caching):
    with_memo, skipped = _run(seed, num_blocks, watermark, async_scheduling, caching, memo=True)
    without_memo, none_skipped = _run(seed, num_blocks, watermark, async_scheduling, caching, memo=False)
    assert with_memo == without_memo
    assert none_skipped == 0


def test_a_blocked_head_is_not_looked_up_again_while_nothing_changed():
    skipped = sum(_run(seed, 48, 0.0, False, True, memo=True)[1] for seed in range(5))
    assert skipped > 0
