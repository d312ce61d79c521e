"""The batches in flight of an asynchronous engine whose batches may run in decode windows
(docs/architecture.md#decode-windows): what a replica's clock schedules and updates,
window batch or real, without knowing which. It reaches the engine only through the
window's port (``decode_window.WindowEngine``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvtwin.sim.core.decode_window import END, REAL_BATCH, WINDOW_BATCH, DecodeWindow, WindowEngine, WindowScheduler
from kvtwin.sim.core.engine import Batch, BatchRecord, Execution, ModelExecutor, RequestSnapshot
from kvtwin.sim.core.engine_stats import EngineStats
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.window_opening import open_decode_window
from kvtwin.sim.core.window_pricing import WindowPricing, part_cost_terms, part_decode_ends


class Launch:
    """A batch just scheduled, as the clock needs it: how long it runs on the device,
    whether it computes anything (a batch that does not takes no time), whether it
    preempted."""

    duration_s: float
    executed: bool
    preempted: bool

    def __init__(self, duration_s: float, executed: bool, preempted: bool):
        self.duration_s = duration_s
        self.executed = executed
        self.preempted = preempted


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

    def __init__(self, engine: WindowEngine, executor: ModelExecutor, pricing: WindowPricing | None):
        self.engine: WindowEngine = engine
        self.executor = executor
        self.pricing = pricing
        # The scheduler windows open over (None: windows never open on this engine).
        self.scheduler: WindowScheduler | None = engine.window_scheduler() if pricing is not None else None
        self.window: DecodeWindow | None = None
        # The next window batch to schedule (``V_index``).
        self.index = 0
        # Size (member decodes) and cost of each window batch in flight, oldest first.
        self.window_batches: deque[tuple[int, Any]] = deque()
        # A closed window's running members and their window steps, until the record of
        # the batch the close made real reports them (``implicit_decodes_by_request``).
        self.unreported: list[tuple[str, int]] | None = None

    @property
    def in_flight(self) -> int:
        """Batches scheduled and not yet applied."""
        return self.engine.num_batches_in_flight() + len(self.window_batches)

    def any_executed(self) -> bool:
        """Whether a batch in flight computes something (window batches always do)."""
        return bool(self.window_batches) or self.engine.any_batch_executed()

    def schedule(self, window_allowed: bool) -> Launch:
        """Schedule the next batch: a window batch if a window is open (or opens now) and
        goes on, else a real one (after closing the window, if one was open)."""
        window = self.window
        if (window is None and window_allowed and self.scheduler is not None
                and self.engine.num_batches_in_flight() == 1):
            window = self.window = self._open()
            self.index = 0
        if window is None:
            return self._schedule_real()
        index = self.index
        status = window.next_batch(index) if window_allowed else END
        if status == WINDOW_BATCH:
            return self._schedule_window_batch(window, index)
        if status == REAL_BATCH:  # its waiting pass admitted what the window cannot take
            if index:
                self._close(window, window.previous_new_blocks, window.previous_reported,
                            window.previous_new_replaced)
            self.window = None
            admitted = window.admitted
            assert admitted is not None  # next_batch keeps what it admitted for a real batch
            output = window.complete(index, admitted)
            batch = Batch(output, self.executor.execute(output))
            self.engine.enqueue_batch(batch)
            return Launch(batch.execution.duration_s, True, bool(output.preempted))
        if index:
            self._close(window, window.new_blocks, window.reported, window.new_replaced)
        self.window = None
        return self._schedule_real()

    def _open(self) -> DecodeWindow | None:
        pricing = self.pricing
        scheduler = self.scheduler
        assert pricing is not None and scheduler is not None
        assert self.unreported is None  # the last close's batch is applied before another window opens
        in_flight = self.engine.oldest_batch()
        return open_decode_window(scheduler, in_flight.output, in_flight.execution.sampled,
                                  pricing.token_bases([r.request_id for r in scheduler.running_requests()]),
                                  pricing.decode_key_shapes())

    def _schedule_real(self) -> Launch:
        batch = self.engine.schedule_batch(self.executor)
        return Launch(batch.execution.duration_s, batch.executed, bool(batch.output.preempted))

    def _schedule_window_batch(self, window: DecodeWindow, index: int) -> Launch:
        """Price window batch ``V_index`` in closed form (its real part's tokens sampled)."""
        pricing = self.pricing
        assert pricing is not None
        terms = window.terms
        num_decodes = terms.num_active
        part = window.parts.get(index)
        if part is not None:  # a prefill chunk and admissions, which the scheduler advanced
            window.note_part_tokens(index, pricing.sample(part),
                                    pricing.token_bases(window.part_sampling_ids(index)))
        if terms.key_shapes is not None:  # windowed or recurrent layers: keys per class
            part_ends = part_decode_ends(part) if part is not None else []
            cost = pricing.decode_step_cost_by_keys(num_decodes + len(part_ends), terms.attended_keys(index, part_ends),
                                                    part_cost_terms(part)[2] if part is not None else None)
        elif part is None:
            cost = pricing.decode_step_cost(num_decodes, terms.context_ends_sum(index))
        else:
            part_decodes, part_ends_sum, prefill_items = part_cost_terms(part)
            cost = pricing.decode_step_cost(num_decodes + part_decodes,
                                            terms.context_ends_sum(index) + part_ends_sum, prefill_items)
        self.window_batches.append((num_decodes, cost))
        return Launch(cost.total_s, True, False)

    def _close(self, window: DecodeWindow, new_blocks: dict[str, KVCacheBlocks], reported: list[str],
               replaced: dict[str, list[tuple[int, int, int]]]) -> None:
        """End ``window`` at ``index``: its batch in flight queued as the real output it is
        (which costs what the window priced it at), its running members' window steps kept
        for that batch's record."""
        index = self.index
        output = window.close(index, new_blocks, reported, replaced)
        execution = self.executor.execute(output)
        _, cost = self.window_batches.pop()
        assert execution.duration_s == cost.total_s, "a window batch priced apart from its real output"
        assert not self.window_batches
        self.engine.enqueue_batch(Batch(output, execution))
        self.unreported = window.members_to_record(index)

    def update(self) -> BatchRecord:
        """Apply the oldest batch in flight."""
        window = self.window
        if window is None:
            unreported = self.unreported  # set: the batch a window's close made real
            self.unreported = None
            return self.engine.update_batch(unreported)
        index = self.index
        self.index = index + 1
        if index == 0:  # the batch the window opened on: a real one
            window.begin_real_update()
            result = self.engine.update_batch()
            window.end_real_update()
            return result
        num_decodes, cost = self.window_batches.popleft()
        finished, window_steps, part, part_sampled = window.apply(index)
        return window_batch_result(num_decodes, cost, finished, window_steps, part, part_sampled,
                                   self.engine.make_stats())

    def request_snapshots(self) -> list[RequestSnapshot]:
        """The engine's unfinished requests as they are now (``EngineCore.request_snapshots``),
        with the window steps of a closed window whose batch made real was not applied (a
        run stopped in between) as their ``implicit_decodes``."""
        unreported = self.unreported
        return self.engine.request_snapshots(dict(unreported) if unreported is not None else None)


def window_batch_result(num_decodes: int, cost: Any, finished: list[Request], window_steps: dict[str, int],
                        part: SchedulerOutput | None, part_sampled: dict[str, list[int]] | None,
                        stats: EngineStats) -> BatchRecord:
    """What applying a window batch did, as the engine reports any batch: its
    ``num_decodes`` member decodes at ``cost`` (``implicit_decodes``), the requests it
    finished with their window steps, and its real part (``part``, its tokens
    ``part_sampled``; None: none), the engine then as ``stats``. The one place a window
    builds a ``BatchRecord``."""
    return BatchRecord(part if part is not None else SchedulerOutput(),
                       [RequestSnapshot(request, window_steps.get(request.request_id, 0)) for request in finished],
                       Execution(part_sampled if part_sampled is not None else {}, cost.total_s, cost), stats,
                       implicit_decodes=num_decodes)
