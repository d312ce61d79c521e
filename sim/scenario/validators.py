"""The checks a scenario's tables share: a table where one is expected, no unknown key,
errors named by their place in the file, and the rules of the plain values the scenario
layer checks itself (a workload's cuts, the run's limit, the SLO's bounds).

Type tests (``is_int``, ``is_number``: a bool is neither) are the core's
(``kvtwin.sim.core.config``), so a value is judged the same way in every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from kvtwin.sim.core.config import is_int, is_number
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
