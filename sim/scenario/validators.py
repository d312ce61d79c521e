"""The checks a scenario's tables share: a table where one is expected, no unknown key,
errors named by their place in the file, and the rules of the plain values the scenario
layer checks itself (a workload's cuts, the run's limit, the SLO's bounds); and
``parse_text``, the one reading of a setting written as text (a flag, a sweep value).

Type tests (``is_int``, ``is_number``: a bool is neither, nor an infinite or NaN float)
and byte sizes (``byte_amount``: ``500GB``, ``1e9``) are the core's
(``kvtwin.sim.core.config``), so a value is judged the same way in every layer: a
scenario's ``kv_cache_memory_bytes = "500GB"``, ``--kv-cache-memory-bytes 500GB`` and
``--sweep engine.kv_cache_memory_bytes=500GB`` are one value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

from kvtwin.sim.core.config import BYTE_FORMS, byte_amount, is_int, is_number
from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys

Rule = tuple[Callable[[object], bool], str]  # (accepts, what is expected)

NON_NEGATIVE_SECONDS: Rule = (lambda v: is_number(v) and v >= 0, "a non-negative number of seconds")
POSITIVE_SECONDS: Rule = (lambda v: is_number(v) and v > 0, "a positive number of seconds")
POSITIVE_SIMULATED_SECONDS: Rule = (lambda v: is_number(v) and v > 0, "a positive number of simulated seconds")
POSITIVE_REQUESTS: Rule = (lambda v: is_int(v) and v > 0, "a positive number of requests")
POSITIVE_FACTOR: Rule = (lambda v: is_number(v) and v > 0, "a positive factor (2 = twice as fast)")
FRACTION_OF_SESSIONS: Rule = (lambda v: is_number(v) and 0 < v <= 1, "a fraction of sessions in (0, 1]")
INTEGER_SEED: Rule = (is_int, "an integer seed")


def check(rule: Rule, value: object, where: str) -> None:
    """Refuse ``value`` as ``where`` unless ``rule`` accepts it."""
    accepts, expected = rule
    if not accepts(value):
        raise ConfigError(where, expected, value)


def table_of(data: dict, name: str) -> dict:
    """The table ``[name]`` of a scenario (empty when absent); anything else is an error."""
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(name, "a table", value)
    return value


def check_keys(table: dict, allowed: Iterable[str], where: str) -> None:
    """Refuse a key of ``table`` not in ``allowed``, listing the allowed ones."""
    allowed = tuple(allowed)
    reject_unknown_keys(table, allowed, where=where, expected=f"one of {', '.join(allowed)}")


@contextlib.contextmanager
def fields_under(where: str) -> Iterator[None]:
    """Errors of a config built from the table ``[where]`` name ``where.field``."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None


TEXT_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                 "bytes": f"a number of bytes: {BYTE_FORMS}",
                 "bytes_per_s": "a number of bytes per second (2e9, or with a unit: 2GB/s)"}


def parse_text(text: str, kind: str, where: str, *, unit: str = "") -> object:
    """A setting written as text, as its config type takes it: ``kind`` int, float, bool or
    str, or a byte ``unit`` (``"bytes"``, ``"bytes_per_s"``) whatever its kind, as an int
    when whole. Ranges (and whether a byte count may be fractional) are the config type's to
    check, in the words it uses for a scenario's value; a non-finite number is never a
    setting."""
    if unit:
        amount = byte_amount(text, per_second=unit == "bytes_per_s")
        if amount is None:
            raise ConfigError(where, TEXT_EXPECTED[unit], text)
        return int(amount) if amount.denominator == 1 else float(amount)
    stripped = text.strip()
    if kind == "bool":
        if stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        raise ConfigError(where, TEXT_EXPECTED[kind], text)
    if kind == "int":
        try:
            return int(stripped.replace("_", ""))
        except ValueError:
            raise ConfigError(where, TEXT_EXPECTED[kind], text) from None
    if kind == "float":
        try:
            value = float(stripped.replace("_", ""))
        except ValueError:
            raise ConfigError(where, TEXT_EXPECTED[kind], text) from None
        if not math.isfinite(value):
            raise ConfigError(where, "a finite number", text)
        return value
    if not stripped:
        raise ConfigError(where, TEXT_EXPECTED[kind], text)
    return stripped
