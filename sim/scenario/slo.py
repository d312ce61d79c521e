"""The service-level objective a scenario's ``[slo]`` table sets: the bounds a request's
TTFT and TPOT must stay within to count as served well."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """A request meets the SLO when its TTFT and TPOT are both within these bounds."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ((self.ttft_s is None or ttft_s <= self.ttft_s)
                and (self.tpot_s is None or (math.isnan(tpot_s) or tpot_s <= self.tpot_s)))
