"""Replacement policies of the CPU offloading tier: which resident chunk to drop next.

Reproduces vLLM 0.33's ``vllm/v1/kv_offload/cpu/policies`` (``base.py``, ``lru.py``,
``arc.py``, the name registry of ``factory.py``) with the same observable decisions:

* ``LRUCachePolicy`` — recency as a rank per key, evictable keys as lazily invalidated
  ``(rank, key)`` entries, popped least first (vLLM's min-heap; here a FIFO for entries that
  arrive in order, a heap for the rest). The rank and the evictable flag live on the
  ``ChunkStatus`` (vLLM: a dict and a set beside the chunks), one lookup per key. A running
  request holds one provisional rank for all its keys, ordered ``(request_rank,
  -end_token)`` so its tail goes before its head; finishing the request gives its keys
  fresh ranks tail-first. Pinning a chunk does not change its rank, so a chunk released
  after a transfer keeps the recency its request gave it.
* ``ARCCachePolicy`` — adaptive replacement: T1 (seen once), T2 (reused), ghost lists B1
  and B2 of recently evicted keys, and ``target_t1_size`` moved by ghost hits on stores.
  Storing never promotes; a request's reuse of a ready chunk promotes it once, when the
  request finishes.

``evict`` is atomic in both: it either drops exactly ``n`` unprotected idle chunks or
changes nothing and returns None.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from kvtwin.sim.core.errors import ConfigError
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


def _last_first(keys: Iterable[OffloadKey]) -> list[OffloadKey]:
    """``keys`` tail first (a list, not ``reversed``: mypyc cannot iterate that over keys)."""
    out = list(keys)
    out.reverse()
    return out


def _resident_prefix(get, keys) -> tuple[int, bool]:
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
        return _resident_prefix(self.get, keys)

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


def _chunk_row(key: OffloadKey, chunk: ChunkStatus) -> list:
    return [list(key), chunk.chunk_id, chunk.ref_cnt]


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
        return _resident_prefix(self.chunks.get, keys)  # the dict's own get: no method call per key

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
        return {"lru": [_chunk_row(key, self.chunks[key]) for key in order]}


class ARCCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        # A ghost hit in B1 says T1 was too small, in B2 that T2 was; the step is
        # larger when the other ghost list is longer (ARC's delta rule).
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in _last_first(keys):
            self._adapt_to_ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in _last_first(keys):
            if key in self.t1:
                chunk = self.t1.pop(key)
                if chunk.is_ready:
                    self.t2[key] = chunk
                else:
                    # Still being written: the store was its only use so far.
                    self.t1[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt_to_ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for key in _last_first(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:
                # Storing is not a second use: refresh recency, keep the list.
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused_keys:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        # Choose all n first, against a T1 size that shrinks as T1 victims are chosen;
        # each list is scanned once from its LRU end, so a list passed over as empty
        # stays passed over for the rest of this eviction.
        t1_scan: Iterator[tuple[OffloadKey, ChunkStatus]] = iter(self.t1.items())
        t2_scan: Iterator[tuple[OffloadKey, ChunkStatus]] = iter(self.t2.items())

        def next_idle(scan: Iterator[tuple[OffloadKey, ChunkStatus]]) -> tuple[OffloadKey, ChunkStatus] | None:
            for key, chunk in scan:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        chosen: list[tuple[OffloadKey, ChunkStatus, bool]] = []
        t1_size = len(self.t1)
        for _ in range(n):
            pick = None
            if t1_size >= int(self.target_t1_size):
                found = next_idle(t1_scan)
                if found is not None:
                    pick = (*found, True)
                    t1_size -= 1
            if pick is None:
                found = next_idle(t2_scan)
                if found is not None:
                    pick = (*found, False)
            if pick is None:
                found = next_idle(t1_scan)
                if found is None:
                    return None
                pick = (*found, True)
                t1_size -= 1
            chosen.append(pick)

        evicted = []
        for key, chunk, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            evicted.append((key, chunk))
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.cache_capacity):
                ghosts.popitem(last=False)
        return evicted

    def snapshot(self) -> dict:
        """T1/T2 as ``[key, chunk_id, ref_cnt]`` and B1/B2 as keys, LRU end first."""
        return {
            "t1": [_chunk_row(key, chunk) for key, chunk in self.t1.items()],
            "t2": [_chunk_row(key, chunk) for key, chunk in self.t2.items()],
            "b1": [list(key) for key in self.b1],
            "b2": [list(key) for key in self.b2],
            "target_t1_size": float(self.target_t1_size),
        }


POLICIES = ("lru", "arc")
_POLICY_CLASSES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    try:
        cls = _POLICY_CLASSES[name]
    except KeyError:
        raise ConfigError("offload.cache_policy", f"one of {', '.join(POLICIES)}", name) from None
    return cls(cache_capacity=capacity)
