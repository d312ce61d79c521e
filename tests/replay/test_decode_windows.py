"""Decode windows (``sim/core/decode_window.py``) change no decision and no record.

A replay with windows and one without must write the same bytes: every table, on the
bundled traces and on random chat workloads that overload a small KV cache (admissions
from inside a window, chunked prefills, finishes, preemptions, prefix hits, a time limit
that cuts a run short, both scheduling policies, replicas behind a router). Each
comparison also checks that windows ran, so it cannot pass by never opening one. The
closed-form decode cost a window prices its batches with is checked against the cost
model's general form, to the bit.
"""

from __future__ import annotations

import dataclasses

import io
from dataclasses import astuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.core.window_opening import open_decode_window
from kvtwin.sim.core.window_pricing import CHUNK_KEYS, WINDOW_KEYS, LocalKeySum, decode_keys
from kvtwin.sim.core.engine import EngineCore
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.trace_requests import arrivals_from_trace
from kvtwin.sim.calibration.file import bundled_calibration
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.replay.run import CostModelExecutor, RecordedClockExecutor, plan_cost_model, run_replay, \
    run_with_executor
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec

from .chat_workload import chat_trace, llama_plan


def _bytes(table: pa.Table | None) -> bytes:
    sink = io.BytesIO()
    if table is not None:
        pq.write_table(table, sink)
    return sink.getvalue()


def _replay(run, **kwargs) -> tuple[dict[str, bytes], ReplayClock]:
    """``run(**kwargs, on_progress=...)``'s tables as parquet bytes, and its final clock."""
    clocks: list[ReplayClock] = []
    result = run(**kwargs, on_progress=clocks.append)
    tables = {name: _bytes(getattr(result, name)) for name in ("requests", "steps", "summary", "replicas")}
    return tables, clocks[-1]


def _assert_same_with_and_without_windows(run, min_window_share: float, **kwargs) -> ReplayClock:
    windowed, clock = _replay(run, decode_windows=True, **kwargs)
    stepwise, stepwise_clock = _replay(run, decode_windows=False, **kwargs)
    for name in windowed:
        assert windowed[name] == stepwise[name], f"{name} differs with decode windows"
    assert stepwise_clock.decode_window_steps == 0
    assert clock.steps == stepwise_clock.steps
    assert clock.decode_window_steps >= min_window_share * clock.steps, (clock.decode_window_steps, clock.steps)
    return clock


@pytest.mark.parametrize(("scenario", "gpu", "limit"), [
    ("mooncake-llama8b-h100-overload.toml", None, 1500),
    ("azure-conv-llama8b.toml", "a100-80gb", 1500),
    ("default.toml", None, 1500),  # two replicas behind a router: windows in both
])
def test_bundled_traces_replay_the_same_with_decode_windows(scenario, gpu, limit):
    resolved = resolve_scenario(SCENARIOS_DIR / scenario, Overrides(gpu=gpu, limit=limit))
    planned = resolved.plan()
    trace = resolved.require_workload().load()
    # Most of these replays' batches only decode: most steps run inside windows.
    _assert_same_with_and_without_windows(run_replay, 0.5, plan=planned, trace=trace, efficiency=resolved.efficiency,
                                          slo=resolved.slo)


def _overload_trace(seed: int, rate_per_s: float, num_requests: int) -> pa.Table:
    return synthesize(parse_spec({
        "kind": "chat", "seed": seed, "num_requests": num_requests, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": rate_per_s},
        "shared_prefix": {"count": 3, "tokens": 400, "zipf_s": 1.0},
        "turns": {"dist": "zipf", "s": 1.2, "max": 6},
        "user_tokens": {"dist": "lognormal", "mean": 200, "sigma": 0.6},
        "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.8},
        "turn_gap_s": {"dist": "exponential", "mean": 5}, "max_prompt_tokens": 3000}))


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 10_000), rate_per_s=st.sampled_from([2.0, 8.0, 30.0]),
       kv_gib=st.sampled_from([0.6, 1.0, 3.0]), max_num_seqs=st.sampled_from([8, 64]),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(), cut=st.booleans(),
       budget=st.sampled_from([256, 1024, None]))
def test_random_overloads_replay_the_same_with_decode_windows(seed, rate_per_s, kv_gib, max_num_seqs, policy,
                                                             caching, cut, budget):
    # A small token budget chunks most prompts: windows carry a prefilling request.
    planned = llama_plan(kv_cache_memory_bytes=int(kv_gib * 2**30), max_num_seqs=max_num_seqs,
                         scheduling_policy=policy, enable_prefix_caching=caching, max_model_len=4096,
                         max_num_batched_tokens=budget)
    trace = _overload_trace(seed, rate_per_s, 120)
    time_limit_s = None
    if cut:  # stop halfway through: whatever a window holds must be written out by then
        full = run_replay(planned, trace, decode_windows=False)
        time_limit_s = full.end_time_s / 2
    _assert_same_with_and_without_windows(run_replay, 0.05, plan=planned, trace=trace, time_limit_s=time_limit_s)


def test_windows_survive_preemption_pressure():
    """A cache of a few thousand tokens under a burst: windows open between preemptions,
    end where an allocation might not fit, and the run is the same."""
    planned = llama_plan(kv_cache_memory_bytes=int(0.6 * 2**30), max_num_seqs=64, max_model_len=4096)
    trace = _overload_trace(11, 30.0, 200)
    result = run_replay(planned, trace)
    assert sum(result.steps.column("num_preempted").to_pylist()) > 0
    _assert_same_with_and_without_windows(run_replay, 0.05, plan=planned, trace=trace)


def test_no_window_without_a_closed_form_clock():
    """A recorded clock times every batch itself: it never gets a window."""
    planned = llama_plan()
    trace = chat_trace(60)
    recorded = RecordedClockExecutor(plan_cost_model(planned), [0.01] * 50)
    assert not recorded.prices_decode_windows()
    _, clock = _replay(run_with_executor, plan=planned, trace=trace, executors=[recorded])
    assert clock.decode_window_steps == 0


@pytest.mark.parametrize(("scenario", "limit"), [
    ("replay-gemma3-27b.toml", 150),  # sliding window 1024 + full attention
    ("replay-gpt-oss-20b.toml", 200),  # sliding window 128 + full attention
    ("replay-qwen3-next.toml", 150),  # Gated DeltaNet (Mamba align) + full attention
    ("replay-jamba-mini.toml", 150),  # Mamba align + full attention
])
def test_hybrid_layouts_replay_the_same_with_decode_windows(scenario, limit):
    """Several KV cache groups, windowed or recurrent layers: windows open, and change nothing."""
    resolved = resolve_scenario(SCENARIOS_DIR / scenario, Overrides(limit=limit))
    _assert_same_with_and_without_windows(run_replay, 0.5, plan=resolved.plan(), trace=resolved.require_workload().load(),
                                          efficiency=resolved.efficiency, slo=resolved.slo)


# Hybrid layouts on a small pool: (model, tensor parallel size, GiB of KV cache at the
# smallest setting). Prefix caching off puts a Mamba model in "none" mode.
_HYBRIDS = [("gemma-3-12b", 1, 3.0), ("gpt-oss-20b", 1, 0.6), ("mistral-7b-v0.1", 1, 0.6),
            ("jamba-mini", 2, 0.6), ("qwen3-next-80b-a3b", 4, 1.0)]


@settings(max_examples=14, deadline=None)
@given(seed=st.integers(0, 10_000), hybrid=st.sampled_from(_HYBRIDS), rate_per_s=st.sampled_from([2.0, 8.0, 30.0]),
       kv_scale=st.sampled_from([1.0, 3.0]), policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(),
       cut=st.booleans(), budget=st.sampled_from([256, 1024, None]),
       retention=st.sampled_from([0, 0, "dense", "periodic"]))
def test_random_overloads_of_hybrid_layouts_replay_the_same(seed, hybrid, rate_per_s, kv_scale, policy, caching, cut,
                                                             budget, retention):
    model, tp, kv_gib = hybrid
    engine = EngineConfig(max_model_len=4096, tensor_parallel_size=tp, kv_cache_memory_bytes=int(kv_scale * kv_gib * 2**30),
                          max_num_seqs=64, scheduling_policy=policy, enable_prefix_caching=caching,
                          max_num_batched_tokens=budget)
    planned = plan(get_model(model), get_gpu("h100"), engine)
    if retention != 0:
        # A periodic interval must land on the layout's hit grid (twice it here).
        interval = 2 * planned.to_json()["scheduler_block_size"] if retention == "periodic" else retention
        planned = plan(get_model(model), get_gpu("h100"),
                       dataclasses.replace(engine, prefix_cache_retention_interval=interval))
    trace = _overload_trace(seed, rate_per_s, 80)
    time_limit_s = None
    if cut:
        time_limit_s = run_replay(planned, trace, decode_windows=False).end_time_s / 2
    _assert_same_with_and_without_windows(run_replay, 0.05, plan=planned, trace=trace, time_limit_s=time_limit_s)


def test_a_synchronous_scheduler_gets_no_window():
    planned = llama_plan(async_scheduling=False)
    _, clock = _replay(run_replay, plan=planned, trace=chat_trace(40))
    assert clock.steps > 0 and clock.decode_window_steps == 0


def test_a_window_opens_only_where_every_running_request_decodes_next():
    """The batch in flight must hold every running request, and each must sample in it
    (a decode, or the chunk that ends its prefill), but for the last one, which may be
    left prefilling."""
    planned = llama_plan(max_num_batched_tokens=512, max_num_seqs=64)
    engine = EngineCore(planned.require_fits(), planned.engine.scheduler, planned.engine.cache)
    executor = CostModelExecutor(plan_cost_model(planned))
    for arrival in arrivals_from_trace(chat_trace(6)):
        engine.add_request(arrival.request)
    scheduler = engine.scheduler
    opened = []
    for _ in range(2000):
        if len(engine.batch_queue) == 1:
            batch = engine.batch_queue[0]
            window = open_decode_window(scheduler, batch.output, batch.execution.sampled,
                                        executor.token_bases([r.request_id for r in scheduler.running]))
            scheduled = list(batch.output.num_scheduled_tokens)
            sampling = [rid in batch.output.num_output_tokens for rid in scheduled]
            if window is not None:
                assert scheduled == [r.request_id for r in scheduler.running]
                assert all(sampling[:-1])
                assert window.prefilling is None if sampling[-1] else window.prefilling is scheduler.running[-1]
            opened.append(window is not None)
        if not engine.has_requests() and not engine.batch_queue:
            break
        engine.step_async(executor)
    assert any(opened) and not all(opened)


@settings(max_examples=200, deadline=None)
@given(ends=st.lists(st.integers(1, 200_000), min_size=1, max_size=300), tp=st.sampled_from([1, 2]),
       model=st.sampled_from(["llama-3.1-8b", "qwen3-32b", "deepseek-v3"]), calibrated=st.booleans(),
       prefills=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 20_000)), max_size=2))
def test_the_closed_form_decode_cost_is_the_general_one_to_the_bit(ends, tp, model, calibrated, prefills):
    planned = plan(get_model(model), get_gpu("h100"),
                   EngineConfig(max_model_len=32768, tensor_parallel_size=tp, kv_cache_memory_bytes=2**33))
    # The bundled calibration has every term on: fixed times, size curves, all-reduce curves.
    efficiency = bundled_calibration("h100", model).efficiency if calibrated else Efficiency()
    executor = CostModelExecutor(plan_cost_model(planned, efficiency))
    assert executor.prices_decode_windows()
    general = executor.cost_model.split_step_cost(ends, prefills)
    closed = executor.decode_step_cost(len(ends), sum(ends), prefills)
    assert astuple(closed) == astuple(general)


@settings(max_examples=120, deadline=None)
@given(ends=st.lists(st.integers(1, 40_000), min_size=1, max_size=200),
       model=st.sampled_from(["gpt-oss-20b", "gemma-3-12b", "mistral-7b-v0.1", "llama-4-scout", "jamba-mini",
                              "qwen3-next-80b-a3b"]),
       hybrid_manager=st.booleans(),
       prefills=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 20_000)), max_size=2))
def test_the_closed_form_by_layer_class_is_the_general_one_to_the_bit(ends, model, hybrid_manager, prefills):
    """Windowed, chunked and recurrent layers: priced from the keys each class attends,
    which ``decode_keys`` computes from the class's shape as its spec does."""
    planned = plan(get_model(model), get_gpu("h100"),
                   EngineConfig(max_model_len=65536, tensor_parallel_size=4, kv_cache_memory_bytes=2**34,
                                # Off (windowed layers kept as full attention) only for attention models.
                                hybrid_kv_cache=None if hybrid_manager or "M" in get_model(model).layer_pattern
                                else False))
    executor = CostModelExecutor(plan_cost_model(planned))
    assert executor.prices_decode_windows()
    shapes = executor.decode_key_shapes()
    assert shapes is not None
    layer_classes = executor.cost_model.layer_classes
    keys = [decode_keys(kind, size, ends) for kind, size in shapes]
    assert keys == [lc.spec.decode_attended_keys(ends) for lc in layer_classes]
    general = executor.cost_model.split_step_cost(ends, prefills)
    closed = executor.decode_step_cost_by_keys(len(ends), keys, prefills)
    assert astuple(closed) == astuple(general)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from([WINDOW_KEYS, CHUNK_KEYS]), size=st.integers(1, 40),
       members=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=12))
def test_a_local_key_sum_follows_its_members(kind, size, members):
    """Members ``(c0, first batch, batches)`` join, decode and leave; at every batch the
    closed-form sum is the sum of their keys."""
    local = LocalKeySum(kind, size)
    computed_at_open = [c0 for c0, _, _ in members]
    last = max(first + n for _, first, n in members)
    for index in range(last + 1):
        for i, (c0, first, n) in enumerate(members):
            if first == index and n:
                local.join(i, c0, index)
            if first + n == index and n:
                local.leave(i, c0)
        local.advance(index, computed_at_open)
        ends = [c0 + index + 1 for c0, first, n in members if first <= index < first + n]
        assert local.keys(index, sum(ends)) == decode_keys(kind, size, ends)


def test_a_chunked_local_layout_replays_the_same_across_chunk_boundaries():
    """Llama 4's chunked-local layers (chunk 8192) beside full attention: contexts that
    cross a chunk boundary inside a window, where a decode's keys fall back to one."""
    planned = plan(get_model("llama-4-scout"), get_gpu("h100"),
                   EngineConfig(max_model_len=16384, tensor_parallel_size=4, kv_cache_memory_bytes=4 * 2**30,
                                max_num_seqs=32))
    trace = synthesize(parse_spec({
        "kind": "chat", "seed": 5, "num_requests": 24, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": 4.0},
        "shared_prefix": {"count": 2, "tokens": 4000, "zipf_s": 1.0},
        "turns": {"dist": "fixed", "value": 1},
        "user_tokens": {"dist": "lognormal", "mean": 4100, "sigma": 0.1},
        "output_tokens": {"dist": "lognormal", "mean": 300, "sigma": 0.3},
        "turn_gap_s": {"dist": "exponential", "mean": 5}, "max_prompt_tokens": 12000}))
    lengths = zip(trace.column("prompt_tokens").to_pylist(), trace.column("output_tokens").to_pylist())
    assert any(p < 8192 < p + o for p, o in lengths)  # a context crosses the chunk while it decodes
    _assert_same_with_and_without_windows(run_replay, 0.3, plan=planned, trace=trace)
