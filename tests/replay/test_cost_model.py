"""The cost model's terms: closed forms, monotonicity, TP, async overlap, calibration."""

import pytest

from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtwin.sim.calibration.file import read_calibration
from kvtwin.sim.replay.cost_model import CostModel, gemm_fraction
from kvtwin.sim.calibration.efficiency import AllReduceCurve, Efficiency, efficiency_from_mapping
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan


def brute(kind, window, start, end):
    total = 0
    for p in range(start, end):
        if kind == "sliding_window":
            total += min(p + 1, window)
        elif kind == "chunked_local":
            total += p % window + 1
        else:
            total += p + 1
    return total


ATTENTION = dict(block_size=16, num_kv_heads=8, head_size=128)
SPECS = {
    "full": (FullAttentionSpec(**ATTENTION), "full_attention", 0),
    "sliding": (SlidingWindowSpec(**ATTENTION, sliding_window=128), "sliding_window", 128),
    "chunked": (ChunkedLocalAttentionSpec(**ATTENTION, attention_chunk_size=64), "chunked_local", 64),
    # Hybrid manager off: memory as full attention, compute still windowed.
    "promoted_sliding": (FullAttentionSpec(**ATTENTION, sliding_window=128), "sliding_window", 128),
    "promoted_chunked": (FullAttentionSpec(**ATTENTION, attention_chunk_size=64), "chunked_local", 64),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("start, end", [(0, 1), (0, 300), (100, 101), (127, 129), (1000, 1513), (5, 5)])
def test_attended_keys_closed_forms_match_brute_force(name, start, end):
    spec, kind, window = SPECS[name]
    assert spec.attended_keys(start, end) == brute(kind, window, start, end)


@pytest.mark.parametrize("name", SPECS)
def test_a_decode_reads_what_its_query_attends(name):
    spec, _, _ = SPECS[name]
    ends = [1, 2, 63, 64, 65, 127, 128, 129, 1000, 4097]
    assert spec.decode_attended_keys(ends) == sum(spec.attended_keys(e - 1, e) for e in ends)
    assert all(spec.kv_tokens_read(e - 1, 1) == spec.attended_keys(e - 1, e) for e in ends)


def test_a_recurrent_state_attends_nothing_and_reads_its_state():
    state = MambaSpec(block_size=16, shapes=((4, 8),), dtype_bytes=(2,), mamba_cache_mode="align")
    assert state.attended_keys(0, 100) == 0 and state.decode_attended_keys([5, 9]) == 0
    assert state.kv_bytes_per_token == 0 and state.state_bytes == 64


def step_cost(cm, items):
    """Cost of a step given as (new tokens, tokens computed before) per request."""
    return cm.split_step_cost([before + 1 for new, before in items if new == 1],
                              [item for item in items if item[0] != 1])


def model_for(name, gpu="h100", tp=1, async_scheduling=True, eff=Efficiency()):
    p = plan(get_model(name), get_gpu(gpu), EngineConfig(tensor_parallel_size=tp, max_model_len=32768))
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=async_scheduling,
                     efficiency=eff)


def test_decode_is_memory_bound_and_grows_with_context():
    cm = model_for("llama-3.1-8b")
    short = step_cost(cm, [(1, 1000)] * 16)
    long = step_cost(cm, [(1, 30000)] * 16)
    assert short.memory_s > short.compute_s
    assert long.total_s > short.total_s
    assert long.kv_bytes > short.kv_bytes * 20


def test_prefill_is_compute_bound():
    cost = step_cost(model_for("llama-3.1-8b"), [(8192, 0)])
    assert cost.compute_s > cost.memory_s


def test_sliding_window_layers_read_at_most_their_window():
    cm = model_for("gpt-oss-20b")
    near = step_cost(cm, [(1, 20000)])
    far = step_cost(cm, [(1, 30000)])
    full_layers = [lc for lc in cm.layer_classes if lc.spec.kind == "full_attention"][0]
    # Only the full-attention half grows with context.
    growth = far.kv_bytes - near.kv_bytes
    assert growth == pytest.approx(10000 * full_layers.kv_bytes_per_token * full_layers.num_layers)


def serial_s(cost, gpu="h100", eff=Efficiency()):
    """The GPU seconds outside the roofline's max: element-wise traffic and fixed time."""
    return cost.elementwise_bytes / (get_gpu(gpu).hbm_bandwidth_bytes_per_s * eff.hbm_bandwidth_fraction) \
        + cost.extra_gpu_s


def test_the_lm_head_runs_only_where_a_request_samples():
    cm = model_for("llama-3.1-8b")
    model = cm.model
    head = 2.0 * 128256 * 4096
    one_prefill = step_cost(cm, [(8192, 0)])
    assert one_prefill.head_flops == head  # one sampling position, not 8192
    assert one_prefill.body_flops == 2.0 * (model.params_active - 2 * 128256 * 4096) * 8192
    assert one_prefill.linear_flops == one_prefill.body_flops + one_prefill.head_flops
    # Two decodes and a partial prefill chunk: three positions (vLLM computes logits at
    # every scheduled request's last token, and drops the partial prefill's sample).
    assert cm.split_step_cost([100, 200], [(512, 0)]).head_flops == 3 * head
    # A model whose embedding is its LM head subtracts that matrix once.
    tied = model_for("gemma-3-12b").model
    assert tied.body_params_active == tied.params_active - tied.vocab_size * tied.hidden_size


def test_gemm_efficiency_grows_with_the_tokens_of_a_step():
    curve = Efficiency(matmul_flops_fraction=0.8, matmul_half_tokens=128.0)
    assert gemm_fraction(curve.matmul_flops_fraction, curve.matmul_half_tokens, 128) == 0.4
    assert gemm_fraction(curve.matmul_flops_fraction, curve.matmul_half_tokens, 3 * 128) == pytest.approx(0.6, rel=1e-15)
    cm = model_for("llama-3.1-8b", eff=curve)
    cost = step_cost(cm, [(128, 0)])
    peak = get_gpu("h100").bf16_flops
    assert cost.compute_s == pytest.approx(cost.body_flops / (peak * 0.4) + cost.head_flops / (peak * 0.8 / 129)
                                           + cost.attention_flops / (peak * 0.45), rel=1e-12)


def test_fixed_gpu_time_and_element_wise_traffic_add_to_the_gpu_time():
    fixed = Efficiency(layer_fixed_s=30e-6, step_gpu_fixed_s=0.5e-3, step_overhead_s=0.0, per_request_overhead_s=0.0)
    plain = step_cost(model_for("llama-3.1-8b", eff=Efficiency(step_overhead_s=0.0, per_request_overhead_s=0.0)),
                      [(1, 100)] * 8)
    slower = step_cost(model_for("llama-3.1-8b", eff=fixed), [(1, 100)] * 8)
    assert slower.extra_gpu_s == pytest.approx(32 * 30e-6 + 0.5e-3, rel=1e-15)
    assert slower.total_s - plain.total_s == pytest.approx(32 * 30e-6 + 0.5e-3, rel=1e-9)
    # Per token and layer: two fused add+RMSNorms (4 hidden vectors each), SiLU-and-mul
    # (3 x 14336), rotary on 32 + 8 heads of 128 (read and write); 2 bytes each.
    per_token = 2.0 * (32 * (8 * 4096 + 3 * 14336) + 32 * 2 * (32 + 8) * 128)
    assert slower.elementwise_bytes == 8 * per_token
    assert plain.total_s == pytest.approx(max(plain.compute_s, plain.memory_s) + serial_s(plain), rel=1e-12)


def test_a_measured_all_reduce_curve_replaces_the_link_model():
    curve = AllReduceCurve(4, (65536.0, 67108864.0), (10e-6, 240e-6))
    cm = model_for("llama-3.1-70b", tp=4, eff=Efficiency(allreduce=(curve,)))
    cost = step_cost(cm, [(4096, 0)])
    message_bytes = 4096 * 8192 * 2
    assert cost.communication_s == pytest.approx(2 * 80 * curve.seconds_for(message_bytes), rel=1e-15)
    # TP 2 has no curve here: the link model.
    assert model_for("llama-3.1-70b", tp=2, eff=Efficiency(allreduce=(curve,))).allreduce_curve is None


def test_tensor_parallelism_splits_compute_and_adds_communication():
    items = [(4096, 0)]
    one, four = model_for("llama-3.1-70b", tp=1), model_for("llama-3.1-70b", tp=4)
    single, split = step_cost(one, items), step_cost(four, items)
    # Each GPU does a quarter of the linear and attention FLOPs (64 query heads -> 16).
    assert split.linear_flops == pytest.approx(single.linear_flops / 4, rel=1e-12)
    assert split.attention_flops == pytest.approx(single.attention_flops / 4, rel=1e-12)
    assert split.compute_s == pytest.approx(single.compute_s / 4, rel=1e-12)
    # Two ring all-reduces per layer of 4096 tokens x 8192 bf16 activations, each moving
    # 2 (tp - 1) / tp of the message over 70% of the link, plus 8 us of latency.
    eff, gpu = Efficiency(), get_gpu("h100")
    message_bytes = 4096 * 8192 * 2
    per_allreduce_s = message_bytes * 2 * 3 / 4 / (gpu.interconnect_bytes_per_s * eff.interconnect_fraction) \
        + eff.allreduce_latency_s
    assert split.communication_s == pytest.approx(2 * 80 * per_allreduce_s, rel=1e-12)
    assert single.communication_s == 0
    assert split.total_s == pytest.approx(max(max(split.compute_s, split.memory_s) + serial_s(split)
                                              + split.communication_s, split.overhead_s), rel=1e-12)


def test_async_scheduling_overlaps_cpu_overhead():
    sync = step_cost(model_for("llama-3.1-8b", async_scheduling=False), [(1, 100)])
    overlapped = step_cost(model_for("llama-3.1-8b", async_scheduling=True), [(1, 100)])
    assert sync.total_s == pytest.approx(max(sync.compute_s, sync.memory_s) + serial_s(sync) + sync.overhead_s)
    assert overlapped.total_s == pytest.approx(max(max(sync.compute_s, sync.memory_s) + serial_s(sync),
                                                   sync.overhead_s))


def test_moe_reads_only_the_experts_the_tokens_touch():
    cm = model_for("gpt-oss-20b")
    one_token = step_cost(cm, [(1, 10)])
    many = step_cost(cm, [(4096, 0)])
    assert one_token.weight_bytes < many.weight_bytes <= cm.weight_bytes * 1.0001


def test_efficiency_factors_scale_the_terms():
    items = [(8192, 0)]
    peak_flops = get_gpu("h100").bf16_flops
    peak_bytes_per_s = get_gpu("h100").hbm_bandwidth_bytes_per_s
    base = step_cost(model_for("llama-3.1-8b"), items)
    tuned = Efficiency(matmul_flops_fraction=1.0, attention_flops_fraction=0.9, hbm_bandwidth_fraction=0.4)
    faster = step_cost(model_for("llama-3.1-8b", eff=tuned), items)
    for cost, eff in ((base, Efficiency()), (faster, tuned)):
        assert cost.compute_s == pytest.approx(cost.linear_flops / (peak_flops * eff.matmul_flops_fraction)
                                               + cost.attention_flops / (peak_flops * eff.attention_flops_fraction),
                                               rel=1e-12)
        assert cost.memory_s == pytest.approx((cost.weight_bytes + cost.kv_bytes)
                                              / (peak_bytes_per_s * eff.hbm_bandwidth_fraction), rel=1e-12)
    # The fractions change the seconds, never the work.
    assert (faster.linear_flops, faster.attention_flops, faster.weight_bytes, faster.kv_bytes) == \
        (base.linear_flops, base.attention_flops, base.weight_bytes, base.kv_bytes)
    assert faster.memory_s == pytest.approx(base.memory_s * 2, rel=1e-12)
    overhead = Efficiency(step_overhead_s=0.004, per_request_overhead_s=1e-4)
    sync = step_cost(model_for("llama-3.1-8b", async_scheduling=False, eff=overhead), [(1, 10)] * 3)
    assert sync.overhead_s == pytest.approx(0.004 + 3 * 1e-4, rel=1e-12)


def test_calibration_file_overrides_and_rejects_unknown_keys(tmp_path):
    good = tmp_path / "cal.toml"
    good.write_text("[cost_model]\nhbm_bandwidth_fraction = 0.5\nstep_overhead_s = 0.004\n")
    eff = read_calibration(good).efficiency
    assert eff.hbm_bandwidth_fraction == 0.5 and eff.step_overhead_s == 0.004
    bad = tmp_path / "bad.toml"
    bad.write_text("hbm_bandwith_fraction = 0.5\n")
    with pytest.raises(ConfigError, match="hbm_bandwith_fraction"):
        read_calibration(bad)
    with pytest.raises(ConfigError, match="fraction in"):
        efficiency_from_mapping({"matmul_flops_fraction": 1.5})


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt-oss-20b", "llama-4-scout", "jamba-mini", "deepseek-v3"])
def test_decode_sums_equal_the_per_request_terms(name):
    """The decode fast path (sums over contexts) must equal the general per-request terms."""
    p = plan(get_model(name), get_gpu("h200"), EngineConfig(max_model_len=32768, tensor_parallel_size=8))
    cm = CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=8,
                   async_scheduling=p.engine.async_scheduling)
    contexts = (0, 5, 127, 128, 1000, 8191, 8192, 20000)
    fast = cm.split_step_cost([c + 1 for c in contexts], [])
    general = cm.split_step_cost([], [(1, c) for c in contexts])
    assert fast.kv_bytes == pytest.approx(general.kv_bytes) and fast.kv_bytes > 0
    assert fast.flops == pytest.approx(general.flops)
