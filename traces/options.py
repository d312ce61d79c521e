"""How a trace is to be read, apart from reading it: the formats, Mooncake's arrival modes,
a generic file's column map, and ``LoadOptions``.

The options are declared once, here: each with its command-line flag (``kvtwin trace
info/convert``, ``kvtwin replay``) and its key in a scenario's ``[workload]`` table, and
checked once, by ``load_options``, whichever of the two gave them. An ``OptionError``
names the option; the caller spells it as its user did (``--map`` or ``workload.map``).

Standard library only: a scenario file is parsed (``kvtwin plan``) and the command line's
help is built from these names without loading pyarrow or NumPy, which the readers
(``kvtwin.traces.load`` and the format modules) need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtwin.traces.columns import MAP_REQUIRED, MAPPABLE

FORMATS = ("parquet", "mooncake", "bailian", "azure", "burstgpt", "generic")
GENERIC = "generic"

# Mooncake's recorded timestamps fall in ~3 s buckets: spread each bucket's requests over
# it (seeded) or keep each bucket a burst; by default, spread only timestamps that are
# bucketed (``kvtwin.traces.mooncake``).
AUTO = "auto"
SPREAD = "spread"
BURST = "burst"
ARRIVAL_MODES = (AUTO, SPREAD, BURST)
DEFAULT_SPREAD_SEED = 0

TIME_UNITS = ("s", "ms", "us", "ns", "datetime")

# Who gave the options, so that an error about the file names what that user can change.
FLAGS = "flags"
SCENARIO = "scenario"


@dataclass(frozen=True)
class Option:
    """One reading option: ``name`` is its ``[workload]`` key, ``field`` the ``LoadOptions``
    attribute it sets."""

    name: str
    field: str
    flag: str
    help: str


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("format", "format", "--format", f"Input format: {', '.join(FORMATS)} (default: detected from the file; "
                                           "a column map means generic)."),
    Option("map", "columns", "--map", "Trace column from source column (COLUMN=SOURCE, repeatable) for a CSV, "
                                      "JSONL or parquet file; columns named as the trace schema's need none."),
    Option("time_unit", "time_unit", "--time-unit", f"Unit of a generic file's arrival column: "
                                                    f"{', '.join(TIME_UNITS)} (default s)."),
    Option("hash_block_tokens", "hash_block_tokens", "--hash-block-tokens",
           "Tokens each of a generic file's block hashes covers."),
    Option("per_block_hashes", "per_block_hashes", "--per-block-hashes",
           "A generic file's block hashes are per block, not chained: chain them."),
    Option("arrivals", "arrivals", "--arrivals", "Mooncake: auto (spread the requests of a timestamp bucket over "
                                                 "it when the timestamps are bucketed, else keep them), spread, "
                                                 "or burst (keep the recorded times)."),
    Option("arrival_seed", "seed", "--seed", "Seed for spreading Mooncake arrivals."),
    Option("skip_bad", "skip_bad", "--skip-bad", "Skip malformed lines (counted and reported) instead of "
                                                 "stopping at the first."),
)}
# Options that only a generic file reads: given with another format, they would be ignored.
GENERIC_ONLY = ("map", "time_unit", "hash_block_tokens", "per_block_hashes")


class OptionError(ValueError):
    """A reading option that cannot be used; ``name`` is its key in ``OPTIONS``, ``entry``
    the entry of a table option at fault (``map``'s trace column), if one is."""

    def __init__(self, name: str, expected: str, got: object = None, *, entry: str | None = None):
        super().__init__(f"{name}: expected {expected}" + ("" if got is None else f", got {got!r}"))
        self.name = name
        self.expected = expected
        self.got = got
        self.entry = entry

    def spelled(self, named_by: str) -> str:
        """The option as the user who gave it sets it (a scenario names the entry too)."""
        where = spell(self.name, named_by)
        return f"{where}.{self.entry}" if self.entry and named_by == SCENARIO else where


@dataclass(frozen=True)
class LoadOptions:
    """How to read a trace. ``arrivals``/``seed`` apply to Mooncake; ``columns`` (trace
    column, source column pairs), ``time_unit``, ``hash_block_tokens`` and
    ``per_block_hashes`` to generic files; ``assume_session_history`` (a block size)
    derives identity from sessions where there is none. ``named_by`` says who gave them
    (``FLAGS`` or ``SCENARIO``), for the words of an error about the file."""

    format: str | None = None
    skip_bad: bool = False
    arrivals: str = AUTO
    seed: int = DEFAULT_SPREAD_SEED
    columns: tuple[tuple[str, str], ...] = ()
    time_unit: str | None = None
    hash_block_tokens: int | None = None
    per_block_hashes: bool = False
    assume_session_history: int | None = None
    named_by: str = FLAGS

    @property
    def generic(self) -> bool:
        """Whether the options ask for the generic reader (a map, or the generic format)."""
        return self.format == GENERIC or bool(self.columns) or self.time_unit is not None \
            or self.hash_block_tokens is not None or self.per_block_hashes

    def spell(self, name: str) -> str:
        """Option ``name`` as the user who gave these options sets it."""
        return spell(name, self.named_by)

    def setting(self, name: str, value: str) -> str:
        """Option ``name`` set to ``value``, as this user writes it."""
        return f"{self.spell(name)} {value}" if self.named_by == FLAGS else f'{self.spell(name)} = "{value}"'

    def map_hint(self, targets: Sequence[str] = MAP_REQUIRED) -> str:
        """How this user maps ``targets`` to the file's columns."""
        if self.named_by == SCENARIO:
            return "workload.map = { " + ", ".join(f'{t} = "COLUMN"' for t in targets) + " }"
        return " ".join(f"--map {t}=COLUMN" for t in targets)


def spell(name: str, named_by: str) -> str:
    return OPTIONS[name].flag if named_by == FLAGS else f"workload.{name}"


def load_options(given: Mapping[str, object], named_by: str = FLAGS, base: LoadOptions = LoadOptions()) -> LoadOptions:
    """``base`` with the options ``given`` (``OPTIONS`` name -> value), each checked, and
    the whole checked together; an ``OptionError`` names the first that cannot be used."""
    changes: dict[str, object] = {}
    for name, value in given.items():
        option = OPTIONS.get(name)
        if option is None:
            raise OptionError(name, f"one of {', '.join(OPTIONS)}", name)
        changes[option.field] = _checked(name, value)
    options = dataclasses.replace(base, named_by=named_by, **changes)
    if options.format is not None and options.format != GENERIC:
        set_ = [name for name in GENERIC_ONLY if getattr(options, OPTIONS[name].field) not in (None, False, ())]
        if set_:
            name = next((n for n in set_ if n in given), set_[0])
            raise OptionError(name, f"no {name} with format {options.format} (only a generic file reads it)",
                              given.get(name))
    return options


def map_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``TRACE_COLUMN=SOURCE_COLUMN`` strings (the ``--map`` flags) as a map."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        target, sep, source = pair.partition("=")
        target, source = target.strip(), source.strip()
        if not sep or not source or target not in MAPPABLE:
            raise OptionError("map", f"TRACE_COLUMN=SOURCE_COLUMN with TRACE_COLUMN one of {', '.join(MAPPABLE)}",
                              pair)
        if target in mapping:
            raise OptionError("map", f"one source for {target}", pair)
        mapping[target] = source
    return mapping


def _checked(name: str, value: object) -> object:
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if name == "format":
        if value is not None and value not in FORMATS:
            raise OptionError(name, f"one of {', '.join(FORMATS)}", value)
        return value
    if name == "map":
        if value is None:
            return ()
        if not isinstance(value, Mapping):
            raise OptionError(name, "a table of trace column = source column", value)
        for target, source in value.items():
            if target not in MAPPABLE:
                raise OptionError(name, f"a trace column ({', '.join(MAPPABLE)})", target, entry=target)
            if not isinstance(source, str) or not source:
                raise OptionError(name, "the name of a column of the file", source, entry=target)
        return tuple(value.items())
    if name == "time_unit":
        if value is not None and value not in TIME_UNITS:
            raise OptionError(name, f"one of {', '.join(TIME_UNITS)}", value)
        return value
    if name == "hash_block_tokens":
        if value is not None and not (is_int(value) and value >= 1):
            raise OptionError(name, "a number of tokens >= 1", value)
        return value
    if name == "arrivals":
        if value not in ARRIVAL_MODES:
            raise OptionError(name, f"one of {', '.join(ARRIVAL_MODES)}", value)
        return value
    if name == "arrival_seed":
        if not (is_int(value) and value >= 0):
            raise OptionError(name, "an integer seed >= 0", value)
        return value
    if not isinstance(value, bool):  # per_block_hashes, skip_bad
        raise OptionError(name, "true or false", value)
    return value
