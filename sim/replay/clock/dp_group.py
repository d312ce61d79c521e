"""A data-parallel group whose ranks step together, as vLLM runs a MoE model with data
parallelism (``DPEngineCoreProc``; docs/semantics.md#data-parallel-lockstep).

The cluster's replicas are the group's ranks; one process (``dp_group_process``) steps
them all:

- **Waves.** The group is idle until any rank has a request; then a wave starts and every
  rank steps, each step, until the check of the group's unfinished requests finds none.
  That check (vLLM's all-reduce in ``_has_global_unfinished_reqs``) runs after the wave's
  first step and then every ``dp_sync_interval`` steps, on the state the step left (a
  request that arrives while the step runs is not in it; it starts the next wave). A wave
  ends with the step counter reset to 0.
- **One step.** Every rank with requests schedules and runs its batch (``EngineCore.step``);
  a rank that ran no tokens (no requests, or nothing it could schedule) runs a dummy batch,
  which touches no KV. The step lasts as long as the slowest rank's batch (the MoE layers'
  collectives hold every rank until the last one gets there), and every rank's results
  count at the same instant: each rank's step row has the group step's start and end.
- **Prefill throttling.** The group's step counter decides, for every rank at once,
  whether the step defers prefills (``prefill_throttle.throttles_prefills``).

This process runs a group with synchronous scheduling (each rank one batch at a time);
with asynchronous scheduling each rank runs its own loop (``dp_async.py``). With a KV
connector on every rank (an offload tier, or a P/D side's) a rank whose requests wait
for a load runs dummies until it lands, and a connector's work outside a wave steps alone
(docs/semantics.md#a-kv-connector-in-a-group). A scenario with drafts or pipeline stages
in a group is refused before it gets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import simpy

from kvtwin.sim.core.engine import BatchRecord
from kvtwin.sim.core.prefill_throttle import throttles_prefills
from kvtwin.sim.replay.clock.engine_processes import ClusterView
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.replay.moe_group_cost import MoEDPGroup
from kvtwin.sim.replay.recorder import BatchTimes

# vLLM 0.33's ``ParallelConfig.dp_sync_interval`` default.
DEFAULT_DP_SYNC_INTERVAL = 16


@dataclass(frozen=True)
class LockstepSettings:
    """How a DP group steps: vLLM's ``prefill_schedule_interval`` and ``dp_sync_interval``,
    and the seconds of a dummy batch (a rank with nothing to run still runs a forward pass
    of one decode token: ``Worker.execute_dummy_batch``)."""

    prefill_schedule_interval: int = 1
    dp_sync_interval: int = DEFAULT_DP_SYNC_INTERVAL
    dummy_batch_s: float = 0.0
    # The group's MoE layers priced for the whole group (None: each rank's own duration).
    moe: MoEDPGroup | None = None


class DPGroup:
    """The group's shared state: its step counter and whether a wave runs, and what the
    run's tables report (dummy batches per rank, the group's steps and waves)."""

    def __init__(self, settings: LockstepSettings, num_ranks: int, first: int = 0):
        """``first``: the cluster index of the group's first rank (its ranks are the
        ``num_ranks`` replicas from there; a P/D side's group starts past the prefill side)."""
        self.settings = settings
        self.first = first
        self.num_ranks = num_ranks
        self.step_counter = 0
        self.running = False
        self.dummy_steps = [0] * num_ranks
        self.group_steps = 0
        self.waves = 0


def dp_group_process(cluster: ClusterView, ranks: Sequence[Replica], group: DPGroup):
    """Step ``ranks`` together until arrivals are done and no rank has requests."""
    env = cluster.env
    settings = group.settings
    connector = ranks[0].engine.has_connector
    stalled = False  # the last step ran no tokens anywhere, with every arrival in
    while True:
        if not group.running:
            if connector and not any(rank.engine.has_unfinished_requests() for rank in ranks):
                # A connector's work outside a wave (docs/semantics.md#a-kv-connector-in-a-group).
                if not (yield from _connector_steps(cluster, ranks)):
                    return
                continue
            if not any(rank.engine.has_requests() for rank in ranks):
                if cluster.arrivals_done:
                    return
                yield _sleep_all(env, ranks)
                continue
            # A rank got a request: it starts a wave and the others join (START_DP_WAVE).
            group.running = True
            group.waves += 1
        throttle = throttles_prefills(settings.prefill_schedule_interval, group.step_counter)
        start_s = env.now
        stepped, dummies, duration_s = _step_ranks(ranks, throttle, settings.dummy_batch_s)
        if settings.moe is not None:
            duration_s = _moe_group_step(settings.moe, ranks, stepped)
        times = BatchTimes(start_s, start_s, start_s + duration_s)
        for rank, result in stepped:
            cluster.applied(rank, result, times, synchronous=True)
        for index in dummies:
            group.dummy_steps[index] += 1
        group.group_steps += 1
        # What the all-reduce would see: the state the step left, before later arrivals.
        unfinished = any(rank.engine.has_unfinished_requests() for rank in ranks)
        executed = len(dummies) < len(ranks)
        preempted = any(result.output.preempted for _, result in stepped)
        if duration_s > 0:
            yield env.timeout(duration_s)
        group.step_counter += 1
        counter = group.step_counter
        if (counter == 1 or counter % settings.dp_sync_interval == 0) and not unfinished:
            group.running = False  # the wave ends
            group.step_counter = 0
            continue
        if executed or preempted or not unfinished:
            stalled = False
            continue
        # Requests wait on some rank, yet no rank could run a token.
        if connector and any(rank.engine.waits_for_transfers() for rank in ranks):
            # A load will let them go on: the dummies' time brings it nearer; free dummies
            # wait for it (or an arrival) rather than spin at one instant.
            reported = any(_reported(result) for _, result in stepped)
            due_s = _next_transfer_s(ranks)
            if reported or due_s is not None:
                stalled = False
                if duration_s == 0 and not reported:
                    yield _sleep_until(env, ranks, due_s)
                continue
        if cluster.arrivals_done:
            if stalled:
                blocked = next(rank for rank in ranks if rank.engine.has_unfinished_requests())
                raise blocked.engine.no_progress_error("workload")
            stalled = True
        elif duration_s == 0:
            # Free dummy batches would spin at one instant: wait for an arrival instead.
            yield _sleep_all(env, ranks)


def _step_ranks(ranks: Sequence[Replica], throttle: bool,
                dummy_batch_s: float) -> tuple[list[tuple[Replica, BatchRecord]], list[int], float]:
    """One group step on every rank: the ranks that stepped with their records, the ranks
    that ran a dummy batch (by index in ``ranks``), and the step's seconds."""
    stepped: list[tuple[Replica, BatchRecord]] = []
    dummies: list[int] = []
    duration_s = 0.0
    for index, rank in enumerate(ranks):
        engine = rank.engine
        if engine.has_requests():
            result = engine.step(rank.executor, throttle)
            stepped.append((rank, result))
            if result.output.num_scheduled_tokens:
                duration_s = max(duration_s, result.execution.duration_s)
                continue
        dummies.append(index)
    if dummies:
        duration_s = max(duration_s, dummy_batch_s)
    return stepped, dummies, duration_s


def _moe_group_step(moe: MoEDPGroup, ranks: Sequence[Replica], stepped: list[tuple[Replica, BatchRecord]]) -> float:
    """MoE-group hook (docs/clock.md#moe-under-data-parallelism): every rank's step is its
    own part plus the group's MoE part; each stepped rank's record carries its whole step."""
    ran = {id(rank): result for rank, result in stepped if result.output.num_scheduled_tokens}
    results = [ran.get(id(rank)) for rank in ranks]
    own = [result.execution.cost if result is not None else None for result in results]
    costs, duration_s = moe.step([cost if isinstance(cost, StepCost) else None for cost in own])
    for result, cost in zip(results, costs):
        if result is not None:
            result.execution.cost = cost
    return duration_s


def _connector_steps(cluster: ClusterView, ranks: Sequence[Replica]):
    """No rank has unfinished requests, yet a connector may still have work (finished
    requests to report, a P/D prefill side's blocks held for a read): each such rank steps
    on its own, with no wave and no dummy, as vLLM's loop steps a rank that ``has_work``
    and skips the dummy of a rank with nothing unfinished while no wave runs. Then the
    group waits for the next transfer or an arrival. False: nothing is left to do."""
    env = cluster.env
    busy = [rank for rank in ranks if rank.engine.has_requests()]
    if not busy and cluster.arrivals_done:
        return False
    reported = False
    for rank in busy:
        now = env.now
        result = rank.engine.step(rank.executor)
        cluster.applied(rank, result, BatchTimes(now, now, now), synchronous=True)
        reported |= _reported(result)
    due_s = _next_transfer_s(ranks)
    # Once every arrival is in, with nothing due, nothing will wake the group: go on (the
    # steps dropped the finished requests, so the loop ends).
    if not reported and not (due_s is None and cluster.arrivals_done):
        yield _sleep_until(env, ranks, due_s)
    return True


def _next_transfer_s(ranks: Sequence[Replica]) -> float | None:
    """When the next transfer in flight on any rank ends (None: none is)."""
    due = [due_s for rank in ranks if (due_s := rank.next_transfer_event_s()) is not None]
    return min(due) if due else None


def _sleep_until(env: simpy.Environment, ranks: Sequence[Replica], due_s: float | None) -> simpy.Event:
    """One event that ``due_s`` (None: never) or an arrival on any rank triggers."""
    wake = _sleep_all(env, ranks)
    if due_s is None:
        return wake
    return env.any_of([wake, env.timeout(max(0.0, due_s - env.now))])


def _reported(result: BatchRecord) -> bool:
    """Whether the worker reported a transfer finished with this step's result (a waiting
    request may go on at the next schedule)."""
    transfers = result.connector_output
    return transfers is not None and bool(transfers.completed_jobs or transfers.finished_recving
                                          or transfers.finished_sending)


def _sleep_all(env: simpy.Environment, ranks: Sequence[Replica]) -> simpy.Event:
    """One event that an arrival on any rank triggers."""
    event = env.event()
    for rank in ranks:
        rank.share_wake(event)
    return event
