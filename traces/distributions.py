"""Seeded length and time distributions for synthetic workloads.

A ``Dist`` is a frozen spec (``kvtwin.traces.synth_spec``); ``sampler(dist)`` turns it into
a function of (rng, count).
Kinds: ``fixed`` (value), ``lognormal`` (mean of the distribution and sigma of its log),
``zipf`` (exponent s > 1, values k = 1, 2, ...), ``exponential`` (mean) and
``empirical`` (drawn with replacement from a column of a trace file). Every kind is
multiplied by ``scale`` and then clipped to ``min``/``max``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# The spec's vocabulary lives with its reader, which a scenario check loads without NumPy.
from kvtwin.traces.synth_spec import EMPIRICAL, EXPONENTIAL, FIXED, LOGNORMAL, ZIPF, Dist

Sampler = Callable[[np.random.Generator, int], np.ndarray]


def sampler(dist: Dist, load_column: Callable[[str, str], np.ndarray] | None = None) -> Sampler:
    """A function drawing ``count`` values of ``dist`` from a numpy Generator.

    ``load_column(trace, column)`` reads an empirical distribution's values (it is called
    once, here, not per draw).
    """
    if dist.kind == FIXED:
        def draw(rng: np.random.Generator, count: int) -> np.ndarray:
            return np.full(count, float(dist.value))
    elif dist.kind == LOGNORMAL:
        mu = math.log(dist.mean) - dist.sigma**2 / 2

        def draw(rng: np.random.Generator, count: int) -> np.ndarray:
            return rng.lognormal(mu, dist.sigma, count)
    elif dist.kind == ZIPF:
        def draw(rng: np.random.Generator, count: int) -> np.ndarray:
            return rng.zipf(dist.s, count).astype(np.float64)
    elif dist.kind == EXPONENTIAL:
        def draw(rng: np.random.Generator, count: int) -> np.ndarray:
            return rng.exponential(dist.mean, count)
    elif dist.kind == EMPIRICAL:
        if load_column is None:
            raise ValueError("an empirical distribution needs a trace loader")
        values = np.asarray(load_column(dist.trace, dist.column), dtype=np.float64)
        if len(values) == 0:
            raise ValueError(f"{dist.trace} has no values in {dist.column}")

        def draw(rng: np.random.Generator, count: int) -> np.ndarray:
            return values[rng.integers(0, len(values), count)]
    else:
        raise ValueError(f"unknown distribution kind {dist.kind!r}")

    def clipped(rng: np.random.Generator, count: int) -> np.ndarray:
        out = draw(rng, count) * dist.scale
        if dist.min is not None or dist.max is not None:
            out = np.clip(out, dist.min, dist.max)
        return out

    return clipped


def token_counts(values: np.ndarray) -> np.ndarray:
    """Rounded token counts, at least 1."""
    return np.maximum(np.rint(values), 1).astype(np.int64)
