"""The one pool of KV blocks that every group draws from.

docs/semantics.md#block-pool (vLLM ``BlockPool``, ``FreeKVCacheBlockQueue``, ``BlockHashToBlockMap``).
What matters for exactness, and what this module reproduces:

* block 0 is the null block: popped first, never handed out, cached or freed;
* the free queue's front is the eviction end: allocation pops from the front, a prefix
  hit unlinks a cached block from the middle, freed unhashed blocks go to the front and
  freed hashed blocks to the tail (the caller passes a request's blocks last-first);
* eviction is lazy: a freed cached block stays in the hash map, hittable, until
  ``get_new_blocks`` hands it out again;
* the hash map may hold several physical blocks under one key (no de-duplication, so
  block tables stay append-only); a lookup returns the first one inserted.

Keys are kept per group (one dict per KV cache group) instead of vLLM's
``hash + group_id`` bytes: the same token block cached in two groups is two entries, as
in vLLM, without building a key object on every lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from kvtwin.sim.core.hashing import BlockHashes, hashes_in_range


class KVCacheBlock:
    """One physical block: its id, how many block tables hold it, and its cache key."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "owner_group", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: object | None = None  # set while the block is in the hash map
        self.group_id = -1
        self.owner_group = -1  # the group that last took it from the pool (usage accounting)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks with O(1) pops, appends and middle removal."""

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block to pop")
        self._unlink(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        tail = self._tail
        last = tail.prev_free
        assert last is not None  # the sentinels are always linked
        count = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, keeping their order (``blocks[0]`` becomes the front)."""
        head = self._head
        for block in reversed(blocks):
            first = head.next_free
            assert first is not None
            head.next_free = block
            block.prev_free = head
            block.next_free = first
            first.prev_free = block
            self.num_free_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        prev_free, next_free = block.prev_free, block.next_free
        assert prev_free is not None and next_free is not None
        prev_free.next_free = next_free
        next_free.prev_free = prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def block_ids(self) -> list[int]:
        """Front-to-back ids (for tests and debugging; O(n))."""
        ids = []
        block = self._head.next_free
        while block is not self._tail and block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every block, the free queue and the per-group hash → block maps."""

    def __init__(self, num_blocks: int, num_groups: int, enable_caching: bool):
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # group id → {hash: block, or {block_id: block} when several blocks share a key}
        self.cached_block_hash_to_block: list[dict[object, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)]
        # Counters for the replay's per-step records: blocks in use per group, and cached
        # blocks evicted so far.
        self.num_used_by_group = [0] * num_groups
        self.num_evictions = 0
        # Bumped whenever a block returns to the free queue: lets the KV cache manager know
        # that a failed admission check would still fail (``KVCacheManager.still_blocked``).
        self.free_generation = 0

    # -- lookups -------------------------------------------------------------------

    def get_cached_block(self, block_hash: object, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for this hash, or None if any group misses."""
        found = []
        for gid in group_ids:
            entry = self.cached_block_hash_to_block[gid].get(block_hash)
            if entry is None:
                return None
            found.append(entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values())))
        return found

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def num_cached_blocks(self) -> int:
        """Distinct (hash, group) keys currently registered."""
        return sum(len(m) for m in self.cached_block_hash_to_block)

    # -- caching -------------------------------------------------------------------

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: BlockHashes, num_cached_blocks: int,
                          num_full_blocks: int, group_id: int, mask: list[bool] | None = None) -> None:
        """Register blocks ``[num_cached_blocks, num_full_blocks)`` of a table under their
        hashes; where ``mask`` (one flag per block of the range) is False, the block stays
        unhashed, as a null block does (docs/semantics.md#prefix-cache-retention)."""
        if num_cached_blocks >= num_full_blocks:
            return
        cache = self.cached_block_hash_to_block[group_id]
        hashes = hashes_in_range(block_hashes, num_cached_blocks, num_full_blocks)
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if mask is not None:
            # Masked-out blocks are dropped from both lists, so the dense loop below is the only one.
            hashes = [h for h, keep in zip(hashes, mask) if keep]
            new_blocks = [b for b, keep in zip(new_blocks, mask) if keep]
        for block, block_hash in zip(new_blocks, hashes):
            if block.is_null:
                continue
            block.block_hash = block_hash
            block.group_id = group_id
            # One probe of a dict that holds every cached block (setdefault, not get then set).
            entry = cache.setdefault(block_hash, block)
            if entry is block:
                continue
            if isinstance(entry, KVCacheBlock):
                cache[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        cache = self.cached_block_hash_to_block[block.group_id]
        entry = cache.get(block_hash)
        if entry is block:
            del cache[block_hash]
        elif entry is not None and type(entry) is dict:
            entry.pop(block.block_id, None)
            if not entry:
                del cache[block_hash]
        self.num_evictions += 1
        block.block_hash = None
        block.group_id = -1

    # -- allocation and freeing ------------------------------------------------------

    def get_new_blocks(self, num_blocks: int, group_id: int = 0) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their cache entries."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise RuntimeError(f"cannot get {num_blocks} free blocks from the pool ({queue.num_free_blocks} free)")
        # The pops are inlined (one relink of the head at the end): every block a replay
        # ever computes passes through here once.
        head = queue._head
        block = head.next_free
        blocks: list[KVCacheBlock] = []
        caches = self.cached_block_hash_to_block
        for _ in range(num_blocks):
            assert block is not None  # num_blocks <= num_free_blocks, checked above
            blocks.append(block)
            following = block.next_free
            block.prev_free = block.next_free = None
            block_hash = block.block_hash
            if block_hash is not None:
                cache = caches[block.group_id]
                # The common eviction (the key's only block), inlined, in one probe.
                entry = cache.pop(block_hash, None)
                if entry is block:
                    self.num_evictions += 1
                    block.block_hash = None
                    block.group_id = -1
                else:
                    if entry is not None:
                        cache[block_hash] = entry  # (several blocks share the key: put it back)
                    self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
            block.owner_group = group_id
            block = following
        assert block is not None
        head.next_free = block
        block.prev_free = head
        queue.num_free_blocks -= num_blocks
        self.num_used_by_group[group_id] += num_blocks
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks, reviving those that sat evictable in the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
                self.num_used_by_group[block.owner_group] += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching zero return to the free queue.

        Unhashed blocks go to the front (reused first, nothing to lose), hashed ones to the
        tail (kept longest so they can still be hit), each list in the given order.
        """
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        used = self.num_used_by_group
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                used[block.owner_group] -= 1
                if block.block_hash is None or not caching:
                    unhashed.append(block)
                else:
                    hashed.append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)
        if unhashed or hashed:
            self.free_generation += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no request holds a block."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        for cache in self.cached_block_hash_to_block:
            cache.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
        return True
