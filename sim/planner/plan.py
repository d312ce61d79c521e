"""The KV cache planner: model + GPU + engine config -> vLLM's layout and capacity.

Spec -> grouping -> page size (docs/semantics.md#number-of-blocks), as vLLM 0.33 does it:

1. ``EngineConfig.resolve`` (``engine_config.py``) fills vLLM's defaults (batching defaults by GPU memory, the
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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.retention import describe_retention, is_sparse_kind, validate_retention_interval
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.planner.grouping import Grouping, PlannedGroup, group_layers
from kvtwin.sim.planner.engine_config import EngineConfig, ResolvedEngineConfig
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.memory_budget import MemoryBudget, estimate_memory, explicit_memory
from kvtwin.sim.planner.models import DTYPE_BYTES, ModelPreset
from kvtwin.sim.planner.parallel import physical_experts, stage_weights
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
    with_prefill_lookahead,
)

# --------------------------------------------------------------------------------------
# Per-layer specs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerSpecs:
    specs: dict[str, KVCacheSpec]
    layer_index: dict[str, int]
    attention_block_size: int
    hybrid_block: HybridBlockSize | None
    kernel_block_alignment_tokens: int
    # A draft head's attention layers, named after the target's as vLLM numbers them
    # (layers.N onwards for an N-layer target); grouped with the target's, priced apart.
    draft_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    @property
    def cached_specs(self) -> dict[str, KVCacheSpec]:
        """Every layer the KV cache holds: the target's, then the draft head's."""
        return {**self.specs, **self.draft_specs} if self.draft_specs else self.specs


def _layer_name(index: int) -> str:
    return f"layers.{index}"


_INDEXER_SUFFIX = ".indexer"


def _indexer_layer_name(index: int) -> str:
    return f"layers.{index}{_INDEXER_SUFFIX}"


def is_indexer_layer(name: str) -> bool:
    """Whether the cached layer ``name`` is a sparse-attention indexer's keys (``indexer_spec``)
    rather than an attention layer: the cost model prices it as the indexer it is
    (docs/clock.md#sparse-attention)."""
    return name.endswith(_INDEXER_SUFFIX)


@dataclass(frozen=True)
class LayerShape:
    """What a layer's spec is built from, as one GPU of the TP group holds it."""

    model: ModelPreset
    block_size: int
    num_kv_heads: int
    kv_dtype_bytes: int
    state_shapes: tuple[tuple[int, ...], ...]
    state_dtype_bytes: tuple[int, ...]
    mamba_cache_mode: str
    mamba_page_padded_bytes: int | None
    # (num_prefill_checkpoint_blocks, prefill_checkpoint_alignment): the state kind's rule.
    prefill_checkpoint: tuple[int, int | None] = (0, None)
    # A state block's tokens: the attention block size in align mode (the granularity of
    # prefix caching); max_model_len otherwise, so one block holds a request's state
    # (vLLM 0.33 ``HybridAttentionMambaModelConfig`` sets ``mamba_block_size`` so).
    state_block_size: int = 0
    # State blocks kept per request for draft tokens (k when drafting; vLLM 0.33
    # ``MambaBase.get_kv_cache_spec`` sets ``num_speculative_blocks`` from the speculative config).
    num_speculative_blocks: int = 0

    def attention(self) -> dict:
        m = self.model
        return dict(block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=m.head_dim,
                    head_size_v=m.head_dim_v, dtype_bytes=self.kv_dtype_bytes)


# A model's layer kind -> its spec (the spec kinds of ``sim/core/spec.py``).
LAYER_SPEC_BUILDERS: dict[str, Callable[[LayerShape], KVCacheSpec]] = {
    FullAttentionSpec.kind: lambda x: FullAttentionSpec(**x.attention()),
    SlidingWindowSpec.kind: lambda x: SlidingWindowSpec(**x.attention(), sliding_window=x.model.sliding_window),
    ChunkedLocalAttentionSpec.kind: lambda x: ChunkedLocalAttentionSpec(
        **x.attention(), attention_chunk_size=x.model.attention_chunk_size),
    # One latent (plus its rope part) per token; absorbed attention multiplies by the latent again.
    MLAAttentionSpec.kind: lambda x: MLAAttentionSpec(
        block_size=x.block_size, num_kv_heads=1, head_size=x.model.mla_head_size,
        head_size_v=x.model.kv_lora_rank or x.model.mla_head_size, dtype_bytes=x.kv_dtype_bytes),
    # The state block size only matters for prefix-caching granularity (``state_block_size``).
    MambaSpec.kind: lambda x: MambaSpec(block_size=x.state_block_size or x.block_size, shapes=x.state_shapes,
                                        dtype_bytes=x.state_dtype_bytes, mamba_cache_mode=x.mamba_cache_mode,
                                        page_size_padded=x.mamba_page_padded_bytes,
                                        num_prefill_checkpoint_blocks=x.prefill_checkpoint[0],
                                        prefill_checkpoint_alignment=x.prefill_checkpoint[1],
                                        num_speculative_blocks=x.num_speculative_blocks),
}


# DeepSeek Sparse Attention on CUDA: the indexer's kernels take blocks of exactly 64 tokens
# (vLLM 0.33 ``DeepseekV32IndexerBackend.get_supported_kernel_block_sizes``,
# v1/attention/backends/mla/indexer.py l.285-286), the sparse MLA backends multiples of 64
# (flashattn_mla_sparse.py l.50-51, flashmla_sparse.py l.158-165); the platform's block size
# is the smallest both take, and a larger one must be a multiple of 64
# (docs/semantics.md#sparse-mla-indexer).
SPARSE_INDEXER_BLOCK_TOKENS = 64
# The sparse-MLA fp8 record, ``fp8_ds_mla``: 512 fp8 latent values, four fp32 scales (one per
# 128), the 64 rope values in bf16 -- 656 bytes (vLLM 0.33 mla_attention.py l.1384-1389).
FP8_DS_MLA_BYTES_PER_TOKEN = 656


def sparse_mla_spec(x: LayerShape) -> MLAAttentionSpec:
    """A DeepSeek-V3.2 layer's latent cache: bf16 like any MLA layer; with a one-byte KV
    cache dtype vLLM serves it as ``fp8_ds_mla`` (``_canonicalize_sparse_mla_kv_cache_dtype``),
    whose 656-byte record the spec holds as 656 one-byte values (docs/semantics.md#sparse-mla-indexer)."""
    if x.kv_dtype_bytes == 1:
        return MLAAttentionSpec(block_size=x.block_size, num_kv_heads=1, head_size=FP8_DS_MLA_BYTES_PER_TOKEN,
                                head_size_v=x.model.kv_lora_rank, dtype_bytes=1)
    return LAYER_SPEC_BUILDERS[MLAAttentionSpec.kind](x)


def indexer_spec(x: LayerShape) -> MLAAttentionSpec:
    """A layer's indexer keys: vLLM 0.33 gives them an MLA spec of their own (one head of
    ``indexer_bytes_per_token`` uint8 values, ``DeepseekV32IndexerCache.get_kv_cache_spec``),
    whatever the KV cache dtype (docs/semantics.md#sparse-mla-indexer)."""
    return MLAAttentionSpec(block_size=x.block_size, num_kv_heads=1, head_size=x.model.indexer_bytes_per_token,
                            dtype_bytes=1)


def _layer_caches(layer: LayerShape, index: int, kind: str) -> tuple[tuple[str, KVCacheSpec], ...]:
    """Layer ``index``'s caches by name: its kind's spec, or with DeepSeek Sparse Attention
    the MLA latent then the indexer's keys, in vLLM's order (docs/semantics.md#sparse-mla-indexer)."""
    if kind == MLAAttentionSpec.kind and layer.model.uses_sparse_indexer:
        return ((_layer_name(index), sparse_mla_spec(layer)), (_indexer_layer_name(index), indexer_spec(layer)))
    return ((_layer_name(index), LAYER_SPEC_BUILDERS[kind](layer)),)


def build_layer_specs(model: ModelPreset, gpu: GPUSpec, eng: ResolvedEngineConfig, *,
                      num_speculative_tokens: int = 0, draft_head: DraftHead | None = None,
                      num_prefill_lookahead_tokens: int = 0) -> LayerSpecs:
    """One spec per cached layer, as one GPU of the TP group sees it (``num_speculative_tokens``:
    the drafts per step, which size a recurrent state's speculative blocks; ``draft_head``:
    its layers are cached too, ``sim/planner/draft_head.py``; ``num_prefill_lookahead_tokens``:
    the prefill tokens the drafter reads ahead, whose tail less one every sliding-window layer
    retains below its window, docs/semantics.md#sliding-window)."""
    tp = eng.tensor_parallel_size
    kv_bytes = eng.kv_cache_dtype_bytes
    kv_heads = max(1, model.num_kv_heads // tp)
    if model.uses_mla:
        attention_bytes_per_token = model.mla_head_size * kv_bytes
        head_size = model.mla_head_size
    else:
        attention_bytes_per_token = kv_heads * (model.head_dim + model.head_dim_v) * kv_bytes
        head_size = model.head_dim

    if model.uses_sparse_indexer:
        kernel_alignment = SPARSE_INDEXER_BLOCK_TOKENS
    else:
        kernel_alignment = gpu.attention_kernel_block_alignment_tokens(head_size=head_size, use_mla=model.uses_mla)
    if eng.user_specified_block_size and eng.user_block_size % kernel_alignment:
        # vLLM refuses a block size its attention kernel cannot tile ("No common block size").
        raise ConfigError("block_size", f"a multiple of {kernel_alignment} tokens, the attention kernel's block on "
                          f"{gpu.name} (e.g. {', '.join(str(kernel_alignment * k) for k in (1, 2, 4))})",
                          eng.user_block_size)
    block_size = cdiv(eng.user_block_size, kernel_alignment) * kernel_alignment
    hybrid_block = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype_bytes: tuple[int, ...] = ()
    if model.state is not None:
        state_shapes = model.state.state_shapes(hidden_size=model.hidden_size, tp=tp)
        role_bytes = {"conv": DTYPE_BYTES[eng.mamba_conv_dtype], "ssm": DTYPE_BYTES[eng.mamba_ssm_dtype]}
        state_dtype_bytes = tuple(role_bytes[r] for r in model.state.state_roles())
        mamba_page = sum(math.prod(s) * b for s, b in zip(state_shapes, state_dtype_bytes))
        has_attention = any(k not in (None, MambaSpec.kind) for k in model.layer_kinds)
        if has_attention:
            checkpoint = None
            if eng.mamba_cache_mode == "align":
                checkpoint = model.state.prefill_checkpoint_kernel_alignment(gpu)
            hybrid_block = hybrid_attention_block_size(
                block_size=block_size, attention_bytes_per_token=attention_bytes_per_token,
                mamba_page_bytes=mamba_page, kernel_alignment_tokens=kernel_alignment,
                checkpoint_alignment_tokens=checkpoint)
            block_size = hybrid_block.block_size

    prefill_checkpoint = (0, None)
    if model.state is not None and eng.mamba_cache_mode == "align":
        prefill_checkpoint = model.state.prefill_checkpoint(gpu, block_size=block_size)
    layer = LayerShape(model=model, block_size=block_size, num_kv_heads=kv_heads, kv_dtype_bytes=kv_bytes,
                       state_shapes=state_shapes, state_dtype_bytes=state_dtype_bytes,
                       mamba_cache_mode=eng.mamba_cache_mode,
                       mamba_page_padded_bytes=hybrid_block.mamba_page_padded_bytes if hybrid_block else None,
                       prefill_checkpoint=prefill_checkpoint,
                       state_block_size=block_size if eng.mamba_cache_mode == "align" else eng.max_model_len,
                       num_speculative_blocks=num_speculative_tokens)
    specs: dict[str, KVCacheSpec] = {}
    index: dict[str, int] = {}
    for i, kind in enumerate(model.layer_kinds):
        if kind is None:
            continue
        for name, spec in _layer_caches(layer, i, kind):
            specs[name] = with_prefill_lookahead(spec, num_prefill_lookahead_tokens)
            index[name] = i
    draft_specs: dict[str, KVCacheSpec] = {}
    if draft_head is not None:
        builder = LAYER_SPEC_BUILDERS[draft_head.layer_kind(model)]
        for i in range(len(model.layer_kinds), len(model.layer_kinds) + draft_head.num_layers):
            name = _layer_name(i)
            draft_specs[name] = with_prefill_lookahead(builder(layer), num_prefill_lookahead_tokens)
            index[name] = i
    return LayerSpecs(specs, index, block_size, hybrid_block, kernel_alignment, draft_specs)


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's worker (docs/semantics.md#parallel-layouts): its layers, the
    bytes one block costs on it (its share of each global group's layers), its memory
    and the blocks that memory alone would give. The engine allocates the fewest of all
    stages on every stage."""

    stage: int
    layer_start: int
    layer_end: int
    layer_names: tuple[str, ...]
    bytes_per_block: int
    memory: MemoryBudget
    num_blocks: int
    experts_per_gpu: int

    def to_json(self, layer_index: dict[str, int]) -> dict:
        return {"stage": self.stage, "layer_start": self.layer_start, "layer_end": self.layer_end,
                "num_layers": self.layer_end - self.layer_start, "num_cached_layers": len(self.layer_names),
                "cached_layer_indices": [layer_index[n] for n in self.layer_names],
                "bytes_per_block": self.bytes_per_block, "num_blocks": self.num_blocks,
                "kv_cache_bytes": self.memory.kv_cache_bytes, "weights_bytes": self.memory.weights_bytes,
                "experts_per_gpu": self.experts_per_gpu}


@dataclass(frozen=True)
class Plan:
    model: ModelPreset
    gpu: GPUSpec
    engine: ResolvedEngineConfig
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
    draft_head: DraftHead | None = None
    # One entry per pipeline stage (one without PP); ``memory`` and ``bytes_per_block``
    # above are those of ``limiting_stage``, the stage with the fewest blocks.
    stages: tuple[StagePlan, ...] = ()
    limiting_stage: int = 0

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
        return KVCacheConfig(num_blocks=self.num_blocks, groups=groups, hash_block_size=hash_block_size,
                             prefix_cache_retention_interval=self.engine.cache.prefix_cache_retention_interval)

    def require_fits(self) -> KVCacheConfig:
        """The layout to run, or a ``ConfigError`` saying what would fit (vLLM refuses to start)."""
        config = self.kv_cache_config
        if config is None:
            hints = "; ".join(f"{s['change']} = {s['value']}" for s in self.suggestions)
            raise ConfigError("model", f"a layout that fits: {self.model.name} on {self.gpu.name} needs "
                              f"{self.shortfall_bytes:,} more bytes of KV cache for one request of "
                              f"{self.engine.max_model_len:,} tokens"
                              + (f" (would fit: {hints})" if hints else " (see kvtwin plan)"))
        return config

    def group_blocks_per_request(self, group: PlannedGroup, *, steady: bool = False) -> int:
        in_flight = self.engine.decode_in_flight_tokens if steady else self.engine.max_in_flight_tokens
        return group.blocks_per_request(max_in_flight_tokens=in_flight, max_model_len=self.engine.max_model_len)

    # -- waste ---------------------------------------------------------------------------

    def waste(self) -> dict:
        """Bytes a request at max_model_len pays for padding layers and padded pages."""
        padding_layers = page_padding = 0
        # The whole model's groups (a pipeline stage's block holds only its share of them).
        bytes_per_block = max(g.bytes_per_block for g in self.groups)
        for g in self.groups:
            blocks = self.group_blocks_per_request(g)
            padding_layers += blocks * (bytes_per_block - g.bytes_per_block)
            page_padding += blocks * (g.bytes_per_block - g.unpadded_bytes_per_block)
        per_request = self.blocks_per_request * bytes_per_block
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
            "unpadded_page_bytes": spec.real_page_size_bytes,
            "layer_indices": [self.layers.layer_index[n] for n in g.layer_names],
            "bytes_per_block": g.bytes_per_block,
            "blocks_per_request": self.group_blocks_per_request(g),
            "steady_state_blocks_per_request": self.group_blocks_per_request(g, steady=True),
            "kv_tokens": (self.num_blocks - 1) * spec.block_size if self.num_blocks else 0,
        }
        if len(pages) > 1:
            out["layer_page_bytes"] = list(g.layer_page_bytes)
        out.update(spec.describe())
        return out

    @property
    def thins_prefix_cache(self) -> bool:
        """Whether the retention setting applies: caching on, and a sliding-window or Mamba group."""
        return self.engine.enable_prefix_caching and any(is_sparse_kind(g.spec) for g in self.groups)

    @property
    def retention(self) -> str:
        """What the prefix cache keeps of this layout, in words (docs/semantics.md#prefix-cache-retention)."""
        if not self.engine.enable_prefix_caching:
            return "none (prefix caching off)"
        if not self.thins_prefix_cache:
            return "every block (no sliding-window or Mamba group to thin)"
        return describe_retention(self.engine.cache.prefix_cache_retention_interval)

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
            "data_parallel_size": eng.data_parallel_size,
            "enable_expert_parallel": eng.enable_expert_parallel,
            "expert_parallel_size": eng.layout.expert_parallel_size,
            "pipeline_parallel_size": eng.pipeline_parallel_size,
            "num_gpus": eng.layout.num_gpus,
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
            "prefix_cache_retention_interval": eng.cache.prefix_cache_retention_interval,
            "prefix_cache_retention": self.retention,
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
            # Each DP rank is an engine with a pool of its own; every PP stage's worker
            # allocates the same count, the fewest any stage's memory gives.
            "num_blocks_scope": "per DP rank, on every PP stage",
            "limiting_stage": self.limiting_stage,
            "pipeline_stages": [st.to_json(self.layers.layer_index) for st in self.stages],
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
        if self.draft_head is not None:
            out["draft_head"] = {
                "method": self.draft_head.method, "num_layers": self.draft_head.num_layers,
                "layer_indices": [self.layers.layer_index[n] for n in self.layers.draft_specs],
                "weights_bytes": self.draft_head.weights_bytes_per_gpu(self.model, tp=eng.tensor_parallel_size)}
        if self.layers.hybrid_block is not None:
            hb = self.layers.hybrid_block
            out["hybrid_block"] = {"alignment_tokens": hb.alignment_tokens, "mamba_page_bytes": hb.mamba_page_bytes,
                                   "mamba_page_padded_bytes": hb.attention_page_bytes,
                                   "mamba_padding_bytes": hb.mamba_padding_bytes}
        if eng.enable_eplb:
            # Only where set: a plan without EPLB keeps its bytes.
            out["eplb"] = {"num_redundant_experts": eng.num_redundant_experts,
                           "num_physical_experts": physical_experts(self.model, eng.layout)}
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


def plan(model: ModelPreset, gpu: GPUSpec, engine: EngineConfig, *, suggest: bool = True,
         num_speculative_tokens: int = 0, draft_head: DraftHead | None = None,
         num_prefill_lookahead_tokens: int = 0) -> Plan:
    """vLLM 0.33's KV cache layout and capacity for ``model`` on ``gpu`` with ``engine``; with
    ``num_speculative_tokens`` k > 0 every Mamba layer keeps k more state blocks per request;
    a ``draft_head`` adds its layers to the KV cache and its weights to the memory taken; a
    drafter reading ``num_prefill_lookahead_tokens`` > 1 prefill tokens ahead (multi-module
    MTP) makes every sliding-window layer retain that many less one below its window."""
    eng = engine.resolve(model, gpu)
    result = plan_resolved(model, gpu, eng, num_speculative_tokens=num_speculative_tokens, draft_head=draft_head,
                           num_prefill_lookahead_tokens=num_prefill_lookahead_tokens)
    if not result.fits and suggest:
        result = dataclasses.replace(result, suggestions=tuple(_suggestions(model, gpu, engine, result,
                                                                            num_speculative_tokens, draft_head,
                                                                            num_prefill_lookahead_tokens)))
    return result


def plan_resolved(model: ModelPreset, gpu: GPUSpec, eng: ResolvedEngineConfig, *, num_speculative_tokens: int = 0,
                  draft_head: DraftHead | None = None, num_prefill_lookahead_tokens: int = 0) -> Plan:
    """``plan`` for an engine config already resolved (no suggestions when it does not fit):
    a P/D side's pool re-planned with its own DP size (``sim/replay/pd_sides.py``)."""
    layers = build_layer_specs(model, gpu, eng, num_speculative_tokens=num_speculative_tokens,
                               draft_head=draft_head, num_prefill_lookahead_tokens=num_prefill_lookahead_tokens)
    grouping = group_layers(layers.cached_specs, hybrid_kv_cache=eng.hybrid_kv_cache)
    # vLLM refuses a retention interval its layout cannot use when the KV cache manager
    # starts; the plan refuses it first (docs/semantics.md#retention-setting).
    validate_retention_interval(eng.cache.prefix_cache_retention_interval,
                                reduce(math.lcm, (g.spec.block_size for g in grouping.groups)),
                                [g.spec for g in grouping.groups])

    draft_weights = draft_head.weights_bytes_per_gpu(model, tp=eng.tensor_parallel_size) if draft_head else 0
    stages = plan_stages(model, gpu, eng, layers, grouping, draft_weights_bytes=draft_weights)
    limiting = min(stages, key=lambda st: (st.plan.num_blocks, st.stage))
    estimate, memory = limiting.estimate, limiting.plan.memory
    bytes_per_block, num_blocks = limiting.plan.bytes_per_block, limiting.plan.num_blocks

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
                  estimated_max_model_len=estimated_len, warnings=tuple(warnings), draft_head=draft_head,
                  stages=tuple(st.plan for st in stages), limiting_stage=limiting.stage)
    return result


@dataclass(frozen=True)
class _StageSizing:
    stage: int
    plan: StagePlan
    estimate: MemoryBudget


def plan_stages(model: ModelPreset, gpu: GPUSpec, eng: ResolvedEngineConfig, layers: LayerSpecs,
                grouping: Grouping, *, draft_weights_bytes: int = 0) -> list[_StageSizing]:
    """Each pipeline stage's worker as vLLM 0.33 sizes it (docs/semantics.md#parallel-layouts):
    the global groups projected onto the stage's layers, a block costing the largest
    projected group's pages, and the blocks its own memory gives. A draft head's layers
    sit on the last stage, where the drafter runs."""
    layout = eng.layout
    ranges = layout.stage_ranges(model.num_layers)
    stage_of = {name: next((s for s, (a, b) in enumerate(ranges) if a <= index < b), len(ranges) - 1)
                for name, index in layers.layer_index.items()}
    out = []
    for stage, (start, end) in enumerate(ranges):
        names = tuple(n for n in layers.cached_specs if stage_of[n] == stage)
        mine = set(names)
        bytes_per_block = max(sum(page for n, page in zip(g.layer_names, g.layer_page_bytes) if n in mine)
                              for g in grouping.groups)
        if bytes_per_block == 0:
            raise ConfigError("pipeline_parallel_size", f"a split of {model.name}'s {model.num_layers} layers where "
                              f"every stage holds a layer with a KV cache (stage {stage} holds layers {start} to "
                              f"{end - 1}, none cached)", layout.pipeline_parallel_size)
        estimate = estimate_memory(model, gpu, tp=eng.tensor_parallel_size,
                                   gpu_memory_utilization=eng.gpu_memory_utilization,
                                   max_num_batched_tokens=eng.max_num_batched_tokens, max_num_seqs=eng.max_num_seqs,
                                   activation_peak_bytes=eng.activation_peak_bytes,
                                   cuda_graph_bytes=eng.cuda_graph_bytes, non_torch_bytes=eng.non_torch_bytes,
                                   draft_weights_bytes=draft_weights_bytes if stage == len(ranges) - 1 else 0,
                                   layout=layout, stage=stage)
        memory = (explicit_memory(estimate, eng.kv_cache_memory_bytes)
                  if eng.kv_cache_memory_bytes is not None else estimate)
        weights = stage_weights(model, layout, stage)
        out.append(_StageSizing(stage, StagePlan(
            stage=stage, layer_start=start, layer_end=end, layer_names=names, bytes_per_block=bytes_per_block,
            memory=memory, num_blocks=max(0, memory.kv_cache_bytes // bytes_per_block),
            experts_per_gpu=weights.experts_per_gpu), estimate))
    return out


def _suggestions(model: ModelPreset, gpu: GPUSpec, engine: EngineConfig, failed: Plan,
                 num_speculative_tokens: int = 0, draft_head: DraftHead | None = None,
                 num_prefill_lookahead_tokens: int = 0) -> list[dict]:
    """What would fit instead: a shorter max_model_len, an fp8 KV cache, more GPUs."""
    out: list[dict] = []
    if failed.estimated_max_model_len > 0:
        out.append({"change": "max_model_len", "value": failed.estimated_max_model_len,
                    "why": "the longest request that fits in the KV cache memory"})
    if failed.engine.kv_cache_dtype_bytes > 1:
        try:
            alt = plan(model, gpu, dataclasses.replace(engine, kv_cache_dtype="fp8"), suggest=False,
                       num_speculative_tokens=num_speculative_tokens, draft_head=draft_head,
                       num_prefill_lookahead_tokens=num_prefill_lookahead_tokens)
        except ConfigError:
            alt = None
        if alt is not None and alt.fits:
            out.append({"change": "kv_cache_dtype", "value": "fp8", "max_concurrency": alt.max_concurrency})
    tp = engine.tensor_parallel_size
    for more in (2 * tp, 4 * tp, 8 * tp):
        try:
            alt = plan(model, gpu, dataclasses.replace(engine, tensor_parallel_size=more), suggest=False,
                       num_speculative_tokens=num_speculative_tokens, draft_head=draft_head,
                       num_prefill_lookahead_tokens=num_prefill_lookahead_tokens)
        except ConfigError:
            continue
        if alt.fits:
            out.append({"change": "tensor_parallel_size", "value": more, "max_concurrency": alt.max_concurrency})
            break
    return out


@dataclass(frozen=True)
class HybridComparison:
    """One layout with vLLM's hybrid KV cache manager on and one with it off (every layer
    as full attention), or why off is not possible for this model."""

    on: Plan
    off: Plan | None
    off_error: str | None = None

    @property
    def kv_bytes_per_request_saving(self) -> float | None:
        """The share of a max_model_len request's KV bytes the hybrid manager saves."""
        if self.off is None:
            return None
        off_bytes = self.off.blocks_per_request * self.off.bytes_per_block
        on_bytes = self.on.blocks_per_request * self.on.bytes_per_block
        return 1 - on_bytes / off_bytes if off_bytes else None

    def to_json(self) -> dict:
        out: dict = {"model": self.on.model.name, "hybrid_on": self.on.to_json()}
        if self.off is None:
            out["hybrid_off"] = {"error": self.off_error}
            return out
        out["hybrid_off"] = self.off.to_json()
        out["kv_bytes_per_request_saving"] = self.kv_bytes_per_request_saving
        return out


def compare_hybrid(model: ModelPreset, gpu: GPUSpec, engine: EngineConfig) -> HybridComparison:
    on = plan(model, gpu, dataclasses.replace(engine, hybrid_kv_cache=True))
    try:
        off = plan(model, gpu, dataclasses.replace(engine, hybrid_kv_cache=False))
    except ConfigError as err:
        return HybridComparison(on, None, err.expected)
    return HybridComparison(on, off)
