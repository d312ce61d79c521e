"""Model presets: the architecture facts the planner turns into one KV cache spec per layer.

The built-in presets live in ``sim/planner/data/models.toml``, each figure with the public
source it was read from (its ``source`` field). A scenario can describe a
model inline with the same fields (``model_from_mapping``) and ``sim/planner/hf_config.py`` reads a
local Hugging Face ``config.json`` into the same form.

A preset holds *facts*, not specs: the spec of a layer also depends on engine settings
(block size, KV cache dtype, tensor parallelism, Mamba state dtypes), so ``sim/planner/plan.py``
builds specs from a preset and an engine config. What a preset does compute itself is the
per-GPU shape of its recurrent states (``RecurrentState.state_shapes``, following vLLM's
``MambaStateShapeCalculator``), its weight bytes and
its FLOPs per token for the cost model.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, ClassVar

from kvtwin.sim.core.config import is_number
from kvtwin.sim.core.errors import ConfigError, config_from_table, reject_unknown_keys, require
from kvtwin.sim.core.spec import SPEC_CLASSES

if TYPE_CHECKING:
    from kvtwin.sim.planner.hardware import GPUSpec

# The indexer quantises its keys in blocks of this many fp8 values, one fp32 scale each
# (vLLM 0.33 ``Indexer.quant_block_size``, model_executor/models/deepseek_v2.py l.725).
INDEXER_QUANT_BLOCK = 128

# Letters of ``layer_pattern`` -> the spec kind a layer gets (None: the layer has no cache).
LAYER_KINDS: dict[str, str | None] = {cls.pattern_letter: cls.kind for cls in SPEC_CLASSES} | {"-": None}
# Layer kinds with K/V projections per KV head (softmax attention, MLA excepted).
KV_HEAD_KINDS: frozenset[str] = frozenset(cls.kind for cls in SPEC_CLASSES if cls.has_kv_heads)

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def dtype_bytes(name: str, *, field: str) -> int:
    if name not in DTYPE_BYTES:
        raise ConfigError(field, f"one of {', '.join(DTYPE_BYTES)}", name)
    return DTYPE_BYTES[name]


def _positive_int(value: object, field: str) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value > 0, field,
            "a positive integer", value)


def _divide(total: int, tp: int, field: str) -> int:
    """``total / tp`` for a tensor-parallel-sharded dimension; it has to divide evenly."""
    if total % tp:
        raise ConfigError("tensor_parallel_size", f"a divisor of {field} ({total})", tp)
    return total // tp


# --------------------------------------------------------------------------------------
# Recurrent states (Mamba-1, Mamba-2, gated DeltaNet, lightning/linear attention)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RecurrentState:
    """Shape facts of one recurrent-state layer. ``state_roles`` says which tensors are
    the convolution window (``mamba_cache_dtype``) and which the SSM / recurrent state
    (``mamba_ssm_cache_dtype``)."""

    kind: ClassVar[str] = ""

    def state_shapes(self, *, hidden_size: int, tp: int) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def state_roles(self) -> tuple[str, ...]:
        return ("conv", "ssm")

    def inner_width(self, hidden_size: int) -> int:
        """Width of the mixer's main projection (for the activation estimate)."""
        raise NotImplementedError

    # Prefill checkpoints (vLLM 0.33, align mode only): a layer whose prefill kernel can
    # leave the state at a block boundary inside a chunk gets one extra state block per
    # request, so the scheduler need not end the prompt's last chunk on that boundary.

    def prefill_checkpoint_kernel_alignment(self, gpu: GPUSpec) -> int | None:
        """Token grid the prefill kernel exports checkpoints on, which the block size must
        be a multiple of (vLLM's ``get_prefill_checkpoint_alignment``); None: no constraint."""
        return None

    def prefill_checkpoint(self, gpu: GPUSpec, *, block_size: int) -> tuple[int, int | None]:
        """``(num_prefill_checkpoint_blocks, prefill_checkpoint_alignment)`` of the layer's
        align-mode spec at this (state) block size: none by default (Mamba-1, lightning)."""
        return 0, None


@dataclass(frozen=True, kw_only=True)
class Mamba1State(RecurrentState):
    """Jamba: conv (d_conv-1, d_inner/tp), ssm (d_inner/tp, d_state), d_inner = expand*hidden."""

    kind: ClassVar[str] = "mamba1"
    d_state: int
    d_conv: int
    expand: int

    def __post_init__(self) -> None:
        for name in ("d_state", "d_conv", "expand"):
            _positive_int(getattr(self, name), name)

    def inner_width(self, hidden_size: int) -> int:
        return self.expand * hidden_size

    def state_shapes(self, *, hidden_size: int, tp: int) -> tuple[tuple[int, ...], ...]:
        d_inner = _divide(self.inner_width(hidden_size), tp, "the Mamba inner width")
        return ((self.d_conv - 1, d_inner), (d_inner, self.d_state))


@dataclass(frozen=True, kw_only=True)
class Mamba2State(RecurrentState):
    """Granite-4.0-H, Nemotron-H: conv (d_conv-1, conv_dim/tp), ssm (heads/tp, head_dim, d_state).

    ``conv_dim = d_inner + 2 * groups * d_state``; when ``n_groups`` does not split over
    the TP ranks vLLM replicates the groups up to ``tp`` first (``MambaStateShapeCalculator``).
    """

    kind: ClassVar[str] = "mamba2"
    d_state: int
    d_conv: int
    num_heads: int
    head_dim: int
    n_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("d_state", "d_conv", "num_heads", "head_dim", "n_groups"):
            _positive_int(getattr(self, name), name)

    def inner_width(self, hidden_size: int) -> int:
        return self.num_heads * self.head_dim

    def state_shapes(self, *, hidden_size: int, tp: int) -> tuple[tuple[int, ...], ...]:
        groups = self.n_groups if self.n_groups % tp == 0 else self.n_groups + (tp - self.n_groups % tp)
        conv_dim = self.inner_width(hidden_size) + 2 * groups * self.d_state
        heads = _divide(self.num_heads, tp, "the Mamba-2 heads")
        return ((self.d_conv - 1, _divide(conv_dim, tp, "the Mamba-2 conv width")),
                (heads, self.head_dim, self.d_state))

    def prefill_checkpoint(self, gpu: GPUSpec, *, block_size: int) -> tuple[int, int | None]:
        # vLLM's MambaMixer2 ends a kernel chunk exactly on the checkpoint, on any GPU, so
        # any token offset works and the block size is unconstrained.
        return 1, 1


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetState(RecurrentState):
    """Qwen3-Next: conv (k-1, (2*nk*dk + nv*dv)/tp), state (nv/tp, dv, dk)."""

    kind: ClassVar[str] = "gated_deltanet"
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def __post_init__(self) -> None:
        for name in ("conv_kernel", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            _positive_int(getattr(self, name), name)

    def inner_width(self, hidden_size: int) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + 2 * self.num_v_heads * self.head_v_dim

    def state_shapes(self, *, hidden_size: int, tp: int) -> tuple[tuple[int, ...], ...]:
        conv_dim = 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
        _divide(self.num_k_heads, tp, "the gated-DeltaNet key heads")
        return ((self.conv_kernel - 1, _divide(conv_dim, tp, "the gated-DeltaNet conv width")),
                (_divide(self.num_v_heads, tp, "the gated-DeltaNet value heads"), self.head_v_dim, self.head_k_dim))

    def prefill_checkpoint_kernel_alignment(self, gpu: GPUSpec) -> int | None:
        return gpu.gdn_prefill_checkpoint_alignment_tokens

    def prefill_checkpoint(self, gpu: GPUSpec, *, block_size: int) -> tuple[int, int | None]:
        # Only the FlashInfer prefill kernel exports mid-prefill states. vLLM then keeps
        # checkpoint offsets on the prefix-cache grid (the state block size, which is
        # already a multiple of the kernel's grid) to bound the states it emits.
        if self.prefill_checkpoint_kernel_alignment(gpu) is None:
            return 0, None
        return 1, block_size


@dataclass(frozen=True, kw_only=True)
class LinearAttentionState(RecurrentState):
    """MiniMax lightning attention: one (heads/tp, head_dim, head_dim) state."""

    kind: ClassVar[str] = "linear_attention"
    num_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim"):
            _positive_int(getattr(self, name), name)

    def inner_width(self, hidden_size: int) -> int:
        return 4 * self.num_heads * self.head_dim

    def state_roles(self) -> tuple[str, ...]:
        # vLLM keys the linear-attention state on mamba_cache_dtype.
        return ("conv",)

    def state_shapes(self, *, hidden_size: int, tp: int) -> tuple[tuple[int, ...], ...]:
        return ((_divide(self.num_heads, tp, "the linear-attention heads"), self.head_dim, self.head_dim),)


STATE_KINDS: dict[str, type[RecurrentState]] = {
    cls.kind: cls for cls in (Mamba1State, Mamba2State, GatedDeltaNetState, LinearAttentionState)
}


def state_from_mapping(entry: object, *, where: str) -> RecurrentState:
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table with a 'kind' key", entry)
    kind = entry.get("kind")
    cls = STATE_KINDS.get(kind)
    if cls is None:
        raise ConfigError(f"{where}.kind", f"one of {', '.join(STATE_KINDS)}", kind)
    state_fields = dataclasses.fields(cls)
    known = sorted(f.name for f in state_fields)
    return config_from_table(cls, {k: v for k, v in entry.items() if k != "kind"}, where=where, table_is="a table",
                             known=known, expected=f"a field of a {kind} state ({', '.join(known)})",
                             required=[f.name for f in state_fields if f.default is dataclasses.MISSING],
                             required_is=f"a value (required for a {kind} state)")


# --------------------------------------------------------------------------------------
# Model presets
# --------------------------------------------------------------------------------------

WEIGHT_FORMATS = ("bf16", "fp16", "fp8", "mxfp4_moe")
# MXFP4: 4-bit values plus one shared 8-bit scale per 32 values.
_MXFP4_BYTES_PER_PARAM = (4 + 8 / 32) / 8


def mxfp4_bytes_per_param() -> float:
    """Bytes of one MXFP4 weight, its share of the block scale included."""
    return _MXFP4_BYTES_PER_PARAM


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Architecture facts of one model (see ``sim/planner/data/models.toml`` for the field meanings)."""

    name: str
    hf_id: str = ""
    architecture: str = ""
    source: str = ""
    num_layers: int
    layer_pattern: str = "F"
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    q_lora_rank: int | None = None
    # DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer per MLA layer scores
    # every cached token with ``index_n_heads`` heads of ``index_head_dim`` and attention
    # reads the ``index_topk`` best. The indexer caches its own fp8 keys per layer
    # (docs/semantics.md#sparse-mla-indexer).
    index_head_dim: int | None = None
    index_n_heads: int | None = None
    index_topk: int | None = None
    intermediate_size: int = 0
    first_dense_layers: int = 0
    # Past the first dense layers, layer i's MLP is routed when (i - offset) % period == 0
    # (Jamba: HF's expert_layer_period 2, expert_layer_offset 1; the others route every one).
    moe_layer_period: int = 1
    moe_layer_offset: int = 0
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    vocab_size: int = 0
    # One matrix for the input embedding and the LM head (params_total counts it once).
    tie_word_embeddings: bool = False
    max_position_embeddings: int
    params_total: float
    params_active: float | None = None
    weight_format: str = "bf16"
    dtype: str = "bfloat16"
    # A model-level default for the SSM state dtype when the engine says "auto"
    # (vLLM's NemotronH config keeps it in float32).
    mamba_ssm_cache_dtype: str = "auto"
    state: RecurrentState | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings", "moe_layer_period"):
            _positive_int(getattr(self, name), name)
        require(isinstance(self.moe_layer_offset, int) and not isinstance(self.moe_layer_offset, bool)
                and 0 <= self.moe_layer_offset < self.moe_layer_period, "moe_layer_offset",
                f"an integer from 0 to moe_layer_period - 1 ({self.moe_layer_period - 1})", self.moe_layer_offset)
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _positive_int(self.head_dim_v, "head_dim_v")
        if self.params_active is None:
            object.__setattr__(self, "params_active", self.params_total)
        require(is_number(self.params_total) and self.params_total > 0, "params_total",
                "a positive parameter count", self.params_total)
        require(is_number(self.params_active) and 0 < self.params_active <= self.params_total,
                "params_active", f"a positive count no larger than params_total ({self.params_total:g})",
                self.params_active)
        require(isinstance(self.layer_pattern, str) and self.layer_pattern != ""
                and all(c in LAYER_KINDS for c in self.layer_pattern), "layer_pattern",
                f"a non-empty string of the letters {''.join(LAYER_KINDS)}", self.layer_pattern)
        require(any(LAYER_KINDS[c] for c in self.layer_pattern), "layer_pattern",
                "at least one layer with a cache", self.layer_pattern)
        require(isinstance(self.tie_word_embeddings, bool), "tie_word_embeddings", "true or false",
                self.tie_word_embeddings)
        require(self.weight_format in WEIGHT_FORMATS, "weight_format", f"one of {', '.join(WEIGHT_FORMATS)}",
                self.weight_format)
        dtype_bytes(self.dtype, field="dtype")
        if self.mamba_ssm_cache_dtype != "auto":
            dtype_bytes(self.mamba_ssm_cache_dtype, field="mamba_ssm_cache_dtype")
        kinds = set(self.layer_pattern)
        if "S" in kinds:
            _positive_int(self.sliding_window, "sliding_window")
        if "C" in kinds:
            _positive_int(self.attention_chunk_size, "attention_chunk_size")
        if "A" in kinds:
            _positive_int(self.kv_lora_rank, "kv_lora_rank")
            _positive_int(self.qk_rope_head_dim, "qk_rope_head_dim")
        indexer = (self.index_head_dim, self.index_n_heads, self.index_topk)
        if any(v is not None for v in indexer):
            require("A" in kinds, "index_topk", "set only on a model with MLA layers (letter A)", self.index_topk)
            for name in ("index_head_dim", "index_n_heads", "index_topk"):
                _positive_int(getattr(self, name), name)
            require(self.index_head_dim % INDEXER_QUANT_BLOCK == 0, "index_head_dim",
                    f"a multiple of {INDEXER_QUANT_BLOCK} (one fp32 scale per {INDEXER_QUANT_BLOCK} fp8 values)",
                    self.index_head_dim)
        if "M" in kinds:
            require(self.state is not None, "state", "a recurrent-state table (the pattern has M layers)")
        if kinds & {"F", "S", "C"}:
            require(self.num_attention_heads % self.num_kv_heads == 0, "num_kv_heads",
                    f"a divisor of num_attention_heads ({self.num_attention_heads})", self.num_kv_heads)

    # -- layers ------------------------------------------------------------------------

    @property
    def layer_letters(self) -> str:
        pattern = self.layer_pattern
        return (pattern * (self.num_layers // len(pattern) + 1))[: self.num_layers]

    @property
    def layer_kinds(self) -> tuple[str | None, ...]:
        """The spec kind of every layer, in layer order (None: no cache)."""
        return tuple(LAYER_KINDS[c] for c in self.layer_letters)

    def count_layers(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def uses_mla(self) -> bool:
        return "mla" in self.layer_kinds

    @property
    def uses_sparse_indexer(self) -> bool:
        """DeepSeek Sparse Attention: an indexer cache beside every MLA layer's latent."""
        return self.index_topk is not None

    @property
    def indexer_bytes_per_token(self) -> int:
        """One indexer key as vLLM 0.33 caches it: ``index_head_dim`` fp8 values plus one
        4-byte scale per 128 of them (docs/semantics.md#sparse-mla-indexer)."""
        assert self.index_head_dim is not None
        return self.index_head_dim + self.index_head_dim // INDEXER_QUANT_BLOCK * 4

    @property
    def mla_head_size(self) -> int:
        """Width of the cached latent: kv_lora_rank + qk_rope_head_dim (one "head")."""
        return (self.kv_lora_rank or 0) + (self.qk_rope_head_dim or 0)

    @property
    def default_hybrid_kv_cache(self) -> bool:
        """vLLM 0.33 turns the hybrid KV cache manager off for chunked-local attention
        models unless an environment override is set, so their local layers are paid as
        full attention by default."""
        return "chunked_local" not in self.layer_kinds

    # -- weights and compute -------------------------------------------------------------

    @property
    def lm_head_params(self) -> float:
        """Parameters of the LM head (vocabulary x hidden); 0 when the vocabulary is unknown."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def body_params_active(self) -> float:
        """Active parameters every token goes through: without the embedding table (a
        lookup, no FLOPs) and the LM head (only sampling positions; the cost model charges
        it apart)."""
        matrices = 1 if self.tie_word_embeddings else 2
        return max(float(self.params_active) - matrices * self.lm_head_params, 0.0)

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is routed: past the first dense ones, every ``moe_layer_period``-th
        from ``moe_layer_offset``."""
        if not self.num_experts:
            return 0
        return sum(1 for i in range(self.first_dense_layers, self.num_layers)
                   if (i - self.moe_layer_offset) % self.moe_layer_period == 0)

    @property
    def routed_expert_params(self) -> float:
        """Parameters of the routed experts (gate, up and down projections of each)."""
        if not self.num_experts:
            return 0.0
        return self.num_moe_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def weights_bytes(self) -> int:
        """Bytes of the checkpoint's weights (whole model, before TP sharding)."""
        if self.weight_format == "fp8":
            return int(self.params_total)
        if self.weight_format == "mxfp4_moe":
            experts = min(self.routed_expert_params, self.params_total)
            return int(experts * _MXFP4_BYTES_PER_PARAM + (self.params_total - experts) * 2)
        return int(self.params_total * 2)

    def kv_projection_weight_bytes_per_kv_head(self) -> int:
        """Bytes of one KV head's K and V projections over every softmax-attention layer."""
        layers = sum(1 for k in self.layer_kinds if k in KV_HEAD_KINDS)
        return layers * self.hidden_size * (self.head_dim + self.head_dim_v) * dtype_bytes(self.dtype, field="dtype")


_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelPreset)}
_REQUIRED_MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelPreset) if f.default is dataclasses.MISSING]


def model_from_mapping(entry: dict[str, Any], *, name: str | None = None, where: str = "model") -> ModelPreset:
    """A model from a TOML/JSON table with the fields of ``ModelPreset`` (state as a sub-table)."""
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table of model fields", entry)
    params = dict(entry)
    params.setdefault("name", name if name is not None else "custom")
    reject_unknown_keys(params, _MODEL_FIELDS, where=where, expected="a model field (see scenarios/README.md)")
    if "state" in params:
        params["state"] = state_from_mapping(params["state"], where=f"{where}.state")
    return config_from_table(ModelPreset, params, where=where, table_is="a table of model fields",
                             known=_MODEL_FIELDS, expected="a model field (see scenarios/README.md)",
                             required=_REQUIRED_MODEL_FIELDS, required_is="a value (required model field)")


def _load_presets() -> dict[str, ModelPreset]:
    raw = tomllib.loads(resources.files("kvtwin.sim.planner.data").joinpath("models.toml").read_text())
    return {name: model_from_mapping(entry, name=name, where=f"models.toml[{name}]")
            for name, entry in raw.items()}


MODEL_PRESETS: dict[str, ModelPreset] = _load_presets()


def model_names() -> list[str]:
    return list(MODEL_PRESETS)


def get_model(name: str, *, field: str = "--model") -> ModelPreset:
    """A built-in preset by its exact name; unknown names list the valid ones."""
    key = str(name).strip().lower()
    if key not in MODEL_PRESETS:
        raise ConfigError(field, f"one of {', '.join(model_names())}", name)
    return MODEL_PRESETS[key]
