"""The base of the single-type managers: one per KV cache group, each owning that group's
block tables (docs/semantics.md#single-type-managers; vLLM ``single_type_kv_cache_manager.py``).

``SingleTypeKVCacheManager`` holds the bookkeeping every attention type shares: the
request's block table, allocation and freeing, caching full blocks, and the count of
blocks an allocation will take from the shared pool. A subclass says how its type uses
blocks: which prefix blocks a hit needs and which blocks a request may drop early
(``get_num_skipped_tokens``). The subclasses: ``attention_managers.py`` (full, sliding
window, chunked local) and ``mamba_manager.py``; ``managers.py`` maps each spec to its
manager.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.block_pool import BlockPool, KVCacheBlock
from kvtwin.sim.core.hashing import BlockHashes
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.retention import reachable_boundaries, thins_caching
from kvtwin.sim.core.spec import KVCacheSpec, cdiv

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
