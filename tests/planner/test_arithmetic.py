"""The planner's arithmetic on real presets, each figure derived by hand here from the
published facts (each preset's ``source`` in ``sim/planner/data/models.toml``) and vLLM's
rules (docs/semantics.md#number-of-blocks). Memory tables worked out from those facts
beforehand are used only as a cross-check."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.planner.grouping import choose_group_size
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.plan import plan

GIB = 1 << 30
KV_40_GIB = 40 * GIB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sync(**kw) -> EngineConfig:
    """The golden settings: 40 GiB of KV cache, 8192-token steps, synchronous scheduling."""
    base = dict(kv_cache_memory_bytes=KV_40_GIB, max_num_batched_tokens=8192, max_num_seqs=1024,
                async_scheduling=False)
    base.update(kw)
    return EngineConfig(**base)


def run(model: str, gpu: str = "h200", **kw):
    return plan(get_model(model), get_gpu(gpu), sync(**kw))


# ---------------------------------------------------------------------------- Gemma-3-27B

GEMMA27_PAGE = 16 * 16 * (128 + 128) * 2  # block 16 x 16 KV heads x (K+V head dims) x bf16


@pytest.mark.parametrize("length", [32768, 131072])
def test_gemma3_27b_sliding_layers_bounded_vs_full(length):
    on = run("gemma-3-27b", max_model_len=length)
    off = run("gemma-3-27b", max_model_len=length, hybrid_kv_cache=False,
              kv_cache_memory_bytes=100 * GIB)
    # 52 SWA + 10 full: group size 10 (52 >= 1.5 x 10), SWA in cdiv(52, 10) = 6 groups, 8 padding slots.
    assert [g.spec.kind for g in on.groups] == ["sliding_window"] * 6 + ["full_attention"]
    assert on.grouping.num_padding_layers == 6 * 10 - 52 == 8
    assert on.bytes_per_block == 10 * GEMMA27_PAGE == 1_310_720
    full_blocks = cdiv(length, 16)
    # vLLM's worst case: the window plus a whole 8192-token step in flight, +1 for alignment.
    swa_admission = cdiv(min(1024 - 1 + 8192, length), 16) + 1
    assert on.blocks_per_request == full_blocks + 6 * swa_admission
    # Once decoding: the window plus one token in flight.
    swa_steady = cdiv(1024 - 1 + 1, 16) + 1
    assert swa_steady == 65
    assert on.steady_state_blocks_per_request == full_blocks + 6 * 65
    # Hybrid off: all 62 layers paid as full attention in one group.
    assert len(off.groups) == 1 and off.groups[0].spec.sliding_window == 1024
    assert off.bytes_per_block == 62 * GEMMA27_PAGE
    assert off.blocks_per_request == full_blocks
    steady_bytes = on.steady_state_blocks_per_request * on.bytes_per_block
    full_bytes = off.blocks_per_request * off.bytes_per_block
    assert full_bytes == 62 * 8192 * length  # 8192 bytes per token per layer
    # Cross-check against the worked-out memory table: 0.1920 at 32k, 0.1690 at 128k.
    expected = {32768: 0.1920, 131072: 0.1690}[length]
    assert steady_bytes / full_bytes == pytest.approx(expected, abs=5e-5)
    if length == 32768:
        assert steady_bytes == 2438 * 1_310_720 == 3_195_535_360


def test_gemma3_27b_hybrid_off_does_not_fit_128k_in_40_gib():
    off = run("gemma-3-27b", max_model_len=131072, hybrid_kv_cache=False)
    assert not off.fits and off.kv_cache_tokens is None and off.max_concurrency is None
    # 40 GiB less the null block, in 62-layer blocks of 16 tokens.
    usable_blocks = (KV_40_GIB - 62 * GEMMA27_PAGE) // (62 * GEMMA27_PAGE)
    assert off.estimated_max_model_len == usable_blocks * 16 == 84544
    assert off.shortfall_bytes == 8192 * 62 * GEMMA27_PAGE - (KV_40_GIB - 62 * GEMMA27_PAGE)
    changes = {s["change"] for s in off.suggestions}
    assert {"max_model_len", "kv_cache_dtype", "tensor_parallel_size"} <= changes


# ---------------------------------------------------------------------------- gpt-oss-20b

@pytest.mark.parametrize("length", [1024, 4096, 32768, 131072])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_gpt_oss_20b_saving_never_passes_one_half(length, asynchronous):
    on = run("gpt-oss-20b", max_model_len=length, async_scheduling=asynchronous)
    off = run("gpt-oss-20b", max_model_len=length, async_scheduling=asynchronous, hybrid_kv_cache=False)
    page = 16 * 8 * (64 + 64) * 2
    assert on.bytes_per_block == 12 * page == 393_216  # 12 SWA and 12 full: group size 12, no padding
    assert off.bytes_per_block == 24 * page
    assert on.grouping.num_padding_layers == 0 and len(on.groups) == 2
    off_bytes = off.blocks_per_request * off.bytes_per_block
    assert off_bytes == 24 * 2048 * cdiv(length, 16) * 16
    for blocks in (on.blocks_per_request, on.steady_state_blocks_per_request):
        saving = 1 - blocks * on.bytes_per_block / off_bytes
        assert saving < 0.5  # half the layers are full attention whatever happens
    # The steady state saves close to one half at long contexts...
    if length >= 32768:
        assert 0.49 < 1 - on.steady_state_blocks_per_request * on.bytes_per_block / off_bytes < 0.5
    # ...while vLLM's own figure, whose window cap is min(W-1+in_flight, len) + one block,
    # costs a block *more* than full attention when the context is short.
    if length <= 4096:
        assert on.blocks_per_request * on.bytes_per_block > off_bytes


# ---------------------------------------------------------------------------- Llama-4-Scout

def test_llama4_scout_chunked_local_groups():
    default = run("llama-4-scout", max_model_len=131072)
    page = 16 * 8 * 256 * 2
    # vLLM 0.33 turns the hybrid manager off for chunked-local models: one full group.
    assert default.engine.hybrid_kv_cache is False
    assert len(default.groups) == 1 and default.groups[0].spec.attention_chunk_size == 8192
    assert default.bytes_per_block == 48 * page
    on = run("llama-4-scout", max_model_len=131072, hybrid_kv_cache=True)
    kinds = [g.spec.kind for g in on.groups]
    assert kinds == ["chunked_local"] * 3 + ["full_attention"]  # 36 local in 3 groups of 12, 12 global
    assert on.bytes_per_block == 12 * page
    local_layers = [i for i in range(48) if i % 4 != 3]
    assert [on.layers.layer_index[n] for n in on.groups[0].layer_names] == local_layers[0::3]
    assert [on.layers.layer_index[n] for n in on.groups[3].layer_names] == list(range(3, 48, 4))
    chunk_blocks = cdiv(min(8192 + 8192, 131072), 16)
    assert on.blocks_per_request == 8192 + 3 * chunk_blocks
    # Decode: the current chunk (plus the token in flight) per local group.
    steady_chunk = cdiv(8192 + 1, 16)
    assert on.steady_state_blocks_per_request == 8192 + 3 * steady_chunk
    # Cross-check against the worked-out memory table ("current chunk full" worst case, 32k): 0.4375
    at32 = run("llama-4-scout", max_model_len=32768, hybrid_kv_cache=True)
    ratio = at32.steady_state_blocks_per_request * at32.bytes_per_block / (48 * 2048 * page)
    assert ratio == pytest.approx(0.4375, abs=1e-3)


# ---------------------------------------------------------------------------- DeepSeek-V3 (MLA)

@pytest.mark.parametrize("gpu,block", [("a100-80gb", 16), ("h200", 16), ("b200", 128)])
def test_deepseek_v3_mla_bytes_per_token(gpu, block):
    p = run("deepseek-v3", gpu=gpu, max_model_len=32768, tensor_parallel_size=8)
    per_token = 61 * (512 + 64) * 2  # one 576-wide latent per layer, not replicated per KV head
    assert per_token == 70_272
    assert p.layers.attention_block_size == block  # Triton MLA / FlashAttention MLA / CUTLASS MLA
    assert p.bytes_per_block == block * per_token
    assert [g.spec.kind for g in p.groups] == ["mla"]
    assert p.blocks_per_request * p.bytes_per_block == 32768 * per_token
    fp8 = run("deepseek-v3", gpu=gpu, max_model_len=32768, kv_cache_dtype="fp8")
    assert fp8.bytes_per_block == block * 61 * 576


# ---------------------------------------------------------------------------- recurrent states

def _state_bytes(shapes, dtype_bytes):
    return sum(math.prod(s) * b for s, b in zip(shapes, dtype_bytes))


@pytest.mark.parametrize("gpu,block,alignment,checkpoint", [("a100-80gb", 544, 16, 0), ("h100", 576, 64, 1)])
def test_qwen3_next_state_bytes_and_gpu_dependent_block_size(gpu, block, alignment, checkpoint):
    p = run("qwen3-next-80b-a3b", gpu=gpu, max_model_len=131072)
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2  # (kernel-1, 2*nk*dk + nv*dv) bf16
    ssm = 32 * 128 * 128 * 2  # (nv, dv, dk) bf16
    state = conv + ssm
    assert state == 1_097_728
    attn_per_token = 2 * (256 + 256) * 2  # 2 KV heads of 256, K and V, bf16
    # Hopper's GDN prefill checkpoints need 64-token alignment: 64 x cdiv(state, 64 x 2048) = 576.
    assert block == alignment * cdiv(state, alignment * attn_per_token)
    assert p.layers.attention_block_size == block
    page = block * attn_per_token
    assert [g.spec.kind for g in p.groups] == ["mamba"] * 3 + ["full_attention"]
    mamba = p.groups[0].spec
    assert mamba.real_page_size_bytes == state and mamba.page_size_bytes == page
    assert p.bytes_per_block == 12 * page
    # align mode: current + previous state per request, 36 GDN layers; on Hopper FlashInfer's
    # prefill exports checkpoints, one more state block per request, on the block grid.
    assert mamba.num_prefill_checkpoint_blocks == checkpoint
    assert mamba.prefill_checkpoint_alignment == (block if checkpoint else None)
    state_blocks = sum(p.group_blocks_per_request(g) for g in p.groups[:3])
    assert state_blocks == 3 * (2 + checkpoint)
    assert 36 * 2 * state == 79_036_416 and 36 * 3 * state == 118_554_624
    assert state_blocks * 12 * mamba.real_page_size_bytes == 36 * (2 + checkpoint) * state
    assert p.blocks_per_request == 3 * (2 + checkpoint) + cdiv(131072, block)
    none_mode = run("qwen3-next-80b-a3b", gpu=gpu, max_model_len=131072, enable_prefix_caching=False)
    assert sum(none_mode.group_blocks_per_request(g) for g in none_mode.groups[:3]) == 3
    # Without checkpoints (no prefix caching) Hopper needs no extra alignment.
    assert none_mode.layers.attention_block_size == 544


def test_qwen3_next_fp32_ssm_state():
    p = run("qwen3-next-80b-a3b", gpu="a100-80gb", max_model_len=32768, mamba_ssm_cache_dtype="float32")
    assert p.groups[0].spec.real_page_size_bytes == 49_152 + 32 * 128 * 128 * 4 == 2_146_304


def test_qwen3_next_kv_heads_replicated_beyond_tp():
    p = run("qwen3-next-80b-a3b", gpu="a100-80gb", max_model_len=32768, tensor_parallel_size=4)
    full = p.groups[-1].spec
    assert full.num_kv_heads == 1  # 2 KV heads over 4 ranks: one whole head per rank
    conv = 3 * (8192 // 4) * 2
    ssm = (32 // 4) * 128 * 128 * 2
    assert p.groups[0].spec.real_page_size_bytes == conv + ssm


def test_jamba_state_bytes_and_groups():
    p = run("jamba-mini", max_model_len=65536)
    d_inner = 2 * 4096
    state = 3 * d_inner * 2 + d_inner * 16 * 2  # conv (3, d_inner) + ssm (d_inner, 16), bf16
    assert state == 311_296
    attn_per_token = 8 * 256 * 2
    assert p.layers.attention_block_size == 16 * cdiv(state, 16 * attn_per_token) == 80
    # 28 Mamba + 4 attention layers (i % 8 == 4): group size 4, 7 state groups + 1, no padding.
    assert [g.spec.kind for g in p.groups] == ["mamba"] * 7 + ["full_attention"]
    assert p.grouping.num_padding_layers == 0
    assert [p.layers.layer_index[n] for n in p.groups[-1].layer_names] == [4, 12, 20, 28]
    assert p.bytes_per_block == 4 * 80 * attn_per_token == 1_310_720
    assert 28 * 2 * state == 17_432_576  # state bytes per request in align mode
    assert p.blocks_per_request == 7 * 2 + cdiv(65536, 80)


def test_prefill_checkpoints_make_three_state_pages_per_request():
    """vLLM 0.33: Mamba-2 mixers and gated DeltaNet on FlashInfer (Hopper) publish prefill
    checkpoints, so an align-mode request holds current + previous + checkpoint state."""
    # Nemotron-H-8B on H100: 24 Mamba-2 layers (fp32 SSM by default) + 4 attention.
    p = run("nemotron-h-8b", gpu="h100", max_model_len=8192)
    state = 3 * (128 * 64 + 2 * 8 * 128) * 2 + 128 * 64 * 128 * 4  # conv bf16 + ssm fp32
    attn_per_token = 8 * (128 + 128) * 2
    block = 16 * cdiv(state, 16 * attn_per_token)
    assert (state, block) == (4_255_744, 1040) and p.layers.attention_block_size == block
    assert [g.spec.kind for g in p.groups] == ["mamba"] * (24 // 4) + ["full_attention"]
    for g in p.groups[:-1]:
        assert (g.spec.num_prefill_checkpoint_blocks, g.spec.prefill_checkpoint_alignment) == (1, 1)
        assert p.group_blocks_per_request(g) == 2 + 1
    assert p.blocks_per_request == 6 * 3 + cdiv(8192, block) == 26

    # Qwen3-Next on 4 x H200: 36 GDN + 12 attention layers, sharded over 4 ranks.
    q = run("qwen3-next-80b-a3b", gpu="h200", tensor_parallel_size=4, max_model_len=262144)
    state = 3 * (2 * 16 * 128 + 32 * 128) // 4 * 2 + (32 // 4) * 128 * 128 * 2
    attn_per_token = 1 * (256 + 256) * 2  # 2 KV heads over 4 ranks: one per rank
    block = 64 * cdiv(state, 64 * attn_per_token)  # FlashInfer's 64-token grid on Hopper
    assert (state, block) == (274_432, 320) and q.layers.attention_block_size == block
    for g in q.groups[:3]:
        # Checkpoint offsets on the prefix-cache grid: the state block size.
        assert (g.spec.num_prefill_checkpoint_blocks, g.spec.prefill_checkpoint_alignment) == (1, block)
        assert q.group_blocks_per_request(g) == 3
    assert q.blocks_per_request == 3 * 3 + cdiv(262144, block) == 829

    # Mamba-1 (Jamba) exports none: two state pages.
    j = run("jamba-mini", gpu="h100", max_model_len=65536)
    assert {(g.spec.num_prefill_checkpoint_blocks, j.group_blocks_per_request(g)) for g in j.groups[:-1]} == {(0, 2)}
    # Without prefix caching ("none" mode) there are no checkpoints and one state page.
    n = run("nemotron-h-8b", gpu="h100", max_model_len=8192, enable_prefix_caching=False)
    assert {(g.spec.num_prefill_checkpoint_blocks, n.group_blocks_per_request(g)) for g in n.groups[:-1]} == {(0, 1)}


def test_without_prefix_caching_a_state_block_spans_max_model_len():
    """vLLM 0.33 (``model_executor/models/config.py``, HybridAttentionMambaModelConfig) sets
    ``mamba_block_size = max_model_len`` when prefix caching is off: one block holds a
    request's state for its whole life, so a request never takes more than one per group."""
    from kvtwin.sim.core.engine import EngineCore
    from kvtwin.sim.core.hashing import TokenPrompt
    from kvtwin.sim.core.request import Request
    from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model

    on = run("nemotron-h-8b", gpu="h100", max_model_len=8192)
    off = run("nemotron-h-8b", gpu="h100", max_model_len=8192, enable_prefix_caching=False)
    assert {g.spec.block_size for g in on.groups[:-1]} == {on.layers.attention_block_size}
    assert {g.spec.block_size for g in off.groups[:-1]} == {8192}
    assert off.groups[-1].spec.block_size == off.layers.attention_block_size
    engine = EngineCore(off.require_fits(), off.engine.scheduler, off.engine.cache)
    engine.add_request(Request("r", TokenPrompt(range(5000)), 40))
    executor = CostModelExecutor(plan_cost_model(off))
    while engine.has_unfinished_requests():
        engine.step(executor)
        if engine.scheduler.running:
            tables = engine.kv_cache_manager.get_block_ids("r")
            assert [len([b for b in t if b]) for t in tables[:-1]] == [1] * (len(tables) - 1)


@pytest.mark.parametrize("model,groups,padding,block", [
    ("gemma-3-12b", 6, 0, 16),        # 40 SWA + 8 full: group size 8
    ("gemma-3-27b", 7, 8, 16),        # 52 SWA + 10 full: group size 10
    ("gpt-oss-120b", 2, 0, 16),       # 18 + 18
    ("granite-4.0-h-small", 10, 0, 528),   # 36 Mamba-2 + 4 full
    ("nemotron-h-8b", 7, 0, 1040),    # 24 Mamba-2 (fp32 SSM) + 4 full, 24 MLP-only layers uncached
    ("minimax-text-01", 8, 0, 512),   # 70 lightning + 10 full
    ("mistral-7b-v0.1", 1, 0, 16),    # all sliding window
    ("llama-3.1-70b", 1, 0, 16),
])
def test_group_counts_and_padding(model, groups, padding, block):
    p = run(model, gpu="a100-80gb", max_model_len=8192)
    assert len(p.groups) == groups
    assert p.grouping.num_padding_layers == padding
    assert p.layers.attention_block_size == block
    assert sum(len(g.layer_names) for g in p.groups) == sum(1 for k in get_model(model).layer_kinds if k)


def test_state_pages_match_models_md_table():
    # Cross-check against the worked-out page unification table.
    granite = run("granite-4.0-h-small", gpu="a100-80gb", max_model_len=8192)
    assert granite.groups[0].spec.real_page_size_bytes == 3 * 8448 * 2 + 128 * 64 * 128 * 2 == 2_147_840
    assert granite.groups[0].spec.page_size_bytes == 528 * 4096 == 2_162_688
    nemo = run("nemotron-h-8b", gpu="a100-80gb", max_model_len=8192)
    assert nemo.groups[0].spec.real_page_size_bytes == 3 * 10240 * 2 + 128 * 64 * 128 * 4 == 4_255_744
    nemo_bf16 = run("nemotron-h-8b", gpu="a100-80gb", max_model_len=8192, mamba_ssm_cache_dtype="bfloat16")
    assert nemo_bf16.layers.attention_block_size == 528
    minimax = run("minimax-text-01", gpu="a100-80gb", max_model_len=8192)
    assert minimax.groups[0].spec.page_size_bytes == 64 * 128 * 128 * 2 == 512 * 4096
    assert minimax.groups[0].spec.page_size_padded is None  # exactly one attention page: no padding


def test_mistral_all_sliding_stays_sliding_with_hybrid_off():
    on = run("mistral-7b-v0.1", max_model_len=32768)
    off = run("mistral-7b-v0.1", max_model_len=32768, hybrid_kv_cache=False)
    # No full-attention layer to promote into: vLLM leaves a uniform model as it is.
    assert off.groups[0].spec.kind == on.groups[0].spec.kind == "sliding_window"
    assert on.blocks_per_request == cdiv(min(4095 + 8192, 32768), 16) + 1 == 769


def test_a_prefill_lookahead_makes_every_sliding_window_retain_its_tail():
    """vLLM's planner: extra_retained_tokens = max(0, num_prefill_lookahead_tokens - 1) on every
    sliding-window layer (docs/semantics.md#sliding-window), in the admission cap too."""
    model, gpu = get_model("gemma-3-27b"), get_gpu("h200")
    base = plan(model, gpu, sync(max_model_len=32768))
    for lookahead in (0, 1):
        same = plan(model, gpu, sync(max_model_len=32768), num_prefill_lookahead_tokens=lookahead)
        assert same.groups == base.groups and same.blocks_per_request == base.blocks_per_request
    # 3-module MTP: k = 3, 2 tokens more below each window (1023 + 2 + 8192 = 9217 tokens).
    mtp = plan(model, gpu, sync(max_model_len=32768), num_prefill_lookahead_tokens=3)
    windows = [g.spec for g in mtp.groups if g.spec.kind == "sliding_window"]
    assert len(windows) == 6 and {s.extra_retained_tokens for s in windows} == {2}
    assert mtp.blocks_per_request == cdiv(32768, 16) + 6 * (cdiv(1024 - 1 + 2 + 8192, 16) + 1)
    assert mtp.blocks_per_request == base.blocks_per_request + 6
    # Promoted to full attention (hybrid manager off) the tail is moot: vLLM drops it.
    off = plan(model, gpu, sync(max_model_len=32768, hybrid_kv_cache=False, kv_cache_memory_bytes=100 * GIB),
               num_prefill_lookahead_tokens=3)
    assert off.groups[0].spec.kind == "full_attention" and not hasattr(off.groups[0].spec, "extra_retained_tokens")


# ---------------------------------------------------------------------------- rules

@pytest.mark.parametrize("sizes,expected", [([10, 52], 10), ([12, 12], 12), ([12, 13], 13), ([10, 14], 14),
                                            ([10, 15], 10), ([4, 28], 4)])
def test_group_size_rule(sizes, expected):
    assert choose_group_size(sizes) == expected


def test_async_scheduling_doubles_in_flight_and_lowers_vllms_figure():
    sync_plan = run("gemma-3-27b", max_model_len=32768)
    async_plan = run("gemma-3-27b", max_model_len=32768, async_scheduling=True)
    assert EngineConfig().async_scheduling is True  # vLLM 0.33's default
    assert async_plan.engine.max_in_flight_tokens == 2 * 8192
    assert async_plan.blocks_per_request == 2048 + 6 * (cdiv(1023 + 16384, 16) + 1)
    assert async_plan.max_concurrency < sync_plan.max_concurrency
    # What users see once prefills are done barely moves (2 decode tokens in flight, not 1).
    assert async_plan.steady_state_blocks_per_request == 2048 + 6 * (cdiv(1023 + 2, 16) + 1)
    assert async_plan.steady_state_concurrency > 2 * async_plan.max_concurrency


def test_async_schedulings_default_has_one_home():
    # The engine config's default reaches the scheduler the replay runs; the core's
    # scheduler config has none of its own to disagree with it.
    resolved = EngineConfig(max_model_len=4096).resolve(get_model("llama-3.1-8b"), get_gpu("h100"))
    assert resolved.scheduler.async_scheduling is True
    with pytest.raises(TypeError, match="async_scheduling"):
        SchedulerConfig(max_model_len=4096)


def test_kv_cache_config_is_what_the_manager_runs_on():
    p = run("gemma-3-27b", max_model_len=32768)
    cfg = p.kv_cache_config
    assert cfg.num_blocks == p.num_blocks == KV_40_GIB // 1_310_720
    assert [g.spec.kind for g in cfg.groups] == [g.spec.kind for g in p.groups]
    assert [g.num_padding_layers for g in cfg.groups] == [1, 1, 1, 1, 2, 2, 0]
    assert cfg.hash_block_size == 16
    assert run("gemma-3-27b", max_model_len=131072, hybrid_kv_cache=False).kv_cache_config is None


# ---------------------------------------------------------------------------- memory budget

def test_memory_budget_arithmetic():
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    engine = EngineConfig(max_model_len=8192, activation_peak_bytes=GIB, cuda_graph_bytes=GIB // 2,
                          non_torch_bytes=GIB // 4)
    p = plan(model, gpu, engine)
    requested = math.ceil(gpu.memory_bytes * 0.92)
    weights = int(8.03e9 * 2)
    assert p.memory.requested_bytes == requested
    assert p.memory.weights_bytes == weights
    assert p.memory.kv_cache_bytes == requested - weights - GIB - GIB // 2 - GIB // 4
    assert p.num_blocks == p.memory.kv_cache_bytes // (32 * 16 * 8 * 256 * 2)
    tp2 = plan(model, gpu, dataclasses.replace(engine, tensor_parallel_size=2))
    assert tp2.memory.weights_bytes == math.ceil(weights / 2)
    assert tp2.bytes_per_block == p.bytes_per_block // 2  # 4 of the 8 KV heads per GPU
    low = plan(model, gpu, dataclasses.replace(engine, gpu_memory_utilization=0.5))
    assert low.memory.kv_cache_bytes == math.ceil(gpu.memory_bytes * 0.5) - weights - GIB - GIB // 2 - GIB // 4


def test_memory_estimate_terms_are_positive_and_explicit_bytes_bypass_them():
    p = plan(get_model("gemma-3-27b"), get_gpu("h100"), EngineConfig(tensor_parallel_size=2, max_model_len=32768))
    m = p.memory
    assert m.kv_cache_source == "estimated"
    assert m.activation_peak_bytes > 0 and m.cuda_graph_bytes > 0 and m.non_torch_bytes > 0
    assert m.weights_bytes == math.ceil(27e9 * 2 / 2)
    assert m.kv_cache_bytes == m.requested_bytes - m.non_kv_bytes
    explicit = plan(get_model("gemma-3-27b"), get_gpu("h100"),
                    EngineConfig(tensor_parallel_size=2, max_model_len=32768, kv_cache_memory_bytes=10 * GIB))
    assert explicit.memory.kv_cache_source == "kv_cache_memory_bytes"
    assert explicit.memory.kv_cache_bytes == 10 * GIB


def test_weights_replicate_kv_heads_beyond_tp():
    model = get_model("qwen3-next-80b-a3b")
    tp4 = plan(model, get_gpu("h200"), EngineConfig(tensor_parallel_size=4, max_model_len=8192))
    per_head = 12 * 2048 * (256 + 256) * 2  # K and V projections of one head, 12 attention layers
    assert tp4.memory.weights_bytes == math.ceil(80e9 * 2 / 4) + int(per_head * (1 - 2 / 4))


def test_model_that_does_not_fit_says_by_how_much_and_what_would():
    p = plan(get_model("llama-3.1-70b"), get_gpu("h100"), EngineConfig(max_model_len=131072))
    assert not p.fits
    assert p.memory.kv_cache_bytes < 0  # 141 GB of weights on an 80 GB card
    assert p.shortfall_bytes > 0
    tp = [s["value"] for s in p.suggestions if s["change"] == "tensor_parallel_size"]
    assert tp and plan(get_model("llama-3.1-70b"), get_gpu("h100"),
                       EngineConfig(max_model_len=131072, tensor_parallel_size=tp[0])).fits


def test_gpt_oss_mxfp4_weights():
    model = get_model("gpt-oss-20b")
    experts = 24 * 32 * 3 * 2880 * 2880  # routed gate/up/down in MXFP4
    assert model.weights_bytes == int(experts * 4.25 / 8 + (21e9 - experts) * 2)
    assert 13e9 < model.weights_bytes < 15e9
