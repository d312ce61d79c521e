"""One data-parallel replica on the SimPy clock: its engine, its executor, and its device.

A replica sleeps on its own event while it has nothing to do; an arrival routed to it (or
the end of arrivals) wakes it. With asynchronous scheduling its batches come from a
``WindowedBatchQueue`` (decode windows where the executor can price them) and run on its
``DeviceTimeline``: with pipeline parallelism, through its stages, each batch's stage times
read from the cost its executor gave it (docs/clock.md#pipeline-parallelism).
"""

from __future__ import annotations

import simpy
from simpy.events import Event

from kvtwin.sim.core.window_pricing import WindowPricing
from kvtwin.sim.core.windowed_batch_queue import WindowedBatchQueue
from kvtwin.sim.core.engine import EngineCore, ModelExecutor
from kvtwin.sim.replay.clock.timeline import DeviceTimeline, StagePasses
from kvtwin.sim.replay.cost_model import StepCost


class Replica:
    def __init__(self, engine: EngineCore, executor: ModelExecutor, window_pricing: WindowPricing | None = None):
        """``window_pricing``: the executor itself where it prices decode windows in closed
        form (None: every batch is scheduled one by one; the results are the same)."""
        self.engine = engine
        self.executor = executor
        self.batches = WindowedBatchQueue(engine, executor, window_pricing)
        num_stages = engine.pipeline_parallel_size
        self.timeline = DeviceTimeline(newest_stage_passes(engine, num_stages) if num_stages > 1 else None)
        self.index = 0  # its place in the cluster, set when the cluster is built
        self._wake: Event | None = None

    def sleep(self, env: simpy.Environment) -> Event:
        """The event this replica waits on until something arrives for it."""
        self._wake = env.event()
        return self._wake

    def share_wake(self, event: Event) -> None:
        """Wait on ``event``, which others wait on too (a DP group sleeps on one event that
        an arrival on any of its ranks triggers: ``dp_group.py``)."""
        self._wake = event

    def wake(self) -> None:
        wake = self._wake
        if wake is not None and not wake.triggered:
            wake.succeed()

    def next_transfer_event_s(self) -> float | None:
        """When the engine's next transfer finishes (``EngineCore.next_transfer_event_s``:
        a P/D read, an offload tier's GPU↔CPU job or a disk tier's CPU↔disk job; None:
        nothing running)."""
        return self.engine.next_transfer_event_s()


def newest_stage_passes(engine: EngineCore, num_stages: int) -> StagePasses:
    """The newest batch's pass through ``num_stages`` stages: its cost's stage times
    (``StepCost.stage_compute_s``, ``stage_send_s``), scaled to the duration the executor
    gave it where that differs (a recorded clock); an executor without stage times (a
    device's) has its duration split evenly over the stages, with no send."""
    def passes(duration_s: float) -> tuple[list[float], list[float]]:
        cost = engine.newest_batch().execution.cost
        if isinstance(cost, StepCost):
            compute, send = cost.stage_compute_s, cost.stage_send_s
            if compute is not None and send is not None and len(compute) == num_stages:
                if duration_s == cost.total_s or not cost.total_s:
                    return compute, send
                scale = duration_s / cost.total_s
                return [c * scale for c in compute], [s * scale for s in send]
        return [duration_s / num_stages] * num_stages, [0.0] * num_stages
    return passes
