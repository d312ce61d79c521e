"""The scheduler's face of the KV cache: find hits, allocate slots, free (vLLM ``KVCacheManager``).

docs/semantics.md#kv-cache-manager. ``allocate_slots`` follows vLLM's order step by step,
because the order is observable: skipped blocks are released *before* the capacity check
(even when the allocation then fails), free hit blocks count against capacity, waiting
requests must fit their whole sequence, and blocks completed by this step's tokens are
cached at schedule time, before the forward pass.

Blocks travel as ``KVCacheBlocks`` (one list per group). Besides the blocks an allocation
appends, the managers log every table entry they change in place (sliding-window and
chunked-local blocks nulled, Mamba state blocks moved or released) in
``replaced_block_ids``, a dict the scheduler pops each scheduled request's entries from
into its output (or drops, when the whole table goes out), which thus lets an executor
keep exact copies of the tables.
"""

from __future__ import annotations

from kvtwin.sim.core.coordinator import HybridKVCacheCoordinator, UnitaryKVCacheCoordinator, get_kv_cache_coordinator
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.attention_managers import FullAttentionManager
from kvtwin.sim.core.mamba_manager import MambaManager
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.spec import KVCacheConfig, cdiv
from kvtwin.sim.core.window_port import WindowKVCacheManager


class KVCacheManager(WindowKVCacheManager):
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 enable_caching: bool = True, watermark: float = 0.0, num_prefill_lookahead: int = 0,
                 use_eagle_block_drop: bool = False):
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, max_model_len, max_in_flight_tokens,
                                                    enable_caching)
        self.block_pool = self.coordinator.block_pool
        if num_prefill_lookahead > 1 and isinstance(self.coordinator, UnitaryKVCacheCoordinator):
            # Multi-module MTP may re-prefill the last k - 1 computed tokens: they are not
            # cached. vLLM's hybrid coordinator overrides that rule (it only applies with the
            # legacy block drop), so only a one-group layout drops them
            # (docs/semantics.md#draft-heads-and-prefix-caching).
            self.coordinator.num_reprefillable_tokens = num_prefill_lookahead - 1
        if use_eagle_block_drop:
            # Mamba checkpoints match the draft head's attention replay boundary (vLLM's
            # coordinator sets ``drop_eagle_checkpoint_block``).
            for manager in self.coordinator.managers:
                if isinstance(manager, MambaManager):
                    manager.drop_eagle_checkpoint_block = True
        self.num_groups = len(kv_cache_config.groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Returned for "no blocks" (no hit, nothing appended on the fast path): test by identity.
        self.empty_blocks: KVCacheBlocks = self.coordinator.empty_blocks
        # request id -> in-place table changes no scheduler output has carried yet (shared
        # with the managers); the scheduler pops a request's entries as it schedules it.
        self.replaced_block_ids = self.coordinator.replaced_block_ids
        # request id → token count up to which allocating for a running request changes
        # nothing (the decode fast path; the scheduler may consult it before calling).
        self.noop_horizon: dict[str, int] = {}
        # The waiting head whose whole-sequence admission check failed at its last try, and
        # what that check depended on (``still_blocked``); one full-attention group only.
        managers = self.coordinator.managers
        # The one full-attention group of the most common layout, or None: running requests
        # then take a path without the loops over groups (``_allocate_running_full``).
        self.single_full_manager = (managers[0] if len(managers) == 1 and isinstance(managers[0], FullAttentionManager)
                                    else None)
        self.remembers_blocked_head = self.single_full_manager is not None
        self._blocked_head: Request | None = None
        self._blocked_free_generation = -1
        self._blocked_with_running = False
        self._blocked_next_hash: object | None = None  # None: the hit cannot grow

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks per group, hit tokens, shared-prefix boundary). Takes no references."""
        if not self.enable_caching:
            return self.empty_blocks, 0, 0
        # The last token is always recomputed: its logits are needed.
        blocks, hit_tokens, uncached = self.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                               request.num_tokens - 1)
        shared_prefix_boundary = hit_tokens + uncached if uncached else 0
        if not any(blocks.blocks):
            blocks = self.empty_blocks
        return blocks, hit_tokens, shared_prefix_boundary

    def get_computed_blocks_for_connector(self, request: Request) -> tuple[KVCacheBlocks, int, int, bool]:
        """``get_computed_blocks`` for a connector that supplies a hybrid model's Mamba
        state itself (``supports_divergent_local_hybrid_hits``), plus whether the hit
        diverged (docs/semantics.md#disaggregated-prefill-and-decode).

        With Mamba and full attention, the full-attention group's own hit is reported even
        where the Mamba group's lags (its state at that boundary comes with the transfer);
        if a lagging group hit deeper than full attention, the agreed hit is used. A
        diverged hit is only valid if the connector then loads tokens: the scheduler falls
        back to ``get_computed_blocks`` when it loads none."""
        coordinator = self.coordinator
        fa_group_id = (coordinator.full_attention_group_id
                       if isinstance(coordinator, HybridKVCacheCoordinator) and coordinator.has_mamba else None)
        if fa_group_id is None or not self.enable_caching:
            agreed_blocks, agreed_tokens, boundary = self.get_computed_blocks(request)
            return agreed_blocks, agreed_tokens, boundary, False
        assert isinstance(coordinator, HybridKVCacheCoordinator)
        # The last token is always recomputed: its logits are needed.
        blocks, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, request.num_tokens - 1)
        num_local = hits[fa_group_id]
        if max(hits) > num_local:
            # A lagging group hit deeper: full attention's blocks were evicted there.
            agreed_blocks, agreed_tokens, boundary = self.get_computed_blocks(request)
            return agreed_blocks, agreed_tokens, boundary, False
        if not any(blocks.blocks):
            blocks = self.empty_blocks
        # Independent lookups see no uncached shared prefix: no boundary to pin.
        return blocks, num_local, 0, min(hits) < num_local

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens; None if the pool is short.

        ``num_external_computed_tokens`` follow the local hit and come from an offload tier:
        they get blocks too (an asynchronous load asks for nothing else: ``num_new_tokens``
        0), and ``delay_cache_blocks`` leaves them uncached until the load has landed.
        Returns the blocks appended to each group's table (``empty_blocks``, by identity,
        when none were). Entries changed in place, even by a call that then
        fails, wait in ``replaced_block_ids`` until taken or until the request is freed."""
        if num_new_tokens <= 0 and num_external_computed_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        fast = (new_computed_blocks is None and num_new_computed_tokens == 0 and not full_sequence_must_fit
                and num_lookahead_tokens == 0 and request.status is RequestStatus.RUNNING)
        if fast:
            # The common decode step: when no group has anything to drop, add or cache, the
            # full path below would change nothing and succeed (a running request needs no
            # watermark), so skip it.
            computed = min(request.num_computed_tokens, self.max_model_len)
            end = computed + num_new_tokens
            if end <= self.noop_horizon.get(request.request_id, -1):
                return self.empty_blocks
            # Where every group's horizon is exact, past it something changes; a Mamba
            # group's is a lower bound, so Mamba layouts ask the O(1) check first.
            # (Blocks are dropped by the tokens processed: async batches in flight excluded.)
            if not self.coordinator.horizon_possible and self.coordinator.is_noop(
                    request.request_id, max(0, computed - request.num_in_flight_tokens), min(end, self.max_model_len),
                    end, min(end, request.num_tokens)):
                return self.empty_blocks
            if self.single_full_manager is not None and not num_external_computed_tokens and not delay_cache_blocks:
                return self._allocate_running_full(request, num_new_tokens, reserved_blocks)
        hit_blocks = new_computed_blocks if new_computed_blocks is not None else self.empty_blocks
        coordinator = self.coordinator
        pool = self.block_pool
        request_id = request.request_id
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, self.max_model_len)

        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks

        # Where the scheduler's prefill ends (past the prompt for a resumed request replaying
        # its outputs): a Mamba group's checkpoint may depend on it.
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            needed = coordinator.get_num_blocks_to_allocate(request_id, full_num_tokens, hit_blocks, total_computed,
                                                            full_num_tokens, True, prefill_end)
            if needed + watermark_blocks > pool.get_num_free_blocks():
                return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)

        # Released even if the allocation below fails: those blocks are dead either way.
        # Async: only by what was processed; batches in flight still read below the window.
        coordinator.remove_skipped_blocks(request_id, max(0, total_computed - request.num_in_flight_tokens))

        needed = coordinator.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hit_blocks,
                                                        num_local_computed + num_external_computed_tokens,
                                                        num_tokens_main_model, False, prefill_end)
        if needed + watermark_blocks > pool.get_num_free_blocks() - reserved_blocks:
            return None

        if hit_blocks is not self.empty_blocks or num_external_computed_tokens:
            coordinator.allocate_new_computed_blocks(request_id, hit_blocks, num_local_computed,
                                                     num_external_computed_tokens)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot, num_tokens_main_model)
        if delay_cache_blocks:
            return new_blocks

        if self.enable_caching:
            coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        if fast:
            self.noop_horizon[request_id] = coordinator.noop_horizon(request_id)
        return new_blocks

    def _allocate_running_full(self, request: Request, num_new_tokens: int, reserved_blocks: int) -> KVCacheBlocks | None:
        """``allocate_slots`` for a running request when the layout is one full-attention
        group: the general path's steps in its order, less what cannot apply (full
        attention skips no tokens, a running request adopts no hit and pays no watermark,
        its table ends where its blocks end)."""
        manager = self.single_full_manager
        assert manager is not None
        request_id = request.request_id
        total_computed = min(request.num_computed_tokens, self.max_model_len)
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model, self.max_model_len)
        table = manager.req_to_blocks.get(request_id)
        needed = max(cdiv(num_tokens_need_slot, manager.block_size) - (len(table) if table is not None else 0), 0)
        if needed > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        new = manager.allocate_new_blocks(request_id, num_tokens_need_slot, num_tokens_main_model)
        if self.enable_caching:
            manager.cache_blocks(self.coordinator.hashes_for(request.block_hashes, manager), request,
                                 min(num_tokens_main_model, request.num_tokens))
        self.noop_horizon[request_id] = manager.noop_horizon(request_id)
        return KVCacheBlocks((new,)) if new else self.empty_blocks

    # -- the blocked head of the waiting queue ------------------------------------------

    def remember_blocked(self, request: Request, hit_tokens: int, has_scheduled_reqs: bool) -> None:
        """``request`` (no tokens computed, its hit ``hit_tokens``) just failed
        ``allocate_slots(..., full_sequence_must_fit=True)``."""
        if not self.remembers_blocked_head:
            return
        self._blocked_head = request
        self._blocked_free_generation = self.block_pool.free_generation
        self._blocked_with_running = has_scheduled_reqs
        self._blocked_next_hash = None
        if self.enable_caching:
            manager = self.coordinator.managers[0]
            hashes = self.coordinator.hashes_for(request.block_hashes, manager)
            next_block = hit_tokens // manager.block_size
            if next_block < min((request.num_tokens - 1) // manager.block_size, len(hashes)):
                self._blocked_next_hash = hashes[next_block]

    def still_blocked(self, request: Request, has_scheduled_reqs: bool) -> bool:
        """Whether ``request``, remembered as blocked, would fail its whole-sequence check
        again now: known without the prefix lookup, which the waiting head would otherwise
        repeat at every step while it waits for room.

        The check fails while the blocks it needs (the sequence's blocks past the hit, plus
        hit blocks sitting evictable in the free queue) exceed the free blocks plus the
        watermark. Suppose no block has returned to the free queue since the failure (the
        pool's ``free_generation`` is unchanged), the watermark applies as it did, and the
        hash just past the remembered hit of H blocks is still uncached, so the hit is now
        some h <= H blocks. Every hit block that was evictable then and is not now (touched
        by an admission, or evicted and its hash cached again in another block) left the
        free queue, as did every block evicted from the hit; nothing came back. So the
        blocks needed fell by no more than the free blocks did: the shortfall H - h of the
        hit at most cancels the evictable blocks it held, and every evictable hit block lost
        took a free block with it. The check still fails."""
        if request is not self._blocked_head:
            return False
        if (self.block_pool.free_generation != self._blocked_free_generation
                or has_scheduled_reqs != self._blocked_with_running):
            return False
        next_hash = self._blocked_next_hash
        return next_hash is None or next_hash not in self.block_pool.cached_block_hash_to_block[0]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's blocks full within ``num_computed_tokens`` (after a load)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def remaining_blocks(self, request: Request) -> int:
        """Blocks the request still needs to hold its whole sequence (vLLM's
        ``_request_remaining_blocks``): what an in-flight prefill has reserved."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, self.empty_blocks, request.num_computed_tokens, num_tokens, True,
            max(request.num_prompt_tokens, request.num_tokens - 1))

    def take_replaced_block_ids(self, request_id: str) -> list[tuple[int, int, int]] | None:
        """Take the table entries ``request_id``'s allocations changed in place since they
        were last taken (None: none), for the batch's output; vLLM's scheduler reads them
        off the allocation as it schedules the request."""
        log = self.replaced_block_ids
        if not log:
            return None
        return log.pop(request_id, None)

    # -- what a decode window asks (``window_port.WindowKVCacheManager``) ----------------

    def get_empty_blocks(self) -> KVCacheBlocks:
        """``allocate_slots``' result when it appended nothing (compare by identity)."""
        return self.empty_blocks

    def num_kv_cache_groups(self) -> int:
        return self.num_groups

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def allocation_horizon(self, request_id: str) -> int:
        """The token count up to which allocating for the running ``request_id`` changes
        nothing (``noop_horizon``; -1: none known, ask ``allocate_slots``)."""
        return self.noop_horizon.get(request_id, -1)

    def blocks_lacking(self, request_id: str, num_tokens: int) -> int:
        """Summed over the groups, the blocks ``request_id``'s table lacks to hold
        ``num_tokens`` tokens: what one more token can take from the pool, at most."""
        needed = 0
        for manager in self.coordinator.managers:
            table = manager.req_to_blocks.get(request_id)
            lacking = -(-num_tokens // manager.block_size) - (len(table) if table is not None else 0)
            if lacking > 0:
                needed += lacking
        return needed

    def blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """The blocks ``allocate_slots(request, num_new_tokens)`` takes from the pool for a
        running request's chunk (vLLM's ``get_num_blocks_to_allocate``)."""
        computed = request.num_computed_tokens
        end = computed + num_new_tokens
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, min(end, self.max_model_len), self.empty_blocks, computed, end, False,
            max(request.num_prompt_tokens, request.num_tokens - 1))

    def free(self, request: Request) -> None:
        self.noop_horizon.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.coordinator.managers)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
