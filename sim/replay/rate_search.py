"""The largest arrival rate a deployment holds: the SLO criterion and the rate search of
``kvtwin capacity --find-max-rate``.

The SLO *holds* for a replay when it admitted enough requests to judge (``judged_requests``:
1,000 for a p99, ten beyond it), at least one request completed, the load was sustained
(``sustained``: a steady window long enough to judge, in which the deployment kept pace
with arrivals; docs/capacity.md#sustained-load), the run is not ``saturated`` (any rule of
its ``saturation_reason``), and

* without ``goodput``: the p99 client-side TTFT (``p99_ttft_client_ms``) of completed requests is at most ``slo.ttft_s`` and their
  p99 TPOT at most ``slo.tpot_s`` (each where set), and no request was left unfinished (by a
  ``time_limit_s``);
* with ``goodput = G``: at least the fraction G of the requests that were admitted
  (completed or unfinished) completed within both bounds (``admitted_attainment``:
  unfinished ones count as misses).

Rejected requests (refused at admission, e.g. longer than ``max_model_len``) do not depend on
the rate and are left out of both: counted as misses, a trace with 2% of prompts too long
would hold a 99% goodput at no rate at all. A point's ``slo_attainment`` (over every
request) and ``rejected_share`` still show them. The search assumes the SLO holds below some rate and fails
above it. It replays the point at its own rate scale (1 unless the scenario or the sweep sets
``workload.rate_scale``), doubles the scale while the SLO holds (or halves it while it fails)
until a failing and a holding scale bracket the threshold, then bisects (geometric midpoint)
until ``hi / lo - 1 <= tolerance`` (default 0.05) or ``max_replays`` replays were spent.
The answer is ``lo``, the largest scale seen to hold: it is within ``tolerance`` below the
threshold when the search converged. Where no scale down to 1/1024 of the start holds (or
the replays ran out first), there is no answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtwin.sim.core.config import is_int, is_number
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.slo import SLO, admitted_attainment

if TYPE_CHECKING:  # a type only: `kvtwin capacity --help` reads this module's defaults
    import pyarrow as pa

DEFAULT_RATE_TOLERANCE = 0.05
DEFAULT_MAX_REPLAYS = 24
# Halving below this fraction of the starting scale gives up: nothing holds.
MIN_SCALE_FRACTION = 1.0 / 1024
# A verdict on a quantile rests on the requests beyond it: at least this many
# (``judged_requests``), so that one long prompt does not decide a p99 alone.
TAIL_REQUESTS = 10
P99 = 0.99


@dataclass(frozen=True)
class RateSearch:
    """``--find-max-rate`` settings (module docstring)."""

    tolerance: float = DEFAULT_RATE_TOLERANCE
    goodput: float | None = None
    max_replays: int = DEFAULT_MAX_REPLAYS
    target_rate: float | None = None

    def check(self) -> None:
        if not (is_number(self.tolerance) and 0 < self.tolerance < 1):
            raise ConfigError("--rate-tolerance", "a relative tolerance in (0, 1)", self.tolerance)
        if self.goodput is not None and not (is_number(self.goodput) and 0 < self.goodput <= 1):
            raise ConfigError("--goodput", "a fraction of requests in (0, 1]", self.goodput)
        if not (is_int(self.max_replays) and self.max_replays >= 2):
            raise ConfigError("--max-replays", "at least 2 replays", self.max_replays)
        if self.target_rate is not None and not (is_number(self.target_rate) and self.target_rate > 0):
            raise ConfigError("--target-rate", "a positive rate in requests per second", self.target_rate)


def judged_requests(goodput: float | None) -> int:
    """The admitted requests a replay needs before its SLO verdict counts
    (docs/capacity.md#enough-load): ``TAIL_REQUESTS`` beyond the quantile judged, the p99
    (or ``goodput``, where below 0.99)."""
    quantile = min(goodput, P99) if goodput is not None else P99
    return math.ceil(TAIL_REQUESTS / (1 - quantile) - 1e-9)


def too_few_requests(summary: dict, goodput: float | None) -> bool:
    """Whether a replay admitted too few requests for its SLO verdict to count."""
    return summary["num_requests"] - summary["rejected"] < judged_requests(goodput)


def slo_holds(summary: dict, slo: SLO, goodput: float | None = None) -> bool:
    """Whether a replay's summary meets the SLO criterion of the module docstring."""
    completed = summary["completed"]
    if completed == 0 or too_few_requests(summary, goodput):
        return False
    # A burst worked off, or a queue that grows, holds nothing (docs/capacity.md#sustained-load).
    if not summary["sustained"] or summary["saturated"]:
        return False
    if goodput is not None:
        return admitted_attainment(summary) >= goodput - 1e-9
    if summary["unfinished"]:
        return False
    # The client's TTFT, as `vllm bench serve` measures it (docs/capacity.md#client-side-latency);
    # a summary from before the client-side columns has only the server's.
    ttft, tpot = summary.get("p99_ttft_client_ms", summary["p99_ttft_ms"]), summary["p99_tpot_ms"]
    return ((slo.ttft_s is None or ttft <= slo.ttft_s * 1000)
            and (slo.tpot_s is None or math.isnan(tpot) or tpot <= slo.tpot_s * 1000))


@dataclass
class SearchResult:
    lo: float | None  # the largest scale seen to hold
    hi: float | None  # the smallest scale seen to fail
    history: list  # (scale, holds) in the order tried
    converged: bool


def bracket_and_bisect(holds: Callable[[float], bool], start: float, tolerance: float = DEFAULT_RATE_TOLERANCE,
                       max_replays: int = DEFAULT_MAX_REPLAYS) -> SearchResult:
    """The largest ``x`` with ``holds(x)`` for a monotone predicate (true below a threshold),
    within ``tolerance`` relative, starting from ``start`` (module docstring)."""
    history: list = []

    def test(x: float) -> bool:
        ok = bool(holds(x))
        history.append((x, ok))
        return ok

    lo = hi = None
    x = start
    if test(x):
        lo = x
        while len(history) < max_replays:
            x *= 2
            if test(x):
                lo = x
            else:
                hi = x
                break
    else:
        hi = x
        while len(history) < max_replays and x / 2 >= start * MIN_SCALE_FRACTION:
            x /= 2
            if test(x):
                lo = x
                break
            hi = x
    if lo is None or hi is None:
        return SearchResult(lo, hi, history, False)
    while hi / lo - 1 > tolerance and len(history) < max_replays:
        mid = math.sqrt(lo * hi)
        if test(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(lo, hi, history, hi / lo - 1 <= tolerance)


def request_rate(trace: pa.Table) -> float:
    """Requests per second of a trace: (n - 1) over the span of its arrivals."""
    n = trace.num_rows
    if n < 2:
        return math.nan
    arrivals = trace.column("arrival_time_s").to_numpy()
    span = float(arrivals.max() - arrivals.min())
    return (n - 1) / span if span > 0 else math.nan




def replicas_for(rate: float | None, per_replica: float) -> int | None:
    """Replicas that serve ``rate`` when one serves ``per_replica`` (None: either unknown)."""
    if rate is None or not math.isfinite(rate) or not (per_replica > 0 and math.isfinite(per_replica)):
        return None
    return max(1, math.ceil(rate / per_replica - 1e-9))
