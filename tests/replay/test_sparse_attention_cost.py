"""The step cost of DeepSeek Sparse Attention (docs/clock.md#sparse-attention).

DeepSeek-V3.2 on 8 H200s, TP 8. Expectations are written from the model's configuration
(61 layers, 128 query heads, latent 512 + rope 64, indexer 64 heads of 128, top 2048
keys) and vLLM 0.33's kernels, not from the cost model's layer classes: per layer and
query the latent attention runs QK^T over 576 values and the absorbed PV over 512 for
each of 16 heads and ``min(keys, 2048)`` keys; the indexer scores every causal key with
64 x 128 fp8 products, on every TP rank.
"""

from __future__ import annotations

import io
from dataclasses import astuple

import pyarrow.parquet as pq
import pytest

from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.core.window_pricing import LocalKeySum, decode_keys
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.run import run_replay
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec

LAYERS = 61
TOPK = 2048
HEADS_PER_RANK = 128 // 8
LATENT_FLOPS_PER_KEY = 2 * HEADS_PER_RANK * (576 + 512)  # per layer and query
INDEXER_FLOPS_PER_KEY = 2 * 64 * 128  # per layer and query, not split over TP
LATENT_BYTES = 576 * 2  # bf16
INDEXER_BYTES = 128 + 4  # fp8 values and one fp32 scale
H200 = get_gpu("h200")
FP8_WORK = H200.bf16_flops / H200.fp8_flops  # the indexer's fp8 FLOPs, at the bf16 rate


def _plan(model: str):
    return plan(get_model(model), H200, EngineConfig(tensor_parallel_size=8, max_model_len=131072,
                                                     kv_cache_memory_bytes=2**34))


def _cost_model(model: str, efficiency: Efficiency = Efficiency()) -> CostModel:
    p = _plan(model)
    return CostModel(p.model, p.gpu, p.layers.specs, async_scheduling=True, tensor_parallel_size=8,
                     efficiency=efficiency)


def _causal(start: int, end: int) -> int:
    return sum(p + 1 for p in range(start, end))


def _capped(start: int, end: int) -> int:
    return sum(min(p + 1, TOPK) for p in range(start, end))


@pytest.mark.parametrize("context", [1000, 2048, 2049, 100_000])
def test_a_decode_attends_its_top_keys_and_indexes_its_whole_context(context):
    cost = _cost_model("deepseek-v3.2").split_step_cost([context] * 32, [])
    keys = min(context, TOPK)
    latent = 32 * LAYERS * LATENT_FLOPS_PER_KEY * keys
    indexer = 32 * LAYERS * INDEXER_FLOPS_PER_KEY * context
    assert cost.attention_flops == pytest.approx(latent + indexer, rel=1e-12)
    assert cost.attention_work == pytest.approx(latent + indexer * FP8_WORK, rel=1e-12)
    # Each decode gathers its top keys, scans every indexer key, and writes one of each.
    assert cost.kv_bytes == pytest.approx(32 * LAYERS * ((keys + 1) * LATENT_BYTES + (context + 1) * INDEXER_BYTES),
                                          rel=1e-12)


def test_past_the_top_k_only_the_indexer_grows_with_the_context():
    cm = _cost_model("deepseek-v3.2")
    long, short = cm.split_step_cost([100_000], []), cm.split_step_cost([1000], [])
    assert long.attention_flops - short.attention_flops == pytest.approx(
        LAYERS * (LATENT_FLOPS_PER_KEY * (TOPK - 1000) + INDEXER_FLOPS_PER_KEY * 99_000), rel=1e-12)
    longer = cm.split_step_cost([200_000], [])
    # Linear in the context beyond the cap: twice the context, twice the indexer's extra.
    assert longer.attention_flops - long.attention_flops == pytest.approx(
        LAYERS * INDEXER_FLOPS_PER_KEY * 100_000, rel=1e-12)
    assert longer.kv_bytes - long.kv_bytes == pytest.approx(LAYERS * INDEXER_BYTES * 100_000, rel=1e-12)
    # The dense model's latent at 100k costs about 100_000 / 2048 times the sparse one's.
    dense = _cost_model("deepseek-v3").split_step_cost([100_000], [])
    assert dense.attention_flops == pytest.approx(LAYERS * LATENT_FLOPS_PER_KEY * 100_000, rel=1e-12)
    assert long.total_s < dense.total_s


@pytest.mark.parametrize(("new", "before"), [(3000, 0), (4096, 96_000), (1, 2047), (512, 1800)])
def test_a_prefill_chunk_attends_at_most_the_top_k_per_query(new, before):
    cost = _cost_model("deepseek-v3.2").split_step_cost([], [(new, before)])
    latent = LAYERS * LATENT_FLOPS_PER_KEY * _capped(before, before + new)
    indexer = LAYERS * INDEXER_FLOPS_PER_KEY * _causal(before, before + new)
    assert cost.attention_flops == pytest.approx(latent + indexer, rel=1e-12)
    assert cost.attention_work == pytest.approx(latent + indexer * FP8_WORK, rel=1e-12)
    # A chunk's queries pick their keys apart: the chunk reads both caches whole.
    assert cost.kv_bytes == pytest.approx(LAYERS * (before + 2 * new) * (LATENT_BYTES + INDEXER_BYTES), rel=1e-12)


def test_deepseek_v3_stays_dense_and_v3_2_adds_only_the_indexer_below_the_cap():
    v3, v32 = _cost_model("deepseek-v3"), _cost_model("deepseek-v3.2")
    assert v3.decodes_cost_by_context_sum and not v32.decodes_cost_by_context_sum
    for context in (10, 1000, 2048):
        dense = v3.split_step_cost([context] * 4, [(700, 300)])
        sparse = v32.split_step_cost([context] * 4, [(700, 300)])
        assert dense.attention_flops == pytest.approx(
            LAYERS * LATENT_FLOPS_PER_KEY * (4 * context + _causal(300, 1000)), rel=1e-12)
        assert sparse.attention_flops - dense.attention_flops == pytest.approx(
            LAYERS * INDEXER_FLOPS_PER_KEY * (4 * context + _causal(300, 1000)), rel=1e-9)
        assert sparse.kv_bytes - dense.kv_bytes == pytest.approx(
            LAYERS * INDEXER_BYTES * (4 * (context + 1) + 1000 + 700), rel=1e-12)


def test_only_the_latent_attention_pays_the_per_head_decode_time():
    plain = _cost_model("deepseek-v3.2")
    per_head = _cost_model("deepseek-v3.2", Efficiency(decode_attention_s_per_head=1e-7))
    ends = [5000] * 10
    extra = per_head.split_step_cost(ends, []).extra_gpu_s - plain.split_step_cost(ends, []).extra_gpu_s
    assert extra == pytest.approx(1e-7 * LAYERS * HEADS_PER_RANK * 10, rel=1e-12)


def test_a_decode_windows_closed_form_prices_each_batch_as_the_step_does_to_the_bit():
    """Members opened below, at and past the cap decode across it batch after batch; the
    window's keys per layer class (``LocalKeySum``) price each batch as ``split_step_cost``."""
    cm = _cost_model("deepseek-v3.2")
    shapes = cm.decode_key_shapes()
    assert shapes is not None
    c0 = [1, 2000, 2040, 2047, 2048, 9000]
    sums = {shape: LocalKeySum(*shape) for shape in shapes if shape[0] == 1}
    assert list(sums) == [(1, TOPK)]  # the latent, as a window of top-k keys
    for local in sums.values():
        for i, start in enumerate(c0):
            local.join(i, start, 0)
    for j in range(60):
        ends = [start + j + 1 for start in c0]
        for local in sums.values():
            local.advance(j, c0)
        keys = [sums[shape].keys(j, sum(ends)) if shape in sums else decode_keys(*shape, ends) for shape in shapes]
        assert keys == [sum(min(e, TOPK) for e in ends), sum(ends)]
        prefills = [(600, 1700)] if j % 7 == 0 else None
        closed = cm.decode_step_cost_by_keys(len(ends), keys, prefills)
        assert astuple(closed) == astuple(cm.split_step_cost(ends, prefills or []))


def _replay(planned, trace, decode_windows: bool) -> tuple[dict[str, bytes], ReplayClock]:
    clocks: list[ReplayClock] = []
    result = run_replay(planned, trace, decode_windows=decode_windows, on_progress=clocks.append)
    tables = {}
    for name in ("requests", "steps", "summary"):
        sink = io.BytesIO()
        pq.write_table(getattr(result, name), sink)
        tables[name] = sink.getvalue()
    return tables, clocks[-1]


def test_a_v3_2_replay_is_the_same_with_decode_windows():
    """Prompts of about the top-k and outputs that carry them past it: windows price the
    latent's cap as the steps do, and the replay writes the same bytes."""
    planned = plan(get_model("deepseek-v3.2"), H200, EngineConfig(tensor_parallel_size=8, max_model_len=16384,
                                                                  kv_cache_memory_bytes=2**32, max_num_seqs=32))
    trace = synthesize(parse_spec({
        "kind": "chat", "seed": 5, "num_requests": 40, "block_tokens": 64,
        "arrival": {"process": "poisson", "rate_per_s": 4.0},
        "shared_prefix": {"count": 2, "tokens": 512, "zipf_s": 1.0},
        "turns": {"dist": "zipf", "s": 1.5, "max": 3},
        "user_tokens": {"dist": "lognormal", "mean": 1500, "sigma": 0.4},
        "output_tokens": {"dist": "lognormal", "mean": 300, "sigma": 0.6},
        "turn_gap_s": {"dist": "exponential", "mean": 3}, "max_prompt_tokens": 8000}))
    # Some requests start below the cap and decode past it.
    assert any(p < TOPK < p + o for p, o in zip(trace.column("prompt_tokens").to_pylist(),
                                               trace.column("output_tokens").to_pylist()))
    windowed, clock = _replay(planned, trace, decode_windows=True)
    stepwise, stepwise_clock = _replay(planned, trace, decode_windows=False)
    for name in windowed:
        assert windowed[name] == stepwise[name], f"{name} differs with decode windows"
    assert stepwise_clock.decode_window_steps == 0
    assert clock.decode_window_steps >= 0.3 * clock.steps, (clock.decode_window_steps, clock.steps)
