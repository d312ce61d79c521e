"""The one error type the simulator raises for bad input.

Every invalid spec, config or request is reported as a ``ConfigError`` naming where the
value came from (a file when known), the field, and what was expected, so the CLI can
print one clear line instead of a traceback.
"""

from __future__ import annotations


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


def require(condition: bool, field: str, expected: str, got: object = None) -> None:
    if not condition:
        raise ConfigError(field, expected, got)
