"""The one error type the simulator raises for bad input.

Every invalid spec, config or request is reported as a ``ConfigError`` naming where the
value came from (a file when known), the field, and what was expected, so the CLI can
print one clear line instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Invalid configuration or input; ``str(err)`` is a complete one-line message."""

    def __init__(self, field: str, expected: str, got: object = None, *, source: str | None = None):
        self.field = field
        self.expected = expected
        self.got = got
        self.source = source
        where = f"{source}: " if source else ""
        got_text = "" if got is None else f", got {got!r}"
        super().__init__(f"{where}{field}: expected {expected}{got_text}")

    def with_source(self, source: str) -> "ConfigError":
        """The same error, attributed to a file (used when a loader knows the path)."""
        return ConfigError(self.field, self.expected, self.got, source=source)


def reject_unknown_keys(mapping: Mapping, allowed: Iterable[str], *, where: str, expected: str) -> None:
    """Refuse the first key of ``mapping`` (sorted) not in ``allowed``, as ``where.key``:
    a typo in a config must never silently fall back to a default."""
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", expected, mapping[unknown[0]])


def require(condition: bool, field: str, expected: str, got: object = None) -> None:
    if not condition:
        raise ConfigError(field, expected, got)


def config_from_table(build: Callable[..., T], entry: object, *, where: str, table_is: str,
                      known: Iterable[str], expected: str, required: Iterable[str] = (),
                      required_is: str = "a value") -> T:
    """A config built from one table of a file: ``entry`` must be a table (``table_is``
    says what kind), its keys among ``known`` (``expected`` says which) and ``required``
    present (the first missing one is named, as ``required_is``); an error the builder
    raises is named under ``where`` unless it already is."""
    if not isinstance(entry, dict):
        raise ConfigError(where, table_is, entry)
    reject_unknown_keys(entry, known, where=where, expected=expected)
    missing = sorted(name for name in required if name not in entry)
    if missing:
        raise ConfigError(f"{where}.{missing[0]}", required_is)
    try:
        return build(**entry)
    except ConfigError as err:
        if err.field.startswith(f"{where}."):
            raise
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None
