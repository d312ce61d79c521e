"""When transfer jobs finish: the worker's side of the offload connector, per clock.

vLLM's worker runs each job the connector hands it and reports it done
in a later step's output; loads run while the engine goes on with other requests, stores
consume bandwidth without blocking compute. A job the connector flushes (a block it reads
was handed out again, or its request was preempted) is waited for before that batch's
forward pass: it is due with that batch at the latest.

* ``StepTransfers`` — the lockstep clock (and the golden cases' worker stand-in): a job
  issued with batch k (a step, with synchronous scheduling) is reported with the results
  of batch ``k + load_steps`` (a load) or ``k + store_steps`` (a store).
* ``TimedTransfers`` — the SimPy clock: loads queue on the host-to-device link and stores
  on the device-to-host link, each first in, first out, at that link's bandwidth; a job is
  reported at the end of the first step that ends after it finished. The wait a flush
  adds to a step is not modelled (flushes are rare: a block must be reused while its
  store still runs).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from kvtwin.sim.core.kv_connector import KVConnectorOutput, KVTransferWorker
from kvtwin.sim.core.offload.connector_metadata import OffloadingConnectorMetadata
from kvtwin.sim.core.scheduler_output import KVConnectorMetadata


class _Completions:
    """Jobs in flight, by the time (or batch) they are due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str | None]] = []
        self._due: dict[int, float] = {}  # job id -> when it is due (a flush can bring it forward)
        self._load_req_ids: dict[int, str | None] = {}  # job id -> its request, if a load

    def add(self, due: float, job_id: int, load_req_id: str | None) -> None:
        self._due[job_id] = due
        self._load_req_ids[job_id] = load_req_id
        heapq.heappush(self._heap, (due, job_id, load_req_id))

    def flush(self, job_ids, due: float) -> None:
        """The worker waits for these jobs: they are due by ``due`` at the latest. (Only the
        flushed jobs are visited: a saturated link can hold many jobs in flight.)"""
        current = self._due
        for job_id in job_ids:
            if current.get(job_id, due) > due:
                current[job_id] = due
                heapq.heappush(self._heap, (due, job_id, self._load_req_ids[job_id]))

    def collect(self, until: float, out: KVConnectorOutput) -> None:
        heap = self._heap
        due = self._due
        while heap and heap[0][0] <= until:
            when, job_id, req_id = heapq.heappop(heap)
            if due.get(job_id) != when:
                continue  # reported already, or brought forward by a flush
            del due[job_id]
            del self._load_req_ids[job_id]
            _report(job_id, req_id, out)

    def next_due(self) -> float | None:
        heap = self._heap
        while heap and self._due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


def _report(job_id: int, req_id: str | None, out: KVConnectorOutput) -> None:
    out.completed_jobs.append(job_id)
    if req_id is not None:
        out.finished_recving.append(req_id)


class StepTransfers(KVTransferWorker):
    def __init__(self, load_steps: int = 1, store_steps: int = 1):
        if load_steps < 0 or store_steps < 0:
            raise ValueError("transfer step counts must be >= 0")
        self.load_steps = load_steps
        self.store_steps = store_steps
        # Batches are numbered as they are scheduled (with synchronous scheduling a batch is
        # a step); their results come back in the same order.
        self.next_batch = 0
        self._jobs = _Completions()
        # Batches scheduled and not yet finished, oldest first.
        self._in_flight: deque[int] = deque()

    def submit(self, meta: KVConnectorMetadata | None) -> None:
        """A batch's jobs, as the worker receives them before its forward pass."""
        batch = self.next_batch
        self.next_batch += 1
        if isinstance(meta, OffloadingConnectorMetadata):
            for job_id, job in meta.load_jobs.items():
                self._jobs.add(batch + self.load_steps, job_id, job.req_id)
            for job_id in meta.store_jobs:
                self._jobs.add(batch + self.store_steps, job_id, None)
            if meta.jobs_to_flush:
                self._jobs.flush(meta.jobs_to_flush, batch)
        self._in_flight.append(batch)

    def finish_step(self, duration_s: float = 0.0) -> KVConnectorOutput:
        """The oldest batch's report: every job due by this batch (a job a batch flushes is
        due with that batch at the latest)."""
        batch = self._in_flight.popleft()
        out = KVConnectorOutput()
        self._jobs.collect(batch, out)
        out.completed_jobs.sort()
        return out


class TimedTransfers(KVTransferWorker):
    def __init__(self, clock_s: Callable[[], float], h2d_bytes_per_s: float, d2h_bytes_per_s: float,
                 bytes_per_key: int):
        self.clock_s = clock_s
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self.d2h_bytes_per_s = d2h_bytes_per_s
        self.bytes_per_key = bytes_per_key
        self._h2d_free_s = 0.0
        self._d2h_free_s = 0.0
        self._jobs = _Completions()
        # When each batch scheduled and not yet finished was scheduled, oldest first.
        self._in_flight: deque[float] = deque()
        # Per load job id: seconds from issue to finish (metrics: the load wait).
        self.load_seconds: dict[int, float] = {}
        self.loaded_bytes = 0
        self.stored_bytes = 0

    def moved_bytes(self) -> tuple[int, int]:
        return self.loaded_bytes, self.stored_bytes

    def job_load_seconds(self) -> dict[int, float] | None:
        return self.load_seconds

    def submit(self, meta: KVConnectorMetadata | None) -> None:
        now = self.clock_s()
        if isinstance(meta, OffloadingConnectorMetadata):
            for job_id, job in meta.load_jobs.items():
                num_bytes = len(job.keys) * self.bytes_per_key
                start = max(now, self._h2d_free_s)
                self._h2d_free_s = done = start + num_bytes / self.h2d_bytes_per_s
                self._jobs.add(done, job_id, job.req_id)
                self.load_seconds[job_id] = done - now
                self.loaded_bytes += num_bytes
            for job_id, job in meta.store_jobs.items():
                num_bytes = len(job.keys) * self.bytes_per_key
                start = max(now, self._d2h_free_s)
                self._d2h_free_s = done = start + num_bytes / self.d2h_bytes_per_s
                self._jobs.add(done, job_id, None)
                self.stored_bytes += num_bytes
            if meta.jobs_to_flush:
                self._jobs.flush(meta.jobs_to_flush, now)
        self._in_flight.append(now)

    def finish_step(self, duration_s: float) -> KVConnectorOutput:
        """The oldest batch's report, at its end: ``duration_s`` after it was scheduled, or
        now if it is applied later (asynchronous scheduling applies a batch when the device
        finished it, which may have started it late)."""
        start_s = self._in_flight.popleft()
        out = KVConnectorOutput()
        self._jobs.collect(max(self.clock_s(), start_s + duration_s), out)
        out.completed_jobs.sort()
        return out

    def next_completion_s(self) -> float | None:
        return self._jobs.next_due()
