"""A Mamba "align" group's no-op horizon (``MambaManager.noop_horizon``) is sound.

The scheduler skips a running request's allocation while its tokens end at or below the
KV cache manager's horizon, so wherever the horizon lets a decode step skip, the full
path must change nothing: ``is_noop`` (the O(1) test the manager asks otherwise) holds
there. Checked before every step of busy replays of Mamba + full-attention layouts, and
the horizon must let most decode steps skip (or it would be a horizon in name only).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec


def _trace(seed: int, num_requests: int):
    return synthesize(parse_spec({
        "kind": "chat", "seed": seed, "num_requests": num_requests, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": 20.0},
        "shared_prefix": {"count": 3, "tokens": 400, "zipf_s": 1.0},
        "turns": {"dist": "zipf", "s": 1.2, "max": 4},
        "user_tokens": {"dist": "lognormal", "mean": 200, "sigma": 0.6},
        "output_tokens": {"dist": "lognormal", "mean": 150, "sigma": 0.8},
        "turn_gap_s": {"dist": "exponential", "mean": 2}, "max_prompt_tokens": 2500}))


def _check_horizons(engine: EngineCore) -> tuple[int, int]:
    """Before a step: each running decode whose next token is within its horizon is a
    no-op step for every group. Returns (decodes within the horizon, decodes)."""
    kv_cache_manager = engine.scheduler.kv_cache_manager
    coordinator = kv_cache_manager.coordinator
    within = total = 0
    for request in engine.scheduler.running:
        computed = request.num_computed_tokens
        if computed < request.num_tokens:
            continue  # still prefilling
        total += 1
        end = computed + 1
        if end <= kv_cache_manager.noop_horizon.get(request.request_id, -1):
            within += 1
            assert coordinator.is_noop(request.request_id, max(0, computed - request.num_in_flight_tokens), end, end,
                                       min(end, request.num_tokens)), (request.request_id, computed)
    return within, total


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), model=st.sampled_from([("jamba-mini", 2), ("qwen3-next-80b-a3b", 4)]),
       kv_gib=st.sampled_from([0.6, 2.0]))
def test_a_mamba_horizon_skips_only_no_op_steps(seed, model, kv_gib):
    name, tp = model
    planned = plan(get_model(name), get_gpu("h100"),
                   EngineConfig(max_model_len=4096, tensor_parallel_size=tp, kv_cache_memory_bytes=int(kv_gib * 2**30),
                                max_num_batched_tokens=512, max_num_seqs=64))
    assert any(g.spec.mamba_cache_mode == "align" for g in planned.require_fits().groups
               if hasattr(g.spec, "mamba_cache_mode"))
    engine = EngineCore(planned.require_fits(), planned.engine.scheduler, planned.engine.cache)
    executor = CostModelExecutor(plan_cost_model(planned))
    for arrival in arrivals_from_trace(_trace(seed, 40)):
        engine.add_request(arrival.request)
    within = total = 0
    for _ in range(20_000):
        if not engine.has_requests() and not engine.batch_queue:
            break
        w, t = _check_horizons(engine)
        within += w
        total += t
        engine.step_async(executor)
    assert total and within >= 0.5 * total, (within, total)


@pytest.mark.parametrize("caching", [False])
def test_mamba_none_mode_has_no_horizon(caching):
    """Without prefix caching a Mamba group keeps one state block ("none" mode), where
    ``is_noop`` never holds: no horizon, every step asks the full path."""
    planned = plan(get_model("jamba-mini"), get_gpu("h100"),
                   EngineConfig(max_model_len=4096, tensor_parallel_size=2, kv_cache_memory_bytes=2**30,
                                enable_prefix_caching=caching))
    engine = EngineCore(planned.require_fits(), planned.engine.scheduler, planned.engine.cache)
    executor = CostModelExecutor(plan_cost_model(planned))
    for arrival in arrivals_from_trace(_trace(5, 10)):
        engine.add_request(arrival.request)
    for _ in range(300):
        engine.step_async(executor)
        for request in engine.scheduler.running:
            assert engine.scheduler.kv_cache_manager.noop_horizon.get(request.request_id, -1) == -1
