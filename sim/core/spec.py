"""KV cache specs: what one layer needs from the block pool, and the layout built from them.

Seed 000 ("KVCacheSpec: the smallest description of one layer's cache") and semantics
sections 3 and 7. A spec describes the physical shape of a layer's cache, never how
attention is computed: block size, bytes per block (page), the worst case a request can
hold, and for windowed kinds the admission cap that the scheduler's whole-sequence check
and the planner's pool sizing share.

``KVCacheGroupSpec`` and ``KVCacheConfig`` are the planner's output and the KV cache
manager's input: one spec per group, and one pool of ``num_blocks`` blocks (null block
included) that every group draws from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import ClassVar, Literal

from kvtwin.sim.core.errors import ConfigError, require


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MambaCacheMode = Literal["none", "align", "all"]


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of every spec. ``kind`` is the name used in configs, outputs and `plan --json`."""

    kind: ClassVar[str] = ""
    block_size: int

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size > 0,
                "block_size", "a positive integer number of tokens", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request may hold in this group at once (pool sizing and admission)."""
        return cdiv(max_model_len, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """K and V of ``num_kv_heads`` heads per token; ``dtype_bytes`` per element."""

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


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token keeps its K/V for the request's lifetime.

    ``sliding_window`` / ``attention_chunk_size`` are only metadata: they record that a
    windowed layer is being treated as full attention (hybrid KV cache manager off), where
    memory is paid in full while compute still uses the window.
    """

    kind: ClassVar[str] = "full_attention"
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent per token, no separate V."""

    kind: ClassVar[str] = "mla"

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """The next token attends the last ``sliding_window`` tokens, itself included."""

    kind: ClassVar[str] = "sliding_window"
    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                "sliding_window", "a positive integer number of tokens", self.sliding_window)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        # The window plus every scheduled-but-unsettled token, and +1 because the window
        # rarely starts on a block boundary.
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4 local layers)."""

    kind: ClassVar[str] = "chunked_local"
    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.attention_chunk_size, int) and self.attention_chunk_size > 0,
                "attention_chunk_size", "a positive integer number of tokens", self.attention_chunk_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A recurrent state (Mamba, gated DeltaNet, linear attention): fixed size per request.

    ``shapes``/``dtype_bytes`` list the state tensors (e.g. conv state and SSM state) of
    one layer. In ``align`` mode the state at every block boundary can be cached, and a
    request holds its current and previous state block; otherwise one state, no caching.
    """

    kind: ClassVar[str] = "mamba"
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype_bytes: tuple[int, ...] = ()
    mamba_cache_mode: MambaCacheMode = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.mamba_cache_mode in ("none", "align", "all"), "mamba_cache_mode",
                "one of none, align, all", self.mamba_cache_mode)
        require(len(self.shapes) == len(self.dtype_bytes), "dtype_bytes",
                f"one entry per state tensor ({len(self.shapes)})", self.dtype_bytes)
        require(self.num_speculative_blocks >= 0, "num_speculative_blocks", "a non-negative integer",
                self.num_speculative_blocks)
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


SPEC_KINDS: dict[str, type[KVCacheSpec]] = {
    cls.kind: cls
    for cls in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)
}


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

    def __post_init__(self) -> None:
        require(isinstance(self.num_blocks, int) and self.num_blocks >= 2, "num_blocks",
                "an integer >= 2 (the null block plus at least one usable block)", self.num_blocks)
        require(len(self.groups) > 0, "kv_cache_groups", "at least one group", len(self.groups))
        if not self.hash_block_size:
            object.__setattr__(self, "hash_block_size", min(g.spec.block_size for g in self.groups))
        for gid, group in enumerate(self.groups):
            require(group.spec.block_size % self.hash_block_size == 0,
                    f"kv_cache_groups[{gid}].block_size",
                    f"a positive multiple of the hash block size {self.hash_block_size}", group.spec.block_size)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(g.spec for g in self.groups)


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
    known = {f for f in cls.__dataclass_fields__}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"a field of a {kind} group ({', '.join(sorted(known))})",
                          params[unknown[0]])
    try:
        return cls(**params)
    except ConfigError as err:
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None
