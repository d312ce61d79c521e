"""The Mamba manager (docs/semantics.md#single-type-managers; vLLM
``single_type_kv_cache_manager.py``): one state block matters. "align" mode keeps only the
state at the last block boundary (plus the previous one until the new state is written,
and, for kernels that export prefill checkpoints, the state at the chunk's last boundary
in the block before); "none" mode one block.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.block_pool import BlockPool, KVCacheBlock
from kvtwin.sim.core.retention import mamba_mask
from kvtwin.sim.core.single_type_manager import SingleTypeKVCacheManager
from kvtwin.sim.core.spec import (
    MambaSpec,
    cdiv,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)

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
