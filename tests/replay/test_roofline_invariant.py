"""ROOFLINE (docs/invariants.md#the-clocks-physical-floor): no step is priced faster than
its roofline at 100% efficiency.

Per GPU of the tensor-parallel group, a step has to do at least its FLOPs at the GPU's
peak and move at least its bytes at the HBM's full bandwidth, so its priced time is at
least ``max(FLOPs / peak, bytes / bandwidth)``, whatever efficiency factors the clock runs
on. Both are recomputed here from the model's shape alone (layers, hidden size, heads,
KV heads, head sizes, intermediate sizes, experts, vocabulary, recurrent state), each as a
lower bound, never through the cost model's helpers:

* FLOPs: 2 per weight of the projections and MLPs a token surely goes through (up and down
  projections only: a gated MLP's third matrix is left out, as is every recurrent mixer),
  the LM head at each scheduled request's last token (vLLM computes logits there), and
  QK^T and PV over the keys each query token attends (causal, windowed or chunked mask),
  with the query heads split over the ranks; at the GPU's highest peak for the weights'
  format (FP8 tensor cores for FP8 checkpoints). With DeepSeek Sparse Attention
  (``index_topk``) a query attends at most its top ``index_topk`` keys, and the indexer
  scores every causal key with ``index_n_heads x index_head_dim`` products on every rank.
* Bytes: the weights once, but for the embedding table (a lookup reads a few rows) and
  the routed experts no token is sent to (a step with tokens touches at least ``top_k``
  experts per MoE layer); the KV each query reads (cached keys it attends) and writes (its
  own; a sparse layer at least its first query's top keys, and its indexer keys whole,
  ``index_head_dim`` fp8 bytes each); a recurrent state's SSM part read and written once
  per request and layer; and the residual stream read and written once per layer per token.

The parameter count (``params_total``) is the only preset figure taken as given: it bounds
the weights that are not routed experts from below once the experts (from their shapes)
are taken off.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.window_pricing import FULL_KEYS, NO_KEYS, LocalKeySum, decode_keys
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPU_PRESETS, get_gpu
from kvtwin.sim.planner.models import MODEL_PRESETS, get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.calibration.band import pessimistic
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.file import bundled_calibration
from kvtwin.sim.calibration.efficiency import Efficiency

SCALE = max(1, int(os.environ.get("KVTWIN_PROPERTY_SCALE", "1")))
MODELS = sorted(MODEL_PRESETS)
GPUS = sorted(GPU_PRESETS)
# Jamba alternates dense and MoE MLPs (HF config: expert_layer_period 2, expert_layer_offset
# 1); every other MoE preset routes every layer past its first dense ones.
MOE_LAYER_PERIOD = {"jamba-mini": 2}
BF16 = 2
KV_DTYPE_BYTES = {"auto": 2, "fp8": 1}
# A floor and a price summed in another order differ in the last bits.
ROUNDING = 1e-9


# -- the floor, from the model's shape ----------------------------------------------------


def _layers(model):
    pattern = model.layer_pattern
    return (pattern * (model.num_layers // len(pattern) + 1))[: model.num_layers]


def _moe_layer_flags(model):
    """Whether each layer's MLP is routed."""
    if not model.num_experts:
        return [False] * model.num_layers
    period = MOE_LAYER_PERIOD.get(model.name, 1)
    offset = 1 if period > 1 else 0
    return [i >= model.first_dense_layers and (i - offset) % period == 0 for i in range(model.num_layers)]


def _mlp_layers(model):
    """Which layers have an MLP: Nemotron-H's sit in their own layers ('-'), whose Mamba
    and attention layers have none; every other preset has one in every layer."""
    letters = _layers(model)
    if "-" in letters:
        return [letter == "-" for letter in letters]
    return [True] * model.num_layers


def _expert_params(model):
    """Up and down projections (the gate left out) of one routed expert."""
    return 2 * model.hidden_size * model.moe_intermediate_size


def body_flops_per_token(model, tp):
    """2 FLOPs per weight every token surely multiplies, per GPU."""
    hidden, heads, kv = model.hidden_size, model.num_attention_heads, model.num_kv_heads
    d_k, d_v = model.head_dim, model.head_dim_v
    weights = 0.0
    for letter, mlp, routed in zip(_layers(model), _mlp_layers(model), _moe_layer_flags(model)):
        if letter in "FSC":
            weights += hidden * (heads * d_k + kv * d_k + kv * d_v) + heads * d_v * hidden
        elif letter == "A":
            # The latent's down projection and the output projection (the query's and the
            # latent's up projections depend on the kernel's absorption: left out).
            weights += hidden * (model.kv_lora_rank + model.qk_rope_head_dim) + heads * d_v * hidden
        if mlp and routed:
            weights += (model.num_experts_per_token * _expert_params(model)
                        + 2 * hidden * model.shared_expert_intermediate_size)
        elif mlp:
            weights += 2 * hidden * model.intermediate_size
    return 2.0 * weights / tp


def _keys(letter, model, before, new):
    """Keys the queries at positions before .. before+new-1 attend in one layer: causal,
    the last ``sliding_window`` of them, or those of the query's own chunk."""
    a, b = before, before + new  # query p attends key positions up to p: p + 1 of them in all

    def tri(lo, hi):  # sum of k for k in (lo, hi]
        return (hi * (hi + 1) - lo * (lo + 1)) // 2

    if letter in "FA":
        return tri(a, b)
    if letter == "S":
        w = model.sliding_window
        return tri(min(a, w), min(b, w)) + w * max(0, b - max(a, w))
    chunk = model.attention_chunk_size
    keys, p = 0, a
    while p < b:
        start = p - p % chunk
        stop = min(b, start + chunk)
        keys += tri(p - start, stop - start)
        p = stop
    return keys


def _sparse_keys(topk, before, new):
    """Keys the queries at positions before .. before+new-1 attend when each attends at
    most its ``topk`` best: ``min(p + 1, topk)`` summed."""
    capped = max(0, before + new - max(before, topk))  # queries at p >= topk
    low = before + new - capped  # the others run from before to low - 1
    return ((low * (low + 1) - before * (before + 1)) // 2 if low > before else 0) + capped * topk


def _kv_tokens(letter, model, before, new):
    """KV entries a chunk moves in one layer: the cached ones its first query attends, and
    its own (written)."""
    if letter in "FA":
        return before + new
    if letter == "S":
        return min(before, model.sliding_window - 1) + new
    return before % model.attention_chunk_size + new


def _kv_bytes_per_token(letter, model, tp, kv_dtype):
    if letter == "A":  # one latent per token, whole on every rank
        return (model.kv_lora_rank + model.qk_rope_head_dim) * KV_DTYPE_BYTES[kv_dtype]
    return model.num_kv_heads * (model.head_dim + model.head_dim_v) * KV_DTYPE_BYTES[kv_dtype] / tp


def _ssm_state_elements(model, tp):
    """The SSM (recurrent) part of one layer's state on one rank, the conv window left out."""
    s = model.state
    kind = type(s).__name__
    if kind == "Mamba1State":
        return s.expand * model.hidden_size * s.d_state / tp
    if kind == "Mamba2State":
        return s.num_heads * s.head_dim * s.d_state / tp
    if kind == "GatedDeltaNetState":
        return s.num_v_heads * s.head_v_dim * s.head_k_dim / tp
    return s.num_heads * s.head_dim * s.head_dim / tp


def weight_bytes_floor(model, tp):
    """The weights a step with tokens reads, per GPU: all but the embedding table and the
    experts none of its tokens is routed to (at least ``top_k`` per MoE layer are hit)."""
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size
    moe_layers = sum(_moe_layer_flags(model))
    # Gate, up and down of every expert: taken off the total, so counted whole.
    all_experts = moe_layers * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size
    others = max(model.params_total - embedding - all_experts, 0.0)
    if model.weight_format == "fp8":
        other_bytes, expert_bytes = 1.0, 1.0
    elif model.weight_format == "mxfp4_moe":
        other_bytes, expert_bytes = BF16, 4.25 / 8
    else:
        other_bytes, expert_bytes = BF16, BF16
    touched = moe_layers * model.num_experts_per_token * 3 * model.hidden_size * model.moe_intermediate_size
    return (others * other_bytes + touched * expert_bytes) / tp


def peak_flops(model, gpu):
    fp8 = gpu.fp8_flops if model.weight_format == "fp8" else 0.0
    return max(gpu.bf16_flops, fp8)


def floor_s(model, gpu, tp, kv_dtype, decode_ends, prefill_items, verify_items=()):
    """``max(FLOPs / peak, bytes / bandwidth)`` of one step, per GPU of the TP group."""
    # A decode ending at e is a one-token chunk after e - 1 tokens.
    items = [(1, end - 1) for end in decode_ends] + list(prefill_items) + list(verify_items)
    tokens = sum(new for new, _ in items)
    heads_per_rank = model.num_attention_heads / tp
    width = heads_per_rank * (model.head_dim + model.head_dim_v)  # QK^T and PV per key
    flops = body_flops_per_token(model, tp) * tokens + 2.0 * model.vocab_size * model.hidden_size / tp * len(items)
    kv_bytes = 0.0
    state_bytes = BF16 * _ssm_state_elements(model, tp) if model.state is not None else 0.0
    for letter in _layers(model):
        if letter == "A" and model.index_topk is not None:
            per_token = _kv_bytes_per_token(letter, model, tp, kv_dtype)
            indexer_width = model.index_n_heads * model.index_head_dim
            for new, before in items:
                flops += 2.0 * width * _sparse_keys(model.index_topk, before, new)
                kv_bytes += per_token * min(before + new, model.index_topk + new - 1)
                flops += 2.0 * indexer_width * _keys(letter, model, before, new)
                kv_bytes += model.index_head_dim * (before + new)
        elif letter in "FSCA":
            per_token = _kv_bytes_per_token(letter, model, tp, kv_dtype)
            for new, before in items:
                flops += 2.0 * width * _keys(letter, model, before, new)
                kv_bytes += per_token * _kv_tokens(letter, model, before, new)
        elif letter == "M":
            kv_bytes += 2 * state_bytes * len(items)
    activation_bytes = 2 * BF16 * model.hidden_size * model.num_layers * tokens
    memory = weight_bytes_floor(model, tp) + kv_bytes + activation_bytes
    return max(flops / peak_flops(model, gpu), memory / gpu.hbm_bandwidth_bytes_per_s)


# -- the clock ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _plan(model_name, gpu_name, tp, kv_dtype):
    model = get_model(model_name)
    max_len = min(model.max_position_embeddings, 65536)
    try:
        return plan(model, get_gpu(gpu_name), EngineConfig(tensor_parallel_size=tp, max_model_len=max_len,
                                                           kv_cache_dtype=kv_dtype,
                                                           kv_cache_memory_bytes=1 << 34))
    except ConfigError:
        return None  # a TP size the model's heads do not split over


def cost_model(p, efficiency, async_scheduling, draft_head=None):
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=p.engine.tensor_parallel_size,
                     async_scheduling=async_scheduling, efficiency=efficiency, draft_head=draft_head)


fraction = st.floats(0.05, 1.0)
seconds = st.floats(0.0, 1e-4)
drawn_efficiency = st.builds(
    Efficiency, matmul_flops_fraction=fraction, matmul_half_tokens=st.floats(0.0, 4096.0),
    attention_flops_fraction=fraction, attention_half_query_tokens=st.floats(0.0, 4096.0),
    hbm_bandwidth_fraction=fraction, interconnect_fraction=fraction, allreduce_latency_s=seconds,
    layer_fixed_s=seconds, decode_attention_s_per_head=st.floats(0.0, 1e-7), step_gpu_fixed_s=seconds,
    step_overhead_s=st.floats(0.0, 3e-3), per_request_overhead_s=st.floats(0.0, 5e-5))


@st.composite
def clocks(draw):
    """A planned model on a GPU at a TP size it splits over, and the factors of a clock: drawn,
    a bundled calibration's, or its pessimistic edge."""
    model = draw(st.sampled_from(MODELS))
    gpu = draw(st.sampled_from(GPUS))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    kv_dtype = draw(st.sampled_from(sorted(KV_DTYPE_BYTES)))
    p = _plan(model, gpu, tp, kv_dtype)
    assume(p is not None)
    calibration = bundled_calibration(gpu, model)
    source = draw(st.sampled_from(["drawn", "bundled", "pessimistic"] if calibration else ["drawn"]))
    if source == "drawn":
        efficiency = draw(drawn_efficiency)
    else:
        efficiency = calibration.efficiency
        if source == "pessimistic":
            efficiency = pessimistic(efficiency, draw(st.floats(0.0, 0.5)))
    return p, kv_dtype, efficiency, draw(st.booleans())


def contexts(max_len):
    return st.integers(1, max_len)


@st.composite
def batches(draw, max_len):
    """Decodes (context ends), prefill chunks (new tokens, computed before), either may be
    empty but not both."""
    decodes = draw(st.lists(contexts(max_len), max_size=48))
    # Short chunks as often as long ones: a step of few tokens is where weights and KV bind.
    new_tokens = st.one_of(st.integers(1, 128), st.integers(1, 8192))
    chunk = new_tokens.flatmap(lambda new: st.tuples(st.just(new), st.integers(0, max(0, max_len - new))))
    prefills = draw(st.lists(chunk, min_size=0 if decodes else 1, max_size=3))
    return decodes, prefills


def _check(priced_s, floor, what):
    assert priced_s >= floor * (1 - ROUNDING), (
        f"ROOFLINE: {what} priced {priced_s * 1e3:.6f} ms, below its roofline floor {floor * 1e3:.6f} ms")


@settings(max_examples=400 * SCALE)
@given(clock=clocks(), data=st.data())
def test_no_step_is_priced_below_its_roofline(clock, data):
    p, kv_dtype, efficiency, async_scheduling = clock
    model, gpu, tp = p.model, p.gpu, p.engine.tensor_parallel_size
    max_len = p.engine.max_model_len
    decodes, prefills = data.draw(batches(max_len))
    cost = cost_model(p, efficiency, async_scheduling).split_step_cost(decodes, prefills)
    _check(cost.total_s, floor_s(model, gpu, tp, kv_dtype, decodes, prefills),
           f"{model.name} on {gpu.name} TP {tp} ({len(decodes)} decodes, chunks {prefills})")


@settings(max_examples=150 * SCALE)
@given(clock=clocks(), data=st.data())
def test_speculative_steps_are_priced_above_their_roofline(clock, data):
    # Verify steps count their drafts as query tokens; a draft head only adds its passes.
    p, kv_dtype, efficiency, async_scheduling = clock
    model, gpu, tp = p.model, p.gpu, p.engine.tensor_parallel_size
    max_len = p.engine.max_model_len
    decodes, prefills = data.draw(batches(max_len))
    verify = data.draw(st.lists(st.tuples(st.integers(2, 6), st.integers(0, max_len - 6)), max_size=16))
    head = data.draw(st.sampled_from([None, DraftHead("eagle", 1, 1), DraftHead("eagle", 1, 3), DraftHead("eagle", 2, 2)]))
    drafting = [before + new for new, before in verify] + decodes
    cost = cost_model(p, efficiency, async_scheduling, head).split_step_cost(
        decodes, prefills, draft_ends=drafting if head else None, verify_items=verify)
    _check(cost.total_s, floor_s(model, gpu, tp, kv_dtype, decodes, prefills, verify),
           f"{model.name} on {gpu.name} TP {tp} (verify {verify}, draft head {head})")


@settings(max_examples=150 * SCALE)
@given(clock=clocks(), data=st.data())
def test_a_decode_windows_closed_form_prices_every_batch_above_its_roofline(clock, data):
    # A decode window prices its batches in closed form (a sum of contexts, or per layer
    # class the keys its members attend, kept by LocalKeySum as contexts grow): batch j of
    # a window whose members opened at c0 decodes each to c0 + j + 1.
    p, kv_dtype, efficiency, _ = clock
    model, gpu, tp = p.model, p.gpu, p.engine.tensor_parallel_size
    max_len = p.engine.max_model_len
    steps = data.draw(st.integers(2, 40))
    c0 = data.draw(st.lists(st.integers(1, max_len - steps - 1), min_size=1, max_size=32))
    prefills = data.draw(st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 4096)), max_size=1))
    cm = cost_model(p, efficiency, async_scheduling=True)  # windows run under asynchronous scheduling only
    shapes = cm.decode_key_shapes()
    assert shapes is not None  # every bundled layout has a closed form
    sums = {shape: LocalKeySum(*shape) for shape in shapes if shape[0] not in (FULL_KEYS, NO_KEYS)}
    for local in sums.values():
        for i, start in enumerate(c0):
            local.join(i, start, 0)
    priced = floor = 0.0
    for j in range(steps):
        ends = [start + j + 1 for start in c0]
        if cm.decodes_cost_by_context_sum:
            cost = cm.decode_step_cost(len(c0), sum(ends), prefills if j == 0 else None)
        else:
            for local in sums.values():
                local.advance(j, c0)
            keys = [decode_keys(kind, size, ends) if (kind, size) not in sums else sums[(kind, size)].keys(j, sum(ends))
                    for kind, size in shapes]
            cost = cm.decode_step_cost_by_keys(len(c0), keys, prefills if j == 0 else None)
        step_floor = floor_s(model, gpu, tp, kv_dtype, ends, prefills if j == 0 else [])
        _check(cost.total_s, step_floor, f"{model.name} on {gpu.name} TP {tp}: window batch {j}")
        priced += cost.total_s
        floor += step_floor
    _check(priced, floor, f"{model.name} on {gpu.name} TP {tp}: a window of {steps} batches")


def test_the_floor_is_a_lower_bound_of_the_presets_own_figures():
    # The floor's FLOPs per token stay under 2 x the active parameters, and its weight
    # bytes under the checkpoint's: a floor above them would be no floor.
    for name in MODELS:
        model = get_model(name)
        assert body_flops_per_token(model, 1) <= 2 * model.params_active, name
        assert weight_bytes_floor(model, 1) <= model.weights_bytes, name


def test_the_floor_binds_llama_8b_on_an_h100_by_hand():
    # One 4096-token prefill of Llama-3.1-8B on an H100: per layer the q, k, v and o
    # projections and the MLP's up and down (the gate left out), the LM head once, and the
    # causal attention's 4096 x 4097 / 2 keys per head; at 989.4 TFLOP/s about 47 ms.
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    body = 32 * (4096 * (32 * 128 + 2 * 8 * 128) + 32 * 128 * 4096 + 2 * 4096 * 14336)
    attention = 2 * 32 * 256 * 32 * 4096 * 4097 / 2
    expected = (2 * body * 4096 + 2 * 128256 * 4096 + attention) / 989.4e12
    assert floor_s(model, gpu, 1, "auto", [], [(4096, 0)]) == pytest.approx(expected, rel=1e-12)
    assert 0.045 < expected < 0.049
    p = _plan("llama-3.1-8b", "h100", 1, "auto")
    full = dataclasses.replace(Efficiency(), matmul_flops_fraction=1.0, attention_flops_fraction=1.0,
                               hbm_bandwidth_fraction=1.0, step_overhead_s=0.0, per_request_overhead_s=0.0)
    priced = cost_model(p, full, True).split_step_cost([], [(4096, 0)]).total_s
    # The clock at 100% sits above the floor by the gates' FLOPs (a third of the MLP's) and
    # the element-wise traffic, not by more: the floor is near enough to catch a real slip.
    assert expected <= priced < 1.6 * expected


def test_a_jamba_decode_reads_its_routed_experts():
    # Jamba routes every other layer (16 of 32 MoE layers): a one-decode step reads the
    # 7e9 non-expert weights and 2 experts in each of 16 layers, about 25 GB, at least 7 ms
    # on an H100 at full bandwidth. Counting 32 MoE layers once took all 32 x 16 experts
    # off 52e9 parameters and priced the weights negative: 0.08 ms.
    p = _plan("jamba-mini", "h100", 1, "auto")
    floor = floor_s(p.model, p.gpu, 1, "auto", [1000], [])
    assert floor > 7e-3
    _check(cost_model(p, Efficiency(), True).split_step_cost([1000], []).total_s, floor, "jamba-mini decode")
