"""The service-level objective a scenario's ``[slo]`` table sets: the bounds a request's
TTFT and TPOT must stay within to count as served well."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when its TTFT and TPOT are both within these bounds."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ((self.ttft_s is None or ttft_s <= self.ttft_s)
                and (self.tpot_s is None or (math.isnan(tpot_s) or tpot_s <= self.tpot_s)))


def admitted_attainment(summary: Mapping) -> float:
    """The share of the requests admitted (completed or unfinished, not rejected) that met
    the SLO, from a summary row (``slo_attainment`` is over every request that arrived).

    What the capacity rate search and the saturation rule judge a load by: a rejection is
    fixed by the request's own size against ``max_model_len`` and the pool, whatever the
    rate, so counting it would make a goodput target unreachable at every rate rather than
    tell where the deployment stops keeping up. NaN when nothing was admitted."""
    arrived = summary["num_requests"]
    admitted = arrived - summary["rejected"]
    if not admitted or math.isnan(summary["slo_attainment"]):
        return math.nan
    return summary["slo_attainment"] * arrived / admitted
