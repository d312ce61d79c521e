"""The latency–load curve of ``kvtwin capacity --load-curve``: each point replayed at a list
of offered request rates, and where its throughput stops following the load
(docs/capacity.md#load-curve).

A rate is requests per second of arrivals, as ``vllm bench serve --request-rate`` sets it.
A point replays its trace at the rate scale whose cut arrives at that rate (``offered_scale``),
with a ``limit`` read as a duration as the rate search reads it (``capacity_points``), so
every rate lasts as long. Its row carries the offered rate (the replayed arrivals' rate) and
the achieved one (completed requests over the time from the first arrival to the last
completion, drain included, as ``vllm bench serve`` reports its request throughput) beside
the summary's latencies and its sustained-load verdict (docs/capacity.md#sustained-load), and with a calibrated clock the same figures at the slow
edge (every step slower by the calibration's held-out step error).

The *knee* of a curve (one per combination of the other swept keys) is the highest offered
rate that was sustained with every lower rate sustained too; the first rate that was not,
and every rate above it, is ``past_knee``. A rate whose steady window was too short to judge
(``short_window``) counts for neither. Where every rate judged held, or the lowest did not,
the knee is outside the curve and ``knee_request_rate`` is null.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from kvtwin.sim.core.config import is_int, is_number
from kvtwin.sim.core.errors import ConfigError

FLAG = "--load-curve"
MAX_RATES = 64
# How close a point's arrival rate comes to the rate asked, and the corrections it may take.
RATE_MATCH = 0.01
MAX_RATE_STEPS = 8

# The columns a load curve adds to a point's row, and their types.
LOAD_CURVE_COLUMNS: dict[str, pa.DataType] = {
    "step_error": pa.float64(),  # first: where a rate search's is
    "offered_request_rate": pa.float64(),
    "load_rate_scale": pa.float64(),
    "achieved_request_rate": pa.float64(),
    "knee_request_rate": pa.float64(),
    "past_knee": pa.bool_(),
    "achieved_request_rate_pessimistic": pa.float64(),
    "p99_ttft_ms_pessimistic": pa.float64(),
    "p99_ttft_client_ms_pessimistic": pa.float64(),
    "p99_tpot_ms_pessimistic": pa.float64(),
    "sustained_pessimistic": pa.bool_(),
}


@dataclass(frozen=True)
class LoadCurve:
    """The offered request rates of ``--load-curve``, ascending."""

    rates_per_s: tuple[float, ...]


def parse_load_curve(spec: str) -> LoadCurve:
    """``R1,R2,...`` (requests/s) or ``LO:HI:N`` (N rates spaced geometrically from LO to HI)."""
    text = spec.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise ConfigError(FLAG, "R1,R2,... or LO:HI:N (requests/s)", spec)
        lo, hi = (_rate(p) for p in parts[:2])
        count = _count(parts[2])
        if hi <= lo:
            raise ConfigError(FLAG, f"LO:HI:N with HI above LO ({lo:g})", spec)
        rates = tuple(lo * (hi / lo) ** (i / (count - 1)) for i in range(count))
    else:
        if not text or any(not p.strip() for p in text.split(",")):
            raise ConfigError(FLAG, "a comma-separated list of requests/s", spec)
        rates = tuple(_rate(p) for p in text.split(","))
        if len(set(rates)) != len(rates):
            raise ConfigError(FLAG, "each rate once", spec)
        if len(rates) < 2:
            raise ConfigError(FLAG, "at least two rates (a curve)", spec)
        if len(rates) > MAX_RATES:
            raise ConfigError(FLAG, f"at most {MAX_RATES} rates", spec)
    return LoadCurve(tuple(sorted(rates)))


def _rate(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ConfigError(FLAG, "rates in requests/s (numbers)", text.strip()) from None
    if not (is_number(value) and math.isfinite(value) and value > 0):
        raise ConfigError(FLAG, "rates above 0 requests/s", text.strip())
    return value


def _count(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(FLAG, "LO:HI:N with N a whole number of rates", text.strip()) from None
    if not (is_int(value) and 2 <= value <= MAX_RATES):
        raise ConfigError(FLAG, f"LO:HI:N with N from 2 to {MAX_RATES}", value)
    return value


def offered_scale(rate_at: Callable[[float], float], rate_per_s: float, start_scale: float) -> float | None:
    """The rate scale at which the replayed cut arrives at ``rate_per_s`` (within
    ``RATE_MATCH``), given ``rate_at(scale)``, the arrival rate of the cut a scale replays;
    None where the cut has no rate (one request, or all at one instant).

    A trace scaled whole arrives at the scale times its own rate, and the first step lands
    on it. A ``limit`` read as a duration takes more of the trace as the scale grows, and
    a recorded trace is rarely as dense later as over its first requests, so the scale is
    corrected by the ratio of asked to got until they agree."""
    scale = start_scale
    for _ in range(MAX_RATE_STEPS):
        got = rate_at(scale)
        if not math.isfinite(got) or got <= 0:
            return None
        if abs(got / rate_per_s - 1) <= RATE_MATCH:
            return scale
        scale *= rate_per_s / got
    return scale


def knees(groups: Sequence[Sequence[tuple[float, bool | None]]]) -> list[tuple[float | None, list[bool]]]:
    """Per curve, given its (offered rate, sustained) points in any order, sustained None
    where the steady window was too short to judge: the knee (module docstring) and, in the
    given order, whether each point is past it. A point not judged neither holds the knee
    nor passes it; it is past the knee when it lies above the first rate judged not
    sustained."""
    out = []
    for points in groups:
        ordered = sorted(range(len(points)), key=lambda i: points[i][0])
        judged = [i for i in ordered if points[i][1] is not None]
        first_failed = next((k for k, i in enumerate(judged) if not points[i][1]), None)
        past = [False] * len(points)
        knee = None
        if first_failed is not None:
            failed_rate = points[judged[first_failed]][0]
            for i in ordered:
                past[i] = points[i][0] >= failed_rate
            if first_failed > 0:
                knee = points[judged[first_failed - 1]][0]
        out.append((knee, past))
    return out


def knee_lines(rows: Sequence[dict], keys: Sequence[str]) -> list[str]:
    """One line per curve of a load curve's ``capacity.parquet`` rows (``keys``: the other
    swept keys): where its throughput stopped following the load, and the most it achieved."""
    curves: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["status"] == "ok":
            curves.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for values, curve in curves.items():
        label = ", ".join(f"{k}={format_value(v)}" for k, v in zip(keys, values))
        rates = sorted(r["offered_request_rate"] for r in curve)
        past = sorted(r["offered_request_rate"] for r in curve if r["past_knee"])
        knee = curve[0]["knee_request_rate"]
        if knee is not None:
            what = f"knee between {knee:,.4g} and {past[0]:,.4g} req/s offered"
        elif not past:
            what = f"every rate judged was sustained: the knee is above {rates[-1]:,.4g} req/s offered"
        else:
            what = f"not sustained at {past[0]:,.4g} req/s offered, the lowest rate judged: the knee is below it"
        most = max((r["achieved_request_rate"] for r in curve if r["achieved_request_rate"] is not None),
                   default=None)
        if most is not None:
            what += f"; at most {most:,.4g} req/s achieved"
        out.append(f"load curve {label + ': ' if label else ''}{what}")
    return out


def format_value(value) -> str:
    """A value as the capacity table prints it (a swept value, a cell): booleans in TOML's
    words, numbers with thousands separators, floats to four significant digits."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
