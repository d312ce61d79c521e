"""The scheduler's paths with a KV connector (vLLM's connector paths in
``v1/core/sched/scheduler.py``): the waiting pass that asks the connector for hits beyond
the GPU's, the hand-over of each step to the connector, a finished request's connector
side, and the worker's reports.

``ConnectorScheduling`` is ``Scheduler``'s base, apart only to keep each file small: its
methods are the scheduler's own, reading and writing the scheduler's connector state
(``KVConnectorState``); the attributes and passes it uses are declared here and set or
defined by ``Scheduler``. Without a connector none of this runs.
"""

from __future__ import annotations

from kvtwin.sim.core.config import SchedulerConfig
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.kv_connector import KVConnector, KVConnectorOutput
from kvtwin.sim.core.kv_connector_state import KVConnectorState
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from kvtwin.sim.core.scheduler_output import SchedulerOutput


class ConnectorScheduling:
    """The connector paths of ``Scheduler`` (module docstring)."""

    # Set by ``Scheduler.__init__``.
    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    connector: KVConnector | None
    connector_state: KVConnectorState
    waiting: FCFSRequestQueue | PriorityRequestQueue
    running: list[Request]
    requests: dict[str, Request]
    mamba_block_size: int

    # Defined by ``Scheduler``: the passes the connector paths share with the plain ones.

    def _first_chunk(self, request: Request, num_computed: int, num_new_computed: int, token_budget: int,
                     long_prefill: int) -> int:
        raise NotImplementedError

    def _admit(self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int,
               hit_tokens: int) -> None:
        raise NotImplementedError

    def advance_computed(self, out: SchedulerOutput) -> None:
        raise NotImplementedError

    def _schedule_waiting_with_connector(self, out: SchedulerOutput, token_budget: int, long_prefill: int) -> None:
        """Admit waiting requests, asking the connector for hits beyond the GPU's. A request
        with an asynchronous load gets its blocks now and waits, holding them, in
        ``kv_holding_waiting`` until the worker reports the load; that queue is served first.
        A request that cannot go this step (the connector asks to wait, its load is still
        running) is set aside and keeps its place; the first that does not fit in the pool
        stops admission, as without a connector."""
        cfg = self.config
        kv_cache_manager = self.kv_cache_manager
        connector = self.connector
        assert connector is not None
        state = self.connector_state
        # The connector supplies a hybrid model's Mamba state (vLLM's NIXL): it may take
        # the full-attention hit where the Mamba hit lags.
        divergent_hits = connector.supports_divergent_local_hybrid_hits
        holding, waiting = state.kv_holding_waiting, self.waiting
        skipped_holding: list[Request] = []
        skipped_waiting: list[Request] = []
        while token_budget > 0:
            queue = holding if len(holding) else waiting
            if not len(queue) or len(self.running) >= cfg.max_num_seqs:
                break
            request = queue.peek()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.request_id not in state.finished_recving_kv_req_ids:
                    skipped_holding.append(queue.pop())
                    continue
                self._finish_remote_load(request)
            if request.num_in_flight_tokens:
                # Preempted while a batch with it was in flight (async; 0 when synchronous).
                (skipped_holding if self._holds_kv_blocks(request) else skipped_waiting).append(queue.pop())
                continue
            num_external = 0
            load_async = False
            if request.num_computed_tokens == 0:
                hit_blocks, hit_tokens, external, load_async = self._connector_lookup(request, divergent_hits)
                if external is None:
                    (skipped_holding if self._holds_kv_blocks(request) else skipped_waiting).append(queue.pop())
                    continue
                num_external = external
            else:
                hit_blocks, hit_tokens = kv_cache_manager.empty_blocks, 0
            num_computed = request.num_computed_tokens + hit_tokens + num_external
            if load_async:
                num_new = 0  # nothing runs until the KV has landed
            else:
                num_new = self._first_chunk(request, num_computed, hit_tokens + num_external, token_budget,
                                            long_prefill)
                if not num_new:
                    break
            # A load holds its blocks with no progress and cannot be preempted here: admit
            # it only if the requests already prefilling keep what they still need.
            reserved = sum(kv_cache_manager.remaining_blocks(r) for r in state.inflight_prefills) if load_async else 0
            new_blocks = kv_cache_manager.allocate_slots(request, num_new, hit_tokens, hit_blocks,
                                            full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                                            reserved_blocks=reserved, has_scheduled_reqs=bool(self.running),
                                            num_external_computed_tokens=num_external,
                                            delay_cache_blocks=load_async)
            if new_blocks is None:
                break
            request_id = request.request_id
            connector.update_state_after_alloc(request, kv_cache_manager.get_blocks(request_id), num_external)
            if num_external:
                self._note_external_hit(out, request, hit_tokens, num_external)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed
                state.inflight_prefills.add(request)
                skipped_holding.append(queue.pop())
                continue
            queue.pop()
            self._admit(out, request, num_computed, num_new, hit_tokens)
            token_budget -= num_new
            if num_computed + num_new < request.num_tokens:
                state.inflight_prefills.add(request)
        for request in reversed(skipped_holding):
            holding.prepend(request)
        for request in reversed(skipped_waiting):
            waiting.prepend(request)

    def _connector_lookup(self, request: Request,
                          divergent_hits: bool) -> tuple[KVCacheBlocks, int, int | None, bool]:
        """A new request's local hit and what the connector adds past it: (hit blocks, hit
        tokens, external tokens or None to ask again next step, whether they load
        asynchronously). Sets the request's shared-prefix boundary."""
        kv_cache_manager = self.kv_cache_manager
        assert self.connector is not None
        if divergent_hits:
            hit_blocks, hit_tokens, request.shared_prefix_boundary, diverged = (
                kv_cache_manager.get_computed_blocks_for_connector(request))
        else:
            hit_blocks, hit_tokens, request.shared_prefix_boundary = kv_cache_manager.get_computed_blocks(request)
            diverged = False
        external, load_async = self.connector.get_num_new_matched_tokens(request, hit_tokens)
        if diverged and external == 0:
            # Nothing loaded brings the Mamba state for the deeper hit: take the hit every
            # group agrees on instead (vLLM's scheduler does the same).
            hit_blocks, hit_tokens, request.shared_prefix_boundary = kv_cache_manager.get_computed_blocks(request)
        return hit_blocks, hit_tokens, external, load_async

    def _note_external_hit(self, out: SchedulerOutput, request: Request, hit_tokens: int, num_external: int) -> None:
        """For metrics: an admission that loads ``num_external`` tokens past its GPU hit."""
        assert self.connector is not None
        if out.external_hits is None:
            out.external_hits = []
        out.external_hits.append((request.request_id, hit_tokens, num_external,
                                  self.connector.get_external_cache_hit_sources(request, num_external)))

    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        return request.num_computed_tokens > 0 or request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    def _finish_remote_load(self, request: Request) -> None:
        """The load landed: cache what it brought and queue the request as before it."""
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1  # the last token is recomputed for its logits
        self.connector_state.finished_recving_kv_req_ids.remove(request.request_id)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING

    def _finish_schedule_with_connector(self, out: SchedulerOutput) -> SchedulerOutput:
        """Hand the step to the connector, which adds its transfer jobs to the output (it
        reads the computed counts from before the step, as vLLM's does), then advance the
        computed counts as without a connector."""
        offloads = self.kv_cache_manager.coordinator.take_boundary_state_offloads() if self.mamba_block_size else None
        assert self.connector is not None
        out.kv_connector_metadata = self.connector.build_connector_meta(out, offloads)
        requests = self.requests
        state = self.connector_state
        if state.defer_block_free and out.num_scheduled_tokens:
            state.sched_step_seq += 1
            for request_id in out.num_scheduled_tokens:
                requests[request_id].last_sched_seq = state.sched_step_seq
        self.advance_computed(out)
        for request_id in out.num_output_tokens:
            state.inflight_prefills.discard(requests[request_id])  # its prefill is done
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput | None) -> None:
        """The worker's report: finished transfers; requests whose load landed may run.
        None: the engine has no connector, so there is nothing to report."""
        if connector_output is None:
            return
        assert self.connector is not None
        self.connector.update_connector_output(connector_output)
        self.connector_state.finished_recving_kv_req_ids.update(connector_output.finished_recving)
        if connector_output.finished_sending:
            delayed = self.connector_state.delayed_free
            for request_id in connector_output.finished_sending:
                self.kv_cache_manager.free(delayed.pop(request_id))

    def _request_finished_with_connector(self, request: Request) -> bool:
        """A finished request's connector side, before ``Scheduler._finish`` frees it: the
        connector learns of it (its last chunks are stored with the next schedule). Returns
        whether its blocks stay allocated until another engine has read them."""
        assert self.connector is not None
        # vLLM drops what the request no longer reads (by the processed tokens) before it
        # hands the table to the connector: those blocks reach the free queue first.
        self.kv_cache_manager.coordinator.remove_skipped_blocks(
            request.request_id, max(0, request.num_computed_tokens - request.num_in_flight_tokens))
        delay_free = self.connector.request_finished(request)
        self.connector_state.inflight_prefills.discard(request)
        if delay_free:
            # Another engine reads its blocks: they stay until finished_sending.
            self.connector_state.delayed_free[request.request_id] = request
        return delay_free
