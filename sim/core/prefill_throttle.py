"""Prefill throttling under data parallelism: what ``Scheduler.schedule(throttle_prefills)``
defers (docs/semantics.md#data-parallel-lockstep).

vLLM's DP engine core asks its scheduler to throttle prefills on every step whose shared
step counter is off the ``prefill_schedule_interval`` cadence. A throttled step defers all
prefill work (running prefill chunks and admissions that still have prompt to compute)
unless nothing would run but prefills (no running request is past its prefill) or the
last step that admitted prefills could not drain the waiting queue ("capacity bound").
"""

from __future__ import annotations

from typing import Protocol

from kvtwin.sim.core.kv_connector_state import KVConnectorState
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.request_queue import FCFSRequestQueue, PriorityRequestQueue


class ThrottledScheduler(Protocol):
    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    connector_state: KVConnectorState
    prefill_capacity_bound: bool


def throttles_prefills(interval: int, step_counter: int) -> bool:
    """Whether a DP group's step asks its ranks to throttle prefills (vLLM
    ``DPEngineCoreProc._should_throttle_prefills``): off the cadence of ``interval`` on
    the group's shared step counter, which is 0 on a wave's first step."""
    return interval > 1 and step_counter % interval != 0


def defers_prefills(scheduler: ThrottledScheduler, throttle_prefills: bool) -> bool:
    """Whether this step defers prefill work (vLLM ``scheduler.py`` ``defer_prefills``):
    asked to throttle, not capacity bound, and some running request decodes."""
    if not throttle_prefills or scheduler.prefill_capacity_bound:
        return False
    return any(not request.is_prefill_chunk for request in scheduler.running)


def note_release(scheduler: ThrottledScheduler, deferred: bool) -> None:
    """After a waiting pass that did not defer (``deferred`` False; else nothing changes):
    the step was capacity bound if requests still wait (those holding KV included, as
    vLLM's ``get_request_counts`` counts them). vLLM compares the waiting count with its ``deferred_waiting`` set (requests
    set aside for reasons other than capacity: KV loads, encoder inputs); without a
    connector, drafts' prefill lookahead or asynchronous scheduling that set stays empty,
    which is where kvtwin throttles (the DP group refuses the rest)."""
    if not deferred:
        waiting = len(scheduler.waiting) + len(scheduler.connector_state.kv_holding_waiting)
        scheduler.prefill_capacity_bound = waiting > 0
