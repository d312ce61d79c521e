"""One replica's device as the clock sees it: batches run one after another.

With asynchronous scheduling a batch is scheduled while the one before it runs; it starts
on the device when that one ends (or when it was scheduled, if later) and its results are
applied at its end. ``DeviceTimeline`` keeps, oldest first, when each batch in flight was
scheduled, starts and ends, and when the batch applied last ended.
"""

from __future__ import annotations

from collections import deque

from kvtwin.sim.replay.recorder import BatchTimes


class DeviceTimeline:
    def __init__(self) -> None:
        self.in_flight: deque[BatchTimes] = deque()
        # When the device finishes the newest batch in flight.
        self.device_free_s = 0.0
        # When the batch applied last ended (0 before the first).
        self.last_applied_end_s = 0.0

    def launch(self, now_s: float, duration_s: float) -> None:
        """A batch scheduled at ``now_s`` runs once the batches before it have."""
        start_s = max(now_s, self.device_free_s)
        self.device_free_s = start_s + duration_s
        self.in_flight.append(BatchTimes(now_s, start_s, self.device_free_s, 0.0))

    def launch_empty(self, now_s: float) -> None:
        """A batch that computes nothing: done as soon as the batches before it are."""
        done_s = max(now_s, self.device_free_s)
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
