"""The KV cache planner: model + GPU + engine config -> vLLM's layout and capacity.

Seed 000 (spec -> grouping -> page size) and semantics section 7, as vLLM 0.33 does it:

1. ``EngineConfig.resolve`` fills vLLM's defaults (batching defaults by GPU memory, the
   hybrid manager default per model, async scheduling on, Mamba "align" mode when prefix
   caching is on) and rejects bad input with one ``ConfigError`` each.
2. One spec per layer, per GPU (KV heads sharded by TP, or replicated when fewer than the
   ranks; recurrent state shapes sharded), with the hybrid attention block size raised so
   one attention page holds a state (``sim/planner/page_size.py``).
3. Grouping (``sim/planner/grouping.py``): hybrid off, uniform, page unification, repeat pattern,
   padding layers, full-allocation fallback.
4. ``bytes_per_block`` = the largest group's bytes per block; ``num_blocks`` = available
   KV bytes // bytes_per_block (null block included); the per-request worst case is the
   sum over groups of each group's admission cap; vLLM's "maximum concurrency" is
   ``num_blocks / that`` and its "GPU KV cache size" is ``int(concurrency x max_model_len)``.
   The fits check plans against ``num_blocks - 1`` usable blocks, as vLLM does.

The output is a ``Plan`` (everything ``kvtwin plan`` prints) whose ``kv_cache_config`` is
the ``KVCacheConfig`` the KV cache manager runs on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import reduce

from kvtwin.sim.core.errors import ConfigError, require
from kvtwin.sim.planner.grouping import Grouping, PlannedGroup, group_layers
from kvtwin.sim.planner.hardware import GIB, GPUSpec
from kvtwin.sim.planner.memory_budget import MemoryBudget, estimate_memory, explicit_memory
from kvtwin.sim.planner.models import DTYPE_BYTES, ModelPreset
from kvtwin.sim.planner.page_size import HybridBlockSize, hybrid_attention_block_size
from kvtwin.sim.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2")
MAMBA_DTYPES = ("auto", "float32", "bfloat16", "bf16", "float16", "fp16")
MAMBA_CACHE_MODES = ("none", "align")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object, name: str, what: str = "a positive integer") -> None:
    require(_is_int(value) and value > 0, name, what, value)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine settings that shape the KV cache (vLLM option names). None = vLLM's default."""

    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None
    hybrid_kv_cache: bool | None = None
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    mamba_cache_mode: str | None = None
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    # Overrides of the memory estimate (bytes per GPU), e.g. from a real profiling run.
    activation_peak_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    non_torch_bytes: int | None = None

    def __post_init__(self) -> None:
        _positive(self.tensor_parallel_size, "tensor_parallel_size")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size",
                     "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None:
                _positive(value, name)
        util = self.gpu_memory_utilization
        require(isinstance(util, (int, float)) and not isinstance(util, bool) and 0 < util <= 1,
                "gpu_memory_utilization", "a fraction in (0, 1]", util)
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}",
                self.kv_cache_dtype)
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            require(getattr(self, name) in MAMBA_DTYPES, name, f"one of {', '.join(MAMBA_DTYPES)}",
                    getattr(self, name))
        if self.mamba_cache_mode is not None:
            require(self.mamba_cache_mode in MAMBA_CACHE_MODES, "mamba_cache_mode",
                    f"one of {', '.join(MAMBA_CACHE_MODES)} ('all' is not modelled)", self.mamba_cache_mode)
        for name in ("hybrid_kv_cache", "async_scheduling", "enable_prefix_caching"):
            value = getattr(self, name)
            if value is not None:
                require(isinstance(value, bool), name, "true or false", value)
        for name in ("activation_peak_bytes", "cuda_graph_bytes", "non_torch_bytes"):
            value = getattr(self, name)
            if value is not None:
                require(_is_int(value) and value >= 0, name, "a non-negative number of bytes", value)

    def resolve(self, model: ModelPreset, gpu: GPUSpec) -> ResolvedEngine:
        """vLLM 0.33's defaults filled in, and the settings checked against the model."""
        tp = self.tensor_parallel_size
        max_model_len = self.max_model_len or model.max_position_embeddings
        # `vllm serve` defaults (engine/arg_utils.py): larger batches on >= 70 GiB GPUs, A100 excepted.
        large = gpu.memory_bytes >= 70 * GIB and "a100" not in f"{gpu.name} {gpu.description}".lower()
        max_num_batched_tokens = self.max_num_batched_tokens or (8192 if large else 2048)
        max_num_seqs = self.max_num_seqs or (1024 if large else 256)
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError("max_num_batched_tokens", f"at least max_num_seqs ({max_num_seqs})",
                              max_num_batched_tokens)
        has_state = "mamba" in model.layer_kinds
        mamba_cache_mode = self.mamba_cache_mode or ("align" if self.enable_prefix_caching and has_state else "none")
        if mamba_cache_mode == "align" and not self.enable_prefix_caching:
            raise ConfigError("mamba_cache_mode", "'none' when prefix caching is off", "align")
        hybrid = model.default_hybrid_kv_cache if self.hybrid_kv_cache is None else self.hybrid_kv_cache
        _check_model_fits_settings(model, tp=tp, max_model_len=max_model_len)
        return ResolvedEngine(
            tensor_parallel_size=tp, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, user_block_size=self.block_size or DEFAULT_BLOCK_SIZE,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_dtype_bytes=DTYPE_BYTES[model.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype],
            gpu_memory_utilization=float(self.gpu_memory_utilization),
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, hybrid_kv_cache=hybrid,
            hybrid_kv_cache_is_default=hybrid == model.default_hybrid_kv_cache,
            async_scheduling=self.async_scheduling, enable_prefix_caching=self.enable_prefix_caching,
            mamba_cache_mode=mamba_cache_mode, **_mamba_dtypes(model, self),
            activation_peak_bytes=self.activation_peak_bytes, cuda_graph_bytes=self.cuda_graph_bytes,
            non_torch_bytes=self.non_torch_bytes)


@dataclass(frozen=True, kw_only=True)
class ResolvedEngine:
    tensor_parallel_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    user_block_size: int
    kv_cache_dtype: str
    kv_cache_dtype_bytes: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    hybrid_kv_cache: bool
    hybrid_kv_cache_is_default: bool
    async_scheduling: bool
    enable_prefix_caching: bool
    mamba_cache_mode: str
    mamba_conv_dtype: str
    mamba_ssm_dtype: str
    activation_peak_bytes: int | None
    cuda_graph_bytes: int | None
    non_torch_bytes: int | None

    @property
    def max_concurrent_batches(self) -> int:
        # Async scheduling keeps two batches in flight (AsyncScheduler).
        return 2 if self.async_scheduling else 1

    @property
    def max_in_flight_tokens(self) -> int:
        """What the sliding-window / chunked-local admission caps add to the window."""
        return self.max_concurrent_batches * self.max_num_batched_tokens

    @property
    def decode_in_flight_tokens(self) -> int:
        """Tokens one request has in flight once its prefill is done (one per batch)."""
        return self.max_concurrent_batches


def _mamba_dtypes(model: ModelPreset, engine: EngineConfig) -> dict[str, str]:
    conv = model.dtype if engine.mamba_cache_dtype == "auto" else engine.mamba_cache_dtype
    ssm = engine.mamba_ssm_cache_dtype
    if ssm == "auto":
        ssm = model.mamba_ssm_cache_dtype if model.mamba_ssm_cache_dtype != "auto" else conv
    return {"mamba_conv_dtype": conv, "mamba_ssm_dtype": ssm}


def _check_model_fits_settings(model: ModelPreset, *, tp: int, max_model_len: int) -> None:
    kinds = set(model.layer_kinds)
    if model.num_attention_heads % tp:
        raise ConfigError("tensor_parallel_size",
                          f"a divisor of {model.name}'s {model.num_attention_heads} attention heads", tp)
    if kinds & {"full_attention", "sliding_window", "chunked_local"}:
        kv = model.num_kv_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ConfigError("tensor_parallel_size",
                              f"a divisor or a multiple of {model.name}'s {kv} KV heads", tp)
    if model.state is not None:
        model.state.state_shapes(hidden_size=model.hidden_size, tp=tp)  # raises on a bad split
    if "sliding_window" in kinds and model.sliding_window > max_model_len:
        raise ConfigError("max_model_len", f"at least {model.name}'s sliding window ({model.sliding_window} tokens)",
                          max_model_len)
    if "chunked_local" in kinds and model.attention_chunk_size > max_model_len:
        raise ConfigError("max_model_len",
                          f"at least {model.name}'s attention chunk ({model.attention_chunk_size} tokens)",
                          max_model_len)


# --------------------------------------------------------------------------------------
# Per-layer specs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpecs:
    specs: dict[str, KVCacheSpec]
    layer_index: dict[str, int]
    attention_block_size: int
    hybrid_block: HybridBlockSize | None
    kv_heads_per_gpu: int
    kernel_block_alignment_tokens: int


def _layer_name(index: int) -> str:
    return f"layers.{index}"


def build_layer_specs(model: ModelPreset, gpu: GPUSpec, eng: ResolvedEngine) -> LayerSpecs:
    """One spec per cached layer, as one GPU of the TP group sees it."""
    tp = eng.tensor_parallel_size
    kv_bytes = eng.kv_cache_dtype_bytes
    kv_heads = max(1, model.num_kv_heads // tp)
    if model.uses_mla:
        attention_bytes_per_token = model.mla_head_size * kv_bytes
        head_size = model.mla_head_size
    else:
        attention_bytes_per_token = kv_heads * (model.head_dim + model.head_dim_v) * kv_bytes
        head_size = model.head_dim

    kernel_alignment = gpu.attention_kernel_block_alignment_tokens(head_size=head_size, use_mla=model.uses_mla)
    block_size = cdiv(eng.user_block_size, kernel_alignment) * kernel_alignment
    hybrid_block = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype_bytes: tuple[int, ...] = ()
    if model.state is not None:
        state_shapes = model.state.state_shapes(hidden_size=model.hidden_size, tp=tp)
        role_bytes = {"conv": DTYPE_BYTES[eng.mamba_conv_dtype], "ssm": DTYPE_BYTES[eng.mamba_ssm_dtype]}
        state_dtype_bytes = tuple(role_bytes[r] for r in model.state.state_roles())
        mamba_page = sum(math.prod(s) * b for s, b in zip(state_shapes, state_dtype_bytes))
        has_attention = any(k in ("full_attention", "sliding_window", "chunked_local", "mla")
                            for k in model.layer_kinds)
        if has_attention:
            checkpoint = None
            if model.state.kind == "gated_deltanet" and eng.mamba_cache_mode == "align":
                checkpoint = gpu.gdn_prefill_checkpoint_alignment_tokens
            hybrid_block = hybrid_attention_block_size(
                block_size=block_size, attention_bytes_per_token=attention_bytes_per_token,
                mamba_page_bytes=mamba_page, kernel_alignment_tokens=kernel_alignment,
                checkpoint_alignment_tokens=checkpoint)
            block_size = hybrid_block.block_size

    attention = dict(block_size=block_size, num_kv_heads=kv_heads, head_size=model.head_dim,
                     head_size_v=model.head_dim_v, dtype_bytes=kv_bytes)
    specs: dict[str, KVCacheSpec] = {}
    index: dict[str, int] = {}
    for i, kind in enumerate(model.layer_kinds):
        if kind is None:
            continue
        if kind == "full_attention":
            spec: KVCacheSpec = FullAttentionSpec(**attention)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(**attention, sliding_window=model.sliding_window)
        elif kind == "chunked_local":
            spec = ChunkedLocalAttentionSpec(**attention, attention_chunk_size=model.attention_chunk_size)
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=model.mla_head_size,
                                    dtype_bytes=kv_bytes)
        else:
            # The state block size only matters for prefix-caching granularity; it follows
            # the attention block size (vLLM's mamba_block_size in "align" mode).
            spec = MambaSpec(block_size=block_size, shapes=state_shapes, dtype_bytes=state_dtype_bytes,
                             mamba_cache_mode=eng.mamba_cache_mode,
                             page_size_padded=hybrid_block.mamba_page_padded_bytes if hybrid_block else None)
        name = _layer_name(i)
        specs[name] = spec
        index[name] = i
    return LayerSpecs(specs, index, block_size, hybrid_block, kv_heads, kernel_alignment)


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    model: ModelPreset
    gpu: GPUSpec
    engine: ResolvedEngine
    layers: LayerSpecs
    grouping: Grouping
    memory: MemoryBudget
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    steady_state_blocks_per_request: int
    fits: bool
    needed_bytes: int
    estimated_max_model_len: int
    warnings: tuple[str, ...] = ()
    suggestions: tuple[dict, ...] = field(default=())

    # -- vLLM's figures ----------------------------------------------------------------

    @property
    def groups(self) -> tuple[PlannedGroup, ...]:
        return self.grouping.groups

    @property
    def max_concurrency(self) -> float | None:
        """vLLM's "Maximum concurrency for N tokens per request" (None: it would not start)."""
        return self.num_blocks / self.blocks_per_request if self.fits else None

    @property
    def kv_cache_tokens(self) -> int | None:
        """vLLM's "GPU KV cache size: N tokens" = int(max concurrency x max_model_len)."""
        concurrency = self.max_concurrency
        return None if concurrency is None else int(concurrency * self.engine.max_model_len)

    @property
    def steady_state_concurrency(self) -> float | None:
        """Requests of max_model_len the pool holds once prefills are done: windowed groups
        then hold the window plus the decode tokens in flight, not a whole prefill chunk."""
        return self.num_blocks / self.steady_state_blocks_per_request if self.fits else None

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.needed_bytes - (self.memory.kv_cache_bytes - self.bytes_per_block))

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """The layout the KV cache manager runs on (None when the model does not fit)."""
        if not self.fits:
            return None
        groups = tuple(KVCacheGroupSpec(g.layer_names, g.spec, g.num_padding_layers) for g in self.groups)
        hash_block_size = reduce(math.gcd, (g.spec.block_size for g in self.groups))
        return KVCacheConfig(num_blocks=self.num_blocks, groups=groups, hash_block_size=hash_block_size)

    def group_blocks_per_request(self, group: PlannedGroup, *, steady: bool = False) -> int:
        in_flight = self.engine.decode_in_flight_tokens if steady else self.engine.max_in_flight_tokens
        return group.blocks_per_request(max_in_flight_tokens=in_flight, max_model_len=self.engine.max_model_len)

    # -- waste ---------------------------------------------------------------------------

    def waste(self) -> dict:
        """Bytes a request at max_model_len pays for padding layers and padded pages."""
        padding_layers = page_padding = 0
        for g in self.groups:
            blocks = self.group_blocks_per_request(g)
            padding_layers += blocks * (self.bytes_per_block - g.bytes_per_block)
            page_padding += blocks * (g.bytes_per_block - g.unpadded_bytes_per_block)
        per_request = self.blocks_per_request * self.bytes_per_block
        total = padding_layers + page_padding
        concurrency = self.max_concurrency or 0.0
        return {
            "num_padding_layers": self.grouping.num_padding_layers,
            "vllm_padding_warnings": [f"Add {n} padding layers, may waste at most {pct * 100:.2f}% KV cache memory"
                                      for n, pct in self.grouping.padding_warnings],
            "padding_layer_bytes_per_request": padding_layers,
            "page_padding_bytes_per_request": page_padding,
            "bytes_per_request": total,
            "fraction_of_request": total / per_request if per_request else 0.0,
            "bytes_when_pool_full": int(total * concurrency),
        }

    # -- output --------------------------------------------------------------------------

    def group_dict(self, gid: int, g: PlannedGroup) -> dict:
        spec = g.spec
        pages = set(g.layer_page_bytes)
        out: dict = {
            "group_id": gid,
            "kind": spec.kind,
            "spec_class": type(spec).__name__,
            "num_layers": len(g.layer_names),
            "num_padding_layers": g.num_padding_layers,
            "block_size": spec.block_size,
            "page_bytes": spec.page_size_bytes,
            "unpadded_page_bytes": getattr(spec, "real_page_size_bytes", spec.page_size_bytes),
            "layer_indices": [self.layers.layer_index[n] for n in g.layer_names],
            "bytes_per_block": g.bytes_per_block,
            "blocks_per_request": self.group_blocks_per_request(g),
            "steady_state_blocks_per_request": self.group_blocks_per_request(g, steady=True),
            "kv_tokens": (self.num_blocks - 1) * spec.block_size if self.num_blocks else 0,
        }
        if len(pages) > 1:
            out["layer_page_bytes"] = list(g.layer_page_bytes)
        if isinstance(spec, SlidingWindowSpec):
            out["sliding_window"] = spec.sliding_window
        if isinstance(spec, ChunkedLocalAttentionSpec):
            out["attention_chunk_size"] = spec.attention_chunk_size
        if isinstance(spec, FullAttentionSpec):
            if spec.sliding_window is not None:
                out["compute_only_sliding_window"] = spec.sliding_window
            if spec.attention_chunk_size is not None:
                out["compute_only_attention_chunk_size"] = spec.attention_chunk_size
        if isinstance(spec, MambaSpec):
            out["state_shapes"] = [list(s) for s in spec.shapes]
            out["state_dtype_bytes"] = list(spec.dtype_bytes)
            out["mamba_cache_mode"] = spec.mamba_cache_mode
        else:
            out["num_kv_heads"] = spec.num_kv_heads
            out["head_size"] = spec.head_size
            if not isinstance(spec, MLAAttentionSpec):
                out["head_size_v"] = spec.head_size_v
        return out

    def to_json(self) -> dict:
        eng = self.engine
        concurrency = self.max_concurrency
        steady = self.steady_state_concurrency
        memory = self.memory.to_dict()
        memory["kv_cache_used_bytes"] = self.num_blocks * self.bytes_per_block
        memory["kv_cache_unused_bytes"] = max(0, self.memory.kv_cache_bytes) - memory["kv_cache_used_bytes"]
        out = {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "vllm_version": "0.33.0",
            "tensor_parallel_size": eng.tensor_parallel_size,
            "max_model_len": eng.max_model_len,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "max_num_seqs": eng.max_num_seqs,
            "kv_cache_dtype": eng.kv_cache_dtype,
            "kv_cache_dtype_bytes": eng.kv_cache_dtype_bytes,
            "hybrid_kv_cache_manager": eng.hybrid_kv_cache,
            "hybrid_kv_cache_is_vllm_default": eng.hybrid_kv_cache_is_default,
            "async_scheduling": eng.async_scheduling,
            "max_in_flight_tokens": eng.max_in_flight_tokens,
            "enable_prefix_caching": eng.enable_prefix_caching,
            "mamba_cache_mode": eng.mamba_cache_mode if self.model.state is not None else None,
            "user_block_size": eng.user_block_size,
            "block_size": self.layers.attention_block_size,
            "kernel_block_alignment_tokens": self.layers.kernel_block_alignment_tokens,
            "scheduler_block_size": reduce(math.lcm, (g.spec.block_size for g in self.groups)),
            "grouping": self.grouping.strategy,
            "group_size": self.grouping.group_size,
            "num_groups": len(self.groups),
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "num_blocks_includes_null_block": True,
            "num_usable_blocks": max(0, self.num_blocks - 1),
            "blocks_per_request": self.blocks_per_request,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": concurrency,
            "steady_state_blocks_per_request": self.steady_state_blocks_per_request,
            "steady_state_concurrency": steady,
            "concurrency_limit": (None if steady is None else min(math.floor(steady), eng.max_num_seqs)),
            "fits": self.fits,
            "needed_bytes_per_request": self.needed_bytes,
            "shortfall_bytes": self.shortfall_bytes,
            "estimated_max_model_len": self.estimated_max_model_len,
            "groups": [self.group_dict(i, g) for i, g in enumerate(self.groups)],
            "memory": memory,
            "waste": self.waste(),
            "warnings": list(self.warnings),
            "suggestions": list(self.suggestions),
        }
        if self.layers.hybrid_block is not None:
            hb = self.layers.hybrid_block
            out["hybrid_block"] = {"alignment_tokens": hb.alignment_tokens, "mamba_page_bytes": hb.mamba_page_bytes,
                                   "mamba_page_padded_bytes": hb.attention_page_bytes,
                                   "mamba_padding_bytes": hb.mamba_padding_bytes}
        return out


def _needed_bytes(grouping: Grouping, bytes_per_block: int, *, in_flight: int, max_model_len: int) -> int:
    blocks = sum(g.blocks_per_request(max_in_flight_tokens=in_flight, max_model_len=max_model_len)
                 for g in grouping.groups)
    return blocks * bytes_per_block


def _estimate_max_model_len(grouping: Grouping, bytes_per_block: int, *, in_flight: int, upper: int,
                            available_bytes: int) -> int:
    """Largest max_model_len whose one request fits (binary search, as vLLM); 0 if none."""
    def fits(length: int) -> bool:
        return _needed_bytes(grouping, bytes_per_block, in_flight=in_flight, max_model_len=length) <= available_bytes

    if not fits(1):
        return 0
    lo, hi, best = 1, upper, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def plan(model: ModelPreset, gpu: GPUSpec, engine: EngineConfig, *, suggest: bool = True) -> Plan:
    """vLLM 0.33's KV cache layout and capacity for ``model`` on ``gpu`` with ``engine``."""
    eng = engine.resolve(model, gpu)
    layers = build_layer_specs(model, gpu, eng)
    grouping = group_layers(layers.specs, hybrid_kv_cache=eng.hybrid_kv_cache)
    bytes_per_block = max(g.bytes_per_block for g in grouping.groups)

    estimate = estimate_memory(model, gpu, tp=eng.tensor_parallel_size,
                               gpu_memory_utilization=eng.gpu_memory_utilization,
                               max_num_batched_tokens=eng.max_num_batched_tokens, max_num_seqs=eng.max_num_seqs,
                               activation_peak_bytes=eng.activation_peak_bytes,
                               cuda_graph_bytes=eng.cuda_graph_bytes, non_torch_bytes=eng.non_torch_bytes)
    memory = (explicit_memory(estimate, eng.kv_cache_memory_bytes)
              if eng.kv_cache_memory_bytes is not None else estimate)
    num_blocks = max(0, memory.kv_cache_bytes // bytes_per_block)

    blocks_per_request = sum(g.blocks_per_request(max_in_flight_tokens=eng.max_in_flight_tokens,
                                                  max_model_len=eng.max_model_len) for g in grouping.groups)
    steady = sum(g.blocks_per_request(max_in_flight_tokens=eng.decode_in_flight_tokens,
                                      max_model_len=eng.max_model_len) for g in grouping.groups)
    needed = blocks_per_request * bytes_per_block
    # The null block is never handed out, so one request must fit in the rest.
    check_bytes = memory.kv_cache_bytes - bytes_per_block
    fits = memory.kv_cache_bytes > 0 and needed <= check_bytes
    estimated_len = _estimate_max_model_len(grouping, bytes_per_block, in_flight=eng.max_in_flight_tokens,
                                            upper=eng.max_model_len, available_bytes=check_bytes)

    warnings: list[str] = []
    if eng.max_model_len > model.max_position_embeddings:
        warnings.append(f"max_model_len {eng.max_model_len} exceeds {model.name}'s max_position_embeddings "
                        f"({model.max_position_embeddings}); vLLM refuses this without a RoPE scaling override")
    if memory.kv_cache_source == "kv_cache_memory_bytes":
        if estimate.requested_bytes < estimate.weights_bytes + eng.kv_cache_memory_bytes:
            warnings.append(f"weights ({estimate.weights_bytes} bytes per GPU) plus kv_cache_memory_bytes exceed "
                            f"{gpu.name}'s usable memory ({estimate.requested_bytes} bytes)")
    elif memory.kv_cache_bytes <= 0:
        warnings.append("no memory is left for the KV cache after weights, activations and CUDA graphs")

    result = Plan(model=model, gpu=gpu, engine=eng, layers=layers, grouping=grouping, memory=memory,
                  bytes_per_block=bytes_per_block, num_blocks=num_blocks, blocks_per_request=blocks_per_request,
                  steady_state_blocks_per_request=steady, fits=fits, needed_bytes=needed,
                  estimated_max_model_len=estimated_len, warnings=tuple(warnings))
    if not fits and suggest:
        result = dataclasses.replace(result, suggestions=tuple(_suggestions(model, gpu, engine, result)))
    return result


def _suggestions(model: ModelPreset, gpu: GPUSpec, engine: EngineConfig, failed: Plan) -> list[dict]:
    """What would fit instead: a shorter max_model_len, an fp8 KV cache, more GPUs."""
    out: list[dict] = []
    if failed.estimated_max_model_len > 0:
        out.append({"change": "max_model_len", "value": failed.estimated_max_model_len,
                    "why": "the longest request that fits in the KV cache memory"})
    if failed.engine.kv_cache_dtype_bytes > 1:
        try:
            alt = plan(model, gpu, dataclasses.replace(engine, kv_cache_dtype="fp8"), suggest=False)
        except ConfigError:
            alt = None
        if alt is not None and alt.fits:
            out.append({"change": "kv_cache_dtype", "value": "fp8", "max_concurrency": alt.max_concurrency})
    tp = engine.tensor_parallel_size
    for more in (2 * tp, 4 * tp, 8 * tp):
        try:
            alt = plan(model, gpu, dataclasses.replace(engine, tensor_parallel_size=more), suggest=False)
        except ConfigError:
            continue
        if alt.fits:
            out.append({"change": "tensor_parallel_size", "value": more, "max_concurrency": alt.max_concurrency})
            break
    return out


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def engine_fields_from_mapping(entry: object, *, where: str = "engine") -> dict:
    """The ``[engine]`` table of a scenario, checked for unknown keys (a typo must not
    silently fall back to a default). Values are validated when ``EngineConfig`` is built."""
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table of engine settings", entry)
    unknown = sorted(set(entry) - _ENGINE_FIELDS)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"an engine setting ({', '.join(sorted(_ENGINE_FIELDS))})",
                          entry[unknown[0]])
    return dict(entry)


def engine_config(fields: dict, *, where: str = "engine") -> EngineConfig:
    """``EngineConfig(**fields)`` with errors naming the scenario table."""
    try:
        return EngineConfig(**fields)
    except ConfigError as err:
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None
