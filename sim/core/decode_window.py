"""Decode windows: runs of batches scheduled without visiting every request at every step.

Most batches of a busy replay only decode: each running request gets one token and
nobody is preempted. Scheduled one by one (``Scheduler.schedule`` and
``update_from_output``), such a batch costs a dozen dictionary operations per request,
nearly all of them counting. In a window the counting is implicit: ``j`` batches in, each
decoding member is at a state known in closed form, and its fields are brought to it only
when something reads them. What the scheduler's own passes would do beyond counting is
still done, by the same calls, in the same order:

* a member whose allocation can change something (the KV cache manager's no-op horizon
  is crossed: a block to add or to cache) gets ``allocate_slots(request, 1)``, in running
  order, after its fields are brought to the batch's state;
* the one request still prefilling, if any (it is last in running order), gets its chunk
  as the running pass would clip it, and its allocation;
* the waiting queue is offered the rest of the budget through the scheduler's own
  ``schedule_waiting`` (usually one comparison: the blocked-head memo);
* the prefill chunk and the admissions, the batch's *real part*, are advanced by the
  scheduler's ``advance_computed``. Each request whose chunk ends its prefill
  becomes a decoding member from the next batch on; a partial chunk leaves its request
  prefilling (``_take``). A second partial chunk behind the first makes the batch a real
  one, finished by the scheduler (``complete``), and ends the window;
* members that sample their last token and the real part are applied through the
  scheduler's own update when their batch is (``apply``): they cache what their token
  completed, the finished are freed, a partial chunk's tokens leave the flight.

Only asynchronous scheduling with two batches in flight (vLLM's default), no offload
connector and no speculative decoding (the proof counts one token per decode) are
windowed; elsewhere the scheduler runs alone. Any layout of KV cache groups is (full
attention, sliding window, chunked local, Mamba, and their hybrids): what a group does
at a decode is the KV cache manager's, called or skipped as the scheduler calls or skips
it. ``WindowedBatchQueue`` (at the end of this file) is what a clock
sees: it hands out window batches and real ones alike, prices each window batch with the
executor's closed form (``WindowPricing``: the sum of the decodes' context ends where every
layer attends its whole context, else per layer class the keys its decodes attend, which
``LocalKeySum`` keeps in closed form for windowed and chunked layers), applies it when the
clock says it ended, and
ends the window where its state must become explicit (the clock's one say is whether the
time limit could cut the batch in flight short).

Why a window batch is the batch ``schedule()`` would make. A window opens when the one
batch in flight, ``X``, schedules exactly the running requests and every one samples in
it (a decode, or the chunk that ends a prefill) but perhaps the last, which may be left
prefilling. Let a member have ``c0`` computed tokens then and ``n0`` outputs; decoding,
``c0 = P + n0`` for its prompt of ``P``, and ``P + max_tokens <= max_model_len`` (longer
ones are rejected at arrival), so only ``max_tokens`` ends it. Call *state* ``j``: ``c0 +
j`` computed tokens, ``n0 + j`` outputs (the executor's tokens ``base + index``), one
placeholder, one token in flight (from state 1 on; at 0, ``X``'s). Suppose window batches
``V_0 .. V_{j-1}`` were scheduled, ``X, V_0 .. V_{j-2}`` applied, and every member still
running is at state ``j``.

In ``schedule()`` for ``V_j`` a member asks for ``num_tokens + placeholders - computed =
1`` token while ``c0 + j + 1 < P + max_tokens``, i.e. while ``j <= last_batch = max_tokens -
n0 - 2``; past that its last token is in flight and it is skipped. One token is never
clipped: the budget holds every member (an admission needs budget left, so members never
outnumber it), ``max_model_len`` is above, and no ``long_prefill`` or Mamba clip applies to
one token. Its allocation is skipped exactly while ``c0 + j + 1 <= horizon``, which is when
the window skips it too (``allocations_in``); otherwise ``allocate_slots`` runs on its real
state ``j``. The horizon is the KV cache manager's own, set by the member's last allocation
(the least over its groups: a windowed or chunked group's includes the next block it drops;
a Mamba group's, in "align" mode, is a lower bound past which ``allocate_slots`` asks
``is_noop`` first, and in "none" mode it has none, -1, so such a member is allocated in
every batch, as the scheduler allocates it), and nothing but that member's own
allocation changes its tables, so it is the scheduler's at every batch. The state ``allocate_slots`` reads is the
real one: computed tokens and outputs (``_sync``), and one token in flight, ``V_{j-1}``'s,
as ``X``'s update left it; a windowed group drops blocks by the tokens computed less those
in flight, and frees them (before the capacity check) in running order, as the scheduler
does, so the free queue's order is the scheduler's. The prefilling request, after every
member, gets what it lacks clipped by the long-prefill threshold, the budget the members
left and ``max_model_len``, and for a Mamba "align" layout split at block boundaries, as
the running pass clips it. A member's token adds at most, per group, the blocks its table
lacks for it (``_blocks_needed``: the count itself for attention groups, a bound for a
Mamba group in align mode; one block in all for one group), blocks freed by an allocation
only add to the free ones, and the prefilling request's need is counted exactly, so when
the free blocks cover them (checked before the batch) no allocation fails and nobody is
preempted; the waiting pass follows with the same budget, eligible count and pool (its
blocked-head memo, kept for one full-attention group only, is the scheduler's either
way). Table entries an allocation changed in place go into the batch's output, as the
running pass takes them. The real part's advance is the scheduler's own; a request whose
chunk samples is then at the state its member formula gives from ``V_{j+1}`` on (``c0 =
computed - j - 1``, once ``V_{j+1}``'s advance, which the window applies with that
request's update, is counted). The advance takes each member to ``c0 + j + 1`` computed
tokens, two placeholders and two in flight.

Applying ``V_{j-1}`` gives each of its members output ``n0 + j + 1``. One that still has
a batch in flight (``V_j``) caches nothing (only the update that leaves no token in flight
does) and does not finish: it is at state ``j + 1``. One that sampled its last token
(``last_batch = j - 1``), and the real part, go through the scheduler's update, in running
order; the partial chunks' tokens leave the flight in the batches' order. By induction
every window batch is the batch ``schedule()`` makes; ``close`` writes state ``j`` into
every member still running and turns the batch in flight into the ``SchedulerOutput``
``schedule()`` would have made of it, for the clock to queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.engine import Batch, BatchRecord, EngineCore, Execution, ModelExecutor, RequestSnapshot
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.core.scheduler_output import SchedulerOutput

# A window opens only if some member decodes at least this many batches more.
MIN_WINDOW_STEPS = 2

# A window batch (``next_batch``): scheduled in the window, or not (the window ends before
# it), or made real (its waiting pass admitted what the window cannot take).
WINDOW_BATCH = 1
END = 0
REAL_BATCH = -1


# How a layer class's decodes attend their context (``WindowPricing.decode_key_shapes``):
# every key, the last ``W`` keys (sliding window), the keys of the current chunk of ``C``
# (chunked local), or none (a recurrent state, read once whatever the context).
FULL_KEYS = 0
WINDOW_KEYS = 1
CHUNK_KEYS = 2
NO_KEYS = 3


def decode_keys(kind: int, size: int, context_ends: list[int]) -> int:
    """The keys decodes ending at ``context_ends`` attend in a layer of shape ``(kind,
    size)``: what ``decode_attended_keys`` of its spec returns."""
    if kind == FULL_KEYS:
        return sum(context_ends)
    if kind == WINDOW_KEYS:
        return sum(e if e < size else size for e in context_ends)
    if kind == CHUNK_KEYS:
        return sum((e - 1) % size + 1 for e in context_ends)
    return 0


class LocalKeySum:
    """The keys a window batch's member decodes attend in layers of one windowed shape,
    kept in closed form as members come and go and their contexts grow by one a batch.

    At batch ``j`` member ``i`` decodes to context ``e = c0 + j + 1``. Sliding window
    ``W``: it attends ``min(e, W)`` keys, ``W`` from batch ``W - 1 - c0`` on; so the sum
    is ``W`` per capped member plus the uncapped members' contexts. Chunked local ``C``:
    it attends ``(e - 1) mod C + 1 = e - C * floor((c0 + j) / C)`` keys; so the sum is the
    members' contexts less ``C`` times the sum of those floors, each of which grows by one
    at a batch known in advance. Either way a member changes class only at a scheduled
    batch (a heap of them), as it changes block in the KV cache manager."""

    def __init__(self, kind: int, size: int):
        self.kind = kind
        self.size = size
        # Window: capped members' count, the uncapped ones' count and c0 sum. Chunk: the
        # active members' floors' sum (in ``capped``).
        self.capped = 0
        self.num_open = 0
        self.c0_sum_open = 0
        # Member -> its floor (chunk), or -1 uncapped / -2 capped (window); gone: absent.
        self.state: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []

    def join(self, i: int, c0: int, index: int) -> None:
        """Member ``i`` (``c0``) decodes from batch ``index`` on."""
        size = self.size
        if self.kind == WINDOW_KEYS:
            cap_batch = size - 1 - c0
            if cap_batch <= index:
                self.state[i] = -2
                self.capped += 1
            else:
                self.state[i] = -1
                self.num_open += 1
                self.c0_sum_open += c0
                heapq.heappush(self.events, (cap_batch, i))
        else:
            floor = (c0 + index) // size
            self.state[i] = floor
            self.capped += floor
            heapq.heappush(self.events, ((floor + 1) * size - c0, i))

    def leave(self, i: int, c0: int) -> None:
        """Member ``i`` decodes no more (its events are dropped when they come up)."""
        state = self.state.pop(i)
        if self.kind == WINDOW_KEYS:
            if state == -2:
                self.capped -= 1
            else:
                self.num_open -= 1
                self.c0_sum_open -= c0
        else:
            self.capped -= state

    def advance(self, index: int, computed_at_open: list[int]) -> None:
        """Bring every member to batch ``index`` (once per batch, in order)."""
        events = self.events
        state = self.state
        size = self.size
        while events and events[0][0] <= index:
            i = heapq.heappop(events)[1]
            current = state.get(i)
            if current is None:
                continue
            c0 = computed_at_open[i]
            if self.kind == WINDOW_KEYS:
                state[i] = -2
                self.capped += 1
                self.num_open -= 1
                self.c0_sum_open -= c0
            else:
                floor = (c0 + index) // size
                state[i] = floor
                self.capped += floor - current
                heapq.heappush(events, ((floor + 1) * size - c0, i))

    def keys(self, index: int, context_ends_sum: int) -> int:
        """The sum at batch ``index`` (members brought to it; ``context_ends_sum`` theirs)."""
        if self.kind == WINDOW_KEYS:
            return self.size * self.capped + self.c0_sum_open + self.num_open * (index + 1)
        return context_ends_sum - self.size * self.capped


class DecodeWindow:
    """A decode window over the running requests of ``scheduler`` (module docstring).

    Members are indexed in running order: those decoding when it opens, then those its
    batches admit or finish prefilling. Member ``i`` decodes in window batches
    ``first_batch[i]`` to ``last_batch[i]`` (it samples its last token in the latter); at
    state ``j`` it has ``c0[i] + j`` computed tokens (the proof's ``c0`` is
    ``computed_at_open``, its ``j`` the methods' ``index``: window batch ``V_index``); its
    output ``k`` is the token ``token_bases[i] + k``. At most one request, last in running order, is still
    prefilling (``prefilling``): its chunks are scheduled, advanced and applied by the
    scheduler's own code, as the *real part* of a batch (``parts``) with the batch's
    admissions. The batch ``X`` in flight when the window opens is applied for real
    (``begin_real_update`` and ``end_real_update`` around the engine's ``update_batch``)."""

    def __init__(self, scheduler: AsyncScheduler, members: list[Request], token_bases: list[int],
                 last_batches: list[int], prefilling: Request | None,
                 key_shapes: list[tuple[int, int]] | None = None):
        self.scheduler = scheduler
        self.kv_cache_manager = scheduler.kv_cache_manager
        # Running members by index (a finished one is dropped: a long window would keep
        # every request it ever held in memory).
        self.requests: dict[int, Request] = dict(enumerate(members))
        self.num_original = len(members)
        self.token_bases = token_bases
        self.first_batch = [0] * self.num_original
        self.last_batch = last_batches
        self.computed_at_open = [r.num_computed_tokens for r in members]
        self.prefilling = prefilling
        # The members in the batch being scheduled, and the sum of their c0.
        self.num_active = self.num_original
        self.c0_sum_active = sum(self.computed_at_open)
        # Pricing by layer class (None: every layer attends the whole context, and the
        # sum of context ends prices a batch): the class's shape, and for a windowed or
        # chunked class its closed-form sum (one per distinct shape).
        self.key_shapes = key_shapes
        self.local_sums: dict[tuple[int, int], LocalKeySum] = {}
        if key_shapes is not None:
            for kind, size in key_shapes:
                if kind in (WINDOW_KEYS, CHUNK_KEYS) and (kind, size) not in self.local_sums:
                    local = self.local_sums[(kind, size)] = LocalKeySum(kind, size)
                    for i, c0 in enumerate(self.computed_at_open):
                        local.join(i, c0, 0)
        # Members by the window batch they first decode in, and by the last one.
        self._first_in: dict[int, list[int]] = {}
        self._last_in: dict[int, list[int]] = {}
        for i, last in enumerate(last_batches):
            self._last_in.setdefault(last, []).append(i)
        # Those whose last batch is the one the current iteration applies (they finish then).
        self.finishing: list[int] = []
        self._batch = -1
        # The window state each member's fields hold (0 at the start; 1 once X is applied).
        self.synced = [0] * self.num_original
        # (window batch, member) of each member's next allocation, in batch then running
        # order: the order the scheduler's running pass calls them in.
        horizon = self.kv_cache_manager.noop_horizon
        events: list[tuple[int, int]] = []
        for i, request in enumerate(members):
            events.append((max(horizon.get(request.request_id, -1) - self.computed_at_open[i], 0), i))
        heapq.heapify(events)
        self._events = events
        # Per window batch with a real part (a prefill chunk, admissions): that part as an
        # output the scheduler advanced, the tokens it samples, and the members it made;
        # dropped once the batch is applied.
        self.parts: dict[int, SchedulerOutput] = {}
        self.part_sampled: dict[int, dict[str, list[int]]] = {}
        self.part_members: dict[int, dict[str, int]] = {}
        # The prefill chunk of the batch being scheduled (0: none).
        self.prefill_chunk = 0
        # Of the last window batch and of the one before it: the blocks appended, and the
        # finished requests the batch reported (what a real output of it carries).
        self.new_blocks: dict[str, KVCacheBlocks] = {}
        self.previous_new_blocks: dict[str, KVCacheBlocks] = {}
        # Likewise the table entries its allocations changed in place (hybrid layouts).
        self.new_replaced: dict[str, list[tuple[int, int, int]]] = {}
        self.previous_new_replaced: dict[str, list[tuple[int, int, int]]] = {}
        self.single_group = self.kv_cache_manager.num_groups == 1
        self.reported: list[str] = []
        self.previous_reported: list[str] = []
        self._scratch = SchedulerOutput()
        self.admitted: SchedulerOutput | None = None  # see next_batch

    def batch_size(self, index: int) -> int:
        """How many members ``V_j`` decodes: those from ``first_batch`` to ``last_batch``
        (one whose last batch was ``V_{j-1}`` is skipped, its last token in flight, and
        finishes when that batch is applied: ``finishing``). Once per ``j``, in order."""
        if index != self._batch:
            self._batch = index
            computed_at_open = self.computed_at_open
            joining = self._first_in.pop(index, [])
            for i in joining:
                self.num_active += 1
                self.c0_sum_active += computed_at_open[i]
            self.finishing = self._last_in.pop(index - 1, [])
            for i in self.finishing:
                self.num_active -= 1
                self.c0_sum_active -= computed_at_open[i]
            if self.local_sums:
                for local in self.local_sums.values():
                    for i in joining:
                        local.join(i, computed_at_open[i], index)
                    for i in self.finishing:
                        local.leave(i, computed_at_open[i])
                    local.advance(index, computed_at_open)
        return self.num_active

    def context_ends_sum(self, index: int) -> int:
        """The sum of the context lengths ``V_j``'s member decodes end at."""
        return self.c0_sum_active + self.num_active * (index + 1)

    def attended_keys(self, index: int, part_ends: list[int]) -> list[int]:
        """Per layer class (``key_shapes``), the keys ``V_j``'s decodes attend: its
        member decodes (closed form) and its real part's decodes ending at ``part_ends``."""
        shapes = self.key_shapes
        assert shapes is not None
        ends_sum = self.context_ends_sum(index)
        attended: list[int] = []
        for kind, size in shapes:
            if kind == FULL_KEYS:
                keys = ends_sum
            elif kind == NO_KEYS:
                keys = 0
            else:
                keys = self.local_sums[(kind, size)].keys(index, ends_sum)
            attended.append(keys + decode_keys(kind, size, part_ends) if part_ends else keys)
        return attended

    def part_decode_ends(self, index: int) -> list[int]:
        """The context ends of ``V_j``'s real part's decodes (one-token chunks)."""
        part = self.parts.get(index)
        if part is None:
            return []
        return [computed + 1 for num_new, computed in zip(part.num_scheduled_tokens.values(), part.num_computed_tokens)
                if num_new == 1]

    def part_cost_terms(self, index: int) -> tuple[int, int, list[tuple[int, int]]]:
        """What ``V_j``'s real part adds to its cost: (decodes, the sum of their context
        ends, prefill chunks as (new tokens, computed before)), as ``step_cost`` splits them."""
        part = self.parts.get(index)
        if part is None:
            return 0, 0, []
        num_decodes = 0
        ends_sum = 0
        prefill_items: list[tuple[int, int]] = []
        for num_new, computed in zip(part.num_scheduled_tokens.values(), part.num_computed_tokens):
            if num_new == 1:
                num_decodes += 1
                ends_sum += computed + 1
            else:
                prefill_items.append((num_new, computed))
        return num_decodes, ends_sum, prefill_items

    def next_batch(self, index: int) -> int:
        """Schedule ``V_j`` if it is a window batch (``WINDOW_BATCH``: ``num_active``
        member decodes, and its real part in ``parts[j]`` if it has one); ``END`` if the
        window ends before it (nobody left, or its allocations might not fit the free
        blocks: a real batch decides whether to preempt); ``REAL_BATCH`` if its waiting
        pass admitted what the window cannot take (``admitted``: see ``complete``)."""
        num_decodes = self.batch_size(index)
        prefilling = self.prefilling
        if not num_decodes and prefilling is None:
            return END
        due = self.allocations_in(index)
        needed = len(due) if self.single_group else self._blocks_needed(due, index)
        chunk = self.prefill_chunk = self._next_chunk() if prefilling is not None else 0
        if chunk:
            assert prefilling is not None
            computed = prefilling.num_computed_tokens
            if computed + chunk > self.kv_cache_manager.noop_horizon.get(prefilling.request_id, -1):
                needed += self.kv_cache_manager.coordinator.get_num_blocks_to_allocate(
                    prefilling.request_id, min(computed + chunk, self.scheduler.config.max_model_len),
                    self.kv_cache_manager.empty_blocks, computed, computed + chunk, False,
                    max(prefilling.num_prompt_tokens, prefilling.num_tokens - 1))
        if needed > self.kv_cache_manager.block_pool.get_num_free_blocks():
            return END
        admitted = self.schedule(index, due, chunk)
        if admitted is not None:
            self.admitted = admitted
            return REAL_BATCH
        return WINDOW_BATCH

    def _blocks_needed(self, due: list[int], index: int) -> int:
        """What the allocations of ``due`` at state ``index`` can take from the pool, at
        most: per group, the blocks its table lacks for the token (one token adds at most
        one block to a group; a Mamba group in align mode takes at most that many)."""
        managers = self.kv_cache_manager.coordinator.managers
        requests = self.requests
        computed_at_open = self.computed_at_open
        needed = 0
        for i in due:
            request_id = requests[i].request_id
            end = computed_at_open[i] + index + 1
            for manager in managers:
                table = manager.req_to_blocks.get(request_id)
                lacking = -(-end // manager.block_size) - (len(table) if table is not None else 0)
                if lacking > 0:
                    needed += lacking
        return needed

    def _next_chunk(self) -> int:
        """The prefilling request's chunk in the running pass: what it lacks, clipped as
        ``schedule()`` clips it, in the budget the members before it left (one token each)."""
        request = self.prefilling
        assert request is not None
        scheduler = self.scheduler
        computed = request.num_computed_tokens
        budget = scheduler.config.max_num_batched_tokens - self.num_active
        chunk = scheduler.clip_running_chunk(request.num_tokens - computed, computed, budget,
                                             scheduler.long_prefill_threshold())
        if scheduler.mamba_block_size and chunk > 0:
            chunk = scheduler.mamba_block_aligned_split(request, chunk, 0)
        return max(chunk, 0)

    def allocations_in(self, index: int) -> list[int]:
        """The members whose allocation ``V_j`` calls, in order; taken off the queue."""
        events = self._events
        last_batch = self.last_batch
        due: list[int] = []
        while events and events[0][0] == index:
            i = heapq.heappop(events)[1]
            if last_batch[i] >= index:
                due.append(i)
        return due

    def schedule(self, index: int, due: list[int], chunk: int) -> SchedulerOutput | None:
        """Schedule window batch ``V_j``: the allocations of ``due`` (``allocations_in(j)``)
        and of the prefilling request's ``chunk``, which fit the free blocks, then the
        waiting pass. Returns None, or the waiting pass's scratch output if it admitted
        what the window cannot take (``complete`` makes the batch real)."""
        scheduler = self.scheduler
        kv_cache_manager = self.kv_cache_manager
        self.previous_reported = self.reported
        self.reported, scheduler.finished_req_ids = scheduler.finished_req_ids, []
        kv_cache_manager.new_step_starts()
        self.previous_new_blocks = self.new_blocks
        self.new_blocks = {}
        self.previous_new_replaced = self.new_replaced
        self.new_replaced = {}
        horizon = kv_cache_manager.noop_horizon
        if due:
            computed_at_open = self.computed_at_open
            for i in due:
                request = self.requests[i]
                self._sync(i, index)
                self._allocate(request, 1)
                next_batch = max(horizon.get(request.request_id, -1) - computed_at_open[i], index + 1)
                heapq.heappush(self._events, (next_batch, i))
        prefilling = self.prefilling
        if chunk:
            assert prefilling is not None
            if prefilling.num_computed_tokens + chunk > horizon.get(prefilling.request_id, -1):
                self._allocate(prefilling, chunk)
        admitted: SchedulerOutput | None = None
        waiting = scheduler.waiting
        if len(waiting):
            scratch = self._scratch
            scheduler.schedule_waiting(scratch, scheduler.config.max_num_batched_tokens - self.num_active - chunk,
                                        scheduler.long_prefill_threshold())
            if scratch.num_scheduled_tokens:
                admitted = scratch
                self._scratch = SchedulerOutput()
        if not chunk and admitted is None:
            # The advance of a window batch (its entry of partial chunks, none, is queued
            # by ``close`` for the one window batch still in flight then).
            scheduler.num_batches += 1
            return None
        part_tokens: dict[str, int] = {}
        if chunk:
            assert prefilling is not None
            part_tokens[prefilling.request_id] = chunk
        if admitted is not None:
            part_tokens.update(admitted.num_scheduled_tokens)
        if not self._can_take(part_tokens):
            assert admitted is not None  # a lone chunk always can
            return admitted
        part = SchedulerOutput(num_scheduled_tokens=part_tokens,
                               scheduled_new_reqs=admitted.scheduled_new_reqs if admitted is not None else [])
        scheduler.advance_computed(part)
        self._take(index, part)
        return None

    def _allocate(self, request: Request, num_new: int) -> None:
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
        if new_blocks is None:
            raise AssertionError(f"decode window: allocation for {request.request_id} failed in a batch "
                                 f"whose allocations were counted against the free blocks")
        if new_blocks is not self.kv_cache_manager.empty_blocks:
            self.new_blocks[request.request_id] = new_blocks
        replaced_log = self.kv_cache_manager.replaced_block_ids
        if replaced_log:
            # Entries changed in place (windowed blocks nulled, Mamba states moved): taken
            # into the batch's output, as the running pass takes them.
            replaced = replaced_log.pop(request.request_id, None)
            if replaced is not None:
                self.new_replaced[request.request_id] = replaced

    def _can_take(self, part_tokens: dict[str, int]) -> bool:
        """Whether the window can carry a real part: every request in it but the last
        ends its prefill with it (and samples); the last may be a partial chunk, and is
        then the one prefilling request, last in running order."""
        requests = self.scheduler.requests
        last = len(part_tokens) - 1
        for k, (request_id, num_new) in enumerate(part_tokens.items()):
            request = requests[request_id]
            if request.num_computed_tokens + num_new != request.num_tokens and k != last:
                return False
        return True

    def _take(self, index: int, part: SchedulerOutput) -> None:
        """``V_j``'s real part, advanced by the scheduler: each request it ends the prefill
        of decodes in the window from ``V_{j+1}`` on; a partial chunk stays prefilling."""
        self.parts[index] = part
        members = self.part_members[index] = {}
        requests = self.scheduler.requests
        horizon = self.kv_cache_manager.noop_horizon
        self.prefilling = None
        for request_id in part.num_scheduled_tokens:
            request = requests[request_id]
            if request_id not in part.num_output_tokens:
                self.prefilling = request  # its chunk samples nothing: more follow
                continue
            i = len(self.computed_at_open)
            members[request_id] = i
            self.requests[i] = request
            # Applied with V_{j+1} scheduled, it is at state j + 2: one more computed
            # token than now, one more output.
            computed_at_open = request.num_computed_tokens - index - 1
            last = request.max_tokens - len(request.output_token_ids) + index - 1
            self.computed_at_open.append(computed_at_open)
            self.first_batch.append(index + 1)
            self.last_batch.append(last)
            self.synced.append(index + 2)
            self.token_bases.append(-1)  # ``note_part_tokens``
            if last >= index + 1:  # else its first token is its last: it finishes when V_j is applied
                self._first_in.setdefault(index + 1, []).append(i)
                self._last_in.setdefault(last, []).append(i)
                heapq.heappush(self._events, (max(horizon.get(request_id, -1) - computed_at_open, index + 1), i))

    def part_sampling_ids(self, index: int) -> list[str]:
        return list(self.part_members[index])

    def note_part_tokens(self, index: int, sampled: dict[str, list[int]], token_bases: list[int | None]) -> None:
        """The executor's tokens for ``V_j``'s real part, and the token bases of the
        members it made (``part_sampling_ids`` order)."""
        self.part_sampled[index] = sampled
        for i, base in zip(self.part_members[index].values(), token_bases):
            assert base is not None  # sampled just now
            self.token_bases[i] = base

    def begin_real_update(self) -> None:
        """Before ``X`` is applied for real, with ``V_0`` scheduled: ``V_0``'s advance."""
        for i in range(self.num_original):
            _advance_one_decode(self.requests[i])

    def end_real_update(self) -> None:
        """``X`` was applied: every original member is at state 1."""
        for i in range(self.num_original):
            self.synced[i] = 1

    def apply(self, index: int) -> tuple[list[Request], dict[str, int], SchedulerOutput | None,
                                     dict[str, list[int]] | None]:
        """Apply ``V_{j-1}`` (``j >= 1``) where it does more than count: members that
        sampled their last token (``finishing``) and the batch's real part go through the
        scheduler's own update, in running order (they cache what their token completed;
        the finished are freed; a partial chunk's tokens leave the flight). Returns the
        finished, the window steps of each finished member, and the real part's output
        and tokens (None: it had none)."""
        finishing = self.finishing
        part = self.parts.pop(index - 1, None)
        part_sampled = self.part_sampled.pop(index - 1, None)
        steps: dict[str, int] = {}
        if not finishing and part is None:
            return [], steps, None, None
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        sampled: dict[str, list[int]] = {}
        for i in finishing:
            self._sync(i, index)
            request = self.requests[i]
            scheduled[request.request_id] = 1
            sampled[request.request_id] = [self.token_bases[i] + len(request.output_token_ids)]
            steps[request.request_id] = self.window_steps(i, index)
            del self.requests[i]
        if part is not None:
            assert part_sampled is not None
            members = self.part_members.pop(index - 1)
            scheduled.update(part.num_scheduled_tokens)
            for request_id, i in members.items():
                if self.last_batch[i] >= index:
                    _advance_one_decode(self.requests[i])  # it is in V_j too
                else:
                    del self.requests[i]  # its first token was its last
            sampled.update(part_sampled)
        else:
            # What the update takes first: this batch's partial chunks, none (a later
            # batch's real part may already be queued behind).
            self.scheduler.in_flight_partials.appendleft([])
        return self.scheduler.update_from_output(out, sampled), steps, part, part_sampled

    def window_steps(self, i: int, index: int) -> int:
        """Of member ``i``'s batches, those applied in window steps up to ``V_{j-1}``."""
        return max(0, index - self.first_batch[i])

    def _sync(self, i: int, index: int) -> None:
        """Write state ``j`` into member ``i``: its computed tokens and outputs."""
        behind = index - self.synced[i]
        if behind <= 0:
            return
        request = self.requests[i]
        request.num_computed_tokens = self.computed_at_open[i] + index
        first = self.token_bases[i] + len(request.output_token_ids)
        request.append_output_token_ids(list(range(first, first + behind)))
        self.synced[i] = index

    def close(self, index: int, new_blocks: dict[str, KVCacheBlocks], reported: list[str],
              replaced: dict[str, list[tuple[int, int, int]]]) -> SchedulerOutput:
        """End the window at state ``j`` (``j >= 1``: ``V_{j-1}`` in flight, appending
        ``new_blocks``, changing ``replaced`` in place and reporting ``reported``
        finished): every member still running
        gets state ``j``, and ``V_{j-1}`` becomes the output ``schedule()`` would have made
        of it (its member decodes, then its real part), for the clock to execute and queue."""
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        computed = out.num_computed_tokens
        sampling = out.num_output_tokens
        last = index - 1
        for i, request in self.requests.items():
            if not self.first_batch[i] <= last <= self.last_batch[i]:
                continue
            self._sync(i, index)
            request_id = request.request_id
            scheduled[request_id] = 1
            computed.append(self.computed_at_open[i] + last)
            sampling[request_id] = len(request.output_token_ids)
        part = self.parts.pop(last, None)
        if part is not None:
            scheduled.update(part.num_scheduled_tokens)
            computed.extend(part.num_computed_tokens)
            sampling.update(part.num_output_tokens)
            out.scheduled_new_reqs = part.scheduled_new_reqs
        else:
            self.scheduler.in_flight_partials.append([])  # the batch's partial chunks: none
        out.scheduled_cached_reqs.new_blocks = new_blocks
        out.scheduled_cached_reqs.replaced_block_ids = replaced
        out.finished_req_ids = reported
        return out

    def members_to_record(self, index: int) -> list[tuple[str, int]]:
        """At ``close(j)``: each running member's request id and its window steps."""
        steps = [(request.request_id, self.window_steps(i, index - 1)) for i, request in self.requests.items()]
        return [(request_id, num_steps) for request_id, num_steps in steps if num_steps]

    def complete(self, index: int, scratch: SchedulerOutput) -> SchedulerOutput:
        """``V_j``'s waiting pass admitted (``scratch``) what the window cannot take: the
        batch as ``schedule()`` makes it, its member decodes (at state ``j``, after
        ``close(j, ...)`` for ``j >= 1``), then the prefilling request's chunk, then the
        admissions, advanced by the scheduler."""
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        for i, request in self.requests.items():
            if self.first_batch[i] <= index <= self.last_batch[i]:
                scheduled[request.request_id] = 1
        if self.prefill_chunk:
            assert self.prefilling is not None
            scheduled[self.prefilling.request_id] = self.prefill_chunk
        scheduled.update(scratch.num_scheduled_tokens)
        out.scheduled_new_reqs = scratch.scheduled_new_reqs
        out.scheduled_cached_reqs.new_blocks = self.new_blocks
        out.scheduled_cached_reqs.replaced_block_ids = self.new_replaced
        out.finished_req_ids = self.reported
        self.scheduler.advance_computed(out)
        return out


def _advance_one_decode(request: Request) -> None:
    """The advance of one decode in the batch after the one about to be applied, which
    the window leaves implicit but that update reads (its tokens still in flight)."""
    request.num_computed_tokens += 1
    request.num_in_flight_tokens += 1
    request.num_output_placeholders += 1


def open_decode_window(scheduler: Scheduler, in_flight: SchedulerOutput, sampled: dict[str, list[int]],
                       token_bases: list[int | None],
                       key_shapes: list[tuple[int, int]] | None = None) -> DecodeWindow | None:
    """A window over ``scheduler.running``, if the batch ``in_flight`` (the only one, its
    tokens ``sampled``) is the batch that opens one and some request decodes
    ``MIN_WINDOW_STEPS`` batches more; else None. ``token_bases``: the executor's base per
    running request (None: it has sampled nothing, or its tokens are not ``base + index``);
    ``key_shapes``: the pricing's (``WindowPricing.decode_key_shapes``)."""
    kv_cache_manager = scheduler.kv_cache_manager
    # The proof counts on vLLM's two batches in flight, on a pool only the scheduler's own
    # passes change (no connector loading into it), and on one token per decode (no drafts).
    if (not isinstance(scheduler, AsyncScheduler) or scheduler.config.max_concurrent_batches != 2
            or scheduler.connector is not None
            or scheduler.num_spec_tokens
            or scheduler.finished_req_ids):
        return None
    running = scheduler.running
    n = len(running)
    scheduled = in_flight.num_scheduled_tokens
    if (n == 0 or len(scheduled) != n or len(sampled) != len(in_flight.num_output_tokens) or in_flight.preempted
            or n > scheduler.config.max_num_batched_tokens):
        return None
    max_model_len = scheduler.config.max_model_len
    longest = -1
    members: list[Request] = []
    bases: list[int] = []
    last_batches: list[int] = []
    prefilling: Request | None = None
    for k, ((request_id, num_tokens), request, base) in enumerate(zip(scheduled.items(), running, token_bases)):
        if (request_id != request.request_id or request.status is not RequestStatus.RUNNING
                or request.num_in_flight_tokens != num_tokens
                or request.num_prompt_tokens + request.max_tokens > max_model_len):
            return None
        if request_id not in in_flight.num_output_tokens:
            # A partial prefill chunk: only the last request may be left prefilling.
            if k != n - 1 or request.num_output_placeholders or request.num_computed_tokens >= request.num_tokens:
                return None
            prefilling = request
            continue
        # It samples in X (a decode, or the chunk that ends its prefill) and then decodes:
        # every token it has computed, one placeholder, only X's tokens in flight.
        if base is None or request.num_output_placeholders != 1 or request.num_computed_tokens != request.num_tokens:
            return None
        outputs = request.output_token_ids
        n0 = len(outputs)
        if n0 and outputs[-1] != base + n0 - 1:
            return None
        # Scheduled while c0 + j + 1 < P + max_tokens; X itself must not finish it.
        last = request.max_tokens - n0 - 2
        if last < 0:
            return None
        if last > longest:
            longest = last
        members.append(request)
        bases.append(base)
        last_batches.append(last)
    if longest < MIN_WINDOW_STEPS:
        return None
    return DecodeWindow(scheduler, members, bases, last_batches, prefilling, key_shapes)


class WindowPricing(Protocol):
    """An executor whose window batches need not run: a closed form prices a batch of
    decodes (with a real part's prefill chunks), and its tokens are ``base + index``."""

    def execute(self, output: SchedulerOutput) -> Execution:
        ...

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> Any:
        """The cost (its ``total_s`` the seconds) ``execute`` predicts for such a batch."""
        ...

    def decode_key_shapes(self) -> list[tuple[int, int]] | None:
        """Per layer class, how its decodes attend (``FULL_KEYS`` ...); None where every
        class attends the whole context (``decode_step_cost`` then prices a batch)."""
        ...

    def decode_step_cost_by_keys(self, num_decodes: int, attended_keys: list[int],
                                 prefill_items: list[tuple[int, int]] | None = None) -> Any:
        """``decode_step_cost`` given the keys the decodes attend per layer class."""
        ...

    def sample(self, output: SchedulerOutput) -> dict[str, list[int]]:
        ...

    def token_bases(self, request_ids: list[str]) -> list[int | None]:
        ...


@dataclass
class Launch:
    """A batch just scheduled, as the clock needs it: how long it runs on the device,
    whether it computes anything (a batch that does not takes no time), whether it
    preempted, and, when scheduling it closed a decode window, the window's running
    members and their window steps (their records catch up at the last window batch)."""

    duration_s: float
    executed: bool
    preempted: bool
    closed_window: list[tuple[str, int]] | None = None

    def __init__(self, duration_s: float, executed: bool, preempted: bool,
                 closed_window: list[tuple[str, int]] | None = None):
        self.duration_s = duration_s
        self.executed = executed
        self.preempted = preempted
        self.closed_window = closed_window


class WindowedBatchQueue:
    """An asynchronous engine's batches in flight, decode windows included.

    The clock asks ``schedule`` for the next batch and ``update`` for the oldest one's
    results, the same way whether a window is open or not. ``schedule`` opens a window on
    the one batch in flight when it can (``open_decode_window``), goes on with it while
    the clock allows (``window_allowed``: the time limit cannot cut the window's batch in
    flight short), and otherwise schedules through the engine. Closing a window turns its
    batch in flight into the real output ``schedule()`` would have made (``close``),
    priced as the window priced it. ``update`` applies the oldest batch: a real one
    through the engine (the window's advance around it while a window opens on it), a
    window batch through ``DecodeWindow.apply``. ``pricing`` None: no windows, every batch
    goes through the engine."""

    def __init__(self, engine: EngineCore, executor: ModelExecutor, pricing: WindowPricing | None):
        self.engine = engine
        self.executor = executor
        self.pricing = pricing
        self.window: DecodeWindow | None = None
        # The next window batch to schedule (``V_index``).
        self.index = 0
        # Size (member decodes) and cost of each window batch in flight, oldest first.
        self.window_batches: deque[tuple[int, Any]] = deque()

    @property
    def in_flight(self) -> int:
        """Batches scheduled and not yet applied."""
        return len(self.engine.batch_queue) + len(self.window_batches)

    def any_executed(self) -> bool:
        """Whether a batch in flight computes something (window batches always do)."""
        return bool(self.window_batches) or any(batch.executed for batch in self.engine.batch_queue)

    def schedule(self, window_allowed: bool) -> Launch:
        """Schedule the next batch: a window batch if a window is open (or opens now) and
        goes on, else a real one (after closing the window, if one was open)."""
        window = self.window
        if window is None and window_allowed and self.pricing is not None and len(self.engine.batch_queue) == 1:
            window = self.window = self._open()
            self.index = 0
        if window is None:
            return self._schedule_real(None)
        index = self.index
        status = window.next_batch(index) if window_allowed else END
        if status == WINDOW_BATCH:
            return self._schedule_window_batch(window, index)
        closed = None
        if status == REAL_BATCH:  # its waiting pass admitted what the window cannot take
            if index:
                closed = self._close(window, window.previous_new_blocks, window.previous_reported,
                                     window.previous_new_replaced)
            self.window = None
            admitted = window.admitted
            assert admitted is not None  # next_batch keeps what it admitted for a real batch
            output = window.complete(index, admitted)
            batch = Batch(output, self.executor.execute(output))
            self.engine.batch_queue.append(batch)
            return Launch(batch.execution.duration_s, True, bool(output.preempted), closed)
        if index:
            closed = self._close(window, window.new_blocks, window.reported, window.new_replaced)
        self.window = None
        return self._schedule_real(closed)

    def _open(self) -> DecodeWindow | None:
        assert self.pricing is not None
        in_flight = self.engine.batch_queue[0]
        scheduler = self.engine.scheduler
        return open_decode_window(scheduler, in_flight.output, in_flight.execution.sampled,
                                  self.pricing.token_bases([r.request_id for r in scheduler.running]),
                                  self.pricing.decode_key_shapes())

    def _schedule_real(self, closed: list[tuple[str, int]] | None) -> Launch:
        batch = self.engine.schedule_batch(self.executor)
        return Launch(batch.execution.duration_s, batch.executed, bool(batch.output.preempted), closed)

    def _schedule_window_batch(self, window: DecodeWindow, index: int) -> Launch:
        """Price window batch ``V_index`` in closed form (its real part's tokens sampled)."""
        pricing = self.pricing
        assert pricing is not None
        num_decodes = window.num_active
        part = window.parts.get(index)
        if part is not None:  # a prefill chunk and admissions, which the scheduler advanced
            window.note_part_tokens(index, pricing.sample(part),
                                    pricing.token_bases(window.part_sampling_ids(index)))
        if window.key_shapes is not None:  # windowed or recurrent layers: keys per class
            part_ends = window.part_decode_ends(index)
            cost = pricing.decode_step_cost_by_keys(num_decodes + len(part_ends),
                                                    window.attended_keys(index, part_ends),
                                                    window.part_cost_terms(index)[2] if part is not None else None)
        elif part is None:
            cost = pricing.decode_step_cost(num_decodes, window.context_ends_sum(index))
        else:
            part_decodes, part_ends_sum, prefill_items = window.part_cost_terms(index)
            cost = pricing.decode_step_cost(num_decodes + part_decodes,
                                            window.context_ends_sum(index) + part_ends_sum, prefill_items)
        self.window_batches.append((num_decodes, cost))
        return Launch(cost.total_s, True, False)

    def _close(self, window: DecodeWindow, new_blocks: dict[str, KVCacheBlocks], reported: list[str],
               replaced: dict[str, list[tuple[int, int, int]]]) -> list[tuple[str, int]]:
        """End ``window`` at ``index``: its batch in flight queued as the real output it is
        (which costs what the window priced it at); returns the members to record."""
        index = self.index
        output = window.close(index, new_blocks, reported, replaced)
        execution = self.executor.execute(output)
        _, cost = self.window_batches.pop()
        assert execution.duration_s == cost.total_s, "a window batch priced apart from its real output"
        assert not self.window_batches
        self.engine.batch_queue.append(Batch(output, execution))
        return window.members_to_record(index)

    def update(self) -> BatchRecord:
        """Apply the oldest batch in flight."""
        window = self.window
        if window is None:
            return self.engine.update_batch()
        index = self.index
        self.index = index + 1
        if index == 0:  # the batch the window opened on: a real one
            window.begin_real_update()
            result = self.engine.update_batch()
            window.end_real_update()
            return result
        num_decodes, cost = self.window_batches.popleft()
        finished, window_steps, part, part_sampled = window.apply(index)
        return BatchRecord(part if part is not None else SchedulerOutput(),
                           [RequestSnapshot(request, window_steps.get(request.request_id, 0)) for request in finished],
                           Execution(part_sampled if part_sampled is not None else {}, cost.total_s, cost),
                           implicit_decodes=num_decodes)
