"""How many draft tokens a verify step accepts: a seeded model of speculative sampling.

docs/semantics.md#speculative-decoding. The scheduler learns acceptance only from what
the model returns (``1 + accepted`` tokens per verify step); in a simulation something
must decide ``accepted``. Here it is drawn per verify step from per-position acceptance
rates: draft ``i`` (0-based) is accepted with probability ``rates[i]`` given that drafts
``0 .. i-1`` were, and the first rejection ends the run, as in speculative sampling (the
target model resamples at the first mismatch and the later drafts are discarded).

A constant rate is the common summary ("acceptance rate alpha"); a per-position table
captures that later drafts of a chain are accepted less often. All draws come from one
``random.Random(seed)``, so the same config and the same sequence of verify steps give the
same counts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvtwin.sim.core.config import is_int, is_number
from kvtwin.sim.core.errors import require


def _is_rate(value: object) -> bool:
    return is_number(value) and 0.0 <= float(value) <= 1.0  # type: ignore[arg-type]


@dataclass(frozen=True)
class AcceptanceConfig:
    """``num_speculative_tokens`` drafts per verify step; ``acceptance`` is one rate for
    every position or a table of ``num_speculative_tokens`` rates (position 0 first), each
    in [0, 1]; ``seed`` seeds the draws."""

    num_speculative_tokens: int
    acceptance: float | tuple[float, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        require(is_int(k) and k >= 1, "num_speculative_tokens", "a positive integer", k)
        rates = self.acceptance
        if isinstance(rates, (list, tuple)):
            require(len(rates) == k, "acceptance", f"a table of num_speculative_tokens = {k} rates (one per "
                    f"draft position)", list(rates))
            for rate in rates:
                require(_is_rate(rate), "acceptance", "rates in [0, 1]", list(rates))
            object.__setattr__(self, "acceptance", tuple(float(r) for r in rates))
        else:
            require(_is_rate(rates), "acceptance", "a rate in [0, 1] or a table of per-position rates", rates)
        require(is_int(self.seed), "seed", "an integer", self.seed)

    @property
    def position_rates(self) -> tuple[float, ...]:
        """The acceptance rate of each draft position, given the ones before were accepted."""
        rates = self.acceptance
        if isinstance(rates, tuple):
            return rates
        return (float(rates),) * self.num_speculative_tokens

    def mean_accepted(self) -> float:
        """Expected drafts accepted per verify step of all k drafts: sum over i of the
        probability that the first i + 1 are accepted."""
        total, run = 0.0, 1.0
        for rate in self.position_rates:
            run *= rate
            total += run
        return total


class AcceptanceModel:
    """Draws the accepted count of each verify step (one ``random.Random(seed)`` stream)."""

    def __init__(self, config: AcceptanceConfig):
        self.config = config
        self.rates: Sequence[float] = config.position_rates
        self.rng = random.Random(config.seed)

    def num_accepted(self, num_drafts: int) -> int:
        """Accepted drafts of a verify step holding ``num_drafts`` drafts (the clips may
        leave fewer than k): the leading run of accepted positions."""
        rates = self.rates
        rng = self.rng
        accepted = 0
        limit = min(num_drafts, len(rates))
        while accepted < limit and rng.random() < rates[accepted]:
            accepted += 1
        return accepted
