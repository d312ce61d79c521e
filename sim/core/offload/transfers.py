"""When transfer jobs finish: the worker's side of the offload connector, per clock.

Issue 13 ("Time"). vLLM's worker runs each job the connector hands it and reports it done
in a later step's output; loads run while the engine goes on with other requests, stores
consume bandwidth without blocking compute. A job the connector flushes (a block it reads
was handed out again, or its request was preempted) is waited for before that step's
forward pass, so it is reported in that step.

* ``StepTransfers`` — the lockstep clock (and the golden cases' worker stand-in): a job
  issued in step s is reported at the end of step ``s + load_steps`` (a load) or
  ``s + store_steps`` (a store).
* ``TimedTransfers`` — the SimPy clock: loads queue on the host-to-device link and stores
  on the device-to-host link, each first in, first out, at that link's bandwidth; a job is
  reported at the end of the first step that ends after it finished. The wait a flush
  adds to a step is not modelled (flushes are rare: a block must be reused while its
  store still runs).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvtwin.sim.core.offload.connector import KVConnectorOutput, OffloadingConnectorMetadata


class _Completions:
    """Jobs in flight, by the time (or step) they finish."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str | None]] = []
        self._done: set[int] = set()

    def add(self, due: float, job_id: int, load_req_id: str | None) -> None:
        heapq.heappush(self._heap, (due, job_id, load_req_id))

    def flush(self, job_ids, out: KVConnectorOutput) -> None:
        """Report these jobs now; their heap entries are dropped when they come up."""
        for _, job_id, req_id in sorted(e for e in self._heap if e[1] in job_ids and e[1] not in self._done):
            self._done.add(job_id)
            _report(job_id, req_id, out)

    def collect(self, until: float, out: KVConnectorOutput) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            _, job_id, req_id = heapq.heappop(heap)
            if job_id in self._done:
                self._done.discard(job_id)  # flushed earlier
                continue
            _report(job_id, req_id, out)

    def next_due(self) -> float | None:
        while self._heap and self._heap[0][1] in self._done:
            self._done.discard(heapq.heappop(self._heap)[1])
        return self._heap[0][0] if self._heap else None

    def __bool__(self) -> bool:
        return self.next_due() is not None


def _report(job_id: int, req_id: str | None, out: KVConnectorOutput) -> None:
    out.completed_jobs.append(job_id)
    if req_id is not None:
        out.finished_recving.append(req_id)


class StepTransfers:
    def __init__(self, load_steps: int = 1, store_steps: int = 1):
        if load_steps < 0 or store_steps < 0:
            raise ValueError("transfer step counts must be >= 0")
        self.load_steps = load_steps
        self.store_steps = store_steps
        self.step = 0
        self._jobs = _Completions()
        self._flushed: KVConnectorOutput | None = None

    def submit(self, meta: OffloadingConnectorMetadata | None) -> None:
        """The step's jobs, as the worker receives them before its forward pass."""
        out = KVConnectorOutput()
        if meta is not None:
            for job_id, job in meta.load_jobs.items():
                self._jobs.add(self.step + self.load_steps, job_id, job.req_id)
            for job_id in meta.store_jobs:
                self._jobs.add(self.step + self.store_steps, job_id, None)
            if meta.jobs_to_flush:
                self._jobs.flush(meta.jobs_to_flush, out)
        self._flushed = out

    def finish_step(self, duration_s: float = 0.0) -> KVConnectorOutput:
        out = self._flushed or KVConnectorOutput()
        self._flushed = None
        self._jobs.collect(self.step, out)
        out.completed_jobs.sort()
        self.step += 1
        return out

    def has_pending(self) -> bool:
        return bool(self._jobs)


class TimedTransfers:
    def __init__(self, clock_s: Callable[[], float], h2d_bytes_per_s: float, d2h_bytes_per_s: float,
                 bytes_per_key: int, load_latency_s: Callable[[object], float] | None = None):
        self.clock_s = clock_s
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self.d2h_bytes_per_s = d2h_bytes_per_s
        self.bytes_per_key = bytes_per_key
        self._h2d_free_s = 0.0
        self._d2h_free_s = 0.0
        self._jobs = _Completions()
        self._flushed: KVConnectorOutput | None = None
        self._step_start_s = 0.0
        # Per load job id: seconds from issue to finish (metrics: the load wait).
        self.load_seconds: dict[int, float] = {}
        self.loaded_bytes = 0
        self.stored_bytes = 0

    def submit(self, meta: OffloadingConnectorMetadata | None) -> None:
        now = self.clock_s()
        self._step_start_s = now
        out = KVConnectorOutput()
        if meta is not None:
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
                self._jobs.flush(meta.jobs_to_flush, out)
        self._flushed = out

    def finish_step(self, duration_s: float) -> KVConnectorOutput:
        out = self._flushed or KVConnectorOutput()
        self._flushed = None
        self._jobs.collect(self._step_start_s + duration_s, out)
        out.completed_jobs.sort()
        return out

    def has_pending(self) -> bool:
        return bool(self._jobs)

    def next_completion_s(self) -> float | None:
        return self._jobs.next_due()
