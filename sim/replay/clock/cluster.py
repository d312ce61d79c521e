"""Replicas behind one front in one SimPy environment, and the run that drives them.

A ``Cluster`` always holds a list of replicas and one ``Front``: what sits in front of
the engines and takes each arrival, as a load balancer does in front of vLLM's
data-parallel engines or vLLM's P/D proxy in front of its prefill and decode instances.
The plain front (``RoutedFront``) asks a router for each arrival's replica; the P/D one
(``pd_front.py``) picks a prefill and a decode replica and moves the request between
them. One replica has the single-replica router, so a one-replica run is exactly the
single-engine replay and no process asks how many replicas there are. Each replica runs
its own engine process and sleeps on its own event while idle; the front is told when a
request it placed finishes or is rejected.

Every applied batch reaches the recorder through ``applied``: the engine's record of the
batch (``BatchRecord``, the engine's figures after it inside) and its times; the front
then sees it too (``Front.after_applied``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import simpy
from mypy_extensions import mypyc_attr

from kvtwin.sim.core.engine import BatchRecord, RequestSnapshot
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival, arrival_process
from kvtwin.sim.replay.clock.collector import relaxed_collection
from kvtwin.sim.replay.clock.dp_async import AsyncGroup
from kvtwin.sim.replay.clock.dp_group import DPGroup, dp_group_process
from kvtwin.sim.replay.clock.engine_processes import async_engine_process, sync_engine_process
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.recorder import BatchTimes, MetricsRecorder
from kvtwin.sim.replay.router import Router, SingleReplicaRouter


# A class, not a ``typing.Protocol``: the cluster calls its front once per arrival and per
# batch, and compiled code calls through a protocol-typed attribute the slow, generic way.
# The P/D front extends it interpreted (it runs a generator process, pd_front.py).
@mypyc_attr(allow_interpreted_subclasses=True)
class Front:
    """What sits in front of a cluster's replicas: it admits each arrival to an engine
    (``arrive``), sees each batch once the cluster has recorded it (``after_applied``), is
    told when a request it placed finishes (``release``), and says whether idle replicas
    may stop once every arrival is in (``replicas_may_stop``). It reaches the cluster only
    through the ``cluster`` it is handed."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas

    def attach(self, cluster: Cluster) -> None:
        """``cluster`` is built around this front (its replicas have their indexes)."""

    def arrive(self, cluster: Cluster, arrival: Arrival) -> None:
        raise NotImplementedError

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        """A request this front placed on ``replica`` finished there (or was rejected)."""
        raise NotImplementedError

    def after_applied(self, cluster: Cluster, replica: Replica, result: BatchRecord, times: BatchTimes) -> None:
        """``replica``'s batch ``result`` was recorded and its finished requests released."""

    def replicas_may_stop(self, cluster: Cluster) -> bool:
        """Every arrival is in: whether nothing more will reach a replica, so that an idle
        one may stop."""
        return True


class RoutedFront(Front):
    """A router in front of the replicas: each arrival goes to the replica it picks."""

    def __init__(self, router: Router):
        super().__init__(router.num_replicas)
        self.router = router
        self.observes = router.observes_engines

    def arrive(self, cluster: Cluster, arrival: Arrival) -> None:
        request = arrival.request
        index = self.router.route(request, arrival.session_id)
        recorder = cluster.recorder
        recorder.arrived(request, arrival.arrival_s, arrival.session_id, index)
        replica = cluster.replicas[index]
        engine = replica.engine
        progress = cluster.progress
        if not engine.add_request(request):
            recorder.rejected(request, engine.rejected[-1])
            progress.rejected += 1
            self.router.release(index, request)
        elif self.observes:
            self.router.observe(index, cluster.env.now)
        progress.arrived += 1
        replica.wake()

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        self.router.release(replica, request)

    def after_applied(self, cluster: Cluster, replica: Replica, result: BatchRecord, times: BatchTimes) -> None:
        # When the clock applies the batch (a synchronous step's start): the engine's
        # state changes then, and the router's releases were made then too.
        if self.observes:
            self.router.observe(replica.index, cluster.env.now)


class Cluster:
    def __init__(self, env: simpy.Environment, replicas: Sequence[Replica], front: Front,
                 recorder: MetricsRecorder, *, time_limit_s: float | None = None,
                 on_progress: Callable[[ReplayClock], None] | None = None, progress_every: int = 2000,
                 dp_group: DPGroup | None = None, dp_groups: Sequence[DPGroup] = ()):
        if front.num_replicas != len(replicas):
            raise ValueError(f"{len(replicas)} replicas behind a front of {front.num_replicas}")
        self.env = env
        self.replicas = list(replicas)
        for index, replica in enumerate(self.replicas):
            replica.index = index
        self.front = front
        self.recorder = recorder
        self.time_limit_s = time_limit_s
        self.on_progress = on_progress
        self.progress_every = progress_every
        self.progress = ReplayClock()
        self.all_arrived = False  # the arrival process has added its last arrival
        # The replicas are the ranks of one data-parallel group that steps together
        # (dp_group.py); None: each replica runs its own engine process.
        self.dp_group = dp_group
        # Groups over some of the replicas (a P/D side's DP ranks, from each group's
        # ``first``); the replicas outside any run their own engine processes.
        self.dp_groups = list(dp_groups) if dp_group is None else [dp_group]
        front.attach(self)

    @property
    def arrivals_done(self) -> bool:
        """No request will reach any replica any more (an idle replica stops only then):
        every arrival is in, and the front has nothing left to hand to a replica."""
        return self.all_arrived and self.front.replicas_may_stop(self)

    # -- what the processes report ----------------------------------------------------------

    def arrive(self, arrival: Arrival) -> None:
        self.front.arrive(self, arrival)

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
        front = self.front
        for snapshot in result.finished:
            front.release(replica.index, snapshot)
        front.after_applied(self, replica, result, times)

    # -- the run ------------------------------------------------------------------------------

    def run(self, arrivals: Iterable[Arrival]) -> float:
        """Replay ``arrivals`` (sorted by time) until every request is done or the time
        limit; returns the simulated time at which the run ended."""
        env = self.env
        env.process(arrival_process(self, iter(arrivals)))
        dones: list[simpy.Process] = []
        grouped: set[int] = set()
        for group in self.dp_groups:
            ranks = self.replicas[group.first:group.first + group.num_ranks]
            grouped.update(range(group.first, group.first + group.num_ranks))
            if ranks[0].engine.async_scheduling:
                dones.extend(AsyncGroup(self, ranks, group).processes())
            else:
                dones.append(env.process(dp_group_process(self, ranks, group)))
        dones.extend(env.process(_engine_process(self, replica)) for replica in self.replicas
                     if replica.index not in grouped)
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


def _engine_process(cluster: Cluster, replica: Replica):
    if replica.engine.async_scheduling:
        return async_engine_process(cluster, replica)
    return sync_engine_process(cluster, replica)


def run_simulation(replicas: Sequence[Replica], arrivals: Iterable[Arrival], recorder: MetricsRecorder, *,
                   router: Router | None = None, time_limit_s: float | None = None,
                   on_progress: Callable[[ReplayClock], None] | None = None, progress_every: int = 2000,
                   env: simpy.Environment | None = None) -> float:
    """Replay ``arrivals`` on ``replicas`` behind ``router`` (a single replica may leave it
    out). ``env`` is the clock: a fresh ``simpy.Environment`` by default, a
    ``simpy.rt.RealtimeEnvironment`` for wall-clock pacing. Returns the simulated time at
    which the run ended."""
    router = router if router is not None else SingleReplicaRouter()
    cluster = Cluster(env if env is not None else simpy.Environment(), replicas, RoutedFront(router), recorder,
                      time_limit_s=time_limit_s, on_progress=on_progress, progress_every=progress_every)
    return cluster.run(arrivals)
