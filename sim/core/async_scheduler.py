"""Asynchronous scheduling: the scheduler of an engine with two batches in flight (vLLM
``v1/core/sched/async_scheduler.py``, vLLM's default; ``EngineCore.step_async``).

A batch is scheduled before the previous one's tokens are known. This changes only what
the scheduler counts (docs/semantics.md#asynchronous-scheduling), so the subclass overrides
only the scheduler's small hooks, as vLLM's does: per batch and per request when a batch is
advanced (``_start_batch``, ``_update_request_after_schedule``) and when it is updated
(``_start_update``, ``_update_request_before_output``, ``_cache_after_output``); the loops
are ``Scheduler``'s.

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
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
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
        # A decode window, which leaves some batches' advance implicit, queues their entries
        # through ``push_in_flight_partials``.
        self.in_flight_partials: deque[list[tuple[Request, int]]] = deque()
        # The entry of the batch being advanced.
        self._batch_partials: list[tuple[Request, int]] = []
        # The drafts every decoding request is given after each batch (their ids are only
        # known to the worker). Shared and never changed.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens
        # Without drafts every block of a hash-block size (a multiple of every group's) that
        # a sampled token completes can be cached without asking the manager.
        self._caching = self.kv_cache_manager.enable_caching
        self._hash_block_size = self.kv_cache_manager.coordinator.hash_block_size

    def _start_batch(self, out: SchedulerOutput) -> None:
        """Count the batch in ``num_batches``; one that schedules tokens queues its entry of
        partial chunks in ``in_flight_partials`` (an empty batch has none; its update pops
        nothing)."""
        self.num_batches += 1
        partials: list[tuple[Request, int]] = []
        if out.num_scheduled_tokens:
            self.in_flight_partials.append(partials)
        self._batch_partials = partials

    def _update_request_after_schedule(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """The request's tokens join its ``num_in_flight_tokens``. A request that samples
        holds a placeholder for its sampled token and one per draft it verifies until this
        batch's update, and is given ``k`` placeholder drafts for its next batch; a partial
        chunk's tokens are queued in the batch's entry of ``in_flight_partials``."""
        request.num_in_flight_tokens += num_tokens
        if request.is_prefill_chunk:
            self._batch_partials.append((request, num_tokens))
            return
        spec_scheduled = out.scheduled_spec_decode_tokens
        if spec_scheduled is None:
            request.num_output_placeholders += 1
            return
        drafts = spec_scheduled.get(request.request_id)
        request.num_output_placeholders += 1 + (len(drafts) if drafts else 0)
        request.spec_token_ids = self._spec_token_placeholders

    def _start_update(self) -> None:
        """The update of the oldest batch in flight (every batch must be updated, in
        schedule order): its writes are done, and its partial chunks' tokens, which
        sample nothing, leave the flight."""
        state = self.connector_state
        if state.defer_block_free:
            state.processed_step_seq += 1
        for request, num_tokens in self.in_flight_partials.popleft():
            request.num_in_flight_tokens -= num_tokens

    def _update_request_before_output(self, request: Request, num_tokens: int) -> None:
        """Its tokens in this batch leave the flight. A request preempted while the batch
        was in flight still receives its tokens after this (stale output: no placeholder,
        no caching) and may finish from the waiting queue."""
        request.num_in_flight_tokens -= num_tokens

    def _cache_after_output(self, request: Request, num_tokens: int) -> None:
        """A sampled token completes blocks only now, after the next batch was allocated:
        cache those full within the tokens processed so far (computed less still in
        flight), before a finished request is freed."""
        if self.num_spec_tokens:
            super()._cache_after_output(request, num_tokens)
            return
        # An allocation caches every block ending at or before the request's length when
        # it is scheduled, which is at least where its batch starts. So only a block ending
        # inside this batch's tokens can be new, and only if no later batch (allocated once
        # those tokens were known) holds the request.
        if self._caching and not request.num_in_flight_tokens:
            processed = request.num_computed_tokens
            hash_block_size = self._hash_block_size
            if processed // hash_block_size != (processed - num_tokens) // hash_block_size:
                self.kv_cache_manager.coordinator.cache_blocks(request, processed)

    # -- what a decode window asks (``decode_window.WindowScheduler``) ------------------
    # A window schedules batches without visiting every running request; these are the
    # scheduler's passes it runs and the writes the batches it leaves implicit would make.

    def windows_allowed(self) -> bool:
        """Whether decode windows may ever open (the premises of their proof: two batches in
        flight, no connector loading into the pool, one token per decode)."""
        return self.config.max_concurrent_batches == 2 and self.connector is None and not self.num_spec_tokens

    def can_open_window(self) -> bool:
        return self.windows_allowed() and not self.finished_req_ids

    def get_kv_cache_manager(self) -> KVCacheManager:
        return self.kv_cache_manager

    def running_requests(self) -> list[Request]:
        return self.running

    def get_request(self, request_id: str) -> Request:
        return self.requests[request_id]

    def num_waiting(self) -> int:
        return len(self.waiting)

    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    def max_model_len(self) -> int:
        return self.config.max_model_len

    def running_chunk(self, request: Request, token_budget: int) -> int:
        """The running pass's chunk for a request still prefilling (``_schedule_running``
        without drafts): what it lacks, clipped, Mamba-aligned; 0: none."""
        computed = request.num_computed_tokens
        chunk = self.clip_running_chunk(request.num_tokens - computed, computed, token_budget,
                                        self.long_prefill_threshold())
        if self.mamba_block_size and chunk > 0:
            chunk = self.mamba_block_aligned_split(request, chunk, 0)
        return max(chunk, 0)

    def start_window_batch(self) -> list[str]:
        reported, self.finished_req_ids = self.finished_req_ids, []
        self.kv_cache_manager.new_step_starts()
        return reported

    def count_batch(self) -> None:
        self.num_batches += 1

    def push_in_flight_partials(self, partials: list[tuple[Request, int]], oldest: bool) -> None:
        if oldest:
            self.in_flight_partials.appendleft(partials)
        else:
            self.in_flight_partials.append(partials)

    def advance_decode(self, request: Request) -> None:
        request.num_computed_tokens += 1
        request.num_in_flight_tokens += 1
        request.num_output_placeholders += 1

    def bring_decode_to(self, request: Request, num_computed_tokens: int, token_ids: list[int]) -> None:
        request.num_computed_tokens = num_computed_tokens
        request.append_output_token_ids(token_ids)
