"""Prefill throttling: which steps of ``Scheduler.schedule`` defer prefill work.

Two cadences of vLLM's ``prefill_schedule_interval``, one rule for what a deferred step
holds back (running prefill chunks and admissions that still have prompt to compute):

* under data parallelism (docs/semantics.md#data-parallel-lockstep) a MoE group's engine
  core asks its scheduler to throttle on every step whose shared step counter is off the
  cadence (``throttles_prefills``, ``defers_prefills``);
* without it (docs/semantics.md#local-prefill-cadence) the scheduler holds prefill itself
  until ``interval`` executed steps have passed since the last step that carried prefill
  (``holds_prefills_locally``, ``note_local_cadence``).

Either way a step defers nothing when nothing would run but prefills (no running request
is past its prefill), or when the last step that admitted prefills could not drain the
waiting queue ("capacity bound").
"""

from __future__ import annotations

from typing import Protocol

from kvtwin.sim.core.kv_connector_state import KVConnectorState
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.request_queue import FCFSRequestQueue, PriorityRequestQueue
from kvtwin.sim.core.scheduler_output import SchedulerOutput


class ThrottledScheduler(Protocol):
    running: list[Request]
    waiting: FCFSRequestQueue | PriorityRequestQueue
    requests: dict[str, Request]
    connector_state: KVConnectorState
    prefill_capacity_bound: bool
    local_prefill_interval: int
    last_prefill_step: int
    num_executed_steps: int


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


def holds_prefills_locally(scheduler: ThrottledScheduler) -> bool:
    """Whether the scheduler's own cadence holds this step's prefill work (vLLM
    ``scheduler.py``, the local cadence after ``defer_prefills``): fewer than ``interval``
    executed steps would have passed since the last one that carried prefill, counting this
    one, the last release drained the queue, and some running request decodes."""
    if scheduler.prefill_capacity_bound:
        return False
    if scheduler.num_executed_steps + 1 - scheduler.last_prefill_step >= scheduler.local_prefill_interval:
        return False
    return any(not request.is_prefill_chunk for request in scheduler.running)


def note_local_cadence(scheduler: ThrottledScheduler, out: SchedulerOutput) -> None:
    """After both passes, before the computed counts advance: a step that scheduled tokens
    is an executed step, and one that carried prefill restarts the interval. It carried
    prefill when a running request it scheduled was still mid-prefill (``is_prefill_chunk``
    from its last schedule) or an admission had more than one prompt token to compute (the
    deferral's own test, so a full prefix hit does not restart it)."""
    if not out.num_scheduled_tokens:
        return
    scheduler.num_executed_steps += 1
    admitted = {new.req_id for new in out.scheduled_new_reqs}
    carried = any(new.num_computed_tokens < new.num_tokens - 1 for new in out.scheduled_new_reqs)
    if not carried:
        requests = scheduler.requests
        carried = any(requests[request_id].is_prefill_chunk for request_id in out.num_scheduled_tokens
                      if request_id not in admitted)
    if carried:
        scheduler.last_prefill_step = scheduler.num_executed_steps
