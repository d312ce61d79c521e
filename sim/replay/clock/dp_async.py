"""A data-parallel MoE group whose ranks schedule asynchronously, as vLLM 0.33 runs it by
default: each rank's ``DPEngineCoreProc.run_busy_loop`` with ``step_with_batch_queue``
(docs/semantics.md#asynchronous-scheduling-in-a-group).

Each rank is its own process running vLLM's engine loop with its own batch queue (depth
``batch_queue_size``, 2); what couples them is the forward pass, a collective of the MoE
layers (``ForwardPasses``):

- **One forward per iteration.** Every iteration of a rank's loop while the group runs
  issues exactly one forward pass: its scheduled batch if that computes anything, else a
  dummy batch (``execute_dummy_batch``), which touches no KV. The group's k-th forward is
  every rank's k-th: it starts once every rank has issued it and the (k-1)-th has ended,
  lasts as long as the slowest rank's part, and ends for every rank at once.
- **Issuing waits for the start.** A rank's loop goes on once its forward has started (the
  DP padding all-reduce of ``coordinate_batch_across_dp`` reads its result back to the host,
  which waits for the previous forward and every rank's arrival), so a rank is never more
  than one forward ahead of the group.
- **Results.** A rank applies its oldest batch when its loop waits for it: its queue is
  full, or its batch computed nothing and it has nothing more to schedule, or it has no
  requests. A batch that computed nothing holds no forward and is ready at once.
- **Waves.** Each rank counts its iterations (the same on every rank); at the first and
  every ``dp_sync_interval``-th the ranks meet in an all-reduce of whether any has
  unfinished requests, each as its own state stood when it got there. None: the wave ends,
  counters back to 0. A rank with a request while the group is idle starts a new wave and
  the others join.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence

import simpy

from kvtwin.sim.core.engine import BatchRecord, Execution
from kvtwin.sim.core.prefill_throttle import throttles_prefills
from kvtwin.sim.replay.clock.dp_group import DPGroup
from kvtwin.sim.replay.clock.engine_processes import ClusterView
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.replay.moe_group_cost import MoEDPGroup
from kvtwin.sim.replay.recorder import BatchTimes

# A rank's batches in flight, oldest first (beside the engine's queue): the forward each
# runs in (None: it computes nothing), when it was scheduled, its start and end; and the
# rank's step that applies the oldest of them.
InFlight = deque[tuple[int | None, float, float, float]]
ApplyOldest = Callable[[], Generator[simpy.Event, object, BatchRecord]]


class ForwardPasses:
    """The group's forward passes: which ranks have issued each one, and when it runs."""

    def __init__(self, env: simpy.Environment, cluster: ClusterView, ranks: Sequence[Replica], group: DPGroup):
        self.env = env
        self.cluster = cluster
        self.ranks = ranks
        self.group = group
        self.issued = [0] * len(ranks)  # forwards each rank has issued
        # The forwards not yet read by every rank, by index.
        self._pending: dict[int, _Forward] = {}
        self.last_end_s = 0.0
        self._idle: simpy.Event | None = None
        self.stalled = False  # the last forward was all dummies with nothing else to wait for
        self.moe: MoEDPGroup | None = None  # a MoE group's pricing of each forward (LockstepSettings.moe)

    def issue(self, rank: int, duration_s: float, progress: bool,
              execution: Execution | None = None) -> tuple[int, simpy.Event]:
        """``rank`` issues its next forward: its index and the event of its start.
        ``progress``: its part is its batch, or its empty schedule preempted (either changes
        what the next schedule can do). ``execution``: its batch's (None: a dummy), which a
        MoE group prices with the group's MoE part (docs/clock.md#moe-under-data-parallelism)."""
        index = self.issued[rank]
        self.issued[rank] = index + 1
        forward = self._pending.get(index)
        if forward is None:
            forward = self._pending[index] = _Forward(self.env.event(), len(self.ranks))
        forward.ranks += 1
        forward.duration_s = max(forward.duration_s, duration_s)
        forward.progress |= progress
        forward.executions[rank] = execution
        if forward.ranks == len(self.ranks):
            if self.moe is not None:
                forward.duration_s = _moe_forward(self.moe, forward.executions)
            self._time(forward)
        return index, forward.started

    def times(self, index: int) -> tuple[float, float]:
        """A started forward's start and end (each rank reads them once)."""
        forward = self._pending[index]
        forward.readers += 1
        if forward.readers == len(self.ranks):
            del self._pending[index]
        return forward.start_s, forward.end_s

    def _time(self, forward: _Forward) -> None:
        """Every rank has issued ``forward``: it starts once the one before it has ended."""
        env = self.env
        self.group.group_steps += 1
        wait: simpy.Event | None = None
        if forward.progress or any(rank.engine.any_batch_executed() for rank in self.ranks):
            self.stalled = False
        elif any(rank.engine.has_unfinished_requests() for rank in self.ranks):
            # Requests wait yet nothing computes anywhere: only a load landing (with a KV
            # connector) or an arrival can change that.
            due = [due_s for rank in self.ranks if rank.engine.has_connector
                   and (due_s := rank.next_transfer_event_s()) is not None]
            if due:
                self.stalled = False
                if forward.duration_s == 0:
                    wait = env.any_of([self.idle_event(), env.timeout(max(0.0, min(due) - env.now))])
            elif self.cluster.arrivals_done:
                if self.stalled:
                    blocked = next(rank for rank in self.ranks if rank.engine.has_unfinished_requests())
                    raise blocked.engine.no_progress_error("workload")
                self.stalled = True
            elif forward.duration_s == 0:
                wait = self.idle_event()  # free dummies would spin at one instant
        start_s = max(env.now, self.last_end_s)
        forward.start_s = start_s
        forward.end_s = self.last_end_s = start_s + forward.duration_s
        started = forward.started
        if wait is not None:
            def at_arrival(_event, forward=forward, started=started):
                forward.start_s = env.now
                forward.end_s = self.last_end_s = env.now + forward.duration_s
                started.succeed()
            wait.callbacks.append(at_arrival)
        elif start_s > env.now:
            env.timeout(start_s - env.now).callbacks.append(lambda _event: started.succeed())
        else:
            started.succeed()

    def idle_event(self) -> simpy.Event:
        """One event that an arrival on any rank triggers (every idle rank waits on it)."""
        idle = self._idle
        if idle is None or idle.triggered:
            idle = self._idle = self.env.event()
            for rank in self.ranks:
                rank.share_wake(idle)
        return idle


def _moe_forward(moe: MoEDPGroup, executions: list[Execution | None]) -> float:
    """A MoE group's forward (docs/clock.md#moe-under-data-parallelism): every rank's part is
    its own batch plus the group's MoE part; each batch's execution carries its whole part,
    and the forward lasts the slowest."""
    own = [execution.cost if execution is not None and isinstance(execution.cost, StepCost) else None
           for execution in executions]
    costs, duration_s = moe.step(own)
    for execution, cost in zip(executions, costs):
        if execution is not None:
            execution.cost = cost
    return duration_s


def _reported(result: BatchRecord) -> bool:
    """Whether the worker reported a transfer finished with this batch's result."""
    transfers = result.connector_output
    return transfers is not None and bool(transfers.completed_jobs or transfers.finished_recving
                                          or transfers.finished_sending)


class _Forward:
    """One forward pass of the group: the ranks that issued it, its slowest part's seconds,
    whether it makes progress, its start event, its start and end once timed, and how many
    ranks read them."""

    def __init__(self, started: simpy.Event, num_ranks: int):
        self.started = started
        self.executions: list[Execution | None] = [None] * num_ranks  # each rank's batch (None: dummy)
        self.ranks = 0
        self.duration_s = 0.0
        self.progress = False
        self.start_s = 0.0
        self.end_s = 0.0
        self.readers = 0


class _SyncPoint:
    """The ranks' all-reduce of whether any has unfinished requests (vLLM's
    ``_has_global_unfinished_reqs``): each brings its own answer; all leave with the OR
    once the last one is there."""

    def __init__(self, env: simpy.Environment, num_ranks: int):
        self.env = env
        self.num_ranks = num_ranks
        self.arrived = 0
        self.any_unfinished = False
        self.done = env.event()

    def join(self, unfinished: bool) -> simpy.Event:
        self.any_unfinished |= unfinished
        self.arrived += 1
        done = self.done
        if self.arrived == self.num_ranks:
            done.succeed(self.any_unfinished)
            self.done = self.env.event()
            self.arrived = 0
            self.any_unfinished = False
        return done


class AsyncGroup:
    """What the ranks' processes share: the forwards, the sync point, each rank's step
    counter (vLLM's ``step_counter``, the same on every rank at its own pace)."""

    def __init__(self, cluster: ClusterView, ranks: Sequence[Replica], group: DPGroup):
        self.cluster = cluster
        self.ranks = ranks
        self.group = group
        self.forwards = ForwardPasses(cluster.env, cluster, ranks, group)
        self.forwards.moe = group.settings.moe
        self.sync = _SyncPoint(cluster.env, len(ranks))
        self.step_counters = [0] * len(ranks)

    def processes(self) -> list[simpy.Process]:
        env = self.cluster.env
        return [env.process(rank_process(self, index)) for index in range(len(self.ranks))]


def rank_process(shared: AsyncGroup, index: int):
    """One rank's engine loop (``DPEngineCoreProc.run_busy_loop`` with
    ``step_with_batch_queue``) until arrivals are done and the group is idle."""
    cluster = shared.cluster
    env = cluster.env
    group = shared.group
    settings = group.settings
    forwards = shared.forwards
    ranks = shared.ranks
    replica = ranks[index]
    engine = replica.engine
    counters = shared.step_counters
    in_flight: InFlight = deque()
    last_end_s = 0.0  # the end of the batch this rank applied last

    connector = engine.has_connector

    def apply_oldest():
        nonlocal last_end_s
        forward, scheduled_s, start_s, end_s = in_flight.popleft()
        if forward is None:
            start_s = end_s = env.now
        elif end_s > env.now:
            yield env.timeout(end_s - env.now)
        times = BatchTimes(scheduled_s, start_s, end_s, last_end_s)
        last_end_s = end_s
        result = engine.update_batch()
        cluster.applied(replica, result, times)
        return result

    while True:
        if not group.running:
            if any(rank.engine.has_unfinished_requests() for rank in ranks):
                # A rank got a request: it starts a wave and the others join (START_DP_WAVE).
                group.running = True
                group.waves += 1
                forwards.idle_event().succeed()
            elif not engine.has_requests() and not in_flight:
                if cluster.arrivals_done:
                    return
                yield forwards.idle_event()
                continue
            elif connector:
                yield from _connector_alone(shared, replica, in_flight, apply_oldest)
                continue
        # One iteration: the engine step (step_with_batch_queue), then a dummy batch if it
        # computed nothing, then the step counter and perhaps the all-reduce.
        executed, preempted = yield from _engine_step(shared, index, in_flight, apply_oldest)
        unfinished = engine.has_unfinished_requests()
        if not executed:
            if not unfinished and not group.running:
                continue  # the group is idle: no forward, no step
            group.dummy_steps[index] += 1
            forward, started = forwards.issue(index, settings.dummy_batch_s, preempted)
            yield started
            forwards.times(forward)
        counter = counters[index] = counters[index] + 1
        if counter != 1 and counter % settings.dp_sync_interval:
            continue
        if not (yield shared.sync.join(unfinished)):
            counters[index] = 0
            group.running = False  # the wave ends on every rank


def _engine_step(shared: AsyncGroup, index: int, in_flight: InFlight, apply_oldest: ApplyOldest):
    """A rank's ``step_with_batch_queue``: schedule a batch if it has requests and issue its
    forward when it computes something, then apply the oldest batch when the queue is full
    or nothing more can be scheduled. Returns (executed, preempted)."""
    env, forwards = shared.cluster.env, shared.forwards
    replica = shared.ranks[index]
    engine = replica.engine
    executed = preempted = False
    if engine.has_requests():
        throttle = throttles_prefills(shared.group.settings.prefill_schedule_interval, shared.step_counters[index])
        batch = engine.schedule_batch(replica.executor, throttle)
        scheduled_s = env.now
        if batch.executed:
            executed = True
            forward, started = forwards.issue(index, batch.execution.duration_s, True, batch.execution)
            yield started
            start_s, end_s = forwards.times(forward)
            in_flight.append((forward, scheduled_s, start_s, end_s))
        else:
            preempted = bool(batch.output.preempted)
            in_flight.append((None, scheduled_s, scheduled_s, scheduled_s))
        if not (len(in_flight) < engine.batch_queue_size and (executed or engine.has_requests())):
            yield from apply_oldest()
    elif in_flight:
        yield from apply_oldest()
    return executed, preempted


def _connector_alone(shared: AsyncGroup, replica: Replica, in_flight: InFlight, apply_oldest: ApplyOldest):
    """A connector's work outside a wave steps alone, no forward and no dummy
    (docs/semantics.md#a-kv-connector-in-a-group): report, then wait for the next transfer
    or an arrival."""
    env = shared.cluster.env
    engine = replica.engine
    if engine.has_requests():
        engine.schedule_batch(replica.executor)
        in_flight.append((None, env.now, env.now, env.now))
    reported = False
    while in_flight:
        reported |= _reported((yield from apply_oldest()))
    due_s = replica.next_transfer_event_s()
    # Once every arrival is in, with nothing due, nothing will wake it: go on (its step
    # dropped the finished requests, so the loop ends).
    if not reported and not (due_s is None and shared.cluster.arrivals_done):
        idle = shared.forwards.idle_event()
        yield idle if due_s is None else env.any_of([idle, env.timeout(max(0.0, due_s - env.now))])
