"""Arrival times: seeded Poisson and Gamma processes, and spreading of bucketed timestamps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtwin.traces.synth_spec import GAMMA, POISSON  # the spec's names, kept free of NumPy there


def interarrival_gaps_s(rng: np.random.Generator, count: int, rate_per_s: float, process: str = POISSON,
                        cv: float = 1.0) -> np.ndarray:
    """``count`` gaps between arrivals at mean rate ``rate_per_s``.

    Poisson: exponential gaps. Gamma: gaps with coefficient of variation ``cv`` (shape
    1/cv**2), so cv > 1 gives bursts and cv < 1 more regular arrivals than Poisson; cv = 1
    is Poisson again.
    """
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    mean_gap_s = 1.0 / rate_per_s
    if process == POISSON:
        return rng.exponential(mean_gap_s, count)
    if process == GAMMA:
        if cv <= 0:
            raise ValueError("cv must be > 0")
        shape = 1.0 / cv**2
        return rng.gamma(shape, mean_gap_s / shape, count)
    raise ValueError(f"unknown arrival process {process!r}")


def arrival_times_s(rng: np.random.Generator, count: int, rate_per_s: float, process: str = POISSON,
                    cv: float = 1.0) -> np.ndarray:
    """Arrival times of ``count`` requests; the first arrives at 0."""
    gaps = interarrival_gaps_s(rng, count, rate_per_s, process, cv)
    if count:
        gaps[0] = 0.0
    return np.cumsum(gaps)


def spread_within_buckets(times_s: np.ndarray, seed: int, bucket_s: float | None = None) -> tuple[np.ndarray, float]:
    """Spread requests that share a bucketed timestamp uniformly over their bucket.

    ``times_s`` must be sorted. Each distinct timestamp t starts a bucket [t, t + w) with
    w = min(gap to the next distinct timestamp, ``bucket_s``); ``bucket_s`` defaults to the
    median gap between distinct timestamps (the bucket width of the recording). The k
    requests of a bucket get k sorted uniform draws in it, so their file order is kept; given
    their count, that is how a Poisson process would have placed them. Returns the new times
    and the bucket width used.
    """
    times_s = np.asarray(times_s, dtype=np.float64)
    if len(times_s) == 0:
        return times_s.copy(), 0.0
    distinct, bucket_of_row = np.unique(times_s, return_inverse=True)
    gaps = np.diff(distinct)
    if bucket_s is None:
        bucket_s = float(np.median(gaps)) if len(gaps) else 0.0
    widths = np.minimum(np.append(gaps, bucket_s), bucket_s)
    draws = np.random.default_rng(seed).random(len(times_s))
    # Rows of a bucket are contiguous, so sorting draws by (bucket, draw) hands each bucket's
    # rows its draws in increasing order.
    ordered = draws[np.lexsort((draws, bucket_of_row))]
    return times_s + ordered * widths[bucket_of_row], bucket_s


# A bucketed clock puts every timestamp on a grid of one width, to within this fraction of
# it (Mooncake's 3 s buckets: within 3 ms, 0.1%) ...
BUCKET_JITTER = 0.01
# ... and is coarse enough that requests share its ticks: on average at least this many
# requests per distinct timestamp (Mooncake's hour: 10.2). A steady one-per-tick rate is
# not bucketed, whatever its regularity.
BUCKET_MIN_REQUESTS = 2.0


@dataclass(frozen=True)
class Bucketing:
    """Whether a trace's timestamps come in buckets: ``width_s`` when they do, else None and
    ``reason``, the rule they break."""

    width_s: float | None
    reason: str = ""


def bucketing(times_s: np.ndarray) -> Bucketing:
    """Whether ``times_s`` were recorded on a bucketed clock, and its width.

    With d the distinct timestamps, sorted, and w the median gap between consecutive ones,
    the timestamps are bucketed when (1) there are at least two distinct ones, (2) there
    are at least ``BUCKET_MIN_REQUESTS`` requests per distinct timestamp on average, and
    (3) every gap between consecutive distinct timestamps is within ``BUCKET_JITTER`` x w
    of a whole multiple k >= 1 of w (k > 1: buckets that got no request). The width is w.
    """
    times_s = np.asarray(times_s, dtype=np.float64)
    distinct = np.unique(times_s)
    if len(distinct) < 2:
        return Bucketing(None, "fewer than two distinct timestamps")
    per_time = len(times_s) / len(distinct)
    if per_time < BUCKET_MIN_REQUESTS:
        return Bucketing(None, f"{per_time:.2g} requests per distinct timestamp, fewer than "
                               f"{BUCKET_MIN_REQUESTS:g}")
    gaps = np.diff(distinct)
    width_s = float(np.median(gaps))
    multiples = np.maximum(np.round(gaps / width_s), 1.0)
    off = np.abs(gaps - multiples * width_s)
    worst = int(np.argmax(off))
    if off[worst] > BUCKET_JITTER * width_s:
        return Bucketing(None, f"a gap of {gaps[worst]:.6g} s is no multiple of the median gap {width_s:.6g} s")
    return Bucketing(width_s)
