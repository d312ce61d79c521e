"""The command-line options of reading a trace, shared by ``kvtwin trace info/convert`` and
``kvtwin replay``: their flags and help come from ``kvtwin.traces.options.OPTIONS``, where
a scenario's ``[workload]`` keys come from too, and ``load_options`` checks them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Optional

import typer

from kvtwin.sim.scenario.trace_source import option_error, trace_options
from kvtwin.traces.options import FLAGS, OPTIONS, LoadOptions, OptionError, map_pairs


def _option(name: str, **settings) -> typer.models.OptionInfo:
    return typer.Option(OPTIONS[name].flag, help=OPTIONS[name].help, **settings)


def reading_option(name: str, default: object = None, **settings) -> typer.models.OptionInfo:
    """Option ``name`` as a parameter's default (for a command whose signature is rebuilt,
    as ``kvtwin.knob_options`` does, where ``Annotated`` options would be lost)."""
    return typer.Option(default, OPTIONS[name].flag, help=OPTIONS[name].help, **settings)


# For commands that declare their options with Annotated.
FormatOpt = Annotated[Optional[str], _option("format")]
MapOpt = Annotated[Optional[list[str]], _option("map", metavar="COLUMN=SOURCE")]
TimeUnitOpt = Annotated[Optional[str], _option("time_unit")]
HashBlockOpt = Annotated[Optional[int], _option("hash_block_tokens")]
PerBlockOpt = Annotated[bool, _option("per_block_hashes")]
ArrivalsOpt = Annotated[Optional[str], _option("arrivals")]
SeedOpt = Annotated[Optional[int], _option("arrival_seed")]
SkipBadOpt = Annotated[bool, _option("skip_bad")]


def given_options(*, fmt: str | None = None, maps: list[str] | None = None, time_unit: str | None = None,
                  hash_block_tokens: int | None = None, per_block: bool = False, arrivals: str | None = None,
                  seed: int | None = None, skip_bad: bool = False) -> dict[str, object]:
    """The reading options a command line gave (``OPTIONS`` name -> value), ``--map``'s
    pairs as one map; a malformed pair is refused by its flag."""
    given = {"format": fmt, "time_unit": time_unit, "hash_block_tokens": hash_block_tokens,
             "arrivals": arrivals, "arrival_seed": seed}
    out: dict[str, object] = {name: value for name, value in given.items() if value is not None}
    if per_block:
        out["per_block_hashes"] = True
    if skip_bad:
        out["skip_bad"] = True
    if maps:
        try:
            out["map"] = map_pairs(maps)
        except OptionError as err:
            raise option_error(err, FLAGS) from None
    return out


def checked_options(given: Mapping[str, object], base: LoadOptions = LoadOptions()) -> LoadOptions:
    """``base`` read as the flags ``given`` say; a bad one is a ``ConfigError`` naming its flag."""
    return trace_options(given, FLAGS, base)
