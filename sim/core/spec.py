"""KV cache specs: what one layer needs from the block pool, and the layout built from them.

docs/semantics.md#single-type-managers and #page-sizes-and-worst-case-per-request. A spec describes the physical shape of a layer's cache, never how
attention is computed: block size, bytes per block (page), the worst case a request can
hold, and for windowed kinds the admission cap that the scheduler's whole-sequence check
and the planner's pool sizing share.

``KVCacheGroupSpec`` and ``KVCacheConfig`` are the planner's output and the KV cache
manager's input: one spec per group, and one pool of ``num_blocks`` blocks (null block
included) that every group draws from.

Each spec class is the one home of its kind's facts: its name (``kind``) and letter in a
model's layer pattern, its pages and admission cap, what a step reads (the keys a query
attends, the KV tokens a chunk reads, a recurrent state) for the cost model, how the
planner groups it (``slot_type``, ``merge_key``, ``as_full_attention``) and what the plan
prints about it (``describe``). Adding a kind means: a spec class here (listed in
``SPEC_CLASSES``), its manager in ``managers.MANAGER_CLASSES``, and how the planner builds
it from a model layer (``sim/planner/plan.py``'s ``LAYER_SPEC_BUILDERS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from math import prod
from typing import ClassVar, Literal

from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys, require


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MambaCacheMode = Literal["none", "align", "all"]


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of every spec. ``kind`` is the name used in configs, outputs and `plan --json`;
    ``pattern_letter`` the layer's letter in a model's ``layer_pattern``."""

    kind: ClassVar[str] = ""
    pattern_letter: ClassVar[str] = ""
    # Whether the layer keeps K and V per KV head, sharded over tensor-parallel ranks
    # (so TP must divide the KV heads, or be a multiple of them).
    has_kv_heads: ClassVar[bool] = False
    # Whether the whole-sequence admission check is capped at
    # ``max_admission_blocks_per_request`` (kinds that free blocks as the request advances).
    caps_admission: ClassVar[bool] = False
    block_size: int

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size > 0,
                "block_size", "a positive integer number of tokens", self.block_size)

    @property
    def real_page_size_bytes(self) -> int:
        """One block's bytes before any padding to a unified page size."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request may hold in this group at once (pool sizing and admission)."""
        return cdiv(max_model_len, self.block_size)

    # -- what one step reads (the cost model) ----------------------------------------

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of cache one token adds (0 for a recurrent state)."""
        return 0.0

    @property
    def state_bytes(self) -> int:
        """Bytes of recurrent state a request reads and writes each step (0 for attention)."""
        return 0

    @property
    def attention_width_per_head(self) -> int:
        """Elements per query head multiplied per attended key (QK^T plus PV); 0 without attention."""
        return 0

    def attended_keys(self, start: int, end: int) -> int:
        """Sum over query positions p in [start, end) of the keys the query at p attends."""
        return 0

    def kv_tokens_read(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Cached tokens a chunk of ``num_new_tokens`` after ``num_computed_tokens`` reads."""
        return 0

    def decode_attended_keys(self, context_ends: list[int]) -> int:
        """``attended_keys(e - 1, e)`` summed over decodes ending at each ``e`` (the hot path)."""
        return 0

    # -- grouping (the planner) -------------------------------------------------------

    def slot_type(self) -> tuple | None:
        """What decides how many token slots a layer needs; None for recurrent states."""
        return None

    def merge_key(self) -> KVCacheSpec:
        """Specs with equal keys can share a group."""
        return self

    def as_full_attention(self, block_size: int) -> FullAttentionSpec | None:
        """This layer treated as full attention (hybrid KV cache manager off), or None if
        it cannot be."""
        return None

    def describe(self) -> dict:
        """The kind's own fields for ``plan --json``."""
        return {}


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """K and V of ``num_kv_heads`` heads per token; ``dtype_bytes`` per element."""

    has_kv_heads: ClassVar[bool] = True

    num_kv_heads: int = 1
    head_size: int = 128
    head_size_v: int | None = None
    dtype_bytes: int = 2
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_heads", "head_size", "dtype_bytes"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        require(isinstance(self.head_size_v, int) and self.head_size_v > 0,
                "head_size_v", "a positive integer", self.head_size_v)
        if self.page_size_padded is not None:
            require(self.page_size_padded >= self.real_page_size_bytes, "page_size_padded",
                    f"at least the unpadded page ({self.real_page_size_bytes} bytes)", self.page_size_padded)

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.real_page_size_bytes / self.block_size

    @property
    def attention_width_per_head(self) -> int:
        return self.head_size + self.head_size_v

    def attended_keys(self, start: int, end: int) -> int:
        return causal_keys(start, end)

    def kv_tokens_read(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return num_computed_tokens + num_new_tokens

    def decode_attended_keys(self, context_ends: list[int]) -> int:
        return sum(context_ends)

    def describe(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_size": self.head_size, "head_size_v": self.head_size_v}


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token keeps its K/V for the request's lifetime.

    ``sliding_window`` / ``attention_chunk_size`` are only metadata: they record that a
    windowed layer is being treated as full attention (hybrid KV cache manager off), where
    memory is paid in full while compute still uses the window.
    """

    kind: ClassVar[str] = "full_attention"
    pattern_letter: ClassVar[str] = "F"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    # Compute still honours a promoted layer's window or chunk; only memory is paid in full.
    def attended_keys(self, start: int, end: int) -> int:
        if self.sliding_window is not None:
            return window_keys(self.sliding_window, start, end)
        if self.attention_chunk_size is not None:
            return chunk_keys(self.attention_chunk_size, start, end)
        return causal_keys(start, end)

    def kv_tokens_read(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        if self.sliding_window is not None:
            return window_tokens_read(self.sliding_window, num_computed_tokens, num_new_tokens)
        if self.attention_chunk_size is not None:
            return chunk_tokens_read(self.attention_chunk_size, num_computed_tokens, num_new_tokens)
        return num_computed_tokens + num_new_tokens

    def decode_attended_keys(self, context_ends: list[int]) -> int:
        if self.sliding_window is not None:
            return window_decode_keys(self.sliding_window, context_ends)
        if self.attention_chunk_size is not None:
            return chunk_decode_keys(self.attention_chunk_size, context_ends)
        return sum(context_ends)

    def slot_type(self) -> tuple | None:
        return ("full", self.block_size)

    def merge_key(self) -> KVCacheSpec:
        # Layers that differ only in the window metadata of hybrid-off promotion still merge.
        if self.sliding_window is None and self.attention_chunk_size is None:
            return self
        return dataclasses.replace(self, sliding_window=None, attention_chunk_size=None)

    def describe(self) -> dict:
        out = super().describe()
        if self.sliding_window is not None:
            out["compute_only_sliding_window"] = self.sliding_window
        if self.attention_chunk_size is not None:
            out["compute_only_attention_chunk_size"] = self.attention_chunk_size
        return out


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token, no separate V."""

    kind: ClassVar[str] = "mla"
    pattern_letter: ClassVar[str] = "A"
    has_kv_heads: ClassVar[bool] = False  # one latent shared by every head

    # ``head_size`` is the latent plus its rope part; ``head_size_v`` is the latent the
    # absorbed PV product reads (kv_lora_rank), which the page does not store twice.
    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def describe(self) -> dict:
        return {"num_kv_heads": self.num_kv_heads, "head_size": self.head_size}


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """The next token attends the last ``sliding_window`` tokens, itself included.

    ``extra_retained_tokens`` keeps that many more tokens' blocks below the window, never
    attended: a multi-module MTP drafter may re-prefill the last ``k - 1`` computed tokens,
    so the planner sets it to ``max(0, num_prefill_lookahead_tokens - 1)`` on every
    sliding-window layer (``with_prefill_lookahead``; docs/semantics.md#sliding-window).
    """

    kind: ClassVar[str] = "sliding_window"
    pattern_letter: ClassVar[str] = "S"
    caps_admission: ClassVar[bool] = True
    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                "sliding_window", "a positive integer number of tokens", self.sliding_window)
        require(_is_int(self.extra_retained_tokens) and self.extra_retained_tokens >= 0,
                "extra_retained_tokens", "a non-negative integer number of tokens", self.extra_retained_tokens)

    @property
    def num_retained_tokens(self) -> int:
        """Computed tokens whose blocks a request keeps below its next token: the window
        less the token itself, plus the extra retained tail."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        # The retained tokens plus every scheduled-but-unsettled token, and +1 because the
        # window rarely starts on a block boundary.
        num_tokens = min(self.num_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def attended_keys(self, start: int, end: int) -> int:
        return window_keys(self.sliding_window, start, end)

    def kv_tokens_read(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return window_tokens_read(self.sliding_window, num_computed_tokens, num_new_tokens)

    def decode_attended_keys(self, context_ends: list[int]) -> int:
        return window_decode_keys(self.sliding_window, context_ends)

    def slot_type(self) -> tuple | None:
        return ("sliding_window", self.sliding_window, self.block_size)

    def as_full_attention(self, block_size: int) -> FullAttentionSpec:
        return _promoted(self, block_size, sliding_window=self.sliding_window)

    def describe(self) -> dict:
        out = {"sliding_window": self.sliding_window, **super().describe()}
        if self.extra_retained_tokens:
            out["extra_retained_tokens"] = self.extra_retained_tokens
        return out


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4 local layers)."""

    kind: ClassVar[str] = "chunked_local"
    pattern_letter: ClassVar[str] = "C"
    caps_admission: ClassVar[bool] = True
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.attention_chunk_size, int) and self.attention_chunk_size > 0,
                "attention_chunk_size", "a positive integer number of tokens", self.attention_chunk_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def attended_keys(self, start: int, end: int) -> int:
        return chunk_keys(self.attention_chunk_size, start, end)

    def kv_tokens_read(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        return chunk_tokens_read(self.attention_chunk_size, num_computed_tokens, num_new_tokens)

    def decode_attended_keys(self, context_ends: list[int]) -> int:
        return chunk_decode_keys(self.attention_chunk_size, context_ends)

    def slot_type(self) -> tuple | None:
        return ("chunked_local", self.attention_chunk_size, self.block_size)

    def as_full_attention(self, block_size: int) -> FullAttentionSpec:
        return _promoted(self, block_size, attention_chunk_size=self.attention_chunk_size)

    def describe(self) -> dict:
        return {"attention_chunk_size": self.attention_chunk_size, **super().describe()}


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state (Mamba, gated DeltaNet, linear attention): fixed size per request.

    ``shapes``/``dtype_bytes`` list the state tensors (e.g. conv state and SSM state) of
    one layer. In ``align`` mode the state at every block boundary can be cached, and a
    request holds its current and previous state block; otherwise one state, no caching.

    Layers whose kernel can leave a state mid-prefill (vLLM 0.33's Mamba-2 mixer, Qwen's
    gated DeltaNet on FlashInfer) publish a *prefill checkpoint*: one extra block per
    request (``num_prefill_checkpoint_blocks``) holding the state at a block boundary
    inside the chunk, so the scheduler need not end the chunk there. Checkpoint offsets
    from the chunk start must be multiples of ``prefill_checkpoint_alignment``; None
    means the kernel exports none, whatever the block count says.
    """

    kind: ClassVar[str] = "mamba"
    pattern_letter: ClassVar[str] = "M"
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype_bytes: tuple[int, ...] = ()
    mamba_cache_mode: MambaCacheMode = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.mamba_cache_mode in ("none", "align", "all"), "mamba_cache_mode",
                "one of none, align, all", self.mamba_cache_mode)
        require(len(self.shapes) == len(self.dtype_bytes), "dtype_bytes",
                f"one entry per state tensor ({len(self.shapes)})", self.dtype_bytes)
        require(self.num_speculative_blocks >= 0, "num_speculative_blocks", "a non-negative integer",
                self.num_speculative_blocks)
        require(_is_int(self.num_prefill_checkpoint_blocks) and self.num_prefill_checkpoint_blocks >= 0,
                "num_prefill_checkpoint_blocks", "a non-negative integer", self.num_prefill_checkpoint_blocks)
        require(self.prefill_checkpoint_alignment is None
                or (_is_int(self.prefill_checkpoint_alignment) and self.prefill_checkpoint_alignment > 0),
                "prefill_checkpoint_alignment", "a positive integer number of tokens, or null",
                self.prefill_checkpoint_alignment)
        if self.page_size_padded is not None:
            require(self.page_size_padded >= self.real_page_size_bytes, "page_size_padded",
                    f"at least the state size ({self.real_page_size_bytes} bytes)", self.page_size_padded)

    @property
    def real_page_size_bytes(self) -> int:
        return sum(prod(shape) * nbytes for shape, nbytes in zip(self.shapes, self.dtype_bytes))

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        if self.mamba_cache_mode == "align":
            return 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        return 1 + self.num_speculative_blocks

    @property
    def state_bytes(self) -> int:
        return self.real_page_size_bytes

    @property
    def has_prefill_checkpoint_blocks(self) -> bool:
        """Whether a request keeps a checkpoint block (only align mode caches states)."""
        return self.mamba_cache_mode == "align" and self.num_prefill_checkpoint_blocks > 0

    def describe(self) -> dict:
        return {"state_shapes": [list(shape) for shape in self.shapes], "state_dtype_bytes": list(self.dtype_bytes),
                "mamba_cache_mode": self.mamba_cache_mode,
                "num_prefill_checkpoint_blocks": self.num_prefill_checkpoint_blocks,
                "prefill_checkpoint_alignment": self.prefill_checkpoint_alignment}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_mamba_prefill_checkpoint_position(num_tokens: int, block_size: int, drop_eagle_block: bool = False) -> int:
    """The last block boundary whose state a later request can reuse (vLLM's helper of the
    same name): hits stop at ``num_tokens - 1`` because the last token's logits are always
    recomputed. Under a draft head's trailing-block drop (caching off,
    docs/semantics.md#draft-heads-and-prefix-caching) attention hits lose their last
    block, so the Mamba state is kept one whole block before the sequence's last boundary."""
    if drop_eagle_block:
        return max(num_tokens // block_size * block_size - block_size, 0)
    return max((num_tokens - 1) // block_size * block_size, 0)


def is_mamba_prefill_checkpoint_valid(query_start: int, query_end: int, checkpoint_position: int,
                                      hash_block_size: int, mamba_block_size: int,
                                      checkpoint_alignment: int | None) -> bool:
    """Whether the kernel can export the state at ``checkpoint_position`` from inside the
    query ``[query_start, query_end)`` into its own block (the one before the running
    state's), as vLLM 0.33 decides it. That block must lie after the block the query's
    initial state comes from, and the offset must be on the kernel's grid."""
    if checkpoint_alignment is None:
        return False
    return (query_start % hash_block_size == 0
            and -(-query_end // mamba_block_size) - 2 > (query_start - 1) // mamba_block_size
            and query_start + hash_block_size <= checkpoint_position
            and query_start < checkpoint_position < query_end
            and (checkpoint_position - query_start) % checkpoint_alignment == 0)


def _promoted(spec: AttentionSpec, block_size: int, **window) -> FullAttentionSpec:
    """A local-attention layer as full attention at ``block_size``, its window kept as metadata."""
    padded = None
    if spec.page_size_padded is not None:
        padded = max(spec.page_size_padded, spec.real_page_size_bytes * block_size // spec.block_size)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                             head_size_v=spec.head_size_v, dtype_bytes=spec.dtype_bytes, page_size_padded=padded,
                             **window)


SPEC_CLASSES: tuple[type[KVCacheSpec], ...] = (
    FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
SPEC_KINDS: dict[str, type[KVCacheSpec]] = {cls.kind: cls for cls in SPEC_CLASSES}


# -- closed forms of what causal queries attend --------------------------------------
# Sums over query positions p in [start, end) of the keys a query at p sees.


def causal_keys(start: int, end: int) -> int:
    if end <= start:
        return 0
    return (end * (end + 1) - start * (start + 1)) // 2


def window_keys(window: int, start: int, end: int) -> int:
    """min(p + 1, W) summed: a triangle up to W, then W per query."""
    def prefix(n: int) -> int:
        if n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return prefix(end) - prefix(start) if end > start else 0


def chunk_keys(chunk: int, start: int, end: int) -> int:
    """(p mod C) + 1 summed: a triangle per chunk."""
    def prefix(n: int) -> int:
        full, rest = divmod(n, chunk)
        return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
    return prefix(end) - prefix(start) if end > start else 0


def window_tokens_read(window: int, num_computed_tokens: int, num_new_tokens: int) -> int:
    return min(num_computed_tokens + num_new_tokens, window + num_new_tokens - 1)


def chunk_tokens_read(chunk: int, num_computed_tokens: int, num_new_tokens: int) -> int:
    return num_computed_tokens + num_new_tokens - (num_computed_tokens // chunk) * chunk


def window_decode_keys(window: int, context_ends: list[int]) -> int:
    return sum(e if e < window else window for e in context_ends)


def chunk_decode_keys(chunk: int, context_ends: list[int]) -> int:
    return sum((e - 1) % chunk + 1 for e in context_ends)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (and so one manager)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    num_padding_layers: int = 0


@dataclass(frozen=True)
class KVCacheConfig:
    """The layout the KV cache manager runs on: groups in group-id order, one shared pool.

    ``num_blocks`` counts the null block (block 0), so ``num_blocks - 1`` are usable.
    ``hash_block_size`` is the granularity of request block hashes; every group's block
    size is a multiple of it.
    """

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    hash_block_size: int = field(default=0)
    # Which sliding-window and Mamba blocks enter the prefix cache (vLLM's resolved
    # ``prefix_cache_retention_interval``): None caches every full block, as this
    # dataclass defaults in vLLM; an engine passes its ``CacheConfig`` value, 0 by default
    # (docs/semantics.md#prefix-cache-retention).
    prefix_cache_retention_interval: int | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.num_blocks, int) and self.num_blocks >= 2, "num_blocks",
                "an integer >= 2 (the null block plus at least one usable block)", self.num_blocks)
        require(len(self.groups) > 0, "kv_cache_groups", "at least one group", len(self.groups))
        if not self.hash_block_size:
            object.__setattr__(self, "hash_block_size", min(g.spec.block_size for g in self.groups))
        interval = self.prefix_cache_retention_interval
        require(interval is None or (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 0),
                "prefix_cache_retention_interval", "a non-negative integer, or dense", interval)
        for gid, group in enumerate(self.groups):
            require(group.spec.block_size % self.hash_block_size == 0,
                    f"kv_cache_groups[{gid}].block_size",
                    f"a positive multiple of the hash block size {self.hash_block_size}", group.spec.block_size)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(g.spec for g in self.groups)


def with_speculative_blocks(spec: KVCacheSpec, num_speculative_tokens: int) -> KVCacheSpec:
    """``spec`` as a drafting engine builds it: a recurrent-state spec keeps one state block
    per draft token (``num_speculative_blocks = k``; vLLM 0.33 ``MambaBase.get_kv_cache_spec``),
    any other spec is unchanged (docs/semantics.md#speculative-decoding)."""
    if isinstance(spec, MambaSpec) and spec.num_speculative_blocks != num_speculative_tokens:
        return dataclasses.replace(spec, num_speculative_blocks=num_speculative_tokens)
    return spec


def with_prefill_lookahead(spec: KVCacheSpec, num_prefill_lookahead_tokens: int) -> KVCacheSpec:
    """``spec`` as vLLM 0.33's planner leaves it for a drafter that reads
    ``num_prefill_lookahead_tokens`` prefill tokens ahead: a sliding-window spec retains
    ``max(0, lookahead - 1)`` more tokens below its window (the tail multi-module MTP may
    re-prefill; ``v1/core/kv_cache_planning.py`` ~l.1636), any other spec is unchanged
    (docs/semantics.md#sliding-window)."""
    if isinstance(spec, SlidingWindowSpec):
        extra = max(0, num_prefill_lookahead_tokens - 1)
        if spec.extra_retained_tokens != extra:
            return dataclasses.replace(spec, extra_retained_tokens=extra)
    return spec


def spec_from_dict(entry: dict, *, block_size: int, where: str) -> KVCacheSpec:
    """A spec from a config mapping such as ``{"kind": "sliding_window", "sliding_window": 128}``.

    Unknown keys are an error rather than silently ignored: a typo must not change a run.
    """
    if not isinstance(entry, dict):
        raise ConfigError(where, "a mapping with a 'kind' key", entry)
    kind = entry.get("kind")
    cls = SPEC_KINDS.get(kind)
    if cls is None:
        raise ConfigError(f"{where}.kind", f"one of {', '.join(sorted(SPEC_KINDS))}", kind)
    params = {k: v for k, v in entry.items() if k != "kind"}
    params.setdefault("block_size", block_size)
    if cls is MambaSpec:
        params.setdefault("mamba_cache_mode", "align")
        for key in ("shapes", "dtype_bytes"):
            if key in params:
                params[key] = tuple(tuple(s) if isinstance(s, list) else s for s in params[key])
    known = sorted(f.name for f in dataclasses.fields(cls))
    reject_unknown_keys(params, known, where=where, expected=f"a field of a {kind} group ({', '.join(known)})")
    try:
        return cls(**params)
    except ConfigError as err:
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None
