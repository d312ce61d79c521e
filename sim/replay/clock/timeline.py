"""One replica's device as the clock sees it: batches run one after another, or through
pipeline stages.

With asynchronous scheduling a batch is scheduled while the one before it runs; it starts
on the device when that one ends (or when it was scheduled, if later) and its results are
applied at its end. ``DeviceTimeline`` keeps, oldest first, when each batch in flight was
scheduled, starts and ends, and when the batch applied last ended.

With pipeline parallelism (``stage_passes`` given; docs/clock.md#pipeline-parallelism) a
batch runs stage after stage, each stage one batch at a time: it starts when the first
stage is free, and it moves on from stage k once stage k has computed it and stage k + 1
has let the previous batch go (vLLM's worker waits for its last send before its next
forward pass, and a stage posts its receive only at the start of its own); the send then
takes its time. Its results are ready when the last stage has computed it. A batch's
``start_s`` is when it enters the first stage, ``end_s`` when it leaves the last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvtwin.sim.replay.recorder import BatchTimes

# A batch's pass through the stages for its duration: each stage's compute seconds, and the
# seconds of its send to the next stage (0 after the last).
StagePasses = Callable[[float], tuple[list[float], list[float]]]


class DeviceTimeline:
    def __init__(self, stage_passes: StagePasses | None = None) -> None:
        """``stage_passes``: the newest batch's pass through the pipeline's stages, given its
        duration (None: one device, the batch's duration its time on it)."""
        self.in_flight: deque[BatchTimes] = deque()
        # When the device finishes the newest batch in flight (pipeline: when the first
        # stage can take the next batch).
        self.device_free_s = 0.0
        # When the batch applied last ended (0 before the first).
        self.last_applied_end_s = 0.0
        self._stage_passes = stage_passes
        # Pipeline: when each stage can take the next batch (the previous one has left it),
        # and when the newest batch leaves the last stage.
        self.stage_free_s: list[float] = []
        self.pipeline_end_s = 0.0

    def launch(self, now_s: float, duration_s: float) -> None:
        """A batch scheduled at ``now_s`` runs once the batches before it have."""
        start_s = max(now_s, self.device_free_s)
        passes = self._stage_passes
        if passes is None:
            self.device_free_s = start_s + duration_s
            self.in_flight.append(BatchTimes(now_s, start_s, self.device_free_s, 0.0))
            return
        compute_s, send_s = passes(duration_s)
        end_s = self._through_stages(start_s, compute_s, send_s)
        self.in_flight.append(BatchTimes(now_s, start_s, end_s, 0.0))

    def _through_stages(self, start_s: float, compute_s: list[float], send_s: list[float]) -> float:
        """Run a batch entering the first stage at ``start_s`` through every stage; its end."""
        free = self.stage_free_s
        if not free:
            free.extend([0.0] * len(compute_s))
        last = len(compute_s) - 1
        enter_s = start_s
        for stage in range(last):
            # The hand-off waits for the next stage to let the previous batch go; until
            # then this stage holds the batch.
            enter_s = max(enter_s + compute_s[stage], free[stage + 1]) + send_s[stage]
            free[stage] = enter_s
        end_s = enter_s + compute_s[last]
        free[last] = end_s
        self.device_free_s = free[0]
        self.pipeline_end_s = end_s
        return end_s

    def launch_empty(self, now_s: float) -> None:
        """A batch that computes nothing: done as soon as the batches before it are."""
        done_s = max(now_s, self.device_free_s if self._stage_passes is None else self.pipeline_end_s)
        self.in_flight.append(BatchTimes(now_s, done_s, done_s, 0.0))

    def ends_before(self, limit_s: float) -> bool:
        """Whether the oldest batch in flight ends before ``limit_s`` (False: none in flight)."""
        return bool(self.in_flight) and self.in_flight[0].end_s < limit_s

    def take_oldest(self) -> BatchTimes:
        """The oldest batch's times, as it is applied (with the previous batch's end)."""
        times = self.in_flight.popleft()
        times.previous_end_s = self.last_applied_end_s
        self.last_applied_end_s = times.end_s
        return times
