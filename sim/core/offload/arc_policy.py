"""vLLM 0.33's ARC replacement policy for the CPU offloading tier
(``vllm/v1/kv_offload/cpu/policies/arc.py``), with the same observable decisions.

Adaptive replacement: T1 (seen once), T2 (reused), ghost lists B1 and B2 of recently
evicted keys, and ``target_t1_size`` moved by ghost hits on stores. Storing never promotes;
a request's reuse of a ready chunk promotes it once, when the request finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvtwin.sim.core.offload.base import OffloadKey, ReqContext
from kvtwin.sim.core.offload.cache_policy import CachePolicy, ChunkStatus, chunk_row, order_request_keys


def _last_first(keys: Iterable[OffloadKey]) -> list[OffloadKey]:
    """``keys`` tail first (a list, not ``reversed``: mypyc cannot iterate that over keys)."""
    out = list(keys)
    out.reverse()
    return out


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
            "t1": [chunk_row(key, chunk) for key, chunk in self.t1.items()],
            "t2": [chunk_row(key, chunk) for key, chunk in self.t2.items()],
            "b1": [list(key) for key in self.b1],
            "b2": [list(key) for key in self.b2],
            "target_t1_size": float(self.target_t1_size),
        }
