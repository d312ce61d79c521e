"""Decode windows: runs of decode-only batches scheduled without visiting every request
at every step (issue 14, step 5).

Most batches of a busy replay only decode: each running request gets one token and
nobody is admitted or preempted. Scheduled one by one (``Scheduler.schedule`` and
``update_from_output``), such a batch costs a dozen dictionary operations per request,
nearly all of them counting. In a window the counting is implicit: ``j`` batches into the
window every request is at a state known in closed form, and a request's fields are
brought to it only when something reads them. What the scheduler's own passes would do
in such a batch is still done, by the same calls, in the same order:

* a running request whose allocation can change something (the KV cache manager's no-op
  horizon is crossed: a block to add or to cache) gets ``allocate_slots(request, 1)``, in
  running order, after its fields are brought to the batch's state;
* the waiting queue is offered the rest of the budget through the scheduler's own
  ``_schedule_waiting`` (usually one comparison: the blocked-head memo); an admission
  makes the batch a real one, finished by the scheduler's own advance (``complete``);
* a request whose last token a batch samples is applied through the scheduler's own
  update when that batch is (``finish``): it caches what that token completed and is
  freed, in running order.

Only asynchronous scheduling with two batches in flight (vLLM's default), one
full-attention KV cache group and no offload connector are windowed; elsewhere the
scheduler runs alone. The clock around it (``sim/replay/workload.py``) prices each batch
with the cost model's closed form, waits for it, records it, and ends the window where
its state must become explicit.

Why a window batch is the batch ``schedule()`` would make. A window opens when the one
batch in flight, ``X``, schedules exactly the running requests, one token each, all
sampling, and each request has one placeholder and one token in flight (it decodes). Let
a request have ``c0`` computed tokens then and ``n0`` outputs; decoding, ``c0 = P + n0``
for its prompt of ``P``, and ``P + max_tokens <= max_model_len`` (longer ones are
rejected at arrival), so only ``max_tokens`` ends it. Call *state* ``j``: ``c0 + j``
computed tokens, ``n0 + j`` outputs (the executor's tokens ``base + index``), one
placeholder, one token in flight. Suppose window batches ``V_0 .. V_{j-1}`` were
scheduled, ``X, V_0 .. V_{j-2}`` applied, and every request still running is at state
``j``. In ``schedule()`` for ``V_j`` a request asks for ``num_tokens + placeholders -
computed = 1`` token while ``c0 + j + 1 < P + max_tokens``, i.e. while ``j <= last_batch
= max_tokens - n0 - 2``; past that its last token is in flight and it is skipped. One
token is never clipped (budget: the window needs all running requests to fit it;
``max_model_len``: above; no ``long_prefill`` or Mamba clip applies to one token). Its
allocation is skipped exactly while ``c0 + j + 1 <= horizon``, which is when the window
skips it too (``allocations_in``); otherwise ``allocate_slots`` runs on its real state
``j``. Each needs at most one block, so when the free blocks cover the batch's callers
(the clock checks before the batch) none fails and nobody is preempted; so the waiting
pass follows, with the same budget, eligible count and pool. The advance takes each
scheduled request to ``c0 + j + 1`` computed tokens, two placeholders and two in flight.
Applying ``V_{j-1}`` then gives each of its requests output ``n0 + j + 1``; one that
still has a batch in flight (``V_j``) caches nothing (only the update that leaves no
token in flight does) and does not finish, and it is at state ``j + 1``; one that
sampled its last token (``last_batch = j - 1``) is applied for real and finishes. By
induction every window batch is the batch ``schedule()`` makes, and ``close`` writes
state ``j`` into every request still running and turns the batch in flight into the
``SchedulerOutput`` ``schedule()`` would have made of it, for the clock to queue.
"""

from __future__ import annotations

import heapq

from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.core.scheduler_output import SchedulerOutput

# Fewer steps than this before some request must leave: not worth opening.
MIN_WINDOW_STEPS = 2


class DecodeWindow:
    """A decode window over the running requests of ``scheduler`` (module docstring).

    ``token_bases[i]`` is the executor's token base of running request ``i``: its output
    ``k`` is the token ``base + k``. Batch ``V_j`` is the ``j``-th window batch; the batch
    ``X`` in flight when the window opens is applied for real (``begin_real_update`` and
    ``end_real_update`` around the clock's ``update_batch``)."""

    def __init__(self, scheduler: Scheduler, token_bases: list[int], last_batches: list[int]):
        self.scheduler = scheduler
        self.kvm = scheduler.kv_cache_manager
        self.requests: list[Request] = list(scheduler.running)
        self.token_bases = token_bases
        # The last window batch each request is in (it samples its last token there).
        self.last_batch = last_batches
        self.c0 = [r.num_computed_tokens for r in self.requests]
        # The requests in the batch being scheduled, and the sum of their c0.
        self.num_active = len(self.requests)
        self.c0_sum_active = sum(self.c0)
        self.alive = [True] * self.num_active
        # Running indices by the last window batch they are in.
        self._last_in: dict[int, list[int]] = {}
        for i, last in enumerate(last_batches):
            self._last_in.setdefault(last, []).append(i)
        # Those whose last batch is the one the current iteration applies (they finish then).
        self.finishing: list[int] = []
        self._batch = -1
        # The window state each request's fields hold (0 at the start; 1 once X is applied).
        self.synced = [0] * self.num_active
        # (window batch, running index) of each request's next allocation, in batch then
        # running order: the order the scheduler's running pass calls them in.
        horizon = self.kvm.noop_horizon
        events: list[tuple[int, int]] = []
        for i, request in enumerate(self.requests):
            events.append((max(horizon.get(request.request_id, -1) - self.c0[i], 0), i))
        heapq.heapify(events)
        self._events = events
        # Of the last window batch and of the one before it: the blocks appended, and the
        # finished requests the batch reported (what a real output of it carries).
        self.new_blocks: dict[str, KVCacheBlocks] = {}
        self.previous_new_blocks: dict[str, KVCacheBlocks] = {}
        self.reported: list[str] = []
        self.previous_reported: list[str] = []
        self._scratch = SchedulerOutput()
        self.admitted: SchedulerOutput | None = None  # see next_batch

    def batch_size(self, j: int) -> int:
        """How many requests ``V_j`` decodes: those whose last batch is not behind it (the
        ones whose last batch was ``V_{j-1}`` are skipped, as their last token is in flight,
        and finish when it is applied: ``finishing``). Call once per ``j``, in order."""
        if j != self._batch:
            self._batch = j
            self.finishing = self._last_in.pop(j - 1, [])
            for i in self.finishing:
                self.num_active -= 1
                self.c0_sum_active -= self.c0[i]
        return self.num_active

    def context_ends_sum(self, j: int) -> int:
        """The sum of the context lengths ``V_j``'s decodes end at (the cost model's input)."""
        return self.c0_sum_active + self.num_active * (j + 1)

    def allocations_in(self, j: int) -> list[int]:
        """The running indices whose allocation ``V_j`` calls, in order; taken off the queue."""
        events = self._events
        last_batch = self.last_batch
        due: list[int] = []
        while events and events[0][0] == j:
            i = heapq.heappop(events)[1]
            if last_batch[i] >= j:
                due.append(i)
        return due

    def next_batch(self, j: int) -> int:
        """Schedule ``V_j`` if it is a window batch: the number of requests it decodes;
        0 if the window ends before it (nobody left to decode, or its allocations might
        not fit the free blocks: a real batch decides whether to preempt); -1 if its
        waiting pass admitted a request (``admitted``: finish it with ``complete``)."""
        num_decodes = self.batch_size(j)
        if not num_decodes:
            return 0
        due = self.allocations_in(j)
        if len(due) > self.kvm.block_pool.get_num_free_blocks():
            return 0
        admitted = self.schedule(j, due)
        if admitted is not None:
            self.admitted = admitted
            return -1
        return num_decodes

    def schedule(self, j: int, due: list[int]) -> SchedulerOutput | None:
        """Schedule window batch ``V_j``, whose allocations ``due`` (``allocations_in(j)``)
        fit the free blocks. Returns None, or the scratch output of the waiting pass if it
        admitted a request: ``V_j`` is then no window batch (see ``complete``)."""
        scheduler = self.scheduler
        kvm = self.kvm
        self.previous_reported = self.reported
        self.reported, scheduler.finished_req_ids = scheduler.finished_req_ids, []
        kvm.new_step_starts()
        self.previous_new_blocks = self.new_blocks
        self.new_blocks = {}
        if due:
            horizon = kvm.noop_horizon
            empty = kvm.empty_blocks
            c0 = self.c0
            for i in due:
                request = self.requests[i]
                self._sync(i, j)
                new_blocks = kvm.allocate_slots(request, 1)
                if new_blocks is None:
                    raise AssertionError(f"decode window: allocation for {request.request_id} failed in a batch "
                                         f"whose allocations were counted against the free blocks")
                if new_blocks is not empty:
                    self.new_blocks[request.request_id] = new_blocks
                next_batch = max(horizon.get(request.request_id, -1) - c0[i], j + 1)
                heapq.heappush(self._events, (next_batch, i))
        waiting = scheduler.waiting
        if len(waiting):
            cfg = scheduler.config
            num_eligible = len(scheduler.running) + len(waiting)
            long_prefill = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
            token_budget = cfg.max_num_batched_tokens - self.num_active
            if long_prefill > 0 and cfg.adaptive_long_prefill_threshold:
                long_prefill = max(long_prefill, cfg.max_num_batched_tokens // num_eligible)
            scratch = self._scratch
            scheduler._schedule_waiting(scratch, token_budget, long_prefill)
            if scratch.num_scheduled_tokens:
                return scratch
        # The advance of a window batch (its entry of partial chunks, none, is queued by
        # ``close`` for the one window batch still in flight then).
        scheduler.num_batches += 1
        return None

    def begin_real_update(self) -> None:
        """Before ``X`` is applied for real, with ``V_0`` scheduled: ``V_0``'s advance."""
        for request in self.requests:
            request.num_computed_tokens += 1
            request.num_in_flight_tokens += 1
            request.num_output_placeholders += 1

    def end_real_update(self) -> None:
        """``X`` was applied: every request is at state 1."""
        self.synced = [1] * len(self.requests)

    def finish(self, j: int) -> list[Request]:
        """Apply ``V_{j-1}`` (``j >= 1``) to the requests it samples the last token of
        (``finishing``), through the scheduler's own update: they cache what their last
        token completed and are freed, in running order. Returns them (finished)."""
        finishing = self.finishing
        if not finishing:
            return []
        out = SchedulerOutput()
        sampled: dict[str, list[int]] = {}
        for i in finishing:
            self._sync(i, j)
            request = self.requests[i]
            out.num_scheduled_tokens[request.request_id] = 1
            sampled[request.request_id] = [self.token_bases[i] + len(request.output_token_ids)]
            self.alive[i] = False
        self.scheduler._in_flight_partials.append([])  # what the update takes: no partial chunk
        return self.scheduler.update_from_output(out, sampled)

    def _sync(self, i: int, j: int) -> None:
        """Write state ``j`` into request ``i``: its computed tokens and outputs."""
        behind = j - self.synced[i]
        if behind <= 0:
            return
        request = self.requests[i]
        request.num_computed_tokens = self.c0[i] + j
        first = self.token_bases[i] + len(request.output_token_ids)
        request.append_output_token_ids(list(range(first, first + behind)))
        self.synced[i] = j

    def alive_request_ids(self) -> list[str]:
        return [r.request_id for r, alive in zip(self.requests, self.alive) if alive]

    def close(self, j: int, new_blocks: dict[str, KVCacheBlocks], reported: list[str]) -> SchedulerOutput:
        """End the window at state ``j`` (``j >= 1``: ``V_{j-1}`` in flight, appending
        ``new_blocks`` and reporting ``reported`` finished): every request still running
        gets state ``j``, and ``V_{j-1}`` becomes the output ``schedule()`` would have made
        of it, for the clock to execute and queue."""
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        computed = out.num_computed_tokens
        sampling = out.num_output_tokens
        for i, request in enumerate(self.requests):
            if not self.alive[i]:
                continue
            self._sync(i, j)
            request_id = request.request_id
            scheduled[request_id] = 1
            computed.append(self.c0[i] + j - 1)
            sampling[request_id] = len(request.output_token_ids)
        out.scheduled_cached_reqs.new_blocks = new_blocks
        out.finished_req_ids = reported
        self.scheduler._in_flight_partials.append([])  # the batch's partial chunks: none
        return out

    def complete(self, j: int, scratch: SchedulerOutput) -> SchedulerOutput:
        """``V_j``'s waiting pass admitted (``scratch``): the batch as ``schedule()`` makes
        it, its running requests (at state ``j``, after ``close(j, ...)`` for ``j >= 1``)
        first, advanced by the scheduler."""
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        for i, request in enumerate(self.requests):
            if self.alive[i] and self.last_batch[i] >= j:
                scheduled[request.request_id] = 1
        scheduled.update(scratch.num_scheduled_tokens)
        out.scheduled_new_reqs = scratch.scheduled_new_reqs
        out.scheduled_cached_reqs.new_blocks = self.new_blocks
        out.finished_req_ids = self.reported
        self._scratch = SchedulerOutput()
        self.scheduler._advance_computed_async(out)
        return out


def open_decode_window(scheduler: Scheduler, in_flight: SchedulerOutput, sampled: dict[str, list[int]],
                       token_bases: list[int | None]) -> DecodeWindow | None:
    """A window over ``scheduler.running``, if the batch ``in_flight`` (the only one, its
    tokens ``sampled``) is the decode-only batch that opens one and some request decodes
    ``MIN_WINDOW_STEPS`` batches more; else None. ``token_bases``: the executor's base per
    running request (None: its tokens are not ``base + index``)."""
    kvm = scheduler.kv_cache_manager
    if (not scheduler.async_scheduling or scheduler.connector is not None or kvm.single_full_manager is None
            or scheduler.finished_req_ids):
        return None
    running = scheduler.running
    n = len(running)
    scheduled = in_flight.num_scheduled_tokens
    if (n == 0 or len(scheduled) != n or len(in_flight.num_output_tokens) != n or len(sampled) != n
            or in_flight.preempted or n > scheduler.config.max_num_batched_tokens):
        return None
    max_model_len = scheduler.config.max_model_len
    longest = -1
    bases: list[int] = []
    last_batches: list[int] = []
    for (request_id, num_tokens), request, base in zip(scheduled.items(), running, token_bases):
        if (num_tokens != 1 or request_id != request.request_id or base is None
                or request.status is not RequestStatus.RUNNING or request.num_output_placeholders != 1
                or request.num_in_flight_tokens != 1 or request.num_computed_tokens != request.num_tokens
                or request.num_prompt_tokens + request.max_tokens > max_model_len):
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
        bases.append(base)
        last_batches.append(last)
    if longest < MIN_WINDOW_STEPS:
        return None
    return DecodeWindow(scheduler, bases, last_batches)
