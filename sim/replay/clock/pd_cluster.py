"""A disaggregated prefill/decode cluster on the SimPy clock.

docs/semantics.md#disaggregated-prefill-and-decode. Replicas ``0 .. P-1`` prefill and
``P .. P+D-1`` decode (``PDRouter``); every engine has a ``PDConnector`` and a
``PDTransfers`` worker, its ``PDTier``, which the cluster is handed beside the replicas
(it never reads them back from an engine). A request flows as through vLLM's P/D proxy:

1. on arrival the router picks a prefill and a decode replica; the prefill replica gets
   a copy of the request (id ``<id>@prefill``, the prompt less the connector's backoff,
   ``max_tokens = 1``), marked for a remote decode;
2. when it finishes there its blocks stay (``request_finished`` delays their free) and
   the client's request goes to the decode replica, announced as a remote prefill of the
   tokens the prefill side computed;
3. the decode replica admits it as an asynchronous load and its worker reads the blocks
   over the decode replica's link; when the read lands the decode side is told
   (``finished_recving``) and so is the prefill side (``finished_sending``: it frees
   the blocks) — each at the end of its first step after that instant;
4. the decode replica recomputes the prompt's last token, samples the first output
   token (the client's first token: vLLM's proxy streams the decode side's reply) and
   decodes the rest.

A request the prefill replica rejects is the client's rejection; one the decode replica
rejects is too, and its prefill blocks are freed at once (vLLM's decode side notifies
the prefill side of an aborted request).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import simpy

from kvtwin.sim.core.engine import BatchRecord, RequestSnapshot
from kvtwin.sim.core.pd_connector import PDTier, PDTransfers, RemoteRead, truncated_prompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import Cluster
from kvtwin.sim.replay.clock.progress import ReplayClock
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.recorder import BatchTimes, MetricsRecorder

PREFILL_SUFFIX = "@prefill"


def prefill_request(request: Request, backoff_tokens: int) -> Request:
    """The request the prefill replica runs for ``request``."""
    return Request(request.request_id + PREFILL_SUFFIX, truncated_prompt(request.prompt, backoff_tokens), 1,
                   arrival_time=request.arrival_time, priority=request.priority)


@dataclasses.dataclass
class _InFlight:
    request: Request  # the client's request
    prefill_id: str
    prefill: int  # replica indexes
    decode: int


class PDCluster:
    """The cluster the engine processes see (``ClusterView``) for a P/D deployment: the
    replay's ``Cluster`` does the bookkeeping of every batch (recorder, progress, router
    releases); this adds the hand-overs between the roles and when idle replicas may stop."""

    def __init__(self, env: simpy.Environment, replicas: Sequence[Replica], tiers: Sequence[PDTier],
                 router: PDRouter, recorder: MetricsRecorder, *, num_prefill: int, copies: int = 1,
                 time_limit_s: float | None = None, on_progress: Callable[[ReplayClock], None] | None = None,
                 progress_every: int = 2000):
        """``tiers``: each replica's connector tier, the one its engine was built with;
        ``num_prefill``: how many of the replicas (the first) prefill; ``copies``: the
        workers each move their share of a read (tensor parallel; 1 with MLA)."""
        self.inner = Cluster(env, replicas, router, recorder, time_limit_s=time_limit_s, on_progress=on_progress,
                             progress_every=progress_every)
        self.env = env
        self.replicas = self.inner.replicas
        self.router = router
        self.recorder = recorder
        self.time_limit_s = time_limit_s
        self.on_progress = on_progress
        self.progress = self.inner.progress
        self.num_prefill = num_prefill
        self.copies = copies
        self.tiers = list(tiers)
        assert len(self.tiers) == len(self.replicas), "one connector tier per replica"
        # Each replica's worker, on the SimPy clock's kind (told of reads in seconds).
        self._workers: list[PDTransfers] = []
        for tier in self.tiers:
            assert isinstance(tier.transfers, PDTransfers)
            self._workers.append(tier.transfers)
        self.roles = ["prefill" if i < num_prefill else "decode" for i in range(len(self.replicas))]
        self._arrivals_done = False
        self._by_prefill_id: dict[str, _InFlight] = {}
        self._by_id: dict[str, _InFlight] = {}
        for worker in self._workers[num_prefill:]:
            worker.on_read = self._read_issued

    @property
    def arrivals_done(self) -> bool:
        """No request will reach any replica any more and no prefill replica still holds
        blocks for a read: the arrivals are done, no prefill is still to hand its request
        over, and no read is still to come (an idle replica stops only then)."""
        if not self._arrivals_done or self._by_prefill_id:
            return False
        return not any(r.engine.holds_blocks_for_reads() for r in self.replicas[:self.num_prefill])

    @arrivals_done.setter
    def arrivals_done(self, value: bool) -> None:
        self._arrivals_done = value

    def _wake_all_if_done(self) -> None:
        if self.arrivals_done:
            for replica in self.replicas:
                replica.wake()

    def run(self, arrivals: Iterable[Arrival]) -> float:
        """As ``Cluster.run``, the processes seeing this cluster."""
        return self.inner.run(arrivals, view=self)

    def arrive(self, arrival: Arrival) -> None:
        request = arrival.request
        p_request = prefill_request(request, self.tiers[0].connector.prefill_backoff_tokens)
        prefill, decode = self.router.route_pair(p_request, request, arrival.session_id)
        self.recorder.arrived(request, arrival.arrival_s, arrival.session_id, decode)
        self.recorder.arrived_prefill(p_request, request.request_id, arrival.arrival_s, prefill)
        flight = _InFlight(request, p_request.request_id, prefill, decode)
        engine = self.replicas[prefill].engine
        connector = self.tiers[prefill].connector
        connector.mark_remote_decode(p_request.request_id)
        self.progress.arrived += 1
        if not engine.add_request(p_request):
            connector.request_finished(p_request)  # forget the mark
            self.recorder.rejected(request, engine.rejected[-1])
            self.progress.rejected += 1
            self.router.release(prefill, p_request)
            self.router.release(decode, request)
            return
        self._by_prefill_id[p_request.request_id] = flight
        self.replicas[prefill].wake()

    def applied(self, replica: Replica, result: BatchRecord, times: BatchTimes, synchronous: bool = False) -> None:
        self.inner.applied(replica, result, times, synchronous)
        if replica.index < self.num_prefill and result.connector_output is not None and result.connector_output.finished_sending:
            self._wake_all_if_done()  # the last blocks held for a read may have gone
        if replica.index < self.num_prefill and result.finished:
            self.progress.finished -= len(result.finished)  # only the decode side finishes a request
            finished = list(result.finished)
            if times.end_s > self.env.now:
                # A synchronous step is applied when it starts: hand over when it ends.
                self.env.process(self._prefilled_at(finished, times.end_s))
            else:
                for p_request in finished:
                    self._prefilled(p_request, times.end_s)

    def _prefilled_at(self, finished: list[RequestSnapshot], end_s: float):
        yield self.env.timeout(end_s - self.env.now)
        for p_request in finished:
            self._prefilled(p_request, end_s)

    def _prefilled(self, p_request: RequestSnapshot, end_s: float) -> None:
        """The prefill side finished: the client's request goes to its decode replica."""
        flight = self._by_prefill_id.pop(p_request.request_id)
        request = flight.request
        decode = self.replicas[flight.decode]
        engine = decode.engine
        connector = self.tiers[flight.decode].connector
        self.recorder.prefill_done(request.request_id, end_s)
        connector.expect_remote_prefill(request.request_id, p_request.num_computed_tokens)
        if not engine.add_request(request):
            connector.request_finished(request)
            self.recorder.rejected(request, engine.rejected[-1])
            self.progress.rejected += 1
            self.router.release(flight.decode, request)
            self._send_done(flight, self.env.now)
            return
        self._by_id[request.request_id] = flight
        decode.wake()

    def _read_issued(self, read: RemoteRead, issued_s: float, done_s: float) -> None:
        """A decode worker issued its read of a request's blocks: the prefill side learns
        when it lands (and frees them then)."""
        flight = self._by_id.pop(read.req_id)
        # A read of no tokens (the decode side's own hit covered what it was to load) only
        # tells the prefill side to free: no transfer, so no transfer seconds (NaN).
        seconds = done_s - issued_s if read.num_tokens else math.nan
        self.recorder.pd_transfer(read.req_id, read.num_bytes * self.copies, seconds,
                                  read.hit_tokens if read.num_tokens else None)
        self._send_done(flight, done_s)

    def _send_done(self, flight: _InFlight, at_s: float) -> None:
        prefill = self.replicas[flight.prefill]
        self._workers[flight.prefill].send_done(flight.prefill_id, at_s)
        prefill.wake()
