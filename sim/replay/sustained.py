"""Whether a replay's load was sustained: the deployment kept pace with arrivals over the
steady part of the run, rather than working through a burst.

The rule, its thresholds and why they are what they are: docs/capacity.md#sustained-load.
Computed from the requests table alone (arrival, first schedule, finish, status): the requests refused at admission are left out, since they never entered the
system and their number does not depend on the load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# The steady window: the middle of the arrival span, from 20% to 80% of it. The first part
# is a warm-up (an empty engine serves its first requests at once); the last part leaves
# the window before the arrivals stop, so that the run's tail does not count as steady.
STEADY_WINDOW_START = 0.2
STEADY_WINDOW_END = 0.8
# Enough load to judge: at least this many arrivals in the window ...
MIN_STEADY_ARRIVALS = 200
# ... and a window at least this many median service times long (a service time: first
# schedule to finish, the time a request occupies the engine), so that the requests in
# flight at its edges are a small part of what it counts.
STEADY_SERVICE_MULTIPLE = 5.0
# Completions over the window at least this share of its arrivals: a deployment that
# serves 90% of what arrives builds a queue of a tenth of the rate, without end.
KEEP_PACE_MIN = 0.9
# The mean number of requests in the system over the window's last quarter, less that over
# its first quarter, at most this share of the window's arrivals.
QUEUE_GROWTH_MAX = 0.1
# The time from the last arrival to the end of the run at most this share of the span.
DRAIN_MAX_SPAN_FRACTION = 0.25

# Reasons, in ``sustained_reason``: a window too short to judge, and the rules that failed.
SHORT_WINDOW = "short_window"
FALLING_BEHIND = "falling_behind"
QUEUE_GROWTH = "queue_growth"
LONG_DRAIN = "long_drain"
FAILURES = (FALLING_BEHIND, QUEUE_GROWTH, LONG_DRAIN)


@dataclass(frozen=True)
class SustainedLoad:
    """The steady window's figures and the verdict (docs/capacity.md#sustained-load)."""

    window_s: float
    arrivals: int
    completions: int
    arrival_rate: float  # requests/s arriving in the window
    completion_rate: float  # requests/s finishing in the window
    queue_growth: float  # mean requests in the system, last quarter less first quarter
    drain_s: float  # end of the run less the last arrival
    span_s: float
    median_service_s: float
    reasons: tuple[str, ...]

    @property
    def judged(self) -> bool:
        return SHORT_WINDOW not in self.reasons

    @property
    def sustained(self) -> bool:
        return not self.reasons

    def columns(self) -> dict:
        """The summary's columns (``reports/SCHEMA.md``)."""
        return {"sustained": self.sustained, "sustained_reason": ",".join(self.reasons),
                "steady_window_s": self.window_s, "steady_arrival_rate": self.arrival_rate,
                "steady_completion_rate": self.completion_rate, "steady_queue_growth": self.queue_growth,
                "drain_s": self.drain_s, "steady_median_service_s": self.median_service_s}


def window_arrivals(summary: dict) -> int:
    """The arrivals in a replay's steady window, from its summary's figures."""
    window_s = summary["steady_window_s"]
    rate = summary["steady_arrival_rate"]
    return round(rate * window_s) if window_s > 0 and math.isfinite(rate) else 0


def needs(summary: dict) -> str:
    """What a summary's window too short to judge lacked, in words (its columns only)."""
    window_s = summary["steady_window_s"]
    arrivals = window_arrivals(summary)
    service_s = summary["steady_median_service_s"]
    floor_s = STEADY_SERVICE_MULTIPLE * service_s if math.isfinite(service_s) else 0.0
    return (f"a steady window of at least {MIN_STEADY_ARRIVALS} arrivals and {floor_s:.1f} s "
            f"({STEADY_SERVICE_MULTIPLE:g} median service times); it had {arrivals} in {window_s:.1f} s")


def mean_in_system(arrival_s: np.ndarray, leave_s: np.ndarray, start_s: float, end_s: float) -> float:
    """The time-averaged number of requests in the system over [start_s, end_s]: each
    request counts for the part of its stay [arrival, leave) inside the interval."""
    if end_s <= start_s:
        return math.nan
    overlap = np.clip(np.minimum(leave_s, end_s) - np.maximum(arrival_s, start_s), 0.0, None)
    return float(overlap.sum() / (end_s - start_s))


def sustained_load(requests: pa.Table, end_time_s: float) -> SustainedLoad:
    """The rule of docs/capacity.md#sustained-load over a requests table."""
    status = requests.column("status").to_numpy(zero_copy_only=False)
    admitted = status != "rejected"
    arrival = requests.column("arrival_time_s").to_numpy()[admitted]
    finished = status[admitted] == "finished"
    finish = requests.column("finish_time_s").to_numpy()[admitted]
    scheduled = requests.column("first_scheduled_time_s").to_numpy()[admitted]
    # An unfinished request stays in the system to the end of the run.
    leave = np.where(finished, finish, end_time_s)
    service = (leave - scheduled)[finished]
    median_service_s = float(np.median(service)) if service.size else math.nan
    if arrival.size == 0:
        return SustainedLoad(0.0, 0, 0, math.nan, math.nan, math.nan, math.nan, 0.0, median_service_s,
                             (SHORT_WINDOW,))
    first, last = float(arrival.min()), float(arrival.max())
    span_s = last - first
    start = first + STEADY_WINDOW_START * span_s
    end = first + STEADY_WINDOW_END * span_s
    window_s = end - start
    arrivals = int(((arrival > start) & (arrival <= end)).sum())
    done_at = leave[finished]
    completions = int(((done_at > start) & (done_at <= end)).sum())
    quarter = window_s / 4
    growth = (mean_in_system(arrival, leave, end - quarter, end)
              - mean_in_system(arrival, leave, start, start + quarter)) if window_s > 0 else math.nan
    drain_s = max(end_time_s - last, 0.0)
    rate = (lambda n: n / window_s) if window_s > 0 else (lambda n: math.nan)
    reasons: list[str] = []
    service_floor_s = STEADY_SERVICE_MULTIPLE * (median_service_s if math.isfinite(median_service_s) else 0.0)
    if arrivals < MIN_STEADY_ARRIVALS or window_s <= 0 or window_s < service_floor_s:
        reasons.append(SHORT_WINDOW)
    else:
        if completions < KEEP_PACE_MIN * arrivals:
            reasons.append(FALLING_BEHIND)
        if growth > QUEUE_GROWTH_MAX * arrivals:
            reasons.append(QUEUE_GROWTH)
        if drain_s > DRAIN_MAX_SPAN_FRACTION * span_s:
            reasons.append(LONG_DRAIN)
    return SustainedLoad(window_s, arrivals, completions, rate(arrivals), rate(completions), growth, drain_s,
                         span_s, median_service_s, tuple(reasons))
