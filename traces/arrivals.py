"""Arrival times: seeded Poisson and Gamma processes, and spreading of bucketed timestamps."""

from __future__ import annotations

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
