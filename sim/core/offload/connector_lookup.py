"""The offloading connector's lookup side (``connector.py``): how many tokens past the GPU
prefix hit the tier holds, and which tier each loaded token came from.

vLLM 0.33's ``_lookup``, ``_maximal_prefix_lookup`` and ``_sliding_window_lookup`` of
``OffloadingConnectorScheduler``, and the split of its ``get_external_cache_hit_sources``.
Full-attention groups are looked up left to right, windowed groups (sliding window, chunked
local, and Mamba, whose "window" is one chunk) right to left, repeating until the hit length
agrees; a chunk still being stored or loaded defers the request a step.
"""

from __future__ import annotations

from kvtwin.sim.core.offload.base import LookupResult
from kvtwin.sim.core.offload.connector_state import GroupOffloadConfig, RequestOffloadState
from kvtwin.sim.core.offload.manager import OffloadingManager
from kvtwin.sim.core.spec import cdiv

# Nearer tiers first: where two tiers' keys cover a token, the outer one is reported.
_TIER_ORDER = {"unspecified": -1, "gpu": 0, "cpu": 1, "disk": 2}


class ConnectorLookup:
    """The lookups of one connector against its manager, over its groups in lookup order:
    full attention first, then the windowed groups from the widest window down."""

    def __init__(self, manager: OffloadingManager, group_configs: tuple[GroupOffloadConfig, ...],
                 chunks_being_loaded: set | None):
        self.manager = manager
        # A tier whose lookups are pure and never RETRY scans a prefix in one call (the
        # waiting queue's head is looked up again every step it cannot be admitted): a
        # speed path the CPU tier offers beside the interface, not part of it.
        self._lookup_prefix = getattr(manager, "lookup_prefix", None)
        self.group_configs = group_configs
        full = [i for i, c in enumerate(group_configs) if c.sliding_window_size_in_chunks is None]
        windowed = sorted((i for i, c in enumerate(group_configs) if c.sliding_window_size_in_chunks is not None),
                          key=lambda i: group_configs[i].sliding_window_size_in_chunks or 0, reverse=True)
        self._full_attention_groups = tuple(full)
        self.sliding_window_groups = tuple(windowed)
        self._lookup_groups = self._full_attention_groups + self.sliding_window_groups
        mamba_sizes = {c.tokens_per_chunk for c in group_configs if c.requires_cow_source}
        assert len(mamba_sizes) <= 1
        self._mamba_align_size: int | None = mamba_sizes.pop() if mamba_sizes else None
        # The connector's chunks being loaded (None without GPU prefix caching), which it
        # fills and empties as loads start and finish.
        self._chunks_being_loaded = chunks_being_loaded

    def _maximal_prefix_lookup(self, keys, ctx) -> int | None:
        if self._lookup_prefix is not None:
            hits, pending = self._lookup_prefix(keys, ctx)
            return None if pending else hits
        hits = 0
        defer = False
        lookup = self.manager.lookup
        for key in keys:
            result = lookup(key, ctx)
            if result is LookupResult.HIT or result is LookupResult.HIT_PENDING:
                hits += 1
                defer |= result is LookupResult.HIT_PENDING
            elif result is LookupResult.RETRY:
                defer = True  # keep scanning so the manager can start its lookups
            else:
                break
        return None if defer else hits

    def _sliding_window_lookup(self, keys, window: int, ctx, initial_window: int | None) -> int | None:
        """End (in ``keys``) of the last run of ``window`` hits, scanning from the end; the
        first run may need a wider window for a partial right chunk. 0 on a miss, None if
        the manager asks to wait."""
        defer = False
        pending_in_window = False
        run = 0
        required = initial_window or window
        lookup = self.manager.lookup
        for idx in range(len(keys) - 1, -1, -1):
            result = lookup(keys[idx], ctx)
            if result is LookupResult.HIT:
                run += 1
            elif result is LookupResult.HIT_PENDING:
                pending_in_window = True
                run += 1
            elif result is LookupResult.RETRY:
                defer = True
                run = 0
                pending_in_window = False
                required = window
            else:
                run = 0
                pending_in_window = False
                required = window
            if run == required:
                return None if defer or pending_in_window else idx + required
        return None if defer or pending_in_window else run

    def num_hit_tokens(self, state: RequestOffloadState) -> int | None:
        """Tokens past ``state.num_locally_computed_tokens`` that every group hits in the
        tier, 0 on a miss, None when the request must wait (a chunk is being stored,
        promoted or loaded)."""
        num_computed = state.num_locally_computed_tokens
        max_hit = state.req.num_tokens
        if self.sliding_window_groups:
            # The last prompt token is recomputed for its logits; keep a hit after that.
            max_hit -= 1
            if self._mamba_align_size is not None:
                max_hit = max_hit // self._mamba_align_size * self._mamba_align_size
        num_hit_tokens = 0
        defer = False
        lookup_groups = self._lookup_groups
        ctx = state.req_context
        while lookup_groups:
            looked_up_sliding_window = False
            groups_iter = iter(lookup_groups)
            lookup_groups = ()
            for group_idx in groups_iter:
                config = self.group_configs[group_idx]
                group_state = state.group_states[group_idx]
                per_chunk = config.tokens_per_chunk
                keys = group_state.offload_keys
                max_hit = min(max_hit, len(keys) * per_chunk)
                if max_hit - num_computed < per_chunk:
                    return 0
                window = config.sliding_window_size_in_chunks
                num_chunks = min(cdiv(max_hit, per_chunk), len(keys))
                start_chunk = num_computed // per_chunk
                window_keys = keys[start_chunk:num_chunks]
                if window is None:
                    num_hit_chunks = self._maximal_prefix_lookup(window_keys, ctx)
                else:
                    candidate_end = min(max_hit, num_chunks * per_chunk)
                    num_hit_chunks = self._sliding_window_lookup(
                        window_keys, window, ctx, config.load_window_size_in_chunks(candidate_end))
                if num_hit_chunks == 0:
                    return 0
                if num_hit_chunks is None:
                    defer = True
                else:
                    max_hit = min(max_hit, per_chunk * (start_chunk + num_hit_chunks))
                new_num_hit_tokens = max_hit - num_computed
                if new_num_hit_tokens < per_chunk:
                    return 0
                if new_num_hit_tokens < num_hit_tokens:
                    if defer:
                        # Another pass over every group: do we still have to wait?
                        defer = False
                        lookup_groups = self._lookup_groups
                    elif looked_up_sliding_window and not lookup_groups:
                        # Confirm the windowed groups already looked up at the new length.
                        lookup_groups = self.sliding_window_groups
                looked_up_sliding_window |= window is not None
                num_hit_tokens = new_num_hit_tokens
        if defer:
            return None
        if self._chunks_being_loaded:
            end = num_computed + num_hit_tokens
            for config, group_state in zip(self.group_configs, state.group_states):
                window = config.load_window_size_in_chunks(end)
                keys = group_state.offload_keys[num_computed // config.tokens_per_chunk:
                                                cdiv(end, config.tokens_per_chunk)]
                if window is not None:
                    keys = keys[-window:]
                if any(key in self._chunks_being_loaded for key in keys):
                    return None  # another request is loading them: wait, then hit on the GPU
        return num_hit_tokens

    def hit_sources(self, state: RequestOffloadState, num_external_tokens: int) -> dict[str, int]:
        """The last load's ``num_external_tokens`` tokens by the tier each came from (the
        connector's ``get_external_cache_hit_sources``)."""
        start = state.num_locally_computed_tokens
        end = start + num_external_tokens
        events: list[tuple[int, int, str]] = [(end, 0, "unspecified")]
        for lo, hi, tier in self._load_source_runs(state, start, end):
            events.append((lo, 1, tier))
            events.append((hi, -1, tier))
        active: dict[str, int] = {}
        sources: dict[str, int] = {}
        position = start
        for boundary, delta, tier in sorted(events, key=lambda e: (e[0], e[1], _TIER_ORDER.get(e[2], 9))):
            if boundary > position:
                live = [t for t, n in active.items() if n > 0]
                outer = max(live, key=_TIER_ORDER.__getitem__) if live else "unspecified"
                sources[outer] = sources.get(outer, 0) + boundary - position
            active[tier] = active.get(tier, 0) + delta
            position = boundary
        return sources

    def _load_source_runs(self, state: RequestOffloadState, start: int, end: int) -> list[tuple[int, int, str]]:
        """The last load's key ranges clipped to ``[start, end)``, each with the tier its
        key came from; a range that continues the previous one from the same tier is
        merged into it (a group's chunks are consecutive). The tiers covering each token
        are the same either way, so the split by tier is too, with one sweep event per
        run instead of per key."""
        runs: list[tuple[int, int, str]] = []
        source = self.manager.get_load_source
        ctx = state.req_context
        run_lo = run_hi = 0
        run_tier: str | None = None
        for lo, hi, key in state.load_key_ranges:
            if lo < start:
                lo = start
            if hi > end:
                hi = end
            if lo >= hi:
                continue
            tier: str = source(key, ctx)
            if tier == run_tier and lo == run_hi:
                run_hi = hi
                continue
            if run_tier is not None:
                runs.append((run_lo, run_hi, run_tier))
            run_lo, run_hi, run_tier = lo, hi, tier
        if run_tier is not None:
            runs.append((run_lo, run_hi, run_tier))
        return runs
