"""Decode windows: runs of batches scheduled without visiting every request at every step
(docs/architecture.md#decode-windows).

The window reaches the engine only through its port: ``WindowScheduler`` and
``WindowEngine`` below and ``WindowKVCacheManager`` (``window_port.py``, a base class of
the manager so that the per-member calls stay native) name every method of the scheduler,
the KV cache manager and the engine a window may call, and the window writes no member of theirs
(``tests/sim/test_decode_window_port.py`` checks both). Its own state is its members
(``window_members.py``) and batches. Which batch opens a window is ``window_opening.py``'s
to say; the clock's driver is ``windowed_batch_queue.py``; the closed-form pricing,
``window_pricing.py``.

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
it. ``WindowedBatchQueue`` (``windowed_batch_queue.py``) is what a clock
sees: it hands out window batches and real ones alike, prices each window batch with the
executor's closed form (``WindowPricing``, ``window_pricing.py``: the sum of the decodes' context ends where every
layer attends its whole context, else per layer class the keys its decodes attend, which
``LocalKeySum`` keeps in closed form for windowed and chunked layers), applies it when the
clock says it ended, and
ends the window where its state must become explicit (the clock's one say is whether the
time limit could cut the batch in flight short).

Why a window batch is the batch ``schedule()`` would make, member by member and batch by
batch, is argued in docs/architecture.md#why-a-window-batch-is-the-batch-schedule-makes;
the names there (``c0``, state ``j``, ``last_batch``, the horizon) are the code's.
"""

from __future__ import annotations

import heapq
from typing import Protocol

from kvtwin.sim.core.engine import Batch, BatchRecord, ModelExecutor, RequestSnapshot
from kvtwin.sim.core.engine_stats import EngineStats
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import CachedRequestData, SchedulerOutput
from kvtwin.sim.core.window_members import WindowMembers
from kvtwin.sim.core.window_port import WindowKVCacheManager
from kvtwin.sim.core.window_pricing import WindowBatchTerms

# A window batch (``next_batch``): scheduled in the window, or not (the window ends before
# it), or made real (its waiting pass admitted what the window cannot take).
WINDOW_BATCH = 1
END = 0
REAL_BATCH = -1


# -- the port: all a window may ask of the engine ------------------------------------------


class WindowScheduler(Protocol):
    """What a window asks of the scheduler (``AsyncScheduler``): the passes of vLLM's
    ``schedule()`` and ``update_from_output`` it runs, and the writes to the scheduler's
    and its requests' state that the batches it leaves implicit would have made."""

    def can_open_window(self) -> bool:
        """Whether a window may open now: windows are allowed (asynchronous scheduling with
        two batches in flight, no connector, no drafts) and no finished request waits to
        be reported."""
        ...

    def get_kv_cache_manager(self) -> WindowKVCacheManager:
        ...

    def running_requests(self) -> list[Request]:
        """The running requests in running order (read only)."""
        ...

    def get_request(self, request_id: str) -> Request:
        ...

    def num_waiting(self) -> int:
        ...

    def max_num_batched_tokens(self) -> int:
        ...

    def max_model_len(self) -> int:
        ...

    def running_chunk(self, request: Request, token_budget: int) -> int:
        """The chunk the running pass gives a request still prefilling, in ``token_budget``:
        what it lacks, clipped by the long-prefill threshold, the budget and
        ``max_model_len``, and split at Mamba block boundaries in "align" mode."""
        ...

    def long_prefill_threshold(self) -> int:
        ...

    def schedule_waiting(self, out: SchedulerOutput, token_budget: int, long_prefill: int) -> None:
        """The waiting pass of ``schedule()`` (admissions allocated, nothing advanced)."""
        ...

    def start_window_batch(self) -> list[str]:
        """What ``schedule()`` does before its running pass: take the finished ids the batch
        reports (returned), and tell the KV cache manager a step starts."""
        ...

    def advance_computed(self, out: SchedulerOutput) -> None:
        """vLLM's ``_update_after_schedule`` of a batch (a window batch's real part)."""
        ...

    def count_batch(self) -> None:
        """The advance of a window batch with no real part: it is counted; its member
        decodes stay implicit (``advance_decode`` writes one where an update reads it)."""
        ...

    def push_in_flight_partials(self, partials: list[tuple[Request, int]], oldest: bool) -> None:
        """Queue a batch's entry of partial chunks (``oldest``: ahead of the queued ones), for
        a window batch whose advance was counted but not run."""
        ...

    def advance_decode(self, request: Request) -> None:
        """``_update_after_schedule`` of one decode token of the batch after the one about to
        be applied (the window leaves it implicit, but that update reads it)."""
        ...

    def bring_decode_to(self, request: Request, num_computed_tokens: int, token_ids: list[int]) -> None:
        """Write a window member's state: its computed tokens and the outputs the updates
        the window left implicit appended."""
        ...

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """vLLM's ``update_from_output`` of a batch (its finishing members, its real part)."""
        ...


class WindowEngine(Protocol):
    """What the window's driver asks of the engine (``EngineCore``) and its batch queue."""

    def window_scheduler(self) -> WindowScheduler | None:
        """The scheduler if its batches may be windowed at all; None where never."""
        ...

    def num_batches_in_flight(self) -> int:
        ...

    def oldest_batch(self) -> Batch:
        ...

    def any_batch_executed(self) -> bool:
        ...

    def schedule_batch(self, executor: ModelExecutor) -> Batch:
        """vLLM's ``step_with_batch_queue`` scheduling half: schedule, execute, queue."""
        ...

    def enqueue_batch(self, batch: Batch) -> None:
        """Queue a window's batch made real, to be updated in its turn."""
        ...

    def update_batch(self, implicit_decodes_by_request: list[tuple[str, int]] | None = None) -> BatchRecord:
        """The update half: apply the oldest batch in flight (the first after a closed
        window: with its members' window steps for the record)."""
        ...

    def request_snapshots(self, implicit_decodes: dict[str, int] | None = None) -> list[RequestSnapshot]:
        """The unfinished requests, for a run that stops (with a closed window's steps no
        record reported)."""
        ...

    def make_stats(self) -> EngineStats:
        """vLLM's ``make_stats``: the engine after a window batch was applied, for its record."""
        ...


class DecodeWindow:
    """A decode window over the running requests of ``scheduler`` (module docstring).

    Its members (``WindowMembers``: running order, their batches, ``c0``, token bases; the
    proof's ``c0`` is ``computed_at_open``, its ``j`` the methods' ``index``: window batch
    ``V_index``). At most one request, last in running order, is still prefilling
    (``prefilling``): its chunks are scheduled, advanced and applied by the scheduler's own
    code, as the *real part* of a batch (``parts``) with the batch's admissions. The batch
    ``X`` in flight when the window opens is applied for real (``begin_real_update`` and
    ``end_real_update`` around the engine's ``update_batch``)."""

    def __init__(self, scheduler: WindowScheduler, members: list[Request], token_bases: list[int],
                 last_batches: list[int], prefilling: Request | None,
                 key_shapes: list[tuple[int, int]] | None = None):
        self.scheduler: WindowScheduler = scheduler
        self.kv_cache_manager: WindowKVCacheManager = scheduler.get_kv_cache_manager()
        self.empty_blocks = self.kv_cache_manager.get_empty_blocks()
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens()
        # Running members by index (a finished one is dropped: a long window would keep
        # every request it ever held in memory).
        self.requests: dict[int, Request] = dict(enumerate(members))
        self.num_original = len(members)
        # The window state each member's fields hold: 0 at the start; 1 once X is applied.
        self.members = WindowMembers()
        for request, base, last in zip(members, token_bases, last_batches):
            self.members.add(request.num_computed_tokens, 0, last, 0, base)
        self.prefilling = prefilling
        # The members in the batch being scheduled and its cost's closed-form terms.
        self.terms = WindowBatchTerms([request.num_computed_tokens for request in members], key_shapes)
        # Members by the window batch they first decode in, and by the last one.
        self._first_in: dict[int, list[int]] = {}
        self._last_in: dict[int, list[int]] = {}
        for i, last in enumerate(last_batches):
            self._last_in.setdefault(last, []).append(i)
        # Those whose last batch is the one the current iteration applies (they finish then).
        self.finishing: list[int] = []
        self._batch = -1
        # (window batch, member) of each member's next allocation, in batch then running
        # order: the order the scheduler's running pass calls them in.
        kv_cache_manager = self.kv_cache_manager
        events: list[tuple[int, int]] = []
        for i, request in enumerate(members):
            events.append((max(kv_cache_manager.allocation_horizon(request.request_id)
                               - request.num_computed_tokens, 0), i))
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
        self.single_group = kv_cache_manager.num_kv_cache_groups() == 1
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
            joining = self._first_in.pop(index, [])
            self.finishing = self._last_in.pop(index - 1, [])
            self.terms.step(index, joining, self.finishing, self.members.computed_at_open_by_index())
        return self.terms.num_active

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
        chunk = self.prefill_chunk = (self.scheduler.running_chunk(prefilling, self.max_num_batched_tokens
                                                                   - self.terms.num_active)
                                      if prefilling is not None else 0)
        kv_cache_manager = self.kv_cache_manager
        if chunk:
            assert prefilling is not None
            if prefilling.num_computed_tokens + chunk > kv_cache_manager.allocation_horizon(prefilling.request_id):
                needed += kv_cache_manager.blocks_to_allocate(prefilling, chunk)
        if needed > kv_cache_manager.num_free_blocks():
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
        kv_cache_manager = self.kv_cache_manager
        requests = self.requests
        members = self.members
        needed = 0
        for i in due:
            needed += kv_cache_manager.blocks_lacking(requests[i].request_id, members.computed_at_open(i) + index + 1)
        return needed

    def allocations_in(self, index: int) -> list[int]:
        """The members whose allocation ``V_j`` calls, in order; taken off the queue."""
        events = self._events
        members = self.members
        due: list[int] = []
        while events and events[0][0] == index:
            i = heapq.heappop(events)[1]
            if members.last_batch(i) >= index:
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
        self.reported = scheduler.start_window_batch()
        self.previous_new_blocks = self.new_blocks
        self.new_blocks = {}
        self.previous_new_replaced = self.new_replaced
        self.new_replaced = {}
        if due:
            members = self.members
            for i in due:
                request = self.requests[i]
                self._sync(i, index)
                self._allocate(request, 1)
                next_batch = max(kv_cache_manager.allocation_horizon(request.request_id)
                                 - members.computed_at_open(i), index + 1)
                heapq.heappush(self._events, (next_batch, i))
        prefilling = self.prefilling
        if chunk:
            assert prefilling is not None
            if prefilling.num_computed_tokens + chunk > kv_cache_manager.allocation_horizon(prefilling.request_id):
                self._allocate(prefilling, chunk)
        admitted: SchedulerOutput | None = None
        if scheduler.num_waiting():
            scratch = self._scratch
            scheduler.schedule_waiting(scratch, self.max_num_batched_tokens - self.terms.num_active - chunk,
                                       scheduler.long_prefill_threshold())
            if scratch.num_scheduled_tokens:
                admitted = scratch
                self._scratch = SchedulerOutput()
        if not chunk and admitted is None:
            # The advance of a window batch (its entry of partial chunks, none, is queued
            # by ``close`` for the one window batch still in flight then).
            scheduler.count_batch()
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
        kv_cache_manager = self.kv_cache_manager
        new_blocks = kv_cache_manager.allocate_slots(request, num_new)
        if new_blocks is None:
            raise AssertionError(f"decode window: allocation for {request.request_id} failed in a batch "
                                 f"whose allocations were counted against the free blocks")
        if new_blocks is not self.empty_blocks:
            self.new_blocks[request.request_id] = new_blocks
        # Entries changed in place (windowed blocks nulled, Mamba states moved): taken into
        # the batch's output, as the running pass takes them.
        replaced = kv_cache_manager.take_replaced_block_ids(request.request_id)
        if replaced is not None:
            self.new_replaced[request.request_id] = replaced

    def _can_take(self, part_tokens: dict[str, int]) -> bool:
        """Whether the window can carry a real part: every request in it but the last
        ends its prefill with it (and samples); the last may be a partial chunk, and is
        then the one prefilling request, last in running order."""
        scheduler = self.scheduler
        last = len(part_tokens) - 1
        for k, (request_id, num_new) in enumerate(part_tokens.items()):
            request = scheduler.get_request(request_id)
            if request.num_computed_tokens + num_new != request.num_tokens and k != last:
                return False
        return True

    def _take(self, index: int, part: SchedulerOutput) -> None:
        """``V_j``'s real part, advanced by the scheduler: each request it ends the prefill
        of decodes in the window from ``V_{j+1}`` on; a partial chunk stays prefilling."""
        self.parts[index] = part
        part_members = self.part_members[index] = {}
        scheduler = self.scheduler
        kv_cache_manager = self.kv_cache_manager
        self.prefilling = None
        for request_id in part.num_scheduled_tokens:
            request = scheduler.get_request(request_id)
            if request_id not in part.num_output_tokens:
                self.prefilling = request  # its chunk samples nothing: more follow
                continue
            # Applied with V_{j+1} scheduled, it is at state j + 2: one more computed
            # token than now, one more output (its token base: ``note_part_tokens``).
            computed_at_open = request.num_computed_tokens - index - 1
            last = request.max_tokens - len(request.output_token_ids) + index - 1
            i = self.members.add(computed_at_open, index + 1, last, index + 2, -1)
            part_members[request_id] = i
            self.requests[i] = request
            if last >= index + 1:  # else its first token is its last: it finishes when V_j is applied
                self._first_in.setdefault(index + 1, []).append(i)
                self._last_in.setdefault(last, []).append(i)
                heapq.heappush(self._events, (max(kv_cache_manager.allocation_horizon(request_id)
                                                  - computed_at_open, index + 1), i))

    def part_sampling_ids(self, index: int) -> list[str]:
        return list(self.part_members[index])

    def note_part_tokens(self, index: int, sampled: dict[str, list[int]], token_bases: list[int | None]) -> None:
        """The executor's tokens for ``V_j``'s real part, and the token bases of the
        members it made (``part_sampling_ids`` order)."""
        self.part_sampled[index] = sampled
        for i, base in zip(self.part_members[index].values(), token_bases):
            assert base is not None  # sampled just now
            self.members.set_token_base(i, base)

    def begin_real_update(self) -> None:
        """Before ``X`` is applied for real, with ``V_0`` scheduled: ``V_0``'s advance."""
        scheduler = self.scheduler
        for i in range(self.num_original):
            scheduler.advance_decode(self.requests[i])

    def end_real_update(self) -> None:
        """``X`` was applied: every original member is at state 1."""
        for i in range(self.num_original):
            self.members.set_synced(i, 1)

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
        scheduler = self.scheduler
        members = self.members
        out = SchedulerOutput()
        scheduled = out.num_scheduled_tokens
        sampled: dict[str, list[int]] = {}
        for i in finishing:
            self._sync(i, index)
            request = self.requests[i]
            scheduled[request.request_id] = 1
            sampled[request.request_id] = [members.token_base(i) + len(request.output_token_ids)]
            steps[request.request_id] = members.window_steps(i, index)
            del self.requests[i]
        if part is not None:
            assert part_sampled is not None
            part_members = self.part_members.pop(index - 1)
            scheduled.update(part.num_scheduled_tokens)
            for i in part_members.values():
                if members.last_batch(i) >= index:
                    scheduler.advance_decode(self.requests[i])  # it is in V_j too
                else:
                    del self.requests[i]  # its first token was its last
            sampled.update(part_sampled)
        else:
            # What the update takes first: this batch's partial chunks, none (a later
            # batch's real part may already be queued behind).
            scheduler.push_in_flight_partials([], True)
        return scheduler.update_from_output(out, sampled), steps, part, part_sampled

    def _sync(self, i: int, index: int) -> None:
        """Write state ``j`` into member ``i``: its computed tokens and outputs."""
        members = self.members
        behind = index - members.synced(i)
        if behind <= 0:
            return
        request = self.requests[i]
        first = members.token_base(i) + len(request.output_token_ids)
        self.scheduler.bring_decode_to(request, members.computed_at_open(i) + index,
                                       list(range(first, first + behind)))
        members.set_synced(i, index)

    def close(self, index: int, new_blocks: dict[str, KVCacheBlocks], reported: list[str],
              replaced: dict[str, list[tuple[int, int, int]]]) -> SchedulerOutput:
        """End the window at state ``j`` (``j >= 1``: ``V_{j-1}`` in flight, appending
        ``new_blocks``, changing ``replaced`` in place and reporting ``reported``
        finished): every member still running gets state ``j``, and ``V_{j-1}`` becomes
        the output ``schedule()`` would have made of it (its member decodes, then its real
        part), for the clock to execute and queue."""
        scheduled: dict[str, int] = {}
        computed: list[int] = []
        sampling: dict[str, int] = {}
        members = self.members
        last = index - 1
        for i, request in self.requests.items():
            if not members.decodes_in(i, last):
                continue
            self._sync(i, index)
            request_id = request.request_id
            scheduled[request_id] = 1
            computed.append(members.computed_at_open(i) + last)
            sampling[request_id] = len(request.output_token_ids)
        part = self.parts.pop(last, None)
        if part is not None:
            scheduled.update(part.num_scheduled_tokens)
            computed.extend(part.num_computed_tokens)
            sampling.update(part.num_output_tokens)
        else:
            self.scheduler.push_in_flight_partials([], False)  # the batch's partial chunks: none
        return SchedulerOutput(num_scheduled_tokens=scheduled, num_computed_tokens=computed,
                               num_output_tokens=sampling,
                               scheduled_new_reqs=part.scheduled_new_reqs if part is not None else None,
                               scheduled_cached_reqs=CachedRequestData(new_blocks, replaced),
                               finished_req_ids=reported)

    def members_to_record(self, index: int) -> list[tuple[str, int]]:
        """At ``close(j)``: each running member's request id and its window steps."""
        members = self.members
        steps = [(request.request_id, members.window_steps(i, index - 1)) for i, request in self.requests.items()]
        return [(request_id, num_steps) for request_id, num_steps in steps if num_steps]

    def complete(self, index: int, scratch: SchedulerOutput) -> SchedulerOutput:
        """``V_j``'s waiting pass admitted (``scratch``) what the window cannot take: the
        batch as ``schedule()`` makes it, its member decodes (at state ``j``, after
        ``close(j, ...)`` for ``j >= 1``), then the prefilling request's chunk, then the
        admissions, advanced by the scheduler."""
        scheduled: dict[str, int] = {}
        members = self.members
        for i, request in self.requests.items():
            if members.decodes_in(i, index):
                scheduled[request.request_id] = 1
        if self.prefill_chunk:
            assert self.prefilling is not None
            scheduled[self.prefilling.request_id] = self.prefill_chunk
        scheduled.update(scratch.num_scheduled_tokens)
        out = SchedulerOutput(num_scheduled_tokens=scheduled, scheduled_new_reqs=scratch.scheduled_new_reqs,
                              scheduled_cached_reqs=CachedRequestData(self.new_blocks, self.new_replaced),
                              finished_req_ids=self.reported)
        self.scheduler.advance_computed(out)
        return out
