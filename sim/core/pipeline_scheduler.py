"""Pipeline parallelism: the synchronous scheduler of an engine that keeps
``pipeline_parallel_size`` batches in flight (vLLM's ``Scheduler`` driven by
``EngineCore.step_with_batch_queue``; docs/semantics.md#pipeline-parallelism), and the
asynchronous one, ``PipelineAsyncScheduler``, that keeps one more (vLLM's default).

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
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.kv_connector import KVConnector
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig


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


class PipelineAsyncScheduler(AsyncScheduler):
    """Asynchronous scheduling with pipeline parallelism, as vLLM 0.33 runs it by default
    (its V2 model runner: ``AsyncScheduler`` with ``use_v2_model_runner``;
    docs/semantics.md#asynchronous-pipeline-parallelism). ``AsyncScheduler``'s placeholders
    and tokens in flight, with ``pipeline_parallel_size + 1`` batches in flight, and *PP
    microbatching*: a request that samples in the batch of schedule ``n`` is given no decode
    before schedule ``n + pipeline_parallel_size`` (``next_decode_eligible_step``), so each
    request is in at most one batch per pipeline stage."""

    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig(), connector: KVConnector | None = None):
        super().__init__(kv_cache_config, scheduler_config, cache_config, connector)
        self.decode_stagger = scheduler_config.pipeline_parallel_size

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """vLLM counts every ``schedule()`` call, one that schedules nothing too, before the
        running pass reads the count."""
        self.current_step += 1
        return super().schedule(throttle_prefills)

    def _update_request_after_schedule(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """``AsyncScheduler``'s, and a request that samples may decode again only
        ``decode_stagger`` schedules later. The running pass reads this only while the
        request holds placeholders: this batch's update comes after that many more
        schedules, since the queue pops its oldest batch only when full (or when nothing is
        unfinished), so a running request still barred always holds this batch's."""
        super()._update_request_after_schedule(request, num_tokens, out)
        if not request.is_prefill_chunk:
            request.next_decode_eligible_step = self.current_step + self.decode_stagger

    def windows_allowed(self) -> bool:
        """Never: a decode window's proof rests on two batches in flight and a decode per
        request in each."""
        return False
