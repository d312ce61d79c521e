"""Simulated time: a SimPy arrival process and an engine process around ``EngineCore.step``.

DESIGN.md "One core, two clocks". The arrival process adds each request at its arrival
time; the engine process steps while there is work (each step lasting what the executor
predicts) and sleeps on an event while idle. Arrivals at the same instant as a step
boundary are added before that step schedules, as the lockstep clock does, so both
clocks make the same decisions for the same arrival order.

With ``async_scheduling`` (vLLM's default) the engine process runs vLLM's batch queue
(``EngineCore.step_async`` in two halves): it schedules batch N+1 as soon as batch N is
handed to the device, so scheduling takes no simulated time (the cost model already
folds the CPU overlap into a batch's duration: ``max(gpu, overhead)``); the device runs
batches one after another, each starting when the previous one ends (or when it was
scheduled, if later); the engine then waits for the oldest batch's end and applies its
results, and schedules the next one at that instant, before the newer batch's results
are known. A metrics step is one batch: it starts when the device starts it and lasts
its device time; its admissions are stamped with the time it was scheduled. Batches that
computed nothing leave no step row unless they preempted.

Decode windows (``decode_windows``, on by default; ``sim/core/decode_window.py``): when
every running request samples in the one batch in flight (one may be left prefilling),
the asynchronous process goes on with window batches, which the scheduler does not visit
request by request. Each is priced by the executor's closed form (``decode_step_cost``,
its prefill chunks included), waited for and recorded like any batch; admissions, the
prefilling request's chunks and finishes go through the scheduler's own code. The window
ends (its batch in flight becoming a real one) when its waiting pass leaves a second
partial prefill behind the first, when a batch's allocations might not fit the free
blocks, when nobody is left to schedule, or before a batch the time limit could cut off.
Arrivals need no end: they only join the waiting queue, which each window batch offers
its budget to. With replicas, each engine process runs its own windows, and the router
(which reads the pools, never a request's counters) is told of finishes as they are
recorded. Engines without offload tiers and executors that ``supports_decode_windows``
get windows; what they record is byte for byte what the batches one by one record.

With an offload tier (``EngineCore.offload``) the engine also
steps while finished requests are still to be reported (their last chunks are stored in
that step, as vLLM steps while ``has_finished_requests``). A step that schedules nothing
because requests wait for transfers (a load from the tier, or a store or a disk promotion
their lookup waits for) steps again at once if the worker reported a transfer finished in
it, and otherwise sleeps until the next transfer finishes or a request arrives, whichever
is first. Without an offload tier none of this runs.

Data-parallel replicas (``engine.replicas``): several engines, each with its own executor
(its own cost-model clock), share one environment. The one arrival process asks the
router (``router.py``) for each arrival's replica and adds the request there; each
replica runs its own engine process (the synchronous or the asynchronous one above) and
sleeps on its own event while idle; the router is told when a routed request finishes or
is rejected (its outstanding tokens). With one replica no router is consulted and the run
is exactly the single-engine replay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import simpy
from simpy.events import URGENT, Event

from kvtwin.sim.core.decode_window import END, REAL_BATCH, open_decode_window
from kvtwin.sim.core.engine import Batch, EngineCore, ModelExecutor
from kvtwin.sim.core.offload.transfers import TimedTransfers
from kvtwin.sim.replay.metrics import MetricsRecorder
from kvtwin.sim.replay.router import Router
from kvtwin.sim.core.request import Request


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    request: Request
    session_id: str | None = None


class _UrgentTimeout(Event):
    """A timeout processed before ordinary events at the same instant.

    SimPy orders same-time events by priority, then creation; arrivals use the urgent
    priority so a request arriving exactly when a step ends is seen by the next step.
    """

    def __init__(self, env: simpy.Environment, delay: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


@dataclass
class ReplayClock:
    """Where the simulated run is: for progress display."""

    now_s: float = 0.0
    steps: int = 0
    arrived: int = 0
    finished: int = 0
    # Refused at arrival: done as far as progress goes (finished + rejected of the total).
    rejected: int = 0
    # Of ``steps``, those recorded inside decode windows (``sim/core/decode_window.py``).
    decode_window_steps: int = 0


def next_offload_event_s(engine: EngineCore) -> float | None:
    """When the next transfer of ``engine``'s offload tier finishes: a GPU↔CPU job, or a
    CPU↔disk job of a disk tier's promotion clock (None: nothing running)."""
    tier = engine.offload
    assert tier is not None and isinstance(tier.transfers, TimedTransfers)  # the SimPy clock's kind
    times = [t for t in (tier.transfers.next_completion_s(), tier.manager.next_finish_s()) if t is not None]
    return min(times) if times else None


def _reported(result) -> bool:
    """Whether the worker reported a transfer finished with this step's result."""
    transfers = result.transfers
    return transfers is not None and bool(transfers.completed_jobs or transfers.finished_recving)


def run_simulation(engine: EngineCore | Sequence[EngineCore], executor: ModelExecutor | Sequence[ModelExecutor],
                   arrivals: Iterable[Arrival], metrics: MetricsRecorder, *,
                   time_limit_s: float | None = None,
                   on_progress: Callable[[ReplayClock], None] | None = None, progress_every: int = 2000,
                   env: simpy.Environment | None = None, router: Router | None = None,
                   decode_windows: bool = True) -> float:
    """Replay ``arrivals`` (sorted by time) until every request is done or the time limit.

    ``engine`` is one engine or a list of data-parallel replicas, ``executor`` its
    executor or one per replica; with several replicas ``router`` (required) picks the
    replica of each arrival, and each replica runs its own engine process in the same
    environment. With one replica the router is not consulted. ``env`` is the clock
    (default a fresh ``simpy.Environment``; a ``simpy.rt.RealtimeEnvironment`` for
    wall-clock pacing). ``decode_windows`` False schedules every batch one by one (the
    results are the same; module docstring). Returns the simulated time at which the run
    ended.
    """
    engines = [engine] if isinstance(engine, EngineCore) else list(engine)
    executors: list[ModelExecutor] = list(executor) if isinstance(executor, Sequence) else [executor]
    if len(executors) != len(engines):
        raise ValueError(f"{len(engines)} engines but {len(executors)} executors")
    num_replicas = len(engines)
    if num_replicas > 1 and router is None:
        raise ValueError("several replicas need a router")
    if num_replicas == 1:
        router = None
    env = env if env is not None else simpy.Environment()
    clock = ReplayClock()
    # Taken one at a time as they arrive: a request exists from its arrival on, and a
    # finished one is not kept alive by a list of them all (pass an iterator, not a list).
    pending = iter(arrivals)
    del arrivals
    # Per replica: the event its engine process sleeps on while idle.
    wakes: list[Event | None] = [None] * num_replicas
    state = {"arrivals_done": False}

    def wake_replica(replica: int) -> None:
        wake = wakes[replica]
        if wake is not None and not wake.triggered:
            wake.succeed()

    def arrival_process():
        for arrival in pending:
            delay = arrival.arrival_s - env.now
            if delay > 0:
                yield _UrgentTimeout(env, delay)
            request = arrival.request
            replica = router.route(request, arrival.session_id) if router is not None else 0
            if router is None:
                metrics.arrived(request, arrival.arrival_s, arrival.session_id)
            else:
                metrics.arrived(request, arrival.arrival_s, arrival.session_id, replica)
            engine = engines[replica]
            if not engine.add_request(request):
                metrics.rejected(request, engine.rejected[-1])
                clock.rejected += 1
                if router is not None:
                    router.release(replica, request)
            clock.arrived += 1
            wake_replica(replica)
        state["arrivals_done"] = True
        for replica in range(num_replicas):
            wake_replica(replica)

    def engine_process(replica: int):
        engine = engines[replica]
        executor = executors[replica]
        offload = engine.offload is not None
        while True:
            if not engine.has_unfinished_requests() and not (offload and engine.scheduler.finished_req_ids):
                if state["arrivals_done"]:
                    return
                wakes[replica] = env.event()
                yield wakes[replica]
                wakes[replica] = None
                continue
            start_s = env.now
            result = engine.step(executor)
            duration_s = result.execution.duration_s
            if router is None:
                metrics.step(engine, result, start_s, start_s + duration_s)
            else:
                metrics.step(engine, result, start_s, start_s + duration_s, replica=replica)
            clock.steps += 1
            clock.finished += len(result.finished)
            if router is not None:
                for request in result.finished:
                    router.release(replica, request)
            if on_progress is not None and clock.steps % progress_every == 0:
                clock.now_s = start_s
                on_progress(clock)
            if duration_s > 0:
                yield env.timeout(duration_s)
            elif not result.output.num_scheduled_tokens:
                if offload and engine.has_unfinished_requests():
                    if (yield from wait_for_transfers(engine, replica, _reported(result))):
                        continue
                # Nothing could be scheduled and no time passes: wait for an arrival
                # rather than spin (the waiting head cannot fit until something changes).
                if state["arrivals_done"]:
                    return
                wakes[replica] = env.event()
                yield wakes[replica]
                wakes[replica] = None

    def wait_for_transfers(engine: EngineCore, replica: int, reported: bool):
        """Requests wait for transfers and nothing could run: True to step again, now if the
        worker just reported one finished (a waiting request may go), else once the next
        one finishes or a request arrives; False if nothing is in flight."""
        if reported:
            return True
        due_s = next_offload_event_s(engine)
        if due_s is None:
            return False
        if due_s > env.now:
            wakes[replica] = env.event()
            yield env.any_of([wakes[replica], env.timeout(due_s - env.now)])
            wakes[replica] = None
        return True

    def wait_for_arrival(replica: int):
        wakes[replica] = env.event()
        yield wakes[replica]
        wakes[replica] = None

    def async_engine_process(replica: int):
        engine = engines[replica]
        executor = executors[replica]
        offload = engine.offload is not None
        queue = engine.batch_queue
        size = engine.batch_queue_size
        # (scheduled at, device start, device end) of each batch in ``queue``, oldest first.
        times: deque[tuple[float, float, float]] = deque()
        device_free_s = 0.0

        def launch(duration_s: float) -> None:
            """A batch scheduled now runs on the device once the batches before it have."""
            nonlocal device_free_s
            now = env.now
            start_s = max(now, device_free_s)
            device_free_s = start_s + duration_s
            times.append((now, start_s, device_free_s))
        windows = decode_windows and not offload and size == 2 and getattr(executor, "supports_decode_windows", False)

        def decode_window():
            """Run a decode window (``sim/core/decode_window.py``) if one opens on the batch
            in flight; True if it left a batch just scheduled behind the one in flight (the
            window's last batch admitted what it could not take), so the next thing is to
            wait."""
            in_flight = queue[0]
            scheduler = engine.scheduler
            window = open_decode_window(scheduler, in_flight.output, in_flight.execution.sampled,
                                        executor.token_bases([r.request_id for r in scheduler.running]))
            if window is None:
                return False
            # The window batch in flight: its member decodes and cost, recorded when applied.
            in_flight_size = 0
            in_flight_cost = None
            last_end_s = 0.0
            j = 0
            while True:
                if time_limit_s is not None and times[0][2] >= time_limit_s:
                    break  # the run may stop before its predecessor is applied: no state may be implicit
                status = window.next_batch(j)
                if status == END:
                    break
                if status == REAL_BATCH:  # it admitted what the window cannot take
                    if j:
                        close_window(window, j, window.previous_new_blocks, window.previous_reported, last_end_s,
                                     in_flight_cost)
                    output = window.complete(j, window.admitted)
                    batch = Batch(output, executor.execute(output))
                    queue.append(batch)
                    launch(batch.execution.duration_s)
                    return True
                num_decodes = window.num_active
                part = window.parts.get(j)
                if part is None:
                    cost = executor.decode_step_cost(num_decodes, window.context_ends_sum(j))
                else:  # a prefill chunk and admissions, which the scheduler advanced
                    window.note_part_tokens(j, executor.sample(part),
                                            executor.token_bases(window.part_sampling_ids(j)))
                    part_decodes, part_ends_sum, prefill_items = window.part_cost_terms(j)
                    cost = executor.decode_step_cost(num_decodes + part_decodes,
                                                     window.context_ends_sum(j) + part_ends_sum, prefill_items)
                launch(cost.total_s)
                batch_times = times.popleft()
                if batch_times[2] > env.now:
                    yield env.timeout(batch_times[2] - env.now)
                if j == 0:
                    window.begin_real_update()
                    result = engine.update_batch()
                    window.end_real_update()
                    record(engine, replica, batch_times, result)
                else:
                    scheduled_s, start_s, end_s = batch_times
                    finished, window_steps, applied_part, part_sampled = window.apply(j)
                    metrics.decode_window_step(engine, start_s, end_s, in_flight_size, in_flight_cost,
                                               end_s - last_end_s, finished, window_steps, applied_part,
                                               part_sampled, scheduled_s, replica)
                    clock.steps += 1
                    clock.decode_window_steps += 1
                    clock.finished += len(finished)
                    if router is not None:
                        for request in finished:
                            router.release(replica, request)
                    if on_progress is not None and clock.steps % progress_every == 0:
                        clock.now_s = start_s
                        on_progress(clock)
                in_flight_size = num_decodes
                in_flight_cost = cost
                last_end_s = batch_times[2]
                j += 1
            if j:
                close_window(window, j, window.new_blocks, window.reported, last_end_s, in_flight_cost)
            return False

        def close_window(window, j: int, new_blocks, reported, last_end_s: float, cost) -> None:
            """End ``window`` at its state ``j``: its batch in flight queued as a real one
            (which costs what the window priced it at)."""
            output = window.close(j, new_blocks, reported)
            execution = executor.execute(output)
            assert execution.duration_s == cost.total_s, "a window batch priced apart from its real output"
            queue.append(Batch(output, execution))
            metrics.close_decode_window(window.members_to_record(j), last_end_s)

        while True:
            if not engine.has_requests() and not queue:
                if state["arrivals_done"]:
                    return
                yield from wait_for_arrival(replica)
                continue
            scheduled = False
            if windows and len(queue) == 1 and engine.has_requests():
                # (Returns at once unless the batch in flight opens a window; after one, the
                # batch in flight is its last and the next is scheduled here as usual.)
                scheduled = yield from decode_window()
            now = env.now
            if not scheduled and engine.has_requests():
                batch = engine.schedule_batch(executor)
                if batch.executed:
                    launch(batch.execution.duration_s)
                else:
                    # Nothing to run: done as soon as the batches before it are (queue order).
                    done_s = max(now, device_free_s)
                    times.append((now, done_s, done_s))
                    if not batch.output.preempted and not any(b.executed for b in queue):
                        # Nothing could be scheduled and nothing runs: apply what is queued (it
                        # computed nothing) and wait for an arrival rather than spin (the
                        # waiting head cannot fit until something changes).
                        reported = False
                        while queue:
                            result = engine.update_batch()
                            record(engine, replica, times.popleft(), result)
                            reported |= _reported(result)
                        if offload and engine.has_unfinished_requests():
                            if (yield from wait_for_transfers(engine, replica, reported)):
                                continue
                        if state["arrivals_done"]:
                            return
                        yield from wait_for_arrival(replica)
                        continue
                if len(queue) < size and (batch.executed or engine.has_requests()):
                    continue  # the queue has room: schedule the next batch at once
            batch_times = times.popleft()
            if batch_times[2] > env.now:
                yield env.timeout(batch_times[2] - env.now)
            record(engine, replica, batch_times, engine.update_batch())

    def record(engine: EngineCore, replica: int, batch_times: tuple[float, float, float], result) -> None:
        """A metrics step for an applied batch that computed or preempted something."""
        output = result.output
        if output.num_scheduled_tokens or output.preempted:
            scheduled_s, start_s, end_s = batch_times
            if router is None:
                metrics.step(engine, result, start_s, end_s, scheduled_s)
            else:
                metrics.step(engine, result, start_s, end_s, scheduled_s, replica=replica)
            clock.steps += 1
            if on_progress is not None and clock.steps % progress_every == 0:
                clock.now_s = start_s
                on_progress(clock)
        elif output.external_hits:
            metrics.loads_issued(engine, output, batch_times[0])  # a batch that only starts loads
        clock.finished += len(result.finished)
        if router is not None:
            for request in result.finished:
                router.release(replica, request)

    env.process(arrival_process())
    process = async_engine_process if engines[0].scheduler.config.async_scheduling else engine_process
    dones = [env.process(process(replica)) for replica in range(num_replicas)]
    done = dones[0] if num_replicas == 1 else env.all_of(dones)
    env.run(until=done if time_limit_s is None else env.any_of([done, env.timeout(time_limit_s)]))
    clock.now_s = env.now
    if on_progress is not None:
        on_progress(clock)
    metrics.finish_unfinished()
    return env.now
