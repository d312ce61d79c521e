"""The two engine processes of a replica: synchronous steps, or vLLM's batch queue.

``sync_engine_process``: each step schedules, runs for what the executor predicts, and is
applied at its end; an idle replica sleeps until an arrival.

``async_engine_process`` (``async_scheduling``, vLLM's default): batch N+1 is scheduled as
soon as batch N is handed to the device, so scheduling takes no simulated time (the cost
model folds the CPU overlap into a batch's duration: ``max(gpu, overhead)``). The device
runs batches one after another (``DeviceTimeline``); the engine waits for the oldest
batch's end, applies its results and schedules the next one at that instant, before the
newer batch's results are known. A metrics step is one batch: it starts when the device
starts it and lasts its device time; its admissions are stamped with the time it was
scheduled. Batches that computed nothing leave no step row unless they preempted.

Decode windows (``sim/core/decode_window.py``) need nothing here: the replica's
``WindowedBatchQueue`` hands out window batches and real ones alike. The clock's one part
in them is whether a window may go on: only while the time limit cannot cut its
batch in flight short, so a run stopped by the limit holds no implicit state.

With a KV connector (an offload tier, or P/D's) the engine also steps while finished
requests are still to be reported (an offload tier stores their last chunks in that step;
a P/D prefill side holds their blocks until the decode side has read them), as vLLM steps
while ``has_finished_requests``. A step that schedules nothing because requests wait for
transfers steps again at once if the worker reported a transfer finished in it, and
otherwise sleeps until the next transfer finishes or a request arrives, whichever is first.
"""

from __future__ import annotations

from typing import Protocol

import simpy

from kvtwin.sim.core.engine import BatchRecord
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import BatchTimes


class ClusterView(Protocol):
    """What an engine process reports to and asks of the cluster it runs in (the
    ``Cluster``, whatever front it has; a protocol because ``cluster.py`` imports this)."""

    env: simpy.Environment

    @property
    def arrivals_done(self) -> bool:
        ...

    def applied(self, replica: Replica, result: BatchRecord, times: BatchTimes, synchronous: bool = False) -> None:
        ...

    time_limit_s: float | None


def sync_engine_process(cluster: ClusterView, replica: Replica):
    env = cluster.env
    engine = replica.engine
    executor = replica.executor
    connector = engine.has_connector
    stalled = False  # the last step scheduled nothing with nothing left to wait for
    while True:
        # With a connector a step also reports finished requests (an offload tier's last
        # stores; P/D's reads of a prefill side's blocks).
        if not (engine.has_requests() if connector else engine.has_unfinished_requests()):
            if cluster.arrivals_done:
                return
            yield replica.sleep(env)
            continue
        start_s = env.now
        result = engine.step(executor)
        duration_s = result.execution.duration_s
        cluster.applied(replica, result, BatchTimes(start_s, start_s, start_s + duration_s), synchronous=True)
        if result.output.num_scheduled_tokens:
            stalled = False
        if duration_s > 0:
            yield env.timeout(duration_s)
        elif not result.output.num_scheduled_tokens:
            if engine.waits_for_transfers():
                if (yield from _wait_for_transfers(cluster, replica, _reported(result))):
                    stalled = False
                    continue
            # Nothing could be scheduled and no time passes: wait for an arrival rather
            # than spin (the waiting head cannot fit until something changes).
            if cluster.arrivals_done:
                if not engine.has_unfinished_requests():
                    return
                # Nothing will arrive or finish any more: the state changes only by what a
                # step does, so a second empty step in a row (blocks cached in the first are
                # hits in the second) means no progress is possible.
                if stalled and not result.output.preempted:
                    raise engine.no_progress_error("workload")
                stalled = True
                continue
            stalled = False
            yield replica.sleep(env)


def async_engine_process(cluster: ClusterView, replica: Replica):
    env = cluster.env
    engine = replica.engine
    batches = replica.batches
    timeline = replica.timeline
    size = engine.batch_queue_size
    limit_s = cluster.time_limit_s
    stalled = False  # the last idle pass found nothing left to wait for
    while True:
        if not engine.has_requests() and not batches.in_flight:
            if cluster.arrivals_done:
                return
            yield replica.sleep(env)
            continue
        if engine.has_requests():
            now = env.now
            # A window goes on only while the time limit cannot cut its batch in flight
            # short: a run stopped by the limit must hold no implicit state.
            launch = batches.schedule(limit_s is None or timeline.ends_before(limit_s))
            if launch.executed:
                stalled = False
                timeline.launch(now, launch.duration_s)
            else:
                timeline.launch_empty(now)
                if not launch.preempted and not batches.any_executed():
                    # Nothing could be scheduled and nothing runs: apply what is queued (it
                    # computed nothing) and wait rather than spin.
                    waited = yield from _idle(cluster, replica)
                    if waited is _DONE:
                        return
                    if waited is _STALLED:
                        # As in the synchronous process: twice in a row, no progress is possible.
                        if stalled:
                            raise engine.no_progress_error("workload")
                        stalled = True
                    else:
                        stalled = False
                    continue
            if batches.in_flight < size and (launch.executed or engine.has_requests()):
                continue  # the queue has room: schedule the next batch at once
        times = timeline.take_oldest()
        if times.end_s > env.now:
            yield env.timeout(times.end_s - env.now)
        cluster.applied(replica, batches.update(), times)


# What an idle replica found (``_idle``): it waited for something and goes on; it is done;
# or nothing is left to wait for although requests are unfinished (it goes on once more).
_WAITED = "waited"
_DONE = "done"
_STALLED = "stalled"


def _idle(cluster: ClusterView, replica: Replica):
    """Apply the batches queued (none computes anything), then wait for a transfer or an
    arrival: ``_WAITED`` to go on, ``_DONE`` when the replica is done, ``_STALLED`` when
    arrivals are done and nothing is in flight, yet requests are unfinished."""
    engine = replica.engine
    reported = False
    while replica.batches.in_flight:
        result = replica.batches.update()
        cluster.applied(replica, result, replica.timeline.take_oldest())
        reported |= _reported(result)
    if engine.waits_for_transfers():
        if (yield from _wait_for_transfers(cluster, replica, reported)):
            return _WAITED
    if cluster.arrivals_done:
        return _STALLED if engine.has_unfinished_requests() else _DONE
    yield replica.sleep(cluster.env)
    return _WAITED


def _wait_for_transfers(cluster: ClusterView, replica: Replica, reported: bool):
    """Requests wait for transfers and nothing could run: True to step again, now if the
    worker just reported one finished (a waiting request may go), else once the next one
    finishes or a request arrives; False if nothing is in flight."""
    if reported:
        return True
    due_s = replica.next_transfer_event_s()
    if due_s is None:
        return False
    env = cluster.env
    if due_s > env.now:
        yield env.any_of([replica.sleep(env), env.timeout(due_s - env.now)])
    return True


def _reported(result) -> bool:
    """Whether the worker reported a transfer finished with this step's result."""
    transfers = result.connector_output
    return transfers is not None and bool(transfers.completed_jobs or transfers.finished_recving
                                          or transfers.finished_sending)
