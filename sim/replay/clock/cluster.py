"""Replicas behind a router in one SimPy environment, and the run that drives them.

A ``Cluster`` always holds a list of replicas and a router; one replica has the
single-replica router, so a one-replica run is exactly the single-engine replay and no
process asks how many replicas there are. The arrival process asks the router for each
arrival's replica; each replica runs its own engine process and sleeps on its own event
while idle; the router is told when a routed request finishes or is rejected.

Every applied batch reaches the recorder through ``applied``: the engine's record of the
batch (``BatchRecord``, the engine's figures after it inside) and its times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import simpy

from kvtwin.sim.core.engine import BatchRecord
from kvtwin.sim.replay.clock.arrivals import Arrival, arrival_process
from kvtwin.sim.replay.clock.collector import relaxed_collection
from kvtwin.sim.replay.clock.engine_processes import async_engine_process, sync_engine_process
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import BatchTimes, MetricsRecorder
from kvtwin.sim.replay.router import Router, SingleReplicaRouter


class Cluster:
    def __init__(self, env: simpy.Environment, replicas: Sequence[Replica], router: Router,
                 recorder: MetricsRecorder, *, time_limit_s: float | None = None,
                 on_progress: Callable[[ReplayClock], None] | None = None, progress_every: int = 2000):
        if router.num_replicas != len(replicas):
            raise ValueError(f"{len(replicas)} replicas behind a router of {router.num_replicas}")
        self.env = env
        self.replicas = list(replicas)
        for index, replica in enumerate(self.replicas):
            replica.index = index
        self.router = router
        self.recorder = recorder
        self.time_limit_s = time_limit_s
        self.on_progress = on_progress
        self.progress_every = progress_every
        self.progress = ReplayClock()
        self.arrivals_done = False

    # -- what the processes report ----------------------------------------------------------

    def arrive(self, arrival: Arrival) -> None:
        request = arrival.request
        index = self.router.route(request, arrival.session_id)
        self.recorder.arrived(request, arrival.arrival_s, arrival.session_id, index)
        replica = self.replicas[index]
        engine = replica.engine
        if not engine.add_request(request):
            self.recorder.rejected(request, engine.rejected[-1])
            self.progress.rejected += 1
            self.router.release(index, request)
        self.progress.arrived += 1
        replica.wake()

    def applied(self, replica: Replica, result: BatchRecord, times: BatchTimes, synchronous: bool = False) -> None:
        """``replica`` applied a batch's results at ``times.end_s``."""
        progress = self.progress
        if self.recorder.on_batch_applied(result, times, replica.index, synchronous):
            progress.steps += 1
            if result.implicit_decodes is not None:
                progress.decode_window_steps += 1
            if self.on_progress is not None and progress.steps % self.progress_every == 0:
                progress.now_s = times.start_s
                self.on_progress(progress)
        progress.finished += len(result.finished)
        for snapshot in result.finished:
            self.router.release(replica.index, snapshot)

    # -- the run ------------------------------------------------------------------------------

    def run(self, arrivals: Iterable[Arrival], view: Any = None) -> float:
        """Replay ``arrivals`` (sorted by time) until every request is done or the time
        limit; returns the simulated time at which the run ended. ``view`` is the cluster
        the processes see: this one, or one that wraps it (``PDCluster``)."""
        seen = self if view is None else view
        env = self.env
        env.process(arrival_process(seen, iter(arrivals)))
        dones = [env.process(_engine_process(seen, replica)) for replica in self.replicas]
        done = dones[0] if len(dones) == 1 else env.all_of(dones)
        limit = self.time_limit_s
        with relaxed_collection():
            env.run(until=done if limit is None else env.any_of([done, env.timeout(limit)]))
        self.progress.now_s = env.now
        if self.on_progress is not None:
            self.on_progress(self.progress)
        self.recorder.finish_unfinished([snapshot for replica in self.replicas
                                         for snapshot in replica.batches.request_snapshots()])
        return env.now


def _engine_process(view: Any, replica: Replica):
    if replica.engine.async_scheduling:
        return async_engine_process(view, replica)
    return sync_engine_process(view, replica)


def run_simulation(replicas: Sequence[Replica], arrivals: Iterable[Arrival], recorder: MetricsRecorder, *,
                   router: Router | None = None, time_limit_s: float | None = None,
                   on_progress: Callable[[ReplayClock], None] | None = None, progress_every: int = 2000,
                   env: simpy.Environment | None = None) -> float:
    """Replay ``arrivals`` on ``replicas`` behind ``router`` (a single replica may leave it
    out). ``env`` is the clock: a fresh ``simpy.Environment`` by default, a
    ``simpy.rt.RealtimeEnvironment`` for wall-clock pacing. Returns the simulated time at
    which the run ended."""
    router = router if router is not None else SingleReplicaRouter()
    cluster = Cluster(env if env is not None else simpy.Environment(), replicas, router, recorder,
                      time_limit_s=time_limit_s, on_progress=on_progress, progress_every=progress_every)
    return cluster.run(arrivals)
