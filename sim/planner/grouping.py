"""Grouping layers into KV cache groups: one block table per group, one pool for all.

docs/semantics.md#grouping-and-page-size. In the order vLLM
0.33's ``get_kv_cache_groups`` tries them:

1. Hybrid KV cache manager off: sliding-window and chunked-local layers are promoted to
   full attention (the window stays as metadata: compute is still windowed, memory is
   not) — only when the model also has full-attention layers; a model whose layers still
   differ afterwards (recurrent states) cannot run that way.
2. Every layer has the same spec -> one group.
3. Every layer needs the same token slots (e.g. all full attention, differing head sizes)
   -> one group whose block costs the sum of its layers' pages.
4. Otherwise unify the page sizes (``sim/planner/page_size.py``) and split by repeat pattern:
   layers with the same spec form a bucket; ``group_size`` is the smallest bucket, or the
   largest when the largest is under 1.5x the smallest; each bucket is cut into
   ``cdiv(n, group_size)`` groups taking every ``num_groups``-th layer (interleaved, so a
   pipeline stage never gets an empty group); short groups count padding layers.
5. If page sizes cannot be unified (MLA), an MLA + sliding-window model falls back to
   full allocation: everything promoted to full attention, one group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.page_size import PageSizeNotUnifiable, unify_page_sizes
from kvtwin.sim.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)


@dataclass(frozen=True)
class PlannedGroup:
    """A KV cache group: its real layers, its spec and what one block costs in it."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    layer_page_bytes: tuple[int, ...]
    layer_unpadded_page_bytes: tuple[int, ...]
    num_padding_layers: int = 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id occupies in this group's real layers."""
        return sum(self.layer_page_bytes)

    @property
    def unpadded_bytes_per_block(self) -> int:
        return sum(self.layer_unpadded_page_bytes)

    def blocks_per_request(self, *, max_in_flight_tokens: int, max_model_len: int) -> int:
        return self.spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)


@dataclass(frozen=True)
class Grouping:
    groups: tuple[PlannedGroup, ...]
    # "uniform", "uniform_type", "uniform_page_size" or "full_allocation_fallback"
    strategy: str
    group_size: int
    # vLLM's "Add N padding layers, may waste at most X% KV cache memory", one per bucket.
    padding_warnings: tuple[tuple[int, float], ...] = ()

    @property
    def num_padding_layers(self) -> int:
        return sum(g.num_padding_layers for g in self.groups)


def _merged_spec(specs: list[KVCacheSpec]) -> KVCacheSpec:
    """One spec for a group: promoted full-attention layers keep a window or chunk as
    metadata only when all of them agree on it."""
    first = specs[0]
    if not isinstance(first, FullAttentionSpec):
        return first
    windows = {s.sliding_window for s in specs if getattr(s, "sliding_window", None) is not None}
    chunks = {s.attention_chunk_size for s in specs if getattr(s, "attention_chunk_size", None) is not None}
    return dataclasses.replace(first, sliding_window=windows.pop() if len(windows) == 1 else None,
                               attention_chunk_size=chunks.pop() if len(chunks) == 1 else None)


def is_uniform(specs: dict[str, KVCacheSpec]) -> bool:
    return len({s.merge_key() for s in specs.values()}) <= 1


def is_uniform_type(specs: dict[str, KVCacheSpec]) -> bool:
    types = {s.slot_type() for s in specs.values()}
    return len(types) == 1 and None not in types


def _group(names: list[str], specs: dict[str, KVCacheSpec], num_padding_layers: int = 0) -> PlannedGroup:
    layer_specs = [specs[n] for n in names]
    return PlannedGroup(layer_names=tuple(names), spec=_merged_spec(layer_specs),
                        layer_page_bytes=tuple(s.page_size_bytes for s in layer_specs),
                        layer_unpadded_page_bytes=tuple(s.real_page_size_bytes for s in layer_specs),
                        num_padding_layers=num_padding_layers)


def promote_local_specs(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Sliding-window and chunked-local layers as full attention, when full layers exist.

    A promoted layer takes the full layers' block size and keeps its window / chunk as
    metadata.
    """
    if is_uniform(specs) or is_uniform_type(specs):
        return dict(specs)
    has_full = any(isinstance(s, FullAttentionSpec) for s in specs.values())
    promotable = {name: spec for name, spec in specs.items() if spec.as_full_attention(spec.block_size) is not None}
    if not (has_full and promotable):
        return dict(specs)
    full_sizes = {s.block_size for s in specs.values() if isinstance(s, FullAttentionSpec)}
    full_block_size = next(iter(full_sizes)) if len(full_sizes) == 1 else None
    promoted = {name: (spec.as_full_attention(full_block_size or spec.block_size) if name in promotable else spec)
                for name, spec in specs.items()}
    return promoted


def choose_group_size(bucket_sizes: list[int]) -> int:
    """The "1" of an n:1 pattern (the smallest bucket), or the largest bucket when the
    buckets are close (max < 1.5 x min) so that a near-even split is not padded twice."""
    smallest, largest = min(bucket_sizes), max(bucket_sizes)
    return largest if largest < smallest * 1.5 else smallest


def _group_by_page_size(specs: dict[str, KVCacheSpec]) -> tuple[list[PlannedGroup], int, list[tuple[int, float]]]:
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        buckets.setdefault(spec.merge_key(), []).append(name)
    layer_buckets = list(buckets.values())
    group_size = choose_group_size([len(b) for b in layer_buckets])
    groups: list[PlannedGroup] = []
    warnings: list[tuple[int, float]] = []
    for layers in layer_buckets:
        remainder = len(layers) % group_size
        if remainder:
            num_padding = group_size - remainder
            warnings.append((num_padding, num_padding / len(layers)))
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            names = layers[i::num_groups]
            groups.append(_group(names, specs, num_padding_layers=group_size - len(names)))
    return groups, group_size, warnings


def _full_allocation_fallback(specs: dict[str, KVCacheSpec]) -> list[PlannedGroup] | None:
    """MLA next to sliding-window layers whose pages cannot be unified: allocate every
    layer as full attention in one group (the sliding-window saving is given up)."""
    if any(isinstance(s, ChunkedLocalAttentionSpec) for s in specs.values()):
        return None
    has_mla = any(isinstance(s, MLAAttentionSpec) for s in specs.values())
    has_swa = any(isinstance(s, SlidingWindowSpec) for s in specs.values())
    if not (has_mla and has_swa):
        return None
    promoted = promote_local_specs(specs)
    if not is_uniform_type(promoted):
        return None
    return [_group(list(promoted), promoted)]


def group_layers(specs: dict[str, KVCacheSpec], *, hybrid_kv_cache: bool) -> Grouping:
    """Group the model's layers (name -> spec, in layer order) as vLLM 0.33 does."""
    if not specs:
        raise ConfigError("model", "at least one layer with a KV cache or state")
    if not hybrid_kv_cache:
        specs = promote_local_specs(specs)
        if not (is_uniform(specs) or is_uniform_type(specs)):
            kinds = sorted({s.kind for s in specs.values()})
            raise ConfigError("hybrid_kv_cache", "on for this model: vLLM turns the hybrid KV cache manager off "
                              "only when every layer can be treated as full attention (layer kinds here: "
                              f"{', '.join(kinds)})", False)
    if is_uniform(specs):
        return Grouping((_group(list(specs), specs),), "uniform", len(specs))
    if is_uniform_type(specs):
        return Grouping((_group(list(specs), specs),), "uniform_type", len(specs))
    try:
        unified = unify_page_sizes(specs)
    except PageSizeNotUnifiable as err:
        fallback = _full_allocation_fallback(specs)
        if fallback is None:
            raise ConfigError("model", "layers whose KV cache pages vLLM can unify", str(err)) from None
        return Grouping(tuple(fallback), "full_allocation_fallback", len(specs))
    groups, group_size, warnings = _group_by_page_size(unified)
    return Grouping(tuple(groups), "uniform_page_size", group_size, tuple(warnings))

