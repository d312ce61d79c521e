"""Prefix-cache retention: which full blocks of a sliding-window or Mamba group enter the
prefix cache (docs/semantics.md#prefix-cache-retention).

vLLM 0.33's engine runs with ``CacheConfig.prefix_cache_retention_interval = 0``: a
sliding-window or Mamba group keeps only the blocks a later hit can stand on at a
*semantic* checkpoint (where a resend or continuation of the prompt resumes, and where a
shared prefix was seen to fork), not at every block boundary. A positive interval adds a
checkpoint every that many tokens; ``None`` (``DENSE`` here) caches every full block. Full
attention and chunked local always cache densely: their hits need every block anyway.

A block left out is simply never registered under its hash: it cannot be hit, is not
counted as cached, and is freed like an unhashed block. The decision is made once, when
the block first becomes full for its request.

The rules are vLLM 0.33's ``reachable_block_mask`` of ``SlidingWindowManager`` and
``MambaManager`` (``v1/core/single_type_kv_cache_manager.py``), ``replay_boundaries`` and
``_validate_prefix_cache_retention_interval`` (``v1/core/kv_cache_coordinator.py``).
kvtwin never runs a draft head's trailing-block drop with prefix caching on (the scheduler
requires lookahead hashes there), so the drop's one-block shift of these rules never
applies and is left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.errors import ConfigError, require
from kvtwin.sim.core.spec import KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv

# ``prefix_cache_retention_interval = None``: every full block is cached.
DENSE = None


def describe_retention(interval: int | None) -> str:
    """The mode in words, as a summary or a plan prints it."""
    if interval is None:
        return "dense"
    if interval == 0:
        return "semantic checkpoints (interval 0)"
    return f"semantic checkpoints + every {interval} tokens"


def retention_label(interval: int | None) -> str:
    """The setting as a scenario spells it (``0``, ``512`` or ``dense``)."""
    return "dense" if interval is None else str(interval)


def parse_retention_setting(value: object) -> int | None:
    """The interval a scenario, a flag or a sweep gives: a non-negative integer (or its
    digits), or ``dense`` for None."""
    if isinstance(value, str):
        text = value.strip().lower().replace("_", "")
        if text == "dense":
            return DENSE
        if text.isdigit():
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ConfigError("prefix_cache_retention_interval",
                      "0 (vLLM's default: semantic checkpoints only), a positive multiple of the block size, "
                      "or dense", value)


def is_sparse_kind(spec: KVCacheSpec) -> bool:
    """Kinds whose caching the interval thins out."""
    return isinstance(spec, (SlidingWindowSpec, MambaSpec))


def validate_retention_interval(interval: int | None, scheduler_block_size: int,
                                specs: Sequence[KVCacheSpec]) -> None:
    """vLLM's checks (``_validate_prefix_cache_retention_interval``): a positive interval
    needs a sliding-window or Mamba group to act on and must land on the hit grid; 0 is
    accepted anywhere (it is the engine default)."""
    if interval is None:
        return
    require(isinstance(interval, int) and not isinstance(interval, bool) and interval >= 0,
            "prefix_cache_retention_interval", "a non-negative integer, or dense", interval)
    if interval == 0:
        return
    require(any(is_sparse_kind(s) for s in specs), "prefix_cache_retention_interval",
            "0 or dense for a model without sliding-window or Mamba layers (only they are thinned)", interval)
    require(interval % scheduler_block_size == 0, "prefix_cache_retention_interval",
            f"a multiple of the scheduler block size ({scheduler_block_size})", interval)


def reachable_boundaries(num_prompt_tokens: int, shared_prefix_boundary: int) -> tuple[int, ...]:
    """Token positions a later request can resume this one's prefix at: the prompt's last
    token (a resend hits up to ``num_tokens - 1``; output tokens never count) and, when its
    admission found one, the shared-prefix junction (docs/semantics.md#prefix-cache-retention)."""
    if shared_prefix_boundary:
        return (num_prompt_tokens - 1, shared_prefix_boundary)
    return (num_prompt_tokens - 1,)


def sliding_window_mask(start_block: int, end_block: int, alignment_tokens: int, sliding_window: int,
                        block_size: int, interval: int | None, boundaries: Sequence[int],
                        final_segment_end_block: int | None = None) -> list[bool] | None:
    """Which blocks ``[start_block, end_block)`` of a sliding-window table to cache (None:
    all). A hit at a boundary needs the ``cdiv(window - 1, block_size)`` blocks ending
    there, so those are the blocks each kept boundary keeps: every alignment boundary
    (dense), every ``interval`` tokens, and each of ``boundaries``, floored to the grid.
    ``final_segment_end_block`` (the offload connector's store horizon) also keeps the
    tail of a last, partial segment."""
    if alignment_tokens % block_size:
        # The mask is per block; a finer grid cannot be expressed, so keep everything.
        return None
    need = cdiv(sliding_window - 1, block_size)
    mask = [False] * (end_block - start_block)
    segment_tokens = alignment_tokens if interval is None else (interval or 0)
    if segment_tokens:
        per_segment = segment_tokens // block_size
        if need >= per_segment:
            return None  # every block ends some kept window
        for i in range(start_block, end_block):
            if i % per_segment >= per_segment - need:
                mask[i - start_block] = True
        if final_segment_end_block is not None:
            tail = final_segment_end_block % per_segment
            if tail:
                first = max(final_segment_end_block - tail, final_segment_end_block - need)
                for i in range(max(start_block, first), min(end_block, final_segment_end_block)):
                    mask[i - start_block] = True
    if interval is not None:
        for boundary in boundaries:
            end = boundary // alignment_tokens * alignment_tokens // block_size
            for i in range(max(start_block, end - need), min(end_block, end)):
                mask[i - start_block] = True
    return mask


def mamba_mask(start_block: int, end_block: int, alignment_tokens: int, block_size: int, interval: int | None,
               boundaries: Sequence[int]) -> list[bool] | None:
    """Which state blocks ``[start_block, end_block)`` of a Mamba table to cache (None:
    all). A hit needs one state, the block ending at the boundary: keep the states at
    every ``interval`` tokens and at each of ``boundaries``, floored to the grid."""
    if interval is None:
        return None
    mask = [False] * (end_block - start_block)
    if interval:
        per_segment = interval // block_size
        if per_segment <= 1:
            return None  # every block boundary is a segment boundary
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in boundaries:
        block = boundary // alignment_tokens * alignment_tokens // block_size - 1
        if start_block <= block < end_block:
            mask[block - start_block] = True
    return mask


def thins_caching(spec: KVCacheSpec, alignment_tokens: int, interval: int | None) -> bool:
    """Whether a group of ``spec`` can ever leave a full block uncached under ``interval``
    (False: its masks are all None, and caching skips them)."""
    block_size = spec.block_size
    if isinstance(spec, SlidingWindowSpec):
        if alignment_tokens % block_size:
            return False
        need = cdiv(spec.sliding_window - 1, block_size)
        if interval is None:
            return need < alignment_tokens // block_size
        return interval == 0 or need < interval // block_size
    if isinstance(spec, MambaSpec):
        return interval is not None and (interval == 0 or interval // block_size > 1)
    return False
