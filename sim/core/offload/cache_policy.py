"""The interface of the CPU offloading tier's replacement policies, and the chunk they manage.

vLLM 0.33's ``vllm/v1/kv_offload/cpu/policies/base.py``: ``ChunkStatus`` (one CPU chunk's
ref count and slot), ``CachePolicy`` (what a policy answers: lookups, insertions, the
request's accesses, eviction), and ``order_request_keys``, the head-to-tail order in which
a request's keys are handed to a policy. The policies themselves are ``lru_policy.py`` and
``arc_policy.py``; ``policies.py`` is their table.

``evict`` is atomic in every policy: it either drops exactly ``n`` unprotected idle chunks
or changes nothing and returns None.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtwin.sim.core.offload.base import OffloadKey, ReqContext


class ChunkStatus:
    """One CPU chunk's state: how many loads read it, and which buffer slot it is.

    ``ref_cnt`` is -1 while the store that fills the chunk is in flight (not readable),
    0 when idle (evictable), and the number of loads in flight otherwise.

    ``key``, ``rank`` and ``evictable`` belong to the LRU policy (vLLM keeps them in the
    policy's own ``_ranks`` dict and ``_evictable`` set): the key the chunk holds, its packed
    recency rank, and whether the policy was told it is idle. Kept on the chunk, a policy
    operation on a key costs one lookup in the big ``chunks`` dict, or none when the caller
    already holds the chunk. A chunk object holds one key for its whole life (a freed chunk
    id gets a new object), so a lazy eviction entry may point at the chunk itself.
    """

    __slots__ = ("ref_cnt", "chunk_id", "key", "rank", "evictable")

    def __init__(self, chunk_id: int):
        self.ref_cnt = -1
        self.chunk_id = chunk_id
        self.key: OffloadKey = ()
        self.rank = 0
        self.evictable = False

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


def _nondecreasing(values: list[int]) -> bool:
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return False
    return True


def sort_by_position(keys: Sequence[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """Keys head to tail by their end-token positions when every key has one, otherwise as
    given. Stable: keys at one position (one block in several groups) keep their order."""
    positions = req_context.offload_key_positions(keys)
    if positions is None:
        return list(keys)
    if _nondecreasing(positions):
        return list(keys)  # keys mostly arrive head to tail already: nothing to sort
    # Sorting indices by a list lookup ties like the keys' own stable sort, without
    # hashing every key again.
    order = sorted(range(len(positions)), key=positions.__getitem__)
    return [keys[i] for i in order]


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext) -> list[OffloadKey]:
    """All groups' keys head to tail: by end-token position when every key has one,
    otherwise group after group as given."""
    if len(key_groups) == 1:
        # One group comes already ordered by the same rule (the manager sorts each group).
        return list(key_groups[0])
    return sort_by_position([key for group in key_groups for key in group], req_context)


def scan_resident_prefix(get, keys) -> tuple[int, bool]:
    """``CachePolicy.resident_prefix`` with the lookup ``get`` given (a dict's own ``get``
    spares a method call per key)."""
    count = 0
    pending = False
    for key in keys:
        chunk = get(key)
        if chunk is None:
            break
        count += 1
        if chunk.ref_cnt < 0:  # not written yet
            pending = True
    return count, pending


class CachePolicy:
    """What a policy must answer; the manager owns ref counts and the chunk pool."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity
        # False where on_store_miss does nothing: the manager then keeps no record of a
        # request's store misses (which only spares a policy the same miss twice).
        self.observes_store_misses = True

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        raise NotImplementedError

    def resident_prefix(self, keys) -> tuple[int, bool]:
        """How many of ``keys``, from the first, are resident, and whether any of those is
        still being written: ``get`` until the first miss, in one loop."""
        return scan_resident_prefix(self.get, keys)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        raise NotImplementedError

    def insert_all(self, keys: list[OffloadKey], chunks: list[ChunkStatus], req_context: ReqContext) -> None:
        """``insert`` each key with its chunk, in order."""
        for i in range(len(keys)):
            self.insert(keys[i], chunks[i], req_context)

    def remove(self, key: OffloadKey) -> None:
        """Forget a chunk whose store failed (no ghost entry, no recency)."""
        raise NotImplementedError

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        raise NotImplementedError

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys a request offers that are absent, seen before they are inserted."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """A request's first sight of keys, before it finishes. The manager may leave out
        keys it knows to be absent: a first sight has no recency to change for them (ARC
        learns from absent keys through ``on_store_miss``)."""
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """Commit one request's accesses; ``key_groups`` are per group, head to tail."""
        for keys in key_groups:
            self.touch(keys, req_context)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def mark_evictable(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """The chunk's ref_cnt just became 0 (``chunk`` is ``get(key)``)."""
        return

    def mark_non_evictable(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """The chunk's ref_cnt just left 0 (``chunk`` is ``get(key)``)."""
        return

    def snapshot(self) -> dict:
        """The policy's order as plain data, for tests and diagnostics."""
        raise NotImplementedError


def chunk_row(key: OffloadKey, chunk: ChunkStatus) -> list:
    """One resident chunk in a policy's ``snapshot``: ``[key, chunk_id, ref_cnt]``."""
    return [list(key), chunk.chunk_id, chunk.ref_cnt]
