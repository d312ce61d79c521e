"""vLLM 0.33's LRU replacement policy for the CPU offloading tier
(``vllm/v1/kv_offload/cpu/policies/lru.py``), with the same observable decisions.

Recency is a rank per key; evictable keys are lazily invalidated ``(rank, key)`` entries,
popped least first (vLLM's min-heap; here a FIFO for entries that arrive in order, a heap
for the rest). The rank and the evictable flag live on the ``ChunkStatus`` (vLLM: a dict
and a set beside the chunks), one lookup per key. A running request holds one provisional
rank for all its keys, ordered ``(request_rank, -end_token)`` so its tail goes before its
head; finishing the request gives its keys fresh ranks tail-first. Pinning a chunk does not
change its rank, so a chunk released after a transfer keeps the recency its request gave
it. ``tests/sim/offload/test_lru_reference.py`` checks it against the rule stated plainly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from kvtwin.sim.core.offload.base import OffloadKey, ReqContext
from kvtwin.sim.core.offload.cache_policy import (CachePolicy, ChunkStatus, chunk_row, order_request_keys,
                                                  scan_resident_prefix)


class _RequestRank:
    """The LRU rank one request's keys share while it runs (kept in its ReqContext)."""

    __slots__ = ("owner", "cache_generation", "rank")

    def __init__(self, owner: object, cache_generation: int, rank: int):
        self.owner = owner
        self.cache_generation = cache_generation
        self.rank = rank


# When a part of the eviction order is compacted (stale entries dropped). The heap's entries
# mostly go stale (a running request's provisional ranks, replaced by fresh ones when it
# finishes) and few stay live, so it is compacted once _HEAP_GROWTH times as long as after its
# last compaction: short, and each entry checked about once. The FIFO mostly empties from its
# front (evictions), so it is compacted only once it is twice as long as there are evictable
# keys (at least half stale). That only decides when stale entries are dropped, which cannot
# reorder the distinct live entries. (vLLM rebuilds its one heap at other moments, e.g. when
# a quarter of the evictable keys change rank at once; by the same argument that decides
# nothing.)
_MIN_COMPACT_LEN: Final = 64
_HEAP_GROWTH: Final = 8

# The heap of out-of-order entries: two parallel lists, ``ranks[i]`` and ``chunks[i]`` (the
# entry ``(ranks[i], chunks[i].key)``), kept as a binary min-heap by the functions below. No
# entry object is allocated (a tuple per entry fed the garbage collector), and comparisons
# are of native ints, the key only on a rank tie. Which of two equal entries comes first
# decides nothing (equal entries are one key at one rank), so any correct heap pops the
# distinct entries in the same order as heapq did.


def _entry_less(rank_a: int, chunk_a: ChunkStatus, rank_b: int, chunk_b: ChunkStatus) -> bool:
    return rank_a < rank_b or (rank_a == rank_b and chunk_a.key < chunk_b.key)


def _heap_push(ranks: list[int], chunks: list[ChunkStatus], rank: int, chunk: ChunkStatus) -> None:
    ranks.append(rank)
    chunks.append(chunk)
    pos = len(ranks) - 1
    while pos > 0:
        parent = (pos - 1) >> 1
        if not _entry_less(rank, chunk, ranks[parent], chunks[parent]):
            break
        ranks[pos] = ranks[parent]
        chunks[pos] = chunks[parent]
        pos = parent
    ranks[pos] = rank
    chunks[pos] = chunk


def _heap_sift_down(ranks: list[int], chunks: list[ChunkStatus], pos: int, rank: int, chunk: ChunkStatus) -> None:
    """Put the entry ``(rank, chunk)`` at ``pos`` and move it down into heap order."""
    n = len(ranks)
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        right = child + 1
        if right < n and _entry_less(ranks[right], chunks[right], ranks[child], chunks[child]):
            child = right
        if not _entry_less(ranks[child], chunks[child], rank, chunk):
            break
        ranks[pos] = ranks[child]
        chunks[pos] = chunks[child]
        pos = child
    ranks[pos] = rank
    chunks[pos] = chunk


def _heap_remove_top(ranks: list[int], chunks: list[ChunkStatus]) -> None:
    rank = ranks.pop()
    chunk = chunks.pop()
    if ranks:
        _heap_sift_down(ranks, chunks, 0, rank, chunk)


def _is_live(rank: int, chunk: ChunkStatus) -> bool:
    """Whether the entry ``(rank, chunk)`` still stands: the chunk is idle at this very rank
    (an evicted chunk never is)."""
    return chunk.rank == rank and chunk.evictable


def _live_entries(ranks: list[int], chunks: list[ChunkStatus], start: int) -> tuple[list[int], list[ChunkStatus]]:
    """The live entries from ``start`` on, in their order, one per chunk (a chunk's live
    entries are equal: each carries its current rank)."""
    live_ranks: list[int] = []
    live_chunks: list[ChunkStatus] = []
    kept: set[OffloadKey] = set()
    for i in range(start, len(chunks)):
        chunk = chunks[i]
        rank = ranks[i]
        if _is_live(rank, chunk) and chunk.key not in kept:
            kept.add(chunk.key)
            live_ranks.append(rank)
            live_chunks.append(chunk)
    return live_ranks, live_chunks


def _heapify(ranks: list[int], chunks: list[ChunkStatus]) -> None:
    for pos in range(len(ranks) // 2 - 1, -1, -1):
        _heap_sift_down(ranks, chunks, pos, ranks[pos], chunks[pos])


# vLLM ranks a key by the pair ``(rank, -end_token)``; here the pair is packed into one int
# that orders the same way, so the heap compares ints instead of nested tuples. End tokens
# stay below ``_POSITION_SPAN`` (far above any max_model_len).
_POSITION_SPAN: Final = 2_147_483_648  # 2**31
_RANK_STRIDE: Final = 4_294_967_296  # 2 * _POSITION_SPAN


def packed_rank(rank: int, end_token: int) -> int:
    """``(rank, -end_token)`` as one int: a fresh rank is ``packed_rank(rank, 0)``. (The
    policy keeps its counter packed, so it only adds: ``_new_rank``.)"""
    return rank * _RANK_STRIDE + _POSITION_SPAN - end_token


class LRUCachePolicy(CachePolicy):
    """vLLM's LRU: evict the idle key of least rank, ``(rank, key)`` breaking ties.

    Each chunk carries its key's rank and whether it is evictable (``ChunkStatus``). The
    evictable keys' ``(rank, key)`` entries are kept lazily (an entry is stale once its
    chunk's rank changes, or the chunk stops being evictable or leaves the cache) in two
    places whose union is what vLLM's single heap holds: a FIFO of entries pushed in
    nondecreasing order, and a heap for the rest. Fresh ranks only grow, so the entries of
    finished requests (most of them) queue in order and leave from the front; only ranks
    given out of order (a running request's provisional ranks, a pinned chunk released)
    need the heap. Eviction takes the least of the two fronts, which pops the union in the
    heap's order.

    The FIFO is two parallel lists read from ``_fifo_head`` on: the ranks, and the chunks
    (whose ``key`` completes the entry); the heap is two such lists too (``_heap_push``).
    Neither allocates an entry object, so queueing a key feeds the garbage collector
    nothing. An entry is live while its chunk is evictable at the entry's rank."""

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._num_evictable = 0
        self._heap_ranks: list[int] = []  # the heap (_heap_push)
        self._heap_chunks: list[ChunkStatus] = []
        self._fifo_ranks: list[int] = []  # nondecreasing with the keys, from _fifo_head on
        self._fifo_chunks: list[ChunkStatus] = []
        self._fifo_head = 0
        self._heap_compact_len = _MIN_COMPACT_LEN  # the heap's length at its next compaction
        self._next_packed_rank = _POSITION_SPAN  # packed_rank(0, 0): no rank given yet
        self._cache_generation = 0
        self.observes_store_misses = False  # on_store_miss: nothing to do

    def _new_rank(self) -> int:
        """The next rank ``r``, as ``packed_rank(r, 0)`` (by addition alone)."""
        self._next_packed_rank += _RANK_STRIDE
        return self._next_packed_rank

    def _request_rank(self, req_context: ReqContext) -> int:
        """The packed rank (end token 0) this request's keys share while it runs."""
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.cache_generation != self._cache_generation:
            state = _RequestRank(self, self._cache_generation, self._new_rank())
            req_context.set_state(state)
        return state.rank

    # -- the eviction order ----------------------------------------------------------

    def _push(self, chunk: ChunkStatus) -> None:
        """Queue the evictable chunk's entry ``(chunk.rank, chunk.key)``."""
        rank = chunk.rank
        fifo_ranks = self._fifo_ranks
        if self._fifo_head < len(fifo_ranks):
            last_rank = fifo_ranks[-1]
            # Out of order against the FIFO's back: into the heap.
            if rank < last_rank or (rank == last_rank and chunk.key < self._fifo_chunks[-1].key):
                _heap_push(self._heap_ranks, self._heap_chunks, rank, chunk)
                return
        fifo_ranks.append(rank)
        self._fifo_chunks.append(chunk)

    def _heap_goes_first(self) -> bool:
        """Whether the heap's front entry is the least of the two fronts (both non-empty).
        Ties go to the heap, as they did when the FIFO's entries were tuples."""
        head = self._fifo_head
        return not _entry_less(self._fifo_ranks[head], self._fifo_chunks[head],
                               self._heap_ranks[0], self._heap_chunks[0])

    def _maybe_compact(self) -> None:
        if len(self._heap_ranks) >= self._heap_compact_len:
            self._compact_heap()
        num_in_fifo = len(self._fifo_ranks) - self._fifo_head
        if num_in_fifo >= _MIN_COMPACT_LEN and num_in_fifo >= 2 * self._num_evictable:
            self._compact_fifo()
        elif self._fifo_head >= _MIN_COMPACT_LEN and 2 * self._fifo_head >= len(self._fifo_ranks):
            # Mostly popped: drop the consumed front so the lists stay short.
            del self._fifo_ranks[:self._fifo_head]
            del self._fifo_chunks[:self._fifo_head]
            self._fifo_head = 0

    def _compact_heap(self) -> None:
        """Keep the heap's live entries, one per chunk, and restore heap order."""
        ranks, live = _live_entries(self._heap_ranks, self._heap_chunks, 0)
        _heapify(ranks, live)
        self._heap_ranks = ranks
        self._heap_chunks = live
        self._heap_compact_len = max(_MIN_COMPACT_LEN, _HEAP_GROWTH * len(live))

    def _compact_fifo(self) -> None:
        """Keep the FIFO's live entries, one per chunk, in their order."""
        self._fifo_ranks, self._fifo_chunks = _live_entries(self._fifo_ranks, self._fifo_chunks, self._fifo_head)
        self._fifo_head = 0

    def _give_fresh_ranks(self, keys: list[OffloadKey]) -> None:
        """Fresh ranks to ``keys`` from the last to the first: the last one given is the
        most recent, so callers pass keys head to tail. Ranks are consecutive, so they are
        counted here rather than asked for one by one; each exceeds every rank given
        before, so its entry joins the FIFO at the back."""
        chunks = self.chunks
        fifo_ranks = self._fifo_ranks
        fifo_chunks = self._fifo_chunks
        rank = self._next_packed_rank
        for i in range(len(keys) - 1, -1, -1):
            chunk = chunks.get(keys[i])
            if chunk is None:
                continue
            rank += _RANK_STRIDE
            chunk.rank = rank
            if chunk.evictable:
                fifo_ranks.append(rank)
                fifo_chunks.append(chunk)
        self._next_packed_rank = rank
        self._maybe_compact()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def resident_prefix(self, keys) -> tuple[int, bool]:
        return scan_resident_prefix(self.chunks.get, keys)  # the dict's own get: no method call per key

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.insert_all([key], [chunk], req_context)

    def insert_all(self, keys: list[OffloadKey], chunks: list[ChunkStatus], req_context: ReqContext) -> None:
        """Each key into the cache with its chunk, in order: a key with a position ranks
        at the request's rank less it (the rank looked up once, when the first such key
        needs it), one without takes a fresh rank; an idle chunk queues for eviction."""
        positions = req_context.offload_key_positions(keys)
        request_rank = -1
        for i in range(len(keys)):
            key = keys[i]
            chunk = chunks[i]
            self.chunks[key] = chunk
            chunk.key = key
            position = positions[i] if positions is not None else req_context.get_offload_key_position(key)
            if position is None:
                chunk.rank = self._new_rank()
            else:
                if request_rank < 0:
                    request_rank = self._request_rank(req_context)
                chunk.rank = request_rank - position
            if chunk.ref_cnt == 0:
                chunk.evictable = True
                self._num_evictable += 1
                self._push(chunk)

    def remove(self, key: OffloadKey) -> None:
        chunk = self.chunks.pop(key)
        if chunk.evictable:
            chunk.evictable = False
            self._num_evictable -= 1

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._give_fresh_ranks(list(keys))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: vLLM's LRU touches store misses, but they are absent keys, which have
        no recency to refresh."""
        return

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        request_rank = self._request_rank(req_context)
        get_position = req_context.get_offload_key_position
        chunks = self.chunks
        for key in keys:
            chunk = chunks.get(key)  # None: not resident
            if chunk is None:
                continue
            position = get_position(key)
            if position is None:
                continue
            rank = request_rank - position
            # Never move a key back in time: a key already ranked by a later request
            # (or a later position of this one) keeps its rank.
            if chunk.rank >= rank:
                continue
            chunk.rank = rank
            if chunk.evictable:
                self._push(chunk)
        self._maybe_compact()

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        if len(key_groups) == 1:
            # One group comes already ordered (order_request_keys): no copy of a list.
            keys = key_groups[0]
            self._give_fresh_ranks(keys if isinstance(keys, list) else list(keys))
        else:
            self._give_fresh_ranks(order_request_keys(key_groups, req_context))

    def clear(self) -> None:
        for chunk in self.chunks.values():
            chunk.evictable = False  # a caller's chunk object outlives the cache
        self.chunks.clear()
        self._num_evictable = 0
        self._heap_ranks.clear()
        self._heap_chunks.clear()
        self._fifo_ranks.clear()
        self._fifo_chunks.clear()
        self._fifo_head = 0
        self._heap_compact_len = _MIN_COMPACT_LEN
        self._next_packed_rank = _POSITION_SPAN  # packed_rank(0, 0): no rank given yet
        self._cache_generation += 1

    def _pop_live(self) -> ChunkStatus | None:
        """Pop the least entry of the FIFO and the heap together; the chunk when the entry
        is live (the chunk is idle at that rank), None when it is stale. (Call only with an
        entry left.)"""
        if self._heap_ranks and (self._fifo_head == len(self._fifo_ranks) or self._heap_goes_first()):
            rank = self._heap_ranks[0]
            chunk = self._heap_chunks[0]
            _heap_remove_top(self._heap_ranks, self._heap_chunks)
        else:
            head = self._fifo_head
            self._fifo_head = head + 1
            rank = self._fifo_ranks[head]
            chunk = self._fifo_chunks[head]
        return chunk if _is_live(rank, chunk) else None

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        selected: list[ChunkStatus] = []
        selected_keys: set[OffloadKey] = set()
        skipped: list[ChunkStatus] = []
        while len(selected) < n and (self._heap_ranks or self._fifo_head < len(self._fifo_ranks)):
            chunk = self._pop_live()
            if chunk is None:
                continue
            key = chunk.key
            # A chunk pinned and released without a rank change has two equal live
            # entries; it is still one chunk.
            if key in selected_keys:
                continue
            if key in protected:
                skipped.append(chunk)
                continue
            assert chunk.ref_cnt == 0, f"evictable chunk {key!r} is in use"
            selected.append(chunk)
            selected_keys.add(key)

        # The entries popped and not taken go back (into the heap: live, so their rank
        # is still the chunk's).
        if len(selected) < n:
            skipped += selected
            selected = []
        for chunk in skipped:
            _heap_push(self._heap_ranks, self._heap_chunks, chunk.rank, chunk)
        if not selected:
            return None

        evicted = []
        for chunk in selected:
            chunk.evictable = False
            del self.chunks[chunk.key]
            evicted.append((chunk.key, chunk))
        self._num_evictable -= len(selected)
        self._maybe_compact()
        return evicted

    def mark_evictable(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        chunk.evictable = True
        self._num_evictable += 1
        self._push(chunk)
        self._maybe_compact()

    def mark_non_evictable(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        chunk.evictable = False
        self._num_evictable -= 1

    def snapshot(self) -> dict:
        """Resident chunks from least to most recent (``[key, chunk_id, ref_cnt]``)."""
        order = sorted(self.chunks, key=lambda key: (self.chunks[key].rank, key))
        return {"lru": [chunk_row(key, self.chunks[key]) for key in order]}
