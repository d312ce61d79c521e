"""The scheduler's bookkeeping for a KV connector, in one object the scheduler always has.

Without a connector every queue and set here stays empty and every flag is off, so the
scheduler reads them without asking first whether a connector is present. Where each
one matters: docs/semantics.md#kv-offloading.
"""

from __future__ import annotations

from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.mamba_manager import MambaManager
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue


class KVConnectorState:
    def __init__(self, scheduling_policy: str, has_connector: bool, async_scheduling: bool):
        # Requests that hold blocks while waiting (their KV is being loaded) queue apart
        # and go first (vLLM's kv_holding_waiting).
        self.kv_holding_waiting: FCFSRequestQueue | PriorityRequestQueue = create_request_queue(scheduling_policy)
        # Requests whose load the worker reported finished, not yet scheduled again.
        self.finished_recving_kv_req_ids: set[str] = set()
        # Requests still prefilling or loading: admitting an asynchronous load must leave
        # them the blocks they still need.
        self.inflight_prefills: set[Request] = set()
        # Two batches in flight with a connector that loads into blocks (vLLM's
        # defer_block_free): a running request still in a batch in flight is not
        # preempted, since its blocks would only come back once that batch has run.
        # Non-empty batches are counted as they are scheduled and as they are applied.
        # (vLLM also delays freeing a request that finishes while a later batch holds it;
        # here a request finishes only at max_tokens or max_model_len, which the scheduler
        # foresees and schedules no further, so that cannot happen.)
        self.defer_block_free = has_connector and async_scheduling
        # Finished requests whose blocks the connector keeps until another engine has read
        # them (P/D's prefill side, vLLM's delay_free_blocks): freed on finished_sending.
        self.delayed_free: dict[str, Request] = {}
        self.sched_step_seq = 0
        self.processed_step_seq = 0

    @staticmethod
    def listen_for_boundary_states(kv_cache_manager: KVCacheManager) -> None:
        """Have the Mamba groups offer the states they cache at block boundaries, for the
        connector to store (nobody listens without one)."""
        for manager in kv_cache_manager.coordinator.managers:
            if isinstance(manager, MambaManager):
                manager.boundary_state_offloads = []
