"""Pipeline parallelism: the synchronous scheduler of an engine that keeps
``pipeline_parallel_size`` batches in flight (vLLM's ``Scheduler`` driven by
``EngineCore.step_with_batch_queue``; docs/semantics.md#pipeline-parallelism).

vLLM's scheduler always counts a request's tokens in batches not yet updated
(``num_in_flight_tokens``); with one batch in flight that count is 0 whenever it is read,
so kvtwin's ``Scheduler`` leaves it out. With several batches it matters as it does for
asynchronous scheduling, and the bookkeeping is ``AsyncScheduler``'s, less the output
placeholders: the synchronous scheduler does not count a token being sampled as one the
request has.

* A request whose sampling batch is in flight lacks nothing (its computed count already
  covers all its tokens), so the running pass skips it until that batch's update; a
  request still prefilling is scheduled its next chunk while earlier chunks are in flight.
* Tokens in flight do not count as processed (windowed and Mamba blocks are released by
  ``computed - in flight``); blocks are cached at allocation only (no placeholders).
* A request preempted while a batch with it is in flight still gets that batch's token
  (stale), may finish from the waiting queue, and is not resumed until that output is in.
"""

from __future__ import annotations

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput


class PipelineScheduler(AsyncScheduler):
    def _update_request_after_schedule(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """The request's tokens join its ``num_in_flight_tokens`` until this batch's update;
        a partial chunk's are queued in the batch's entry of ``in_flight_partials`` (it
        samples nothing, so the update would not otherwise see it). No placeholder."""
        request.num_in_flight_tokens += num_tokens
        if request.is_prefill_chunk:
            self._batch_partials.append((request, num_tokens))

    def windows_allowed(self) -> bool:
        """Never: a decode window's proof rests on asynchronous scheduling's placeholders."""
        return False
