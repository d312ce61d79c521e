"""Invariant checks over a live ``EngineCore`` (see ``docs/invariants.md``).

``check_invariants(engine)`` asserts everything that must hold *between* engine steps and
needs nothing but the engine: the block pool (POOL-CONSERVE, POOL-REF, POOL-NULL,
POOL-HASH), the block tables (GROUP-DISJOINT, SWA-BOUND, MAMBA-BOUND, table/hash
consistency) and the scheduler's queues (REQ-CONSERVE for the requests the scheduler knows).
Pass the step's ``BatchRecord`` and the requests' token counts from before the step to also
check what that step decided (BUDGET, HIT-CAP, positions before the window nulled).

``check_cache_hit_probe`` checks HIT-AGREE / HIT-MONOTONE for one block-hash chain against
the pool as it is now. Every check raises ``AssertionError`` with a message naming the
invariant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.block_pool import KVCacheBlock
from kvtwin.sim.core.coordinator import HybridKVCacheCoordinator, KVCacheCoordinatorNoPrefixCache
from kvtwin.sim.core.engine import EngineCore, BatchRecord
from kvtwin.sim.core.attention_managers import ChunkedLocalAttentionManager, SlidingWindowManager
from kvtwin.sim.core.mamba_manager import MambaManager
from kvtwin.sim.core.request import RequestStatus
from kvtwin.sim.core.spec import FullAttentionSpec, cdiv


REJECTION_CODES = ("prompt_too_long", "bad_max_tokens", "exceeds_max_model_len", "exceeds_kv_pool")


def _fail(name: str, message: str) -> None:
    raise AssertionError(f"{name}: {message}")


# -- block pool -------------------------------------------------------------------------------

def check_pool(engine: EngineCore) -> None:
    kvm = engine.kv_cache_manager
    pool = kvm.block_pool
    num_blocks = pool.num_gpu_blocks
    null = pool.null_block
    managers = kvm.coordinator.managers

    free_ids = pool.free_block_queue.block_ids()
    if len(free_ids) != pool.get_num_free_blocks():
        _fail("POOL-CONSERVE", f"free counter {pool.get_num_free_blocks()} != free queue length {len(free_ids)}")
    dupes = [b for b, n in Counter(free_ids).items() if n > 1]
    if dupes:
        _fail("POOL-REF", f"blocks {dupes} appear more than once in the free queue")
    free_set = set(free_ids)

    # block id -> table entries holding it, over every group's tables
    held: Counter[int] = Counter()
    for gid, manager in enumerate(managers):
        for rid, table in manager.req_to_blocks.items():
            for i, block in enumerate(table):
                if block.block_id == 0 or block.is_null:
                    if block is not null or block.block_id != 0:
                        _fail("POOL-NULL", f"group {gid} request {rid} position {i}: {block!r} "
                                           f"is not the pool's null block")
                    continue
                if pool.blocks[block.block_id] is not block:
                    _fail("POOL-REF", f"group {gid} request {rid} holds a block object foreign to the pool")
                held[block.block_id] += 1

    # POOL-NULL
    if not null.is_null or null.block_id != 0:
        _fail("POOL-NULL", f"the null block is {null!r}")
    if 0 in free_set:
        _fail("POOL-NULL", "block 0 is in the free queue")
    if null.block_hash is not None:
        _fail("POOL-NULL", "block 0 carries a block hash")
    if any(b.is_null for b in pool.blocks[1:]):
        _fail("POOL-NULL", "a block other than 0 is marked null")

    # POOL-CONSERVE
    if len(free_ids) + len(held) != num_blocks - 1:
        _fail("POOL-CONSERVE", f"free {len(free_ids)} + held {len(held)} != num_blocks - 1 = {num_blocks - 1}")
    both = free_set & held.keys()
    if both:
        _fail("POOL-CONSERVE", f"blocks {sorted(both)} are both free and held by a table")

    # POOL-REF
    for block in pool.blocks[1:]:
        expected = held.get(block.block_id, 0)
        if block.ref_cnt != expected:
            _fail("POOL-REF", f"block {block.block_id} ref_cnt {block.ref_cnt} != {expected} table entries")
        if block.block_id in free_set and block.ref_cnt != 0:
            _fail("POOL-REF", f"free block {block.block_id} has ref_cnt {block.ref_cnt}")

    # POOL-HASH: the maps and the blocks' own keys agree both ways.
    in_map: set[int] = set()
    for gid, cache in enumerate(pool.cached_block_hash_to_block):
        for key, entry in cache.items():
            if type(entry) is KVCacheBlock:
                entries = [entry]
            else:
                if not entry:
                    _fail("POOL-HASH", f"group {gid}: empty multi-block entry left under a key")
                for bid, blk in entry.items():
                    if blk.block_id != bid:
                        _fail("POOL-HASH", f"group {gid}: block {blk.block_id} filed under id {bid}")
                entries = list(entry.values())
            for blk in entries:
                if blk.block_id == 0 or blk.is_null:
                    _fail("POOL-NULL", f"group {gid}: block 0 is in the hash map")
                if blk.block_id in in_map:
                    _fail("POOL-HASH", f"block {blk.block_id} is in the hash map twice")
                in_map.add(blk.block_id)
                if blk.block_hash != key or blk.group_id != gid:
                    _fail("POOL-HASH", f"block {blk.block_id} in group {gid}'s map under a key that is not its "
                                       f"own (block says group {blk.group_id})")
                if blk.block_id not in free_set and blk.block_id not in held:
                    _fail("POOL-HASH", f"cached block {blk.block_id} is neither held nor free")
    for block in pool.blocks[1:]:
        if block.block_hash is not None and block.block_id not in in_map:
            _fail("POOL-HASH", f"block {block.block_id} carries a hash but is not in the hash map")
        if block.block_hash is None and block.group_id != -1:
            _fail("POOL-HASH", f"unhashed block {block.block_id} still names group {block.group_id}")
    if not kvm.enable_caching and in_map:
        _fail("POOL-HASH", "blocks were cached with prefix caching off")

    usage = kvm.usage
    expected_usage = 1.0 - len(free_ids) / (num_blocks - 1)
    if abs(usage - expected_usage) > 1e-12:
        _fail("POOL-CONSERVE", f"usage {usage} != 1 - free/(num_blocks - 1) = {expected_usage}")


# -- block tables -------------------------------------------------------------------------------

def check_tables(engine: EngineCore) -> None:
    sched = engine.scheduler
    kvm = engine.kv_cache_manager
    coordinator = kvm.coordinator
    cfg = sched.config
    running = {r.request_id: r for r in sched.running}

    owner: dict[int, int] = {}  # block id -> group id
    for gid, manager in enumerate(coordinator.managers):
        spec = manager.spec
        bs = manager.block_size
        tables = manager.req_to_blocks
        stray = (tables.keys() | manager.num_cached_block.keys()) - running.keys()
        if stray:
            _fail("REQ-CONSERVE", f"group {gid} keeps blocks or state for non-running requests {sorted(stray)}")
        if isinstance(manager, MambaManager):
            stray = (manager.allocated_block_reqs | manager.last_state_block_idx.keys()) - running.keys()
            if stray:
                _fail("MAMBA-BOUND", f"group {gid} keeps state for non-running requests {sorted(stray)}")
        for rid, request in running.items():
            if rid not in tables:
                _fail("REQ-CONSERVE", f"running request {rid} has no block table in group {gid}")
            table = tables[rid]
            real = [b for b in table if not b.is_null]
            nc = request.num_computed_tokens

            # GROUP-DISJOINT
            for block in real:
                other = owner.setdefault(block.block_id, gid)
                if other != gid:
                    _fail("GROUP-DISJOINT", f"block {block.block_id} is live in groups {other} and {gid}")

            # The table covers exactly the computed tokens (a chunk's slots are allocated
            # when it is scheduled, and num_computed_tokens advances at schedule time).
            expected_len = cdiv(nc, bs)
            if isinstance(manager, MambaManager) and manager.align:
                expected_len += manager.num_speculative_blocks
            # With drafts (SPEC-SLOTS) the slots of rejected drafts stay allocated: up to k
            # (plus lookahead) positions past the computed tokens.
            spare = cfg.num_speculative_tokens + cfg.num_lookahead_tokens
            longest = expected_len if not spare else (
                cdiv(min(nc + spare, cfg.max_model_len), bs) + expected_len - cdiv(nc, bs))
            if not expected_len <= len(table) <= longest:
                _fail("TABLE-LEN", f"group {gid} request {rid}: {len(table)} table entries for {nc} computed "
                                   f"tokens (expected {expected_len}" + (f" to {longest})" if spare else ")"))
            if table and table[-1].is_null and not isinstance(spec, FullAttentionSpec):
                _fail("TABLE-LEN", f"group {gid} request {rid}: the block being written is the null block")
            if isinstance(spec, FullAttentionSpec) and len(real) != len(table):
                _fail("POOL-NULL", f"full-attention group {gid} request {rid} has a null block in its table")

            # SWA-BOUND / MAMBA-BOUND (chunked local shares the admission cap's bound).
            if isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                # vLLM's cap counts the batches' tokens in flight; with drafts the slots of
                # rejected drafts and a head's lookahead (the spare above) lie past them.
                cap = spec.max_admission_blocks_per_request(cfg.max_in_flight_tokens + spare, cfg.max_model_len)
                if len(real) > cap:
                    _fail("SWA-BOUND", f"group {gid} ({spec.kind}) request {rid} holds {len(real)} real blocks > "
                                       f"admission cap {cap}: {[b.block_id for b in table]}")
            if isinstance(manager, MambaManager):
                cap = spec.max_admission_blocks_per_request(cfg.max_in_flight_tokens, cfg.max_model_len)
                if manager.align and cfg.async_scheduling:
                    # What the batch in flight reads (its state, and its checkpoint with
                    # prefill checkpoints) is retired only once it ran: vLLM frees by the
                    # processed tokens, so one more of each while two batches fly.
                    cap += 1 + spec.num_prefill_checkpoint_blocks
                if len(real) > cap:
                    _fail("MAMBA-BOUND", f"group {gid} request {rid} holds {len(real)} real state blocks > {cap}: "
                                         f"{[b.block_id for b in table]}")

            # Cached entries carry exactly this request's chain hash; uncached ones none.
            num_cached = manager.num_cached_block.get(rid, 0)
            if num_cached > len(table):
                _fail("POOL-HASH", f"group {gid} request {rid}: num_cached_block {num_cached} > table {len(table)}")
            if kvm.enable_caching:
                hashes = coordinator.hashes_for(request.block_hashes, manager)
                for i, block in enumerate(table):
                    if block.is_null:
                        continue
                    if i < num_cached:
                        if block.block_hash is None and manager.thins_caching:
                            # Left out by prefix-cache retention, which must say so.
                            mask = manager.retained_blocks(request, i, i + 1)
                            if mask is not None and not mask[0]:
                                continue
                        if i >= len(hashes) or block.block_hash != hashes[i] or block.group_id != gid:
                            _fail("POOL-HASH", f"group {gid} request {rid} position {i}: cached block "
                                               f"{block.block_id} does not carry the request's hash there")
                    elif block.block_hash is not None:
                        _fail("POOL-HASH", f"group {gid} request {rid} position {i}: block {block.block_id} is "
                                           f"cached beyond num_cached_block {num_cached}")


# -- scheduler queues -------------------------------------------------------------------------------

def check_queues(engine: EngineCore) -> None:
    sched = engine.scheduler
    running_ids = [r.request_id for r in sched.running]
    waiting = list(sched.waiting)
    waiting_ids = [r.request_id for r in waiting]
    if len(set(running_ids)) != len(running_ids):
        _fail("REQ-CONSERVE", f"a request is in the running list twice: {running_ids}")
    if len(set(waiting_ids)) != len(waiting_ids):
        _fail("REQ-CONSERVE", f"a request is in the waiting queue twice: {waiting_ids}")
    both = set(running_ids) & set(waiting_ids)
    if both:
        _fail("REQ-CONSERVE", f"requests {sorted(both)} are both waiting and running")
    if set(sched.requests) != set(running_ids) | set(waiting_ids):
        _fail("REQ-CONSERVE", f"scheduler.requests {sorted(sched.requests)} != waiting ∪ running "
                              f"{sorted(set(running_ids) | set(waiting_ids))}")
    for request in sched.running:
        if request.status is not RequestStatus.RUNNING:
            _fail("REQ-CONSERVE", f"running request {request.request_id} has status {request.status}")
        # Async: the tokens being sampled in flight (placeholders) count as tokens it has; the
        # last of them is not computed yet (0 placeholders when synchronous).
        if not 0 < request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders:
            _fail("REQ-CONSERVE", f"running request {request.request_id} computed {request.num_computed_tokens} "
                                  f"of {request.num_tokens} tokens + {request.num_output_placeholders} placeholders")
        if not isinstance(sched, AsyncScheduler) and request.num_output_placeholders:
            _fail("REQ-CONSERVE", f"synchronous request {request.request_id} holds output placeholders")
    for request in waiting:
        if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            _fail("REQ-CONSERVE", f"waiting request {request.request_id} has status {request.status}")
        if request.num_computed_tokens != 0:
            _fail("PREEMPT-RESUME", f"waiting request {request.request_id} keeps {request.num_computed_tokens} "
                                    f"computed tokens")
    hasher = sched.hasher
    if hasher is not None:
        # HASH-LOOKAHEAD: a request has a hash for every block whose end plus the hash
        # lookahead (0, or a draft head's 1) lies within its tokens, and no more.
        for request in sched.requests.values():
            expected = max(0, request.num_tokens - hasher.lookahead) // hasher.hash_block_size
            if len(request.block_hashes) != expected:
                _fail("HASH-LOOKAHEAD", f"request {request.request_id}: {len(request.block_hashes)} block hashes for "
                                        f"{request.num_tokens} tokens, lookahead {hasher.lookahead} (expected {expected})")
    if len(sched.running) > sched.config.max_num_seqs:
        _fail("BUDGET", f"{len(sched.running)} running requests > max_num_seqs {sched.config.max_num_seqs}")
    for rejection in engine.rejected:
        request = rejection.request
        if request.status is not RequestStatus.REJECTED or rejection.code not in REJECTION_CODES \
                or not rejection.detail:
            _fail("REQ-CONSERVE", f"rejected request {request.request_id} has status {request.status}, "
                                  f"rejection {rejection.code!r}: {rejection.detail!r}")
        if request.request_id in sched.requests:
            _fail("REQ-CONSERVE", f"rejected request {request.request_id} was queued")


# -- one step's decisions -------------------------------------------------------------------------------

def check_step(engine: EngineCore, result: BatchRecord, num_tokens_before: Mapping[str, int],
               in_flight_before: Mapping[str, int] | None = None) -> None:
    """What the step decided: BUDGET, HIT-CAP, and nulls before the window.

    ``num_tokens_before`` maps each request id the scheduler knew before the step to its
    ``num_tokens`` then (admission sees the sequence before this step's sampled token).
    ``in_flight_before`` (async scheduling) maps it to its ``num_in_flight_tokens`` then:
    a window slides only by what was processed, so while a batch is in flight the
    positions it still reads stay real (0 for every request when synchronous).
    """
    in_flight_before = in_flight_before or {}
    sched = engine.scheduler
    cfg = sched.config
    kvm = engine.kv_cache_manager
    coordinator = kvm.coordinator
    out = result.output

    total = out.total_num_scheduled_tokens
    if total > cfg.max_num_batched_tokens:
        _fail("BUDGET", f"{total} tokens scheduled > max_num_batched_tokens {cfg.max_num_batched_tokens}")
    bad = {rid: n for rid, n in out.num_scheduled_tokens.items() if n <= 0}
    if bad:
        _fail("BUDGET", f"non-positive scheduled token counts {bad}")
    if out.preempted and out.scheduled_new_reqs:
        _fail("BUDGET", f"admitted {[a.req_id for a in out.scheduled_new_reqs]} in a step that preempted "
                        f"{out.preempted}")

    align = coordinator.scheduler_block_size
    for admission in out.scheduled_new_reqs:
        hit = admission.hit_tokens
        num_tokens = num_tokens_before[admission.req_id]
        if hit < 0 or hit > num_tokens - 1:
            _fail("HIT-CAP", f"request {admission.req_id} hit {hit} tokens of {num_tokens} (cap num_tokens-1)")
        if hit % align:
            _fail("HIT-CAP", f"request {admission.req_id} hit {hit} tokens, not a multiple of {align}")
        if (not kvm.enable_caching or isinstance(coordinator, KVCacheCoordinatorNoPrefixCache)) and hit:
            _fail("HIT-CAP", f"request {admission.req_id} hit {hit} tokens with prefix caching off")
        if admission.req_id not in out.num_scheduled_tokens:
            _fail("REQ-CONSERVE", f"admitted request {admission.req_id} has no scheduled tokens")

    # Positions the step's tokens can no longer read are the null block.
    finished = {r.request_id for r in result.finished}
    for rid, n in out.num_scheduled_tokens.items():
        if rid in finished:
            continue
        request = sched.requests[rid]
        processed = request.num_computed_tokens - n - in_flight_before.get(rid, 0)
        for gid, manager in enumerate(coordinator.managers):
            if not isinstance(manager, (SlidingWindowManager, ChunkedLocalAttentionManager)):
                continue
            table = manager.req_to_blocks[rid]
            dead = min(manager.get_num_skipped_tokens(processed) // manager.block_size, len(table))
            live = [i for i in range(dead) if not table[i].is_null]
            if live:
                _fail("SWA-BOUND", f"group {gid} request {rid}: positions {live} lie before the window "
                                   f"(processed {processed}) but hold real blocks")


def check_invariants(engine: EngineCore, result: BatchRecord | None = None,
                     num_tokens_before: Mapping[str, int] | None = None,
                     in_flight_before: Mapping[str, int] | None = None) -> None:
    """Every state invariant; with ``result`` (and ``num_tokens_before``) also the step's decisions."""
    check_pool(engine)
    check_tables(engine)
    check_queues(engine)
    if result is not None:
        check_step(engine, result, num_tokens_before or {}, in_flight_before)


# -- prefix-hit probes -------------------------------------------------------------------------------

def _needed_blocks(manager, hit: int) -> tuple[int, int]:
    """Block positions [first, end) whose KV the token at position ``hit`` reads."""
    bs = manager.block_size
    end = hit // bs
    if hit <= 0:
        return 0, 0
    if isinstance(manager, SlidingWindowManager):
        return max(0, hit - manager.spec.sliding_window + 1) // bs, end
    if isinstance(manager, ChunkedLocalAttentionManager):
        chunk = manager.spec.attention_chunk_size
        return hit // chunk * chunk // bs, end
    if isinstance(manager, MambaManager):
        return end - 1, end  # the state after the last hit token
    return 0, end


def _group_finders(coordinator) -> list[tuple[str, callable]]:
    """(label, finder(max_length) -> hit length) for every lookup unit of the coordinator."""
    pool = coordinator.block_pool
    if isinstance(coordinator, HybridKVCacheCoordinator):
        units = [(g.manager, g.group_ids, g.spec) for g in coordinator.attention_groups]
        align = coordinator.alignment_tokens
    else:
        units = [(m, [gid], m.spec) for gid, m in enumerate(coordinator.managers)]
        align = None
    finders = []
    for manager, group_ids, spec in units:
        def finder(length, hashes, manager=manager, group_ids=group_ids, spec=spec):
            return type(manager).find_longest_cache_hit(coordinator.hashes_for(hashes, manager), length, group_ids,
                                                        pool, spec, align or manager.block_size)[1]
        finders.append((f"groups {list(group_ids)} ({spec.kind})", finder))
    return finders


def check_cache_hit_probe(coordinator, block_hashes: Sequence, max_length: int, shorter: Sequence[int] = (),
                          exhaustive: bool = False) -> int:
    """HIT-AGREE and HIT-MONOTONE for one hash chain against the pool as it is now.

    ``coordinator`` is a KV cache coordinator (``engine.kv_cache_manager.coordinator``).
    Checks that the agreed hit is a fixed point of the coordinator and of every group's
    own finder, that every hit block sits in the pool's map under the probed hash (a hit
    reflects what the pool still holds), and that each ``shorter`` maximum gives no longer
    a hit. With ``exhaustive``, also that the hit is the *longest* length every group
    accepts (the greatest common fixed point at or below ``max_length``). Returns the hit.
    """
    if isinstance(coordinator, KVCacheCoordinatorNoPrefixCache):
        _, hit, _ = coordinator.find_longest_cache_hit(block_hashes, max_length)
        if hit:
            _fail("HIT-CAP", f"hit {hit} with prefix caching off")
        return hit
    # The scheduler asks with num_tokens - 1 for a chain of num_tokens // hash_block_size hashes.
    if not 0 <= max_length < (len(block_hashes) + 1) * coordinator.hash_block_size:
        raise ValueError(f"max_length {max_length} outside what num_tokens - 1 can be for "
                         f"{len(block_hashes)} block hashes")
    pool = coordinator.block_pool
    blocks, hit, _ = coordinator.find_longest_cache_hit(block_hashes, max_length)
    if not 0 <= hit <= max_length:
        _fail("HIT-CAP", f"hit {hit} outside [0, {max_length}]")
    if hit % coordinator.scheduler_block_size:
        _fail("HIT-CAP", f"hit {hit} not a multiple of {coordinator.scheduler_block_size}")
    for gid, manager in enumerate(coordinator.managers):
        group_blocks = blocks[gid]
        if hit and len(group_blocks) * manager.block_size < hit:
            _fail("HIT-AGREE", f"group {gid} returns {len(group_blocks)} blocks for a {hit}-token hit")
        if hit == 0 and any(not b.is_null for b in group_blocks):
            _fail("HIT-AGREE", f"group {gid} returns real blocks for a 0-token hit")
        if len(group_blocks) * manager.block_size > hit + manager.block_size - 1:
            _fail("HIT-AGREE", f"group {gid} returns {len(group_blocks)} blocks, more than a {hit}-token hit needs")
        # Sound: the hit holds every block the next token reads in this group.
        first, end = _needed_blocks(manager, hit)
        missing = [i for i in range(first, end) if i >= len(group_blocks) or group_blocks[i].is_null]
        if missing:
            _fail("HIT-AGREE", f"group {gid} ({manager.spec.kind}): a {hit}-token hit lacks blocks {missing} "
                               f"that the next token reads")
        hashes = coordinator.hashes_for(block_hashes, manager)
        for i, block in enumerate(group_blocks):
            if block.is_null:
                continue
            if block.block_hash != hashes[i] or block.group_id != gid:
                _fail("HIT-AGREE", f"group {gid} position {i}: hit block {block.block_id} is not cached under "
                                   f"the probed hash")
            if pool.get_cached_block(hashes[i], [gid]) is None:
                _fail("HIT-AGREE", f"group {gid} position {i}: hit block not in the pool's map")

    # The fixed point: asking again at the agreed length returns it unchanged ...
    _, again, _ = coordinator.find_longest_cache_hit(block_hashes, hit)
    if again != hit:
        _fail("HIT-AGREE", f"hit {hit} for max {max_length}, but {again} when asked at {hit}")
    # ... and so does every group's own finder.
    finders = _group_finders(coordinator)
    for label, finder in finders:
        own = finder(hit, block_hashes)
        if own != hit:
            _fail("HIT-AGREE", f"{label} return {own} when asked at the agreed hit {hit} (max {max_length})")
    if exhaustive:
        step = coordinator.scheduler_block_size
        for length in range(max_length // step * step, hit, -step):
            if all(finder(length, block_hashes) == length for _, finder in finders):
                _fail("HIT-AGREE", f"every group accepts {length} tokens (<= max {max_length}) but the hit is {hit}")

    for smaller in shorter:
        if not 0 <= smaller <= max_length:
            continue
        _, shorter_hit, _ = coordinator.find_longest_cache_hit(block_hashes, smaller)
        if shorter_hit > hit or shorter_hit > max(smaller, 0):
            _fail("HIT-MONOTONE", f"max {smaller} gives hit {shorter_hit}, max {max_length} gives {hit}")
    return hit
