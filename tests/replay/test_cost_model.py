"""The cost model's terms: closed forms, monotonicity, TP, async overlap, calibration."""

import pytest

from kvtwin.sim.replay.cost_model import CostModel, Efficiency, attended_keys, efficiency_from_mapping, load_calibration
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import EngineConfig, plan


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


@pytest.mark.parametrize("kind, window", [("full_attention", 0), ("sliding_window", 128), ("chunked_local", 64)])
@pytest.mark.parametrize("start, end", [(0, 1), (0, 300), (100, 101), (127, 129), (1000, 1513), (5, 5)])
def test_attended_keys_closed_forms_match_brute_force(kind, window, start, end):
    assert attended_keys(kind, window, start, end) == brute(kind, window, start, end)


def model_for(name, gpu="h100", tp=1, async_scheduling=True, eff=Efficiency()):
    p = plan(get_model(name), get_gpu(gpu), EngineConfig(tensor_parallel_size=tp, max_model_len=32768))
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=async_scheduling,
                     efficiency=eff)


def test_decode_is_memory_bound_and_grows_with_context():
    cm = model_for("llama-3.1-8b")
    short = cm.step_cost([(1, 1000)] * 16)
    long = cm.step_cost([(1, 30000)] * 16)
    assert short.memory_s > short.compute_s
    assert long.total_s > short.total_s
    assert long.kv_bytes > short.kv_bytes * 20


def test_prefill_is_compute_bound():
    cost = model_for("llama-3.1-8b").step_cost([(8192, 0)])
    assert cost.compute_s > cost.memory_s


def test_sliding_window_layers_read_at_most_their_window():
    cm = model_for("gpt-oss-20b")
    near = cm.step_cost([(1, 20000)])
    far = cm.step_cost([(1, 30000)])
    full_layers = [lc for lc in cm.layer_classes if lc.kind == "full_attention"][0]
    # Only the full-attention half grows with context.
    growth = far.kv_bytes - near.kv_bytes
    assert growth == pytest.approx(10000 * full_layers.kv_bytes_per_token * full_layers.num_layers)


def test_tensor_parallelism_splits_compute_and_adds_communication():
    one = model_for("llama-3.1-70b", tp=4).step_cost([(4096, 0)])
    assert one.communication_s > 0
    single = model_for("llama-3.1-8b", tp=1).step_cost([(4096, 0)])
    assert single.communication_s == 0


def test_async_scheduling_overlaps_cpu_overhead():
    sync = model_for("llama-3.1-8b", async_scheduling=False).step_cost([(1, 100)])
    overlapped = model_for("llama-3.1-8b", async_scheduling=True).step_cost([(1, 100)])
    assert sync.total_s == pytest.approx(max(sync.compute_s, sync.memory_s) + sync.overhead_s)
    assert overlapped.total_s == pytest.approx(max(max(sync.compute_s, sync.memory_s), sync.overhead_s))


def test_moe_reads_only_the_experts_the_tokens_touch():
    cm = model_for("gpt-oss-20b")
    one_token = cm.step_cost([(1, 10)])
    many = cm.step_cost([(4096, 0)])
    assert one_token.weight_bytes < many.weight_bytes <= cm.weight_bytes * 1.0001


def test_efficiency_factors_scale_the_terms():
    base = model_for("llama-3.1-8b").step_cost([(8192, 0)])
    faster = model_for("llama-3.1-8b", eff=Efficiency(matmul_flops_fraction=1.0,
                                                       attention_flops_fraction=0.9)).step_cost([(8192, 0)])
    assert faster.compute_s < base.compute_s


def test_calibration_file_overrides_and_rejects_unknown_keys(tmp_path):
    good = tmp_path / "cal.toml"
    good.write_text("[cost_model]\nhbm_bandwidth_fraction = 0.5\nstep_overhead_s = 0.004\n")
    eff = load_calibration(good)
    assert eff.hbm_bandwidth_fraction == 0.5 and eff.step_overhead_s == 0.004
    bad = tmp_path / "bad.toml"
    bad.write_text("hbm_bandwith_fraction = 0.5\n")
    with pytest.raises(ConfigError, match="hbm_bandwith_fraction"):
        load_calibration(bad)
    with pytest.raises(ConfigError, match="fraction in"):
        efficiency_from_mapping({"matmul_flops_fraction": 1.5})


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt-oss-20b", "llama-4-scout", "jamba-mini"])
def test_decode_sums_equal_the_per_request_terms(name):
    """The decode fast path (sums over contexts) must equal the general per-request terms."""
    p = plan(get_model(name), get_gpu("h200"), EngineConfig(max_model_len=32768, tensor_parallel_size=8))
    cm = CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=8)
    items = [(1, c) for c in (0, 5, 127, 128, 1000, 8191, 8192, 20000)]
    fast = cm.step_cost(items)
    general_kv = general_flops = 0.0
    for new, before in items:
        end = before + new
        for lc in cm.layer_classes:
            if lc.kind == "mamba":
                general_kv += 2 * lc.state_bytes * lc.num_layers
                continue
            read = min(end, lc.window_tokens + new - 1) if lc.kind == "sliding_window" else (
                end - (before // lc.window_tokens) * lc.window_tokens if lc.kind == "chunked_local" else end)
            general_kv += (read + new) * lc.kv_bytes_per_token * lc.num_layers
            general_flops += 2.0 * lc.attention_width * lc.num_layers * attended_keys(lc.kind, lc.window_tokens,
                                                                                      before, end)
    assert fast.kv_bytes == pytest.approx(general_kv)
    assert fast.flops - cm.linear_flops_per_token * len(items) == pytest.approx(general_flops)
