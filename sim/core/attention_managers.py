"""The attention managers (docs/semantics.md#single-type-managers; vLLM
``single_type_kv_cache_manager.py``).

* Full attention: left-to-right hit scan, nothing freed early.
* Sliding window: a hit needs ``cdiv(window - 1, block_size)`` contiguous cached blocks,
  found right to left; blocks that slid out of the window become the null block.
* Chunked local: blocks before the current chunk are free hits and are dropped early.
"""

from __future__ import annotations

from kvtwin.sim.core.block_pool import BlockPool, KVCacheBlock
from kvtwin.sim.core.hashing import hashes_in_range
from kvtwin.sim.core.retention import sliding_window_mask
from kvtwin.sim.core.single_type_manager import SingleTypeKVCacheManager
from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, SlidingWindowSpec, cdiv

class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, alignment_tokens):
        computed: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        block_size = spec.block_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        if len(group_ids) == 1:
            # The common case, without the per-group list building.
            cache = block_pool.cached_block_hash_to_block[group_ids[0]]
            out = computed[0]
            start = 0
            while start < max_num_blocks:
                # Hashes in growing runs: a miss usually comes early or not at all.
                stop = min(max_num_blocks, start + max(64, start))
                for block_hash in hashes_in_range(block_hashes, start, stop):
                    entry = cache.get(block_hash)
                    if entry is None:
                        return cls._aligned(computed, block_size, alignment_tokens)  # chained: nothing later hits
                    out.append(entry if type(entry) is KVCacheBlock else next(iter(entry.values())))
                start = stop
        else:
            for i in range(max_num_blocks):
                hit = block_pool.get_cached_block(block_hashes[i], group_ids)
                if hit is None:
                    break
                for blocks, block in zip(computed, hit):
                    blocks.append(block)
        return cls._aligned(computed, block_size, alignment_tokens)

    @staticmethod
    def _aligned(computed: list[list[KVCacheBlock]], block_size: int, alignment_tokens: int):
        hit_length = len(computed[0]) * block_size
        if alignment_tokens != block_size and hit_length % alignment_tokens:
            hit_length = hit_length // alignment_tokens * alignment_tokens
            for blocks in computed:
                del blocks[hit_length // block_size:]
        return computed, hit_length


class SlidingWindowManager(SingleTypeKVCacheManager):
    spec: SlidingWindowSpec

    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int, enable_caching: bool,
                 hash_block_size: int, max_admission_blocks_per_request: int | None = None):
        super().__init__(spec, block_pool, group_id, enable_caching, hash_block_size,
                         max_admission_blocks_per_request)
        # The next token attends the last `window` tokens including itself; a multi-module
        # MTP drafter's re-prefillable tail is kept below that (docs/semantics.md#sliding-window).
        self.num_retained_tokens = spec.num_retained_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.num_retained_tokens)

    def _skip_horizon(self, request_id: str, table: list[KVCacheBlock]) -> int:
        # One more block drops once computed - retained reaches the end of the next block.
        return (self._leading_nulls(request_id, table) + 1) * self.block_size + self.num_retained_tokens

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, spec, retention_interval, boundaries,
                             final_segment_end_block=None):
        assert isinstance(spec, SlidingWindowSpec)
        return sliding_window_mask(start_block, end_block, alignment_tokens, spec.sliding_window, spec.block_size,
                                   retention_interval, boundaries, final_segment_end_block)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, alignment_tokens):
        assert isinstance(spec, SlidingWindowSpec)
        block_size = spec.block_size
        num_needed = cdiv(spec.sliding_window - 1, block_size)
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        computed: list[list[KVCacheBlock]] = [[null] * max_num_blocks for _ in group_ids]
        run = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(block_hashes[i], group_ids)
            if hit is None:
                run = 0
                continue
            for blocks, block in zip(computed, hit):
                blocks[i] = block
            run += 1
            if run >= num_needed and (alignment_tokens == block_size
                                      or (i + run) * block_size % alignment_tokens == 0):
                for blocks in computed:
                    del blocks[i + run:]
                match_found = True
                break
        if not match_found:
            # A run that starts at block 0 is a valid hit even if shorter than the window.
            for blocks in computed:
                del blocks[run:]
            if alignment_tokens != block_size:
                keep = run * block_size // alignment_tokens * alignment_tokens // block_size
                for blocks in computed:
                    del blocks[keep:]
        return computed, len(computed[0]) * block_size


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    spec: ChunkedLocalAttentionSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.spec.attention_chunk_size
        return num_computed_tokens // chunk * chunk

    def _skip_horizon(self, request_id: str, table: list[KVCacheBlock]) -> int:
        # Blocks drop when a chunk boundary passes the end of the next block.
        chunk = self.spec.attention_chunk_size
        return cdiv((self._leading_nulls(request_id, table) + 1) * self.block_size, chunk) * chunk

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, alignment_tokens):
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        block_size = spec.block_size
        chunk = spec.attention_chunk_size
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        # Blocks of earlier chunks are never read again: they count as hits for free.
        start_block = (max_length // chunk * chunk) // block_size if max_length > 0 else 0
        start_block = min(start_block, max_num_blocks)
        null = block_pool.null_block
        computed: list[list[KVCacheBlock]] = [[null] * start_block for _ in group_ids]
        for i in range(start_block, max_num_blocks):
            hit = block_pool.get_cached_block(block_hashes[i], group_ids)
            if hit is None:
                break
            for blocks, block in zip(computed, hit):
                blocks.append(block)
        return computed, len(computed[0]) * block_size
