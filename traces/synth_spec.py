"""The synthetic-workload spec: frozen dataclasses and their strict TOML reader.

``SYNTH.md`` documents every key. Unknown keys, wrong types and out-of-range values are
errors naming the spec file and the dotted key, never silently ignored.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtwin.traces.errors import TraceError

# Arrival processes (``kvtwin.traces.arrivals`` draws them).
POISSON = "poisson"
GAMMA = "gamma"

# Distribution kinds (``kvtwin.traces.distributions`` samples them).
FIXED = "fixed"
LOGNORMAL = "lognormal"
ZIPF = "zipf"
EXPONENTIAL = "exponential"
EMPIRICAL = "empirical"
KINDS = (FIXED, LOGNORMAL, ZIPF, EXPONENTIAL, EMPIRICAL)

REQUESTS = "requests"
CHAT = "chat"
AGENT = "agent"
WORKLOAD_KINDS = (REQUESTS, CHAT, AGENT)


@dataclass(frozen=True)
class Dist:
    """One length or time distribution (``kvtwin.traces.distributions`` samples it)."""

    kind: str
    value: float | None = None
    mean: float | None = None
    sigma: float | None = None
    s: float | None = None
    scale: float = 1.0
    min: float | None = None
    max: float | None = None
    trace: str | None = None
    column: str | None = None


@dataclass(frozen=True)
class ArrivalSpec:
    """Arrivals of requests (kind ``requests``) or of sessions (``chat``, ``agent``)."""

    rate_per_s: float
    process: str = POISSON
    cv: float = 1.0


@dataclass(frozen=True)
class SharedPrefixSpec:
    """``count`` shared prefixes (system prompts, agent contexts), picked with Zipf popularity:
    prefix k (k = 1..count) with probability proportional to 1 / k**zipf_s (0: uniform)."""

    count: int
    tokens: Dist
    zipf_s: float = 1.0


@dataclass(frozen=True)
class SynthSpec:
    kind: str
    seed: int
    arrival: ArrivalSpec
    output_tokens: Dist
    num_requests: int | None = None
    duration_s: float | None = None
    block_tokens: int = 16
    prompt_tokens: Dist | None = None
    shared_prefix: SharedPrefixSpec | None = None
    turns: Dist | None = None
    user_tokens: Dist | None = None
    turn_gap_s: Dist | None = None
    max_prompt_tokens: int | None = None


_DIST_KEYS = {FIXED: {"value"}, LOGNORMAL: {"mean", "sigma"}, ZIPF: {"s"}, EXPONENTIAL: {"mean"},
              EMPIRICAL: {"trace", "column"}}
_DIST_OPTIONAL = {"min", "max", "scale"}
_TOP_KEYS = {"kind", "seed", "arrival", "output_tokens", "num_requests", "duration_s", "block_tokens",
             "prompt_tokens", "shared_prefix", "turns", "user_tokens", "turn_gap_s", "max_prompt_tokens"}
_NEEDED = {REQUESTS: ("prompt_tokens",), CHAT: ("turns", "user_tokens", "turn_gap_s"),
           AGENT: ("turns", "user_tokens", "turn_gap_s", "shared_prefix")}
_NOT_FOR = {REQUESTS: ("turns", "user_tokens", "turn_gap_s", "max_prompt_tokens"), CHAT: ("prompt_tokens",),
            AGENT: ("prompt_tokens",)}


def read_spec(path: str | Path) -> SynthSpec:
    """Read a spec file: its top level, or its ``[workload]`` table when it has one."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        match = re.search(r"line (\d+)", str(err))
        raise TraceError(str(path), "toml", "valid TOML", line=int(match.group(1)) if match else None,
                         got=str(err)) from None
    if "workload" in raw and isinstance(raw["workload"], Mapping):
        raw = raw["workload"]
    return parse_spec(raw, str(path))


def parse_spec(raw: Mapping[str, object], source: str = "<spec>") -> SynthSpec:
    """Check and convert a spec mapping (e.g. a scenario's ``[workload]`` table)."""
    reader = _Reader(source)
    reader.keys(raw, _TOP_KEYS, "")
    kind = reader.choice(raw, "kind", WORKLOAD_KINDS)
    for key in _NEEDED[kind]:
        reader.require(raw, key, f"a {key} entry (kind {kind!r} needs it)")
    for key in _NOT_FOR[kind]:
        if key in raw:
            raise TraceError(source, key, f"no {key} for kind {kind!r}")
    if "num_requests" not in raw and "duration_s" not in raw:
        raise TraceError(source, "num_requests", "num_requests or duration_s (when to stop)")
    shared = None
    if "shared_prefix" in raw:
        table = reader.table(raw, "shared_prefix")
        reader.keys(table, {"count", "tokens", "zipf_s"}, "shared_prefix.")
        shared = SharedPrefixSpec(count=int(reader.number(table, "count", "shared_prefix.", minimum=1, integer=True)),
                                  tokens=reader.dist(table, "tokens", "shared_prefix."),
                                  zipf_s=reader.number(table, "zipf_s", "shared_prefix.", minimum=0, default=1.0))
    arrival = reader.table(raw, "arrival")
    reader.keys(arrival, {"process", "rate_per_s", "cv"}, "arrival.")
    process = reader.choice(arrival, "process", (POISSON, GAMMA), "arrival.", default=POISSON)
    if "cv" in arrival and process != GAMMA:
        raise TraceError(source, "arrival.cv", "cv only with process = \"gamma\"")
    return SynthSpec(
        kind=kind,
        seed=int(reader.number(raw, "seed", "", integer=True, minimum=0)),
        arrival=ArrivalSpec(rate_per_s=reader.number(arrival, "rate_per_s", "arrival.", positive=True),
                            process=process,
                            cv=reader.number(arrival, "cv", "arrival.", positive=True, default=1.0)),
        output_tokens=reader.dist(raw, "output_tokens", ""),
        num_requests=_optional_int(reader, raw, "num_requests"),
        duration_s=reader.number(raw, "duration_s", "", positive=True, default=None),
        block_tokens=int(reader.number(raw, "block_tokens", "", integer=True, minimum=1, default=16)),
        prompt_tokens=reader.dist(raw, "prompt_tokens", "") if "prompt_tokens" in raw else None,
        shared_prefix=shared,
        turns=reader.dist(raw, "turns", "") if "turns" in raw else None,
        user_tokens=reader.dist(raw, "user_tokens", "") if "user_tokens" in raw else None,
        turn_gap_s=reader.dist(raw, "turn_gap_s", "") if "turn_gap_s" in raw else None,
        max_prompt_tokens=_optional_int(reader, raw, "max_prompt_tokens"),
    )


def _optional_int(reader: _Reader, raw: Mapping, key: str) -> int | None:
    value = reader.number(raw, key, "", integer=True, minimum=1, default=None)
    return None if value is None else int(value)


class _Reader:
    """Typed access to a spec mapping; every failure is a TraceError naming the dotted key."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, expected: str, got: object = None) -> TraceError:
        return TraceError(self.source, key, expected, got=got)

    def keys(self, raw: Mapping, allowed: set[str], prefix: str) -> None:
        for key in raw:
            if key not in allowed:
                raise self.fail(prefix + key, f"one of the keys {', '.join(sorted(allowed))}", got=key)

    def require(self, raw: Mapping, key: str, expected: str) -> None:
        if key not in raw:
            raise self.fail(key, expected)

    def table(self, raw: Mapping, key: str) -> Mapping:
        value = raw.get(key)
        if not isinstance(value, Mapping):
            raise self.fail(key, "a table", got=value)
        return value

    def choice(self, raw: Mapping, key: str, options: tuple[str, ...], prefix: str = "",
               default: str | None = None) -> str:
        value = raw.get(key, default)
        if value not in options:
            raise self.fail(prefix + key, "one of " + ", ".join(repr(o) for o in options), got=value)
        return value

    def number(self, raw: Mapping, key: str, prefix: str, *, minimum: float | None = None, positive: bool = False,
               integer: bool = False, default: object = ...) -> float | None:
        if key not in raw:
            if default is ...:
                raise self.fail(prefix + key, "a value (it is missing)")
            return default
        value = raw[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and integer:
            ok = isinstance(value, int)
        if ok and minimum is not None:
            ok = value >= minimum
        if ok and positive:
            ok = value > 0
        if not ok:
            what = "an integer" if integer else "a number"
            if positive:
                what += " > 0"
            elif minimum is not None:
                what += f" >= {minimum:g}"
            raise self.fail(prefix + key, what, got=value)
        return value

    def dist(self, raw: Mapping, key: str, prefix: str) -> Dist:
        """A distribution: a bare number (fixed) or a table with ``dist`` and its parameters."""
        name = prefix + key
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (math.isfinite(value) and value > 0):
                raise self.fail(name, "a number > 0", got=value)
            return Dist(FIXED, value=float(value))
        if not isinstance(value, Mapping):
            raise self.fail(name, "a number or a table like { dist = \"lognormal\", mean = 500, sigma = 0.8 }",
                            got=value)
        kind = self.choice(value, "dist", KINDS, name + ".")
        self.keys(value, {"dist"} | _DIST_KEYS[kind] | _DIST_OPTIONAL, name + ".")
        sub = name + "."
        if kind == EMPIRICAL:
            trace = value.get("trace")
            if not isinstance(trace, str) or not trace:
                raise self.fail(sub + "trace", "a trace file path (or bundled:NAME)", got=trace)
            column = value.get("column", key if key in ("prompt_tokens", "output_tokens") else None)
            if column not in ("prompt_tokens", "output_tokens"):
                raise self.fail(sub + "column", "\"prompt_tokens\" or \"output_tokens\"", got=column)
            params: dict[str, object] = {"trace": trace, "column": column}
        elif kind == FIXED:
            params = {"value": self.number(value, "value", sub, positive=True)}
        elif kind == LOGNORMAL:
            params = {"mean": self.number(value, "mean", sub, positive=True),
                      "sigma": self.number(value, "sigma", sub, positive=True)}
        elif kind == ZIPF:
            exponent = self.number(value, "s", sub, positive=True)
            if exponent <= 1:
                raise self.fail(sub + "s", "a number > 1", got=exponent)
            params = {"s": exponent}
        else:
            params = {"mean": self.number(value, "mean", sub, positive=True)}
        low = self.number(value, "min", sub, minimum=0, default=None)
        high = self.number(value, "max", sub, positive=True, default=None)
        if low is not None and high is not None and high < low:
            raise self.fail(sub + "max", f"a number >= min ({low:g})", got=high)
        return Dist(kind, min=low, max=high, scale=self.number(value, "scale", sub, positive=True, default=1.0),
                    **params)
