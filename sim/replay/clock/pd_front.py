"""The P/D front: what sits in front of a disaggregated prefill/decode cluster.

docs/semantics.md#disaggregated-prefill-and-decode. The cluster is the replay's one
``Cluster``; its front (``PDFront``) plays vLLM's P/D proxy, where a plain replay's
(``RoutedFront``) plays a load balancer. Replicas ``0 .. P-1`` prefill and ``P .. P+D-1``
decode (``PDRouter``); every engine has a ``PDConnector`` and a ``PDTransfers`` worker,
its ``PDTier``, which the front is handed beside the router (it never reads them back
from an engine). A request flows as through vLLM's P/D proxy:

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
from collections.abc import Sequence
from functools import partial

from kvtwin.sim.core.connector_tier import ConnectorTier
from kvtwin.sim.core.engine import BatchRecord, RequestSnapshot
from kvtwin.sim.core.pd_connector import PDTier, PDTransfers, RemoteRead, truncated_prompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import Cluster, Front
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.pd_router import PDRouter
from kvtwin.sim.replay.recorder import BatchTimes

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


class PDFront(Front):
    """vLLM's P/D proxy in front of the cluster: picks each arrival's prefill and decode
    replica, hands a request over to its decode replica when its prefill finishes, and
    keeps idle replicas running while a prefill or a read is still to come. The cluster
    does the bookkeeping of every batch (recorder, progress, releases) before
    ``after_applied``."""

    def __init__(self, tiers: Sequence[ConnectorTier | None], router: PDRouter, *, copies: int = 1):
        """``tiers``: each replica's connector tier, the one its engine was built with
        (prefill replicas first, as ``router`` numbers them); ``copies``: the workers each
        move their share of a read (tensor parallel; 1 with MLA)."""
        super().__init__(router.num_replicas)
        self.router = router
        self.num_prefill = router.num_prefill
        self.copies = copies
        self.tiers: list[PDTier] = []
        # Each replica's worker, on the SimPy clock's kind (told of reads in seconds).
        self._workers: list[PDTransfers] = []
        for tier in tiers:
            assert isinstance(tier, PDTier) and isinstance(tier.transfers, PDTransfers), "a P/D tier per replica"
            self.tiers.append(tier)
            self._workers.append(tier.transfers)
        assert len(self.tiers) == router.num_replicas, "one connector tier per replica"
        self._by_prefill_id: dict[str, _InFlight] = {}
        self._by_id: dict[str, _InFlight] = {}

    def attach(self, cluster: Cluster) -> None:
        for worker in self._workers[self.num_prefill:]:
            worker.on_read = partial(self._read_issued, cluster)

    def replicas_may_stop(self, cluster: Cluster) -> bool:
        """No prefill is still to hand its request over, and no prefill replica still
        holds blocks for a read (no read is still to come)."""
        if self._by_prefill_id:
            return False
        return not any(r.engine.holds_blocks_for_reads() for r in cluster.replicas[:self.num_prefill])

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        self.router.release(replica, request)

    def _wake_all_if_done(self, cluster: Cluster) -> None:
        if cluster.arrivals_done:
            for replica in cluster.replicas:
                replica.wake()

    def arrive(self, cluster: Cluster, arrival: Arrival) -> None:
        request = arrival.request
        recorder = cluster.recorder
        progress = cluster.progress
        p_request = prefill_request(request, self.tiers[0].connector.prefill_backoff_tokens)
        prefill, decode = self.router.route_pair(p_request, request, arrival.session_id)
        recorder.arrived(request, arrival.arrival_s, arrival.session_id, decode)
        recorder.arrived_prefill(p_request, request.request_id, arrival.arrival_s, prefill)
        flight = _InFlight(request, p_request.request_id, prefill, decode)
        engine = cluster.replicas[prefill].engine
        connector = self.tiers[prefill].connector
        connector.mark_remote_decode(p_request.request_id)
        progress.arrived += 1
        if not engine.add_request(p_request):
            connector.request_finished(p_request)  # forget the mark
            recorder.rejected(request, engine.rejected[-1])
            progress.rejected += 1
            self.router.release(prefill, p_request)
            self.router.release(decode, request)
            return
        self._by_prefill_id[p_request.request_id] = flight
        if self.router.observes_engines:
            self.router.observe(prefill, cluster.env.now)
        cluster.replicas[prefill].wake()

    def after_applied(self, cluster: Cluster, replica: Replica, result: BatchRecord, times: BatchTimes) -> None:
        if self.router.observes_engines:
            self.router.observe(replica.index, cluster.env.now)
        if replica.index < self.num_prefill and result.connector_output is not None and result.connector_output.finished_sending:
            self._wake_all_if_done(cluster)  # the last blocks held for a read may have gone
        if replica.index < self.num_prefill and result.finished:
            cluster.progress.finished -= len(result.finished)  # only the decode side finishes a request
            finished = list(result.finished)
            env = cluster.env
            if times.end_s > env.now:
                # A synchronous step is applied when it starts: hand over when it ends.
                env.process(self._prefilled_at(cluster, finished, times.end_s))
            else:
                for p_request in finished:
                    self._prefilled(cluster, p_request, times.end_s)

    def _prefilled_at(self, cluster: Cluster, finished: list[RequestSnapshot], end_s: float):
        env = cluster.env
        yield env.timeout(end_s - env.now)
        for p_request in finished:
            self._prefilled(cluster, p_request, end_s)

    def _prefilled(self, cluster: Cluster, p_request: RequestSnapshot, end_s: float) -> None:
        """The prefill side finished: the client's request goes to its decode replica."""
        flight = self._by_prefill_id.pop(p_request.request_id)
        request = flight.request
        recorder = cluster.recorder
        decode = cluster.replicas[flight.decode]
        engine = decode.engine
        connector = self.tiers[flight.decode].connector
        recorder.prefill_done(request.request_id, end_s)
        connector.expect_remote_prefill(request.request_id, p_request.num_computed_tokens)
        if not engine.add_request(request):
            connector.request_finished(request)
            recorder.rejected(request, engine.rejected[-1])
            cluster.progress.rejected += 1
            self.router.release(flight.decode, request)
            self._send_done(cluster, flight, cluster.env.now)
            return
        self._by_id[request.request_id] = flight
        if self.router.observes_engines:
            self.router.observe(flight.decode, cluster.env.now)
        decode.wake()

    def _read_issued(self, cluster: Cluster, read: RemoteRead, issued_s: float, done_s: float) -> None:
        """A decode worker issued its read of a request's blocks: the prefill side learns
        when it lands (and frees them then)."""
        flight = self._by_id.pop(read.req_id)
        # A read of no tokens (the decode side's own hit covered what it was to load) only
        # tells the prefill side to free: no transfer, so no transfer seconds (NaN).
        seconds = done_s - issued_s if read.num_tokens else math.nan
        cluster.recorder.pd_transfer(read.req_id, read.num_bytes * self.copies, seconds,
                                     read.hit_tokens if read.num_tokens else None)
        self._send_done(cluster, flight, done_s)

    def _send_done(self, cluster: Cluster, flight: _InFlight, at_s: float) -> None:
        prefill = cluster.replicas[flight.prefill]
        self._workers[flight.prefill].send_done(flight.prefill_id, at_s)
        prefill.wake()
