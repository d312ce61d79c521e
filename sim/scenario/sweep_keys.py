"""Sweep axes over a scenario: the ``--sweep KEY=V1,V2,...`` grammar, the keys that may be
swept, and a point applied to the scenario's TOML mapping.

A sweep is one or more axes; its points are the cartesian product of the axes (the first
axis varies slowest), numbered from 0 in that order. KEY is a dotted scenario path:

* ``engine.<field>`` — any ``EngineConfig`` field (``engine.max_num_seqs``,
  ``engine.kv_cache_memory_bytes``, ...) and the deployment's ``engine.replicas`` and
  ``engine.router``; ``none`` resets an optional field to vLLM's default;
* ``hardware.gpu`` — a GPU preset (field overrides in the scenario's ``[hardware]`` table,
  such as ``price_per_hour``, stay; an inline GPU is replaced by the preset), or
  ``hardware.<field>`` for one GPU field;
* ``model.preset`` — a model preset (the scenario's ``[model]`` table is replaced by it);
* ``workload.rate_scale``, ``workload.limit`` (and the other cuts: ``start_s``, ``end_s``,
  ``sample_sessions``, ``sample_seed``);
* ``slo.ttft_s``, ``slo.tpot_s``; ``cost_model.<field>`` (``Efficiency``);
* ``offload.<field>`` — the offload tiers (``offload.cpu_bytes``, ``offload.policy``,
  ``offload.disk_bytes``, ...; ``OffloadConfig``): ``offload.cpu_bytes=0,...`` puts the
  run without offloading next to the sized tiers;
* ``disaggregation.<field>`` — disaggregated prefill/decode (``prefill_replicas``,
  ``decode_replicas``, ``link``, ``bandwidth_gbps``, ...; ``Disaggregation``), and
  ``disaggregation.shape=2P1D,1P2D,none``: each ``xPyD`` sets both replica counts, ``none``
  runs the point aggregated (no ``[disaggregation]`` table: ``engine.replicas`` replicas),
  so xPyD and the aggregated deployment at equal GPUs sit in one sweep; wide-EP shapes
  name DP sides: ``p8dp-d16dp`` (each side one DP engine of that many ranks), ``p2-d4dp``;
* ``speculative.<field>`` — speculative decoding (``speculative.num_speculative_tokens``,
  ``speculative.acceptance``, ...; ``SpeculativeConfig``).

Values are parsed as the field's type (integers, numbers, ``true``/``false``, strings). A
point is applied by editing the scenario file's TOML mapping at the dotted key and reading
the result through the normal scenario path (``resolve_scenario(..., data=...)``), so every
value meets the same checks as in a scenario file. Each value is checked that way on its own
before anything runs: a bad key or value is one ``ConfigError`` naming ``--sweep KEY``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.features import require_allowed
from kvtwin.sim.scenario.knobs import Knob, knob, section_knobs
from kvtwin.sim.scenario.parse import scenario_from_data
from kvtwin.sim.scenario.validators import parse_text

FLAG = "--sweep"


# The scenario tables a sweep may vary (``[run]`` is the command's, not a point's).
SWEPT_SECTIONS = ("engine", "hardware", "model", "workload", "slo", "cost_model", "offload", "disaggregation",
                  "speculative")


def sweep_key(key: str) -> Knob:
    """The setting sweep axis ``key`` names, or a ``ConfigError`` listing what may be swept."""
    section, _, name = key.partition(".")
    if section not in SWEPT_SECTIONS or not name:
        raise ConfigError(FLAG, "KEY=V1,V2,... with KEY one of engine.<field>, hardware.gpu, model.preset, "
                                "workload.rate_scale, workload.limit, slo.ttft_s, slo.tpot_s, cost_model.<field>, "
                                "offload.<field>, disaggregation.<field>, disaggregation.shape, "
                                "speculative.<field>",
                          key)
    fields = section_knobs(section)
    if name not in fields:
        raise ConfigError(f"{FLAG} {key}", f"a field of [{section}] to sweep ({', '.join(sorted(fields))})", name)
    return fields[name]


def parse_value(axis: Knob, raw: str) -> object:
    """``raw`` as the axis's type (``validators.parse_text``, as a flag is read); ``None`` for
    ``none`` on an optional field."""
    where = f"{FLAG} {axis.key}"
    if axis.optional and raw.strip().lower() == "none":
        return None
    try:
        return parse_text(raw, axis.kind, where, unit=axis.unit)
    except ConfigError as err:
        if not axis.optional:
            raise
        raise ConfigError(where, f"{err.expected} (or none for the default)", raw) from None


@dataclass(frozen=True)
class Axis:
    key: Knob
    values: tuple


def parse_sweeps(specs: Sequence[str]) -> list[Axis]:
    """``--sweep KEY=V1,V2,...`` flags (repeatable) as axes, in the order given."""
    axes: list[Axis] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep:
            raise ConfigError(FLAG, "KEY=V1,V2,...", spec)
        axis = sweep_key(key.strip())
        if any(a.key.key == axis.key for a in axes):
            raise ConfigError(f"{FLAG} {axis.key}", "each key swept once (list all its values in one flag)", spec)
        raw = [v for v in values.split(",")]
        if not values.strip() or any(not v.strip() for v in raw):
            raise ConfigError(f"{FLAG} {axis.key}", "a comma-separated list of values", values)
        parsed = tuple(parse_value(axis, v) for v in raw)
        if len(set(parsed)) != len(parsed):
            raise ConfigError(f"{FLAG} {axis.key}", "distinct values", values)
        axes.append(Axis(axis, parsed))
    return axes


@dataclass(frozen=True)
class Point:
    index: int
    values: dict  # sweep key -> value


def sweep_points(axes: Sequence[Axis]) -> list[Point]:
    """The cartesian product of the axes, first axis slowest; no axis gives one point."""
    combos = itertools.product(*(a.values for a in axes))
    return [Point(i, {a.key.key: v for a, v in zip(axes, combo)}) for i, combo in enumerate(combos)]


def apply_values(data: dict, values: dict) -> dict:
    """A copy of a scenario's TOML mapping with each dotted key set (``sweep_key`` rules)."""
    out = copy.deepcopy(data)
    for key, value in values.items():
        axis = sweep_key(key)
        if axis.section == "hardware" and axis.name == "gpu":
            table = out.get("hardware")
            if isinstance(table, dict) and ("gpu" in table or not table):
                table["gpu"] = value
            else:
                out["hardware"] = {"gpu": value}
            continue
        if axis.section == "model":
            out["model"] = {"preset": value}
            continue
        if axis.section == "disaggregation" and axis.name == "shape":
            _apply_shape(out, key, value)
            continue
        if axis.section == "workload" and not isinstance(out.get("workload"), dict):
            raise ConfigError(f"{FLAG} {key}", "a scenario with a [workload] table")
        table = out.setdefault(axis.section, {})
        if not isinstance(table, dict):
            raise ConfigError(axis.section, "a table", table)
        if value is None:
            table.pop(axis.name, None)
        else:
            table[axis.name] = value
    return out


def parse_shape(value: str, where: str) -> tuple[int, int]:
    """``xPyD`` (``2P1D``: two prefill replicas, one decode replica) as ``(x, y)``."""
    text = value.strip().upper()
    prefill, sep, rest = text.partition("P")
    decode, sep2, tail = rest.partition("D")
    if not (sep and sep2 and not tail and prefill.isdigit() and decode.isdigit()):
        raise ConfigError(where, "xPyD (such as 2P1D: prefill and decode replicas), p<N>[dp]-d<M>[dp] (such as "
                          "p8dp-d16dp: sides of DP ranks) or none (aggregated)", value)
    return int(prefill), int(decode)


SIDE_SHAPE_EXPECTED = ("p<N>[dp]-d<M>[dp] (such as p8dp-d16dp: a prefill side of one DP engine of 8 ranks, "
                       "a decode side of 16; p2-d1: two prefill and one decode replica)")


def parse_side_shape(value: str, where: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``p<N>[dp]-d<M>[dp]`` as each side's ``(replicas, data_parallel_size)``: ``p8dp`` is one
    DP engine of 8 ranks, ``p2`` two plain replicas (docs/semantics.md#data-parallel-pd-sides)."""
    text = value.strip().lower()
    prefill, sep, decode = text.partition("-")
    sides = []
    for part, letter in ((prefill, "p"), (decode, "d")):
        count = part[1:].removesuffix("dp")
        if not (sep and part.startswith(letter) and count.isdigit()):
            raise ConfigError(where, SIDE_SHAPE_EXPECTED, value)
        sides.append((1, int(count)) if part.endswith("dp") else (int(count), 1))
    return sides[0], sides[1]


def _apply_shape(out: dict, key: str, value: object) -> None:
    """``disaggregation.shape``: ``xPyD`` sets the table's replica counts, ``p<N>[dp]-d<M>[dp]``
    each side's replicas or DP ranks (its link and routers stay; a side's DP size the shape
    does not give is dropped, back to 1); none drops the table, so the point runs
    aggregated (``engine.replicas``)."""
    if value is None:
        out.pop("disaggregation", None)
        return
    where = f"{FLAG} {key}"
    text = str(value)
    if "-" in text:
        (prefill, prefill_dp), (decode, decode_dp) = parse_side_shape(text, where)
    else:
        (prefill, decode), prefill_dp, decode_dp = parse_shape(text, where), 1, 1
    table = out.setdefault("disaggregation", {})
    if not isinstance(table, dict):
        raise ConfigError("disaggregation", "a table", table)
    table["prefill_replicas"], table["decode_replicas"] = prefill, decode
    for name, size in (("prefill_data_parallel_size", prefill_dp), ("decode_data_parallel_size", decode_dp)):
        if size > 1:
            table[name] = size
        else:
            table.pop(name, None)


def with_limit(data: dict, limit: int | None) -> dict:
    """``--limit N``: the scenario's ``[workload] limit`` for every point (a swept
    ``workload.limit`` still wins)."""
    if limit is None:
        return data
    knob("workload.limit").check(limit, "--limit")
    return apply_values(data, {"workload.limit": limit})


def check_axes(path: Path, data: dict, axes: Sequence[Axis]) -> None:
    """Read the scenario with each swept value alone, so a value the scenario rules refuse is
    a flag error now, not a failed point later."""
    for axis in axes:
        for value in axis.values:
            try:
                scenario = scenario_from_data(apply_values(data, {axis.key.key: value}), path)
                require_allowed(scenario, where=str(path))
            except ConfigError as err:
                if err.field.startswith(FLAG):
                    raise
                raise ConfigError(f"{FLAG} {axis.key.key}", err.expected,
                                  value if value is not None else "none") from None
