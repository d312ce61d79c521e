"""The scheduler-side manager of the CPU offloading tier: which blocks live in CPU memory.

Reproduces vLLM 0.33's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``)
decision for decision: the chunk pool (fresh chunk ids first, then the most recently
freed), ref counts that pin chunks during loads, the prepare/complete skeletons of loads
and stores, the per-request access record that feeds the cache policy (first sights in
prefix order, store misses once per request, reuse versus insertion at finish), the
eviction of exactly the missing number of chunks, never one of the keys being offered,
and ``reset_cache``. The replacement decisions are the policy's (``policies``).

The admission filter ``store_threshold >= 2`` (store a key only once it has been offered
that many times, counted in a bounded tracker) is supported as vLLM has it; the default
``store_threshold=1`` (vLLM's default) stores every absent key. Not modelled: KV events
(``take_events``), Prometheus stats and config info, out-of-tree policies, the
``lock`` (the simulator is single-threaded) and the worker side (transfers are described
by chunk ids only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.offload.base import (
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    offload_key_group,
)
from kvtwin.sim.core.offload.cache_policy import CachePolicy, ChunkStatus, sort_by_position
from kvtwin.sim.core.offload.policies import make_policy


class _RequestCacheAccess:
    """The keys one request has shown this manager, kept in the request's ReqContext.

    ``key_groups`` holds first sights per KV cache group in arrival order; at finish they
    are re-sorted by position (when all are known) and handed to the policy, with the
    keys this request only inserted told apart from the ready ones it reused. The record
    belongs to one manager and one cache generation: after ``reset_cache`` a request
    starts a fresh one.
    """

    __slots__ = ("owner", "cache_generation", "key_groups", "seen_keys", "inserted_keys",
                 "reused_keys", "store_miss_keys", "finished")

    def __init__(self, owner: object, cache_generation: int):
        self.owner = owner
        self.cache_generation = cache_generation
        self.key_groups: dict[int, list[OffloadKey]] = {}
        self.seen_keys: set[OffloadKey] = set()
        self.inserted_keys: set[OffloadKey] = set()
        self.reused_keys: set[OffloadKey] = set()
        self.store_miss_keys: set[OffloadKey] = set()
        self.finished = False


class CPUOffloadingManager:
    """``num_chunks`` CPU chunks (one offloaded block each) under one cache policy."""

    def __init__(self, num_chunks: int, policy: str = "lru", *, store_threshold: int = 1,
                 max_tracker_size: int = 64_000):
        require(isinstance(num_chunks, int) and num_chunks >= 0, "offload.num_chunks", "an integer >= 0", num_chunks)
        require(isinstance(store_threshold, int) and store_threshold >= 0, "offload.store_threshold",
                "an integer >= 0", store_threshold)
        self.num_chunks = num_chunks
        self.policy_name = policy
        self._policy = make_policy(policy, num_chunks)
        # Chunk ids below this have been handed out at least once since the last reset.
        self._num_allocated_chunks = 0
        self._free_list: list[int] = []
        self._num_evictable_chunks = 0
        self._num_write_pending_chunks = 0
        self._cache_generation = 0
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        # Offers per key, oldest first, for the admission filter (only when it is on).
        self._offer_counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        # Cumulative counters for metrics; they never feed a decision.
        self.num_stored_keys = 0  # keys given a chunk by prepare_store
        self.num_store_failed_keys = 0  # of those, dropped by complete_store(success=False)
        self.num_loaded_keys = 0  # keys pinned by prepare_load
        self.num_evicted_keys = 0
        self.num_skipped_store_keys = 0  # absent keys the admission filter turned away

    # --- counters -----------------------------------------------------------------

    @property
    def num_used_chunks(self) -> int:
        """Chunks that hold a key (pending, pinned or idle)."""
        return self._num_allocated_chunks - len(self._free_list)

    @property
    def num_evictable_chunks(self) -> int:
        return self._num_evictable_chunks

    @property
    def num_write_pending_chunks(self) -> int:
        return self._num_write_pending_chunks

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated_chunks

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    def counters(self) -> dict[str, int]:
        """The step columns of the CPU tier (reports/SCHEMA.md), cumulative but the chunks in use."""
        return {"offload_cpu_loaded_keys": self.num_loaded_keys, "offload_cpu_stored_keys": self.num_stored_keys,
                "offload_cpu_evicted_keys": self.num_evicted_keys, "offload_cpu_used_chunks": self.num_used_chunks}

    # --- chunk pool ---------------------------------------------------------------

    def _allocate_chunks(self, count: int) -> list[ChunkStatus]:
        # Never-used chunk ids first, in order; then the free list from its end, so the
        # chunk freed last is reused first.
        num_fresh = min(count, self.num_chunks - self._num_allocated_chunks)
        assert len(self._free_list) >= count - num_fresh, "chunk pool overcommitted"
        chunks = [ChunkStatus(self._num_allocated_chunks + i) for i in range(num_fresh)]
        self._num_allocated_chunks += num_fresh
        chunks += [ChunkStatus(self._free_list.pop()) for _ in range(count - num_fresh)]
        return chunks

    # --- the admission filter -----------------------------------------------------

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        counts = self._offer_counts
        assert counts is not None
        offered_known: set[OffloadKey] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered_known.add(key)
        # A full tracker drops its oldest entries for new keys, but never one of the
        # keys counted by this very offer.
        num_droppable = len(counts) - len(offered_known)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if num_droppable == 0:
                    continue
                counts.popitem(last=False)
                num_droppable -= 1
            counts[key] = 1

    # --- the per-request access record --------------------------------------------

    def _access_record(self, req_context: ReqContext) -> _RequestCacheAccess:
        state = req_context.get_state(_RequestCacheAccess)
        if state is None or state.owner is not self or state.cache_generation != self._cache_generation:
            state = _RequestCacheAccess(self, self._cache_generation)
            req_context.set_state(state)
        return state

    def _record_access(self, keys: Iterable[OffloadKey], req_context: ReqContext,
                       reused_keys: Collection[OffloadKey] = (), resident: list[bool] | None = None) -> None:
        """Note the request's first sights of ``keys`` and tell the policy. ``resident``,
        when given, says which of ``keys`` are in the cache: the policy is then shown only
        those (an absent key has no recency to update; its lookup in the big ``chunks``
        dict would be a cache miss), still in one call whenever there is a first sight."""
        state = self._access_record(req_context)
        seen_keys = state.seen_keys
        key_groups = state.key_groups
        first_sights = []
        any_first_sight = False
        group_idx = -1
        group: list[OffloadKey] = []
        for i, key in enumerate(keys):
            if key in seen_keys:
                continue
            assert not state.finished, f"request {req_context.req_id!r} showed a new key after it finished"
            # Offers come group by group: look the group's list up when the group changes.
            key_group = offload_key_group(key)
            if key_group != group_idx:
                group_idx = key_group
                found = key_groups.get(group_idx)
                if found is None:
                    key_groups[group_idx] = found = []
                group = found
            group.append(key)
            seen_keys.add(key)
            any_first_sight = True
            if resident is None or resident[i]:
                first_sights.append(key)
        if any_first_sight:
            self._policy.on_request_access(first_sights, req_context)
        # Reading back a chunk this request stored itself is not a reuse.
        if reused_keys:
            inserted_keys = state.inserted_keys
            state.reused_keys.update(key for key in reused_keys if key not in inserted_keys)

    # --- the manager interface ----------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access_record(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self._policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def lookup_prefix(self, keys, req_context: ReqContext) -> tuple[int, bool]:
        """``lookup`` of ``keys`` in order until the first MISS, in one call: (HIT or
        HIT_PENDING answers, whether any was HIT_PENDING). This tier never answers RETRY,
        and looking up changes nothing, so the connector's prefix scan may use it."""
        return self._policy.resident_prefix(keys)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> str:
        return "cpu"

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        """Pin ready chunks for reading; returns their chunk ids, in the keys' order."""
        chunk_ids = []
        policy = self._policy
        for key in keys:
            chunk = policy.get(key)
            assert chunk is not None, f"prepare_load of absent key {key!r}"
            assert chunk.is_ready, f"prepare_load of key {key!r} whose store is in flight"
            if chunk.ref_cnt == 0:
                policy.mark_non_evictable(key, chunk)
                self._num_evictable_chunks -= 1
            chunk.ref_cnt += 1
            chunk_ids.append(chunk.chunk_id)
        self.num_loaded_keys += len(chunk_ids)
        self._record_access(keys, req_context, reused_keys=keys)
        return chunk_ids

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        policy = self._policy
        for key in keys:
            chunk = policy.get(key)
            assert chunk is not None, f"complete_load of absent key {key!r}"
            assert chunk.ref_cnt > 0, f"complete_load of key {key!r} that no load pins"
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable_chunks += 1
                policy.mark_evictable(key, chunk)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Give each absent offered key a chunk, evicting idle chunks if needed.

        Returns None when not enough idle, unoffered chunks can be evicted; the pool and
        the resident keys are then unchanged, but the offer still counts as the request's
        access (its first sights, and ARC's ghost-hit adaptation), as in vLLM.
        """
        keys = list(keys)
        if self._offer_counts is not None:
            self._count_offers(keys)
        absent: list[OffloadKey] = []
        ready_present: list[OffloadKey] = []
        # The offered keys the request is credited with (absent or ready), in offer order,
        # and which of them are resident.
        accessed: list[OffloadKey] = []
        resident_flags: list[bool] = []
        policy = self._policy
        for key in keys:
            chunk = policy.get(key)
            if chunk is None:
                absent.append(key)
                accessed.append(key)
                resident_flags.append(False)
            elif chunk.is_ready:
                ready_present.append(key)
                accessed.append(key)
                resident_flags.append(True)
        # Keys whose store is in flight are neither: another request is writing them.

        resident: list[bool] | None = resident_flags
        if self._offer_counts is not None:
            admitted = [key for key in absent if self._offer_counts.get(key, 0) >= self.store_threshold]
            self.num_skipped_store_keys += len(absent) - len(admitted)
            if len(admitted) < len(absent):
                credited = set(admitted)
                credited.update(ready_present)
                accessed = [key for key in accessed if key in credited]
                resident = None  # the policy looks each first sight up itself
            absent = admitted

        state = self._access_record(req_context)
        if policy.observes_store_misses:
            new_misses = [key for key in absent if key not in state.store_miss_keys]
            if new_misses:
                # Before insertion, which drops ghost entries ARC must learn from first.
                policy.on_store_miss(new_misses, req_context)
                state.store_miss_keys.update(new_misses)

        self._record_access(accessed, req_context, reused_keys=ready_present, resident=resident)

        if not absent:
            return PrepareStoreOutput(keys_to_store=[], evicted_keys=[], chunk_ids=[])

        evicted_keys: list[OffloadKey] = []
        num_to_evict = len(absent) - self.num_free_chunks
        if num_to_evict > 0:
            if num_to_evict > self._num_evictable_chunks:
                return None
            evicted = policy.evict(num_to_evict, set(keys))
            if evicted is None:
                return None
            self._num_evictable_chunks -= len(evicted)
            for key, chunk in evicted:
                self._free_list.append(chunk.chunk_id)
                evicted_keys.append(key)
            self.num_evicted_keys += len(evicted)

        chunks = self._allocate_chunks(len(absent))
        policy.insert_all(absent, chunks, req_context)
        self._num_write_pending_chunks += len(absent)
        self.num_stored_keys += len(absent)
        state.inserted_keys.update(absent)
        return PrepareStoreOutput(keys_to_store=absent, evicted_keys=evicted_keys,
                                  chunk_ids=[chunk.chunk_id for chunk in chunks])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Make in-flight stores readable, or on failure free their chunks.

        Keys that are absent or already ready are ignored (another store finished them,
        or ``reset_cache`` dropped them).
        """
        policy = self._policy
        for key in keys:
            chunk = policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self._num_write_pending_chunks -= 1
            if success:
                chunk.ref_cnt = 0
                self._num_evictable_chunks += 1
                policy.mark_evictable(key, chunk)
            else:
                policy.remove(key)
                self._free_list.append(chunk.chunk_id)
                self.num_store_failed_keys += 1

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestCacheAccess)
        if (state is None or state.owner is not self or state.cache_generation != self._cache_generation
                or state.finished):
            return
        state.finished = True
        key_groups: list[list[OffloadKey]] = []
        for group_idx in sorted(state.key_groups):
            key_groups.append(sort_by_position(state.key_groups[group_idx], req_context))
        self._policy.on_request_finished(key_groups, state.inserted_keys - state.reused_keys,
                                         state.reused_keys, req_context)

    def on_schedule_end(self, context: object = None) -> None:
        return

    def has_pending_work(self) -> bool:
        return False

    def next_finish_s(self) -> float | None:
        """When the tier's own next transfer finishes on a timed clock: it has none."""
        return None

    def reset_cache(self) -> None:
        """Drop every chunk, pinned or in flight; the caller guarantees that no
        completion of a job started before the reset arrives afterwards."""
        self._policy.clear()
        self._cache_generation += 1
        self._num_evictable_chunks = 0
        self._num_write_pending_chunks = 0
        self._free_list.clear()
        self._num_allocated_chunks = 0
