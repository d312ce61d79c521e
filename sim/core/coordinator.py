"""KV cache coordinators: one set of managers over one shared pool, and the hybrid hit.

docs/semantics.md#coordinators. Every coordinator owns the single
``BlockPool`` and one manager per group; most calls just loop over the managers in
group order. They differ only in how a prefix hit is found:

* ``KVCacheCoordinatorNoPrefixCache`` — caching off: never a hit.
* ``UnitaryKVCacheCoordinator`` — one group: its manager's finder, as is.
* ``HybridKVCacheCoordinator`` — several groups: groups with an identical spec are looked
  up together ("attention groups"), full attention first; each finder may only shorten
  the candidate length, and the search repeats until a pass leaves it unchanged (one pass
  for the simple full + one-other case). The full-attention lists are then truncated to
  the agreed length. The longest single-group hit minus the agreed length is returned as
  the uncached common prefix, which the scheduler uses to pin a Mamba state there.
"""

from __future__ import annotations

from math import lcm

from kvtwin.sim.core.block_pool import BlockPool, KVCacheBlock
from kvtwin.sim.core.hashing import BlockHashes, CoarseBlockHashes
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.managers import manager_class_for
from kvtwin.sim.core.single_type_manager import SingleTypeKVCacheManager
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.retention import validate_retention_interval
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, MambaSpec, cdiv


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 enable_caching: bool):
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = kv_cache_config.hash_block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, len(kv_cache_config.groups), enable_caching)
        self.managers: list[SingleTypeKVCacheManager] = []
        for gid, group in enumerate(kv_cache_config.groups):
            spec = group.spec
            # The same bound the planner sizes the pool with, so whatever startup promised
            # can be admitted at run time.
            cap = (spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
                   if spec.caps_admission else None)
            self.managers.append(manager_class_for(spec)(spec, self.block_pool, gid, enable_caching,
                                                         self.hash_block_size, cap))
        self.num_groups = len(self.managers)
        self.empty_blocks = KVCacheBlocks.empty(self.num_groups)
        # One log of in-place table changes for all groups (see the managers): request id ->
        # ``(group id, position, new block id)`` in the order made, until the scheduler pops them.
        self.replaced_block_ids: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.managers:
            manager.replaced_block_ids = self.replaced_block_ids
        self.scheduler_block_size = lcm(*(g.spec.block_size for g in kv_cache_config.groups))
        # Hits land on this grid, so a Mamba prefill checkpoint is placed on it too, and
        # retention keeps the blocks a hit on it can stand on.
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        validate_retention_interval(self.retention_interval, self.scheduler_block_size, kv_cache_config.specs)
        # Groups of equal specs thin their blocks alike: one mask per call serves them all.
        self.mask_memo: dict[tuple[int, int, int], list[bool] | None] = {}
        mask_classes: list[object] = []
        for manager in self.managers:
            manager.cache_hit_alignment_tokens = self.scheduler_block_size
            manager.set_retention(self.retention_interval)
            if manager.spec not in mask_classes:
                mask_classes.append(manager.spec)
            manager.mask_class = mask_classes.index(manager.spec)
            manager.mask_memo = self.mask_memo
        # Whether every group's horizon is exact. A Mamba group's is only a lower bound
        # (tokens in flight delay its releases; "none" mode has none): past it, the
        # KV cache manager asks ``is_noop`` before taking the full path.
        self.horizon_possible = all(m.has_noop_horizon for m in self.managers)
        # Multi-module MTP: the last computed tokens a later chunk may re-prefill are not
        # cached (set by the KV cache manager for one group only; 0 otherwise).
        self.num_reprefillable_tokens = 0

    # -- hash views --------------------------------------------------------------------

    def hashes_for(self, block_hashes: BlockHashes, manager: SingleTypeKVCacheManager) -> BlockHashes:
        factor = manager.hash_factor
        return block_hashes if factor == 1 else CoarseBlockHashes(block_hashes, factor)

    # -- loops over managers -----------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: KVCacheBlocks,
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        """The managers' sum. ``prefill_end`` matters only under retention interval 0, where
        a Mamba prefill checkpoint is reserved only by the chunk that ends the prefill
        (docs/semantics.md#prefix-cache-retention)."""
        blocks = new_computed_blocks.blocks
        if self.retention_interval != 0:
            prefill_end = 0
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, blocks[i], total_computed_tokens,
                                         num_tokens_main_model, apply_admission_cap, prefill_end)
            for i, m in enumerate(self.managers))

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: KVCacheBlocks,
                                     num_local_computed_tokens: int, num_external_computed_tokens: int = 0) -> None:
        blocks = new_computed_blocks.blocks
        for i, m in enumerate(self.managers):
            m.allocate_new_computed_blocks(request_id, blocks[i], num_local_computed_tokens,
                                           num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            # Two phases (vLLM issue #33775): every group's hit is held before any group
            # takes fresh blocks for the loaded tokens.
            for m in self.managers:
                m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                    num_external_computed_tokens)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba states cached at block boundaries since the last call, per request, for an
        offload connector: ``(group id, block id, boundary tokens)``."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.managers:
            pending = m.boundary_state_offloads
            if pending:
                for request_id, group_id, block_id, boundary in pending:
                    offloads.setdefault(request_id, []).append((group_id, block_id, boundary))
                pending.clear()
        return offloads

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> KVCacheBlocks:
        """The blocks appended per group; ``empty_blocks`` when none were."""
        managers = self.managers
        if len(managers) == 1:
            new = managers[0].allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            return KVCacheBlocks((new,)) if new else self.empty_blocks
        per_group = tuple([m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model) for m in managers])
        return KVCacheBlocks(per_group) if any(per_group) else self.empty_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if self.num_reprefillable_tokens:
            num_tokens = max(0, num_tokens - self.num_reprefillable_tokens)
        block_hashes = request.block_hashes
        memo = self.mask_memo
        if memo:
            memo.clear()  # a mask holds for one request's blocks in one call only
        for m in self.managers:
            m.cache_blocks(self.hashes_for(block_hashes, m), request, num_tokens)
        if memo:
            memo.clear()

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def noop_horizon(self, request_id: str) -> int:
        return min(m.noop_horizon(request_id) for m in self.managers)

    def is_noop(self, request_id: str, num_computed_tokens: int, num_tokens_need_slot: int,
                num_tokens_main_model: int, num_tokens_to_cache: int) -> bool:
        for m in self.managers:
            if not m.is_noop(request_id, num_computed_tokens, num_tokens_need_slot, num_tokens_main_model,
                             num_tokens_to_cache):
                return False
        return True

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.managers))

    def find_longest_cache_hit(self, block_hashes: BlockHashes,
                               max_cache_hit_length: int) -> tuple[KVCacheBlocks, int, int]:
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return self.empty_blocks, 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        manager = self.managers[0]
        blocks, hit_length = type(manager).find_longest_cache_hit(
            self.hashes_for(block_hashes, manager), max_cache_hit_length, [0], self.block_pool, manager.spec,
            manager.block_size)
        if not hit_length:
            return self.empty_blocks, 0, 0
        return KVCacheBlocks(tuple(blocks)), hit_length, 0


class _AttentionGroup:
    """Groups whose spec is identical, looked up together (a hash must hit in all of them)."""

    __slots__ = ("spec", "group_ids", "manager")

    def __init__(self, spec, group_ids, manager):
        self.spec = spec
        self.group_ids = group_ids
        self.manager = manager


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                 enable_caching: bool):
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching)
        by_spec: dict = {}
        for gid, group in enumerate(self.kv_cache_config.groups):
            by_spec.setdefault(group.spec, []).append(gid)
        groups = [_AttentionGroup(spec, ids, self.managers[ids[0]]) for spec, ids in by_spec.items()]
        # Full attention first: its left-to-right scan gives the upper bound the others
        # can only shorten, and it never needs a second look.
        groups.sort(key=lambda g: 0 if isinstance(g.spec, FullAttentionSpec) else 1)
        self.attention_groups = groups
        self.is_simple_hybrid = len(groups) == 2 and isinstance(groups[0].spec, FullAttentionSpec)
        self.alignment_tokens = self.scheduler_block_size
        # The group whose hit a connector's divergent local lookup reports (vLLM: the
        # first of the full-attention groups), or None without full attention.
        self.full_attention_group_id: int | None = (groups[0].group_ids[0]
                                                    if isinstance(groups[0].spec, FullAttentionSpec) else None)
        self.has_mamba = any(isinstance(g.spec, MambaSpec) for g in groups)

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        num_groups = len(self.managers)
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_length_by_group = [0] * num_groups
        while True:
            curr = hit_length
            for group in self.attention_groups:
                first = group.group_ids[0]
                if isinstance(group.spec, FullAttentionSpec) and hit_blocks[first] is not None:
                    # A full-attention hit is prefix-closed: shortening is a truncation.
                    curr = min(curr, hit_length_by_group[first])
                    continue
                manager = group.manager
                blocks, new_length = type(manager).find_longest_cache_hit(
                    self.hashes_for(block_hashes, manager), curr, group.group_ids, self.block_pool,
                    group.spec, self.alignment_tokens)
                curr = new_length
                for gid, blks in zip(group.group_ids, blocks):
                    hit_blocks[gid] = blks
                    hit_length_by_group[gid] = new_length
                longest_hit_length = max(longest_hit_length, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.is_simple_hybrid:
                break
        for group in self.attention_groups:
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            keep = cdiv(hit_length, group.spec.block_size)
            for gid in group.group_ids:
                if hit_blocks[gid] is not None:
                    del hit_blocks[gid][keep:]
        blocks = KVCacheBlocks(tuple(b if b is not None else [] for b in hit_blocks))
        return blocks, hit_length, longest_hit_length - hit_length

    def find_longest_cache_hit_per_group(self, block_hashes: BlockHashes,
                                         max_cache_hit_length: int) -> tuple[KVCacheBlocks, list[int]]:
        """Each attention group's own longest hit, none shortening another's: (blocks per
        group, hit tokens per group). The hits may disagree; the caller decides what to do."""
        num_groups = len(self.managers)
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
        hit_lengths = [0] * num_groups
        for group in self.attention_groups:
            manager = group.manager
            blocks, length = type(manager).find_longest_cache_hit(
                self.hashes_for(block_hashes, manager), max_cache_hit_length, group.group_ids, self.block_pool,
                group.spec, self.alignment_tokens)
            for gid, blks in zip(group.group_ids, blocks):
                hit_blocks[gid] = blks
                hit_lengths[gid] = length
        return KVCacheBlocks(tuple(hit_blocks)), hit_lengths


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int,
                             enable_caching: bool) -> KVCacheCoordinator:
    cls: type[KVCacheCoordinator]
    if not enable_caching:
        cls = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching)
