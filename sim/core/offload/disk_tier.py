"""The disk tier below the CPU tier (``tiered_manager.py``): a bounded chunk pool under a
cache policy, and the view of a request's context that its policy sees.

vLLM's filesystem tier (``vllm/v1/kv_offload/tiering/fs/``) is unbounded; here the disk
holds a fixed number of chunks under the CPU tier's policy classes (``policies.py``), and a
write that finds it full evicts idle chunks or drops the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtwin.sim.core.offload.base import OffloadKey, ReqContext
from kvtwin.sim.core.offload.cache_policy import ChunkStatus
from kvtwin.sim.core.offload.policies import make_policy


class DiskView(ReqContext):
    """One write batch (or one promotion) as the disk policy sees it: the request's key
    positions, but state slots of its own. A fresh view per call gives each write batch a
    fresh LRU request rank, and never overwrites the CPU policy's slot of the same type
    (LRU's request rank) in the request's own context."""

    __slots__ = ("_base",)

    def __init__(self, base: ReqContext):
        super().__init__(base.req_id)
        self._base = base

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._base.get_offload_key_position(key)

    def offload_key_positions(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        return self._base.offload_key_positions(keys)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._base.set_offload_key_position(key, end_token)


class DiskTier:
    """``num_chunks`` disk chunks under a policy; ``ChunkStatus.ref_cnt`` is -1 while a
    write is in flight, 0 when idle, the number of promotions reading it otherwise."""

    def __init__(self, num_chunks: int, policy: str):
        self.num_chunks = num_chunks
        self.policy = make_policy(policy, num_chunks)
        self._num_allocated = 0
        self._free_list: list[int] = []
        self.num_evictable = 0

    @property
    def num_used_chunks(self) -> int:
        return self._num_allocated - len(self._free_list)

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_list) + self.num_chunks - self._num_allocated

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.policy.get(key)

    def allocate(self, keys: list[OffloadKey], protected: set[OffloadKey],
                 ctx: ReqContext) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """Give a chunk (not yet ready) to as many of ``keys`` (absent ones) as fit, head
        first, evicting idle unprotected chunks; returns (written, evicted)."""
        idle_protected = sum(1 for key in protected if (c := self.policy.get(key)) is not None and c.ref_cnt == 0)
        fit = min(len(keys), self.num_free_chunks + self.num_evictable - idle_protected)
        keys = keys[:max(fit, 0)]
        evicted_keys: list[OffloadKey] = []
        if not keys:
            return [], evicted_keys
        self.policy.on_store_miss(keys, ctx)
        num_to_evict = len(keys) - self.num_free_chunks
        if num_to_evict > 0:
            evicted = self.policy.evict(num_to_evict, protected)
            assert evicted is not None, "disk eviction failed with enough idle chunks"
            self.num_evictable -= len(evicted)
            for key, chunk in evicted:
                self._free_list.append(chunk.chunk_id)
                evicted_keys.append(key)
        num_fresh = min(len(keys), self.num_chunks - self._num_allocated)
        chunks = [ChunkStatus(self._num_allocated + i) for i in range(num_fresh)]
        self._num_allocated += num_fresh
        chunks += [ChunkStatus(self._free_list.pop()) for _ in range(len(keys) - num_fresh)]
        for key, chunk in zip(keys, chunks):
            self.policy.insert(key, chunk, ctx)
        return keys, evicted_keys

    def complete_write(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.ref_cnt == -1, f"disk write of {key!r} finished twice"
            chunk.ref_cnt = 0
            self.num_evictable += 1
            self.policy.mark_evictable(key, chunk)

    def pin(self, key: OffloadKey) -> None:
        chunk = self.policy.get(key)
        assert chunk is not None and chunk.is_ready, f"disk read of {key!r}, which is not on disk"
        if chunk.ref_cnt == 0:
            self.policy.mark_non_evictable(key, chunk)
            self.num_evictable -= 1
        chunk.ref_cnt += 1

    def unpin(self, key: OffloadKey) -> None:
        chunk = self.policy.get(key)
        assert chunk is not None and chunk.ref_cnt > 0, f"disk read of {key!r} finished twice"
        chunk.ref_cnt -= 1
        if chunk.ref_cnt == 0:
            self.num_evictable += 1
            self.policy.mark_evictable(key, chunk)
