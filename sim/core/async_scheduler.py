"""Asynchronous scheduling: the scheduler of an engine with two batches in flight (vLLM
``v1/core/sched/async_scheduler.py``, vLLM's default; ``EngineCore.step_async``).

A batch is scheduled before the previous one's tokens are known. This changes only what
the scheduler counts (docs/semantics.md#asynchronous-scheduling), so the subclass overrides two
methods: how a batch's computed counts advance, and how its update is applied.

* A request that samples in a batch holds an *output placeholder* until that batch's
  update: it counts as a token the request has, so the next batch schedules its decode
  (``num_tokens + placeholders - computed``) and it samples output ``outputs +
  placeholders``; a request whose batch in flight samples its last token is skipped.
* Tokens of batches in flight (``num_in_flight_tokens``) do not count as processed:
  windowed and Mamba blocks are released by ``computed - in flight``.
* The update resolves placeholders and caches the blocks a sampled token completed (they
  could not be cached when the next batch was allocated), before freeing what finished;
  finished requests reach the executor with the next schedule, one batch late.
* A request preempted while a batch with it is in flight still gets that batch's token
  (stale output, no placeholder), may finish from the waiting queue, and is not resumed
  while such output is in flight (set aside for the step, keeping its place).
* With speculative decoding (docs/semantics.md#speculative-decoding) the scheduler never
  sees draft ids: a request that samples in a batch holds ``1 + drafts`` placeholders and
  gets ``k`` placeholder drafts for its next batch; the update rolls the rejected drafts
  back from both counts.
"""

from __future__ import annotations

from collections import deque

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.kv_connector import KVConnector
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig


class AsyncScheduler(Scheduler):
    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig(), connector: KVConnector | None = None):
        super().__init__(kv_cache_config, scheduler_config, cache_config, connector)
        # Batches scheduled so far (one per ``advance_computed``; clocks and tests count them).
        self.num_batches = 0
        # Per batch in flight that schedules tokens, oldest first: its (request, tokens) that
        # sample nothing (partial prefill chunks), whose tokens leave the flight at its update.
        # A caller that advances or applies a batch by other means than ``advance_computed``
        # and ``update_from_output`` must keep one entry per such batch, in schedule order.
        self.in_flight_partials: deque[list[tuple[Request, int]]] = deque()
        # The drafts every decoding request is given after each batch (their ids are only
        # known to the worker). Shared and never changed.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens

    def advance_computed(self, out: SchedulerOutput) -> None:
        """As ``Scheduler.advance_computed``, with the batch in flight: each scheduled
        request's tokens join its ``num_in_flight_tokens``; a request that samples samples
        output ``outputs + placeholders`` and holds one more placeholder until this batch's
        update; a partial chunk's tokens are queued in ``in_flight_partials`` (one entry
        per batch that schedules tokens). Counts one batch in ``num_batches``."""
        if out.scheduled_spec_decode_tokens is not None:
            self._advance_computed_spec(out)
            return
        requests = self.requests
        noted_computed = out.num_computed_tokens
        sampling = out.num_output_tokens
        scheduled = out.num_scheduled_tokens
        self.num_batches += 1
        partials: list[tuple[Request, int]] = []
        if scheduled:  # (an empty batch has none; its update pops nothing)
            self.in_flight_partials.append(partials)
        for request_id, num_tokens in scheduled.items():
            request = requests[request_id]
            computed = request.num_computed_tokens
            noted_computed.append(computed)
            computed += num_tokens
            request.num_computed_tokens = computed
            request.num_in_flight_tokens += num_tokens
            # Everything it has, the outputs still being sampled included, is computed:
            # it samples one more, and holds a placeholder for it until this batch's
            # update (a partial prefill chunk samples nothing).
            placeholders = request.num_output_placeholders
            have = request.num_tokens + placeholders
            if computed >= have:
                sampling[request_id] = have - request.num_prompt_tokens
                request.num_output_placeholders = placeholders + 1
            else:
                partials.append((request, num_tokens))

    def _advance_computed_spec(self, out: SchedulerOutput) -> None:
        """``advance_computed`` with drafts: a request that samples holds one placeholder for
        its sampled token and one per draft it verifies, and is given ``k`` placeholder
        drafts for its next batch; ``is_prefill_chunk`` notes a partial chunk."""
        requests = self.requests
        noted_computed = out.num_computed_tokens
        sampling = out.num_output_tokens
        scheduled = out.num_scheduled_tokens
        spec_scheduled = out.scheduled_spec_decode_tokens
        assert spec_scheduled is not None
        placeholder_drafts = self._spec_token_placeholders
        self.num_batches += 1
        partials: list[tuple[Request, int]] = []
        if scheduled:
            self.in_flight_partials.append(partials)
        for request_id, num_tokens in scheduled.items():
            request = requests[request_id]
            computed = request.num_computed_tokens
            noted_computed.append(computed)
            computed += num_tokens
            request.num_computed_tokens = computed
            request.num_in_flight_tokens += num_tokens
            placeholders = request.num_output_placeholders
            have = request.num_tokens + placeholders
            request.is_prefill_chunk = computed < have
            if request.is_prefill_chunk:
                partials.append((request, num_tokens))
                continue
            sampling[request_id] = have - request.num_prompt_tokens
            drafts = spec_scheduled.get(request_id)
            request.num_output_placeholders = placeholders + 1 + (len(drafts) if drafts else 0)
            request.spec_token_ids = placeholder_drafts

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """The update of the oldest batch in flight; every batch must be updated, in
        schedule order. Returns the requests it finished.

        Its tokens leave the flight. Each sampled token resolves one of the request's
        placeholders; it completes blocks only now, after the next batch was allocated, so
        the blocks full within the tokens processed so far (computed less still in flight)
        are cached here, before a finished request is freed. A request preempted while this
        batch was in flight still receives its token (stale output: no placeholder, no
        caching) and may finish from the waiting queue.
        """
        scheduled = output.num_scheduled_tokens
        requests = self.requests
        if not scheduled:
            return []
        if output.scheduled_spec_decode_tokens is not None:
            return self._update_from_output_spec_async(output, sampled)
        state = self.connector_state
        if state.defer_block_free:
            state.processed_step_seq += 1  # this batch's writes are done
        # Partial prefill chunks sample nothing; their tokens leave the flight too.
        for request, num_tokens in self.in_flight_partials.popleft():
            request.num_in_flight_tokens -= num_tokens
        finished: list[Request] = []
        max_model_len = self.config.max_model_len
        kv_cache_manager = self.kv_cache_manager
        caching = kv_cache_manager.enable_caching
        hash_block_size = kv_cache_manager.coordinator.hash_block_size  # every group's block size is a multiple
        coordinator = kv_cache_manager.coordinator
        preempted = RequestStatus.PREEMPTED
        for request_id, tokens in sampled.items():
            # Never finished already: a request whose last token is in flight is not
            # scheduled again (vLLM would discard such a token).
            request = requests[request_id]
            num_tokens = scheduled[request_id]
            in_flight = request.num_in_flight_tokens - num_tokens
            request.num_in_flight_tokens = in_flight
            if not tokens:
                continue
            request.append_output_token_ids(tokens)
            done = len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= max_model_len
            if request.status is preempted:
                if done:
                    self._remove_waiting(request)
                    self._finish(request, finished)
                continue
            placeholders = request.num_output_placeholders
            if placeholders:
                request.num_output_placeholders = placeholders - len(tokens)
                if caching and not in_flight:
                    # An allocation caches every block ending at or before the request's
                    # length when it is scheduled, which is at least where its batch starts.
                    # So only a block ending inside this batch's tokens can be new, and only
                    # if no later batch (allocated once those tokens were known) holds the
                    # request; every group's blocks end on hash-block boundaries.
                    processed = request.num_computed_tokens
                    if processed // hash_block_size != (processed - num_tokens) // hash_block_size:
                        coordinator.cache_blocks(request, processed)
            if done:
                self._finish(request, finished)
        if finished:
            done_ids = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done_ids]
            for request in finished:
                del requests[request.request_id]
        return finished

    def _update_from_output_spec_async(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """``update_from_output`` with drafts. Rejected drafts leave the computed count and
        the placeholders (not for stale output: the preemption already reset both); the
        tokens are appended up to a stop; a running request caches the blocks full within
        what was processed (computed less still in flight), before a finished one is
        freed. A request that finished in an earlier update while this batch was in flight
        (drafts make its end uncertain, so it was scheduled again) gets nothing."""
        scheduled = output.num_scheduled_tokens
        spec_scheduled = output.scheduled_spec_decode_tokens
        assert spec_scheduled is not None
        requests = self.requests
        for partial, num_tokens in self.in_flight_partials.popleft():
            partial.num_in_flight_tokens -= num_tokens
        finished: list[Request] = []
        preempted = RequestStatus.PREEMPTED
        running_status = RequestStatus.RUNNING
        for request_id, tokens in sampled.items():
            found = requests.get(request_id)
            if found is None:
                continue
            request = found
            request.num_in_flight_tokens -= scheduled[request_id]
            if not tokens:
                continue
            stale = request.status is preempted
            drafts = spec_scheduled.get(request_id)
            if drafts and not stale:
                num_rejected = len(drafts) - (len(tokens) - 1)
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= num_rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= num_rejected
            was_running = request.status is running_status
            stopped = self.append_verified_tokens(request, tokens, stale)
            if was_running:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
            if stopped:
                if stale:
                    self._remove_waiting(request)
                self._finish(request, finished)
        self._drop_finished(finished)
        return finished
