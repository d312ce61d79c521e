"""Single-type managers: one per KV cache group, each owning that group's block tables.

docs/semantics.md#single-type-managers (vLLM ``single_type_kv_cache_manager.py``). A manager knows how its
attention type uses blocks: which prefix blocks a hit needs, which blocks a request may
drop early (``get_num_skipped_tokens``), and how many blocks an allocation will take from
the shared pool. The base class holds the bookkeeping every type shares.

* Full attention: left-to-right hit scan, nothing freed early.
* Sliding window: a hit needs ``cdiv(window - 1, block_size)`` contiguous cached blocks,
  found right to left; blocks that slid out of the window become the null block.
* Chunked local: blocks before the current chunk are free hits and are dropped early.
* Mamba: one state block matters; "align" mode keeps only the state at the last block
  boundary (plus the previous one until the new state is written, and, for kernels that
  export prefill checkpoints, the state at the chunk's last boundary in the block before),
  "none" mode one block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.block_pool import BlockPool, KVCacheBlock
from kvtwin.sim.core.hashing import BlockHashes, hashes_in_range
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.retention import mamba_mask, reachable_boundaries, sliding_window_mask, thins_caching
from kvtwin.sim.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)

NULL_BLOCK_ID = 0  # the pool's first block is the null block


class SingleTypeKVCacheManager:
    """Block tables of one group: ``req_to_blocks`` (may contain the null block) and how
    many leading entries were handed to the pool's hash map (``num_cached_block``; the
    key's presence marks a request that has been allocated at least once)."""

    has_noop_horizon = True
    # (request id, group id, block id, boundary tokens) of states cached since the scheduler
    # last took them, for an offload connector; only Mamba "align" groups offer them, and
    # only when a connector listens (otherwise None).
    boundary_state_offloads: list[tuple[str, int, int, int]] | None = None

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int, enable_caching: bool,
                 hash_block_size: int, max_admission_blocks_per_request: int | None = None):
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.hash_factor = spec.block_size // hash_block_size
        self.hash_block_size = hash_block_size
        # The grid hits are aligned to; the coordinator sets its scheduler block size.
        self.cache_hit_alignment_tokens = spec.block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # request id -> leading null entries of its table last counted (``_leading_nulls``).
        self.leading_nulls: dict[str, int] = {}
        # request id -> (group id, position, new block id) for every table entry changed in
        # place since the scheduler last took them: an executor mirroring the tables learns
        # of these from the scheduler output. The coordinator makes all its managers share
        # one dict, so "nothing changed" is one emptiness test.
        self.replaced_block_ids: dict[str, list[tuple[int, int, int]]] = {}
        # Prefix-cache retention (docs/semantics.md#prefix-cache-retention), set by the
        # coordinator once the hit grid is known; ``thins_caching`` is False where every
        # mask would be None, so caching never builds one.
        self.retention_interval: int | None = None
        self.thins_caching = False
        # Managers of equal specs compute equal masks for one request's blocks; the
        # coordinator gives them one class id and a memo it empties per caching call.
        self.mask_class = 0
        self.mask_memo: dict[tuple[int, int, int], list[bool] | None] = {}

    def set_retention(self, interval: int | None) -> None:
        self.retention_interval = interval
        self.thins_caching = self.enable_caching and thins_caching(self.spec, self.cache_hit_alignment_tokens, interval)

    # -- queries ---------------------------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV the next token no longer reads (0: keep everything)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Blocks the pool must give for ``num_tokens`` slots. ``prefill_end`` (0: every
        chunk) is where the request's prefill ends, for a Mamba group that reserves a
        prefill checkpoint only on the chunk reaching it."""
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        table = self.req_to_blocks.get(request_id)
        num_table = len(table) if table is not None else 0
        if request_id in self.num_cached_block:
            return max(num_required - num_table, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks) + num_table), 0)
        # Hit blocks sitting evictable in the free queue stop being free once touched.
        first_kept = max(0, num_skipped_blocks - num_table)
        num_evictable = len([b for b in new_computed_blocks[first_kept:] if b.ref_cnt == 0 and not b.is_null])
        return num_new + num_evictable

    # -- mutations -------------------------------------------------------------------

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                     num_local_computed_tokens: int, num_external_computed_tokens: int = 0) -> None:
        """Adopt a new request's prefix hit: null for skipped positions, touch the rest.

        Positions are skipped by the whole computed prefix, the tokens an offload tier
        supplies (``num_external_computed_tokens``) included."""
        if request_id in self.num_cached_block:
            return
        table = self.req_to_blocks.setdefault(request_id, [])
        num_skipped_blocks = self.get_num_skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        kept = new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks > 0 else new_computed_blocks
        if self.enable_caching:
            self.block_pool.touch(kept)
        if num_skipped_blocks > 0:
            table.extend([self.null_block] * num_skipped_blocks)
        table.extend(kept)
        self.num_cached_block[request_id] = len(table)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Blocks for the tokens an offload tier will load, past the local hit; the ones the
        attention no longer reads stay null. Runs once every group adopted its local hit,
        so taking blocks here cannot evict another group's hit blocks."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total)
        if num_skipped > 0:
            num_external_computed_tokens = min(num_total - num_skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        table = self.req_to_blocks[request_id]
        num_new = cdiv(num_total, self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.block_pool.get_new_blocks(num_new, self.group_id))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new, self.group_id)
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, block_hashes: BlockHashes, request: Request, num_tokens: int) -> None:
        """Register blocks that are full once ``num_tokens`` tokens are computed, those the
        retention mode keeps (docs/semantics.md#caching-blocks)."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = min(num_tokens, len(block_hashes) * self.block_size) // self.block_size
        if num_full > num_cached:
            mask: list[bool] | None = None
            if self.thins_caching:
                key = (self.mask_class, num_cached, num_full)
                memo = self.mask_memo
                if key in memo:
                    mask = memo[key]
                else:
                    mask = memo[key] = self.retained_blocks(request, num_cached, num_full)
            self.block_pool.cache_full_blocks(self.req_to_blocks[request_id], block_hashes, num_cached,
                                              num_full, self.group_id, mask)
        self.num_cached_block[request_id] = max(num_full, num_cached)

    def retained_blocks(self, request: Request, start_block: int, end_block: int) -> list[bool] | None:
        """Which of the request's blocks ``[start, end)`` enter the prefix cache (None: all)."""
        return type(self).reachable_block_mask(
            start_block, end_block, self.cache_hit_alignment_tokens, self.spec, self.retention_interval,
            reachable_boundaries(request.num_prompt_tokens, request.shared_prefix_boundary))

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int, spec: KVCacheSpec,
                             retention_interval: int | None, boundaries: Sequence[int],
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        """Blocks ``[start, end)`` a later hit can stand on under the retention mode (None:
        every block). Full attention and chunked local need every block."""
        return None

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks the request can no longer read with the null block, highest first."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        null = self.null_block
        removed = []
        stop = min(num_skipped_tokens // self.block_size, len(table))
        for i in range(stop - 1, -1, -1):
            if table[i] is null:
                break  # everything before was nulled by an earlier call
            removed.append(table[i])
            table[i] = null
        if removed:
            self.block_pool.free_blocks(removed)
            self._record_nulled(request_id, range(stop - len(removed), stop))

    def _record_nulled(self, request_id: str, positions) -> None:
        gid = self.group_id
        entries = [(gid, i, NULL_BLOCK_ID) for i in positions]
        log = self.replaced_block_ids.get(request_id)
        if log is None:
            self.replaced_block_ids[request_id] = entries
        else:
            log.extend(entries)

    def free(self, request_id: str) -> None:
        table = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        self.leading_nulls.pop(request_id, None)
        self.replaced_block_ids.pop(request_id, None)
        if table:
            # Last block first, so a request's chain is evicted tail first.
            self.block_pool.free_blocks(reversed(table))

    def new_step_starts(self) -> None:
        pass

    def is_noop(self, request_id: str, num_computed_tokens: int, num_tokens_need_slot: int,
                num_tokens_main_model: int, num_tokens_to_cache: int) -> bool:
        """Whether allocating for a running request would change nothing in this group:
        no block to drop, none to add, none newly full. Most decode steps are such steps;
        answering this is O(1) where the full path is not."""
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return False
        block_size = self.block_size
        if len(table) * block_size < num_tokens_need_slot:
            return False
        if self.enable_caching and num_tokens_to_cache // block_size > self.num_cached_block.get(request_id, 0):
            return False
        return self._nothing_to_skip(table, num_computed_tokens)

    def noop_horizon(self, request_id: str) -> int:
        """The largest token count ``end`` such that, for a running request with computed
        tokens below ``end``, allocating up to ``end`` is a no-op in this group given its
        current table. Lets the KV cache manager skip decode steps with one comparison."""
        table = self.req_to_blocks.get(request_id)
        if table is None:
            return -1
        block_size = self.block_size
        horizon = len(table) * block_size
        if self.enable_caching:
            horizon = min(horizon, (self.num_cached_block.get(request_id, 0) + 1) * block_size - 1)
        return min(horizon, self._skip_horizon(request_id, table))

    def _skip_horizon(self, request_id: str, table: list[KVCacheBlock]) -> int:
        """Computed-token counts below this drop no further block (no early freeing: none)."""
        return 1 << 62

    def _leading_nulls(self, request_id: str, table: list[KVCacheBlock]) -> int:
        """The table's leading null entries. An entry once null stays null until the
        request is freed (blocks are only nulled or appended), so the count found last
        time is where the scan resumes: a long context's table is not rescanned from 0
        at every horizon."""
        null = self.null_block
        known = self.leading_nulls
        count = known.get(request_id, 0)
        end = len(table)
        while count < end and table[count] is null:
            count += 1
        known[request_id] = count
        return count

    def _nothing_to_skip(self, table: list[KVCacheBlock], num_computed_tokens: int) -> bool:
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped <= 0:
            return True
        n = min(num_skipped // self.block_size, len(table))
        return n == 0 or table[n - 1] is self.null_block

    # -- prefix hits -----------------------------------------------------------------

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashes, max_length: int, group_ids: Sequence[int],
                               block_pool: BlockPool, spec: KVCacheSpec,
                               alignment_tokens: int) -> tuple[list[list[KVCacheBlock]], int]:
        raise NotImplementedError


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


class MambaManager(SingleTypeKVCacheManager):
    """Recurrent state blocks. Align mode: the table is nulls plus the last state block(s)
    and, in a step with a prefill checkpoint, the checkpoint block just before them."""

    # Its horizon is a lower bound (``noop_horizon``): past it, ``is_noop`` decides.
    has_noop_horizon = False

    spec: MambaSpec

    def __init__(self, spec: MambaSpec, block_pool: BlockPool, group_id: int, enable_caching: bool,
                 hash_block_size: int, max_admission_blocks_per_request: int | None = None):
        super().__init__(spec, block_pool, group_id, enable_caching, hash_block_size,
                         max_admission_blocks_per_request)
        self.align = spec.mamba_cache_mode == "align"
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.last_state_block_idx: dict[str, int] = {}
        self.allocated_block_reqs: set[str] = set()
        # Hashes cached in this step: a state written this step cannot be read by another
        # request scheduled in the same step.
        self.cached_blocks_this_step: set = set()
        self.has_prefill_checkpoint_blocks = spec.has_prefill_checkpoint_blocks
        # Set by the KV cache manager under a draft head's trailing-block drop.
        self.drop_eagle_checkpoint_block = False
        # Requests whose last (non-admission) count reserved a checkpoint block, which the
        # allocation that follows keeps real (vLLM's ``_checkpoints``).
        self.checkpoints: set[str] = set()
        # request id -> table index below which every entry is null. Align-mode tables have
        # real blocks behind null gaps (a checkpoint, a state whose retirement tokens in
        # flight delayed), so skipped blocks are found by a scan from here, not by stopping
        # at the first null (vLLM's ``_num_retired_blocks``).
        self.num_retired_blocks: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Only the state after the last computed token is needed.
        return num_computed_tokens - 1

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, spec, retention_interval, boundaries,
                             final_segment_end_block=None):
        return mamba_mask(start_block, end_block, alignment_tokens, spec.block_size, retention_interval, boundaries)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_ids, block_pool, spec, alignment_tokens):
        block_size = spec.block_size
        computed: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        max_num_blocks = min(max_length // block_size, len(block_hashes))
        for i in range(max_num_blocks - 1, -1, -1):
            hit = block_pool.get_cached_block(block_hashes[i], group_ids)
            if hit is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            null = block_pool.null_block
            for blocks, block in zip(computed, hit):
                blocks.extend([null] * i)
                blocks.append(block)
            return computed, (i + 1) * block_size
        return computed, 0

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False, prefill_end=0):
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # More than the pool holds: the allocation fails and the request waits a step.
            return self.block_pool.num_gpu_blocks + 1
        if not self.align:
            if self.num_speculative_blocks:
                num_tokens += self.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_tokens_main_model,
                                                      apply_admission_cap, prefill_end)
        # Align mode ignores lookahead tokens: they would break block alignment.
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        table = self.req_to_blocks.get(request_id)
        num_new = num_required - len(new_computed_blocks) - (len(table) if table else 0)
        checkpoint = 0
        if self.has_prefill_checkpoint_blocks:
            # Under retention interval 0 only the chunk that ends the prefill reserves one
            # (prefill_end; 0 otherwise: every chunk), docs/semantics.md#prefix-cache-retention.
            checkpoint = (num_tokens_main_model >= prefill_end
                          and self._checkpoint_index(request_id, table, total_computed_tokens,
                                                     num_tokens_main_model) >= 0)
            # The whole-sequence check only counts; the per-step count decides.
            if not apply_admission_cap:
                if checkpoint:
                    self.checkpoints.add(request_id)
                else:
                    self.checkpoints.discard(request_id)
        if num_new > 0:
            # At most one new state block (and the checkpoint's); a running request reuses
            # its speculative blocks.
            cap = 1 + checkpoint
            if request_id not in self.allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable

    def _checkpoint_index(self, request_id: str, table: list[KVCacheBlock] | None, query_start: int,
                          query_end: int) -> int:
        """Where the chunk ``[query_start, query_end)`` exports a prefill checkpoint: the
        block before the running state's, holding the state at the last hit-grid boundary
        before ``query_end``; -1 if it exports none. vLLM 0.33 reserves one for every
        qualifying chunk under dense or periodic retention; under interval 0 the caller
        asks only for the chunk reaching the prefill end."""
        position = get_mamba_prefill_checkpoint_position(query_end, self.cache_hit_alignment_tokens,
                                                         self.drop_eagle_checkpoint_block)
        if not is_mamba_prefill_checkpoint_valid(query_start, query_end, position, self.hash_block_size,
                                                 self.block_size, self.spec.prefill_checkpoint_alignment):
            return -1
        idx = cdiv(query_end, self.block_size) - 2
        if idx < 0:
            return -1
        if (table is None or idx >= len(table) or table[idx] is self.null_block
                or (request_id in self.allocated_block_reqs and idx >= len(table) - self.num_speculative_blocks)):
            return idx
        return -1

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        if not self.align:
            if self.num_speculative_blocks:
                num_tokens += self.block_size * self.num_speculative_blocks
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        table = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        # The checkpoint block sits just before the running state's and stays real.
        checkpoint = 1 if self.checkpoints and request_id in self.checkpoints else 0
        if num_required <= len(table) and not checkpoint:
            self.allocated_block_reqs.add(request_id)
            return []
        prev_len = len(table)
        was_allocated = request_id in self.allocated_block_reqs
        if was_allocated:
            self.last_state_block_idx[request_id] = prev_len - 1 - self.num_speculative_blocks
        elif prev_len > 0:
            # A hit's last block holds the state the request resumes from.
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped_blocks = num_required - self.num_speculative_blocks - 1
        null_end = num_skipped_blocks - checkpoint
        if prev_len < null_end:
            table.extend([self.null_block] * (null_end - prev_len))
        if was_allocated:
            moved = []
            for idx in range(prev_len - self.num_speculative_blocks, prev_len):
                if idx >= null_end:
                    break
                table.append(table[idx])
                table[idx] = self.null_block
                moved.append(idx)
            if moved:
                self._record_nulled(request_id, moved)
        new_blocks = self.block_pool.get_new_blocks(max(num_required - len(table), 0), self.group_id)
        returned = table[prev_len:]
        table.extend(new_blocks)
        self.allocated_block_reqs.add(request_id)
        return returned + new_blocks

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                     num_local_computed_tokens: int, num_external_computed_tokens: int = 0) -> None:
        fresh = request_id not in self.num_cached_block
        super().allocate_new_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                             num_external_computed_tokens)
        if fresh and self.align:
            # A hit is nulls and then its state block: nothing below it to retire.
            self.num_retired_blocks[request_id] = max(len(self.req_to_blocks[request_id]) - 1, 0)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                  num_external_computed_tokens)
        if self.align:
            # Nulls and then the state block the load fills.
            self.num_retired_blocks[request_id] = max(len(self.req_to_blocks[request_id]) - 1, 0)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.align:
            super().remove_skipped_blocks(request_id, num_computed_tokens)
            return
        table = self.req_to_blocks.get(request_id)
        if table and num_computed_tokens > 1:
            stop = min((num_computed_tokens - 1) // self.block_size, len(table))
            first = self.num_retired_blocks.get(request_id, 0)
            if first < stop:
                null = self.null_block
                # Highest first, as vLLM frees them; the nulls in between cost one test each.
                positions = [i for i in range(stop - 1, first - 1, -1) if table[i] is not null]
                if positions:
                    self.block_pool.free_blocks([table[i] for i in positions])
                    for i in positions:
                        table[i] = null
                    self._record_nulled(request_id, positions)
                self.num_retired_blocks[request_id] = stop
        # The previous state block was only needed to seed the current one.
        last_idx = self.last_state_block_idx.get(request_id)
        if last_idx is not None and last_idx < cdiv(num_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks[request_id]
            if table[last_idx] is not self.null_block:
                self.block_pool.free_blocks([table[last_idx]])
                table[last_idx] = self.null_block
                self._record_nulled(request_id, (last_idx,))

    def cache_blocks(self, block_hashes, request, num_tokens):
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(block_hashes, request, num_tokens)
        after = self.num_cached_block[request_id]
        if after > before:
            offers = self.boundary_state_offloads
            table = self.req_to_blocks[request_id]
            for idx in range(before, after):
                block = table[idx]
                if not block.is_null and block.block_hash is not None:
                    self.cached_blocks_this_step.add(block.block_hash)
                    if offers is not None and self.align:
                        # An offload connector stores each state cached at a boundary,
                        # reading this exact block (vLLM's boundary-state hand-off).
                        offers.append((request_id, self.group_id, block.block_id, (idx + 1) * self.block_size))

    def is_noop(self, request_id, num_computed_tokens, num_tokens_need_slot, num_tokens_main_model,
                num_tokens_to_cache):
        if not self.align:
            return False
        table = self.req_to_blocks.get(request_id)
        if table is None or request_id not in self.allocated_block_reqs:
            return False
        block_size = self.block_size
        if cdiv(num_tokens_main_model, block_size) + self.num_speculative_blocks > len(table):
            return False
        if self.enable_caching and num_tokens_to_cache // block_size > self.num_cached_block.get(request_id, 0):
            return False
        last_idx = self.last_state_block_idx.get(request_id)
        null = self.null_block
        if (last_idx is not None and last_idx < cdiv(num_computed_tokens, block_size) - 1
                and table[last_idx] is not null):
            return False
        stop = min((num_computed_tokens - 1) // block_size, len(table))
        first = self.num_retired_blocks.get(request_id, 0)
        if first < stop:
            for i in range(first, stop):
                if table[i] is not null:
                    return False
            # Only nulls there: retiring them changes nothing, so the next call starts after.
            self.num_retired_blocks[request_id] = stop
        return True

    def noop_horizon(self, request_id: str) -> int:
        """In align mode, a token count up to which ``is_noop`` holds for the table as it
        is, so that a decode may skip the full path (none, -1, in "none" mode, where
        ``is_noop`` never holds). Each of ``is_noop``'s conditions bounds the end of the
        step: a state block to add (``cdiv(end, block_size)`` plus the speculative blocks
        past the table), a block to cache, the previous state block to release
        (``cdiv(computed, block_size) - 1`` past it) and a real block to retire
        (``(computed - 1) // block_size`` past it), with ``computed < end``. Tokens in
        flight only lower ``computed`` there, so the horizon is a lower bound: once crossed,
        ``allocate_slots`` still asks ``is_noop`` before the full path."""
        if not self.align:
            return -1
        table = self.req_to_blocks.get(request_id)
        if table is None or request_id not in self.allocated_block_reqs:
            return -1
        block_size = self.block_size
        horizon = (len(table) - self.num_speculative_blocks) * block_size
        if self.enable_caching:
            horizon = min(horizon, (self.num_cached_block.get(request_id, 0) + 1) * block_size - 1)
        null = self.null_block
        last_idx = self.last_state_block_idx.get(request_id)
        if last_idx is not None and table[last_idx] is not null:
            horizon = min(horizon, (last_idx + 1) * block_size + 1)
        for k in range(self.num_retired_blocks.get(request_id, 0), len(table)):
            if table[k] is not null:
                horizon = min(horizon, (k + 1) * block_size + 1)
                break
        return horizon

    def free(self, request_id: str) -> None:
        if self.boundary_state_offloads:
            # Offers are good until the end of the step that made them; these blocks go
            # back to the pool now.
            self.boundary_state_offloads[:] = [e for e in self.boundary_state_offloads if e[0] != request_id]
        self.allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.checkpoints.discard(request_id)
        self.num_retired_blocks.pop(request_id, None)
        super().free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


# One manager class per spec class (vLLM's ``spec_manager_map``). MLA is full attention
# as far as blocks go; a subclass of a listed spec gets its nearest listed base's manager.
MANAGER_CLASSES: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for cls in type(spec).__mro__:
        manager = MANAGER_CLASSES.get(cls)
        if manager is not None:
            return manager
    raise TypeError(f"no manager for {type(spec).__name__}")
