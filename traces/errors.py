"""The error type trace loading raises for bad input: names the file, line and field."""

from __future__ import annotations


class TraceError(ValueError):
    """A malformed trace; ``str(err)`` is a complete one-line message."""

    def __init__(self, path: str, field: str, expected: str, *, line: int | None = None, got: object = None):
        self.path = path
        self.field = field
        self.expected = expected
        self.line = line
        self.got = got
        where = f"{path}:{line}" if line is not None else path
        got_text = "" if got is None else f", got {got!r}"
        super().__init__(f"{where}: {field}: expected {expected}{got_text}")
