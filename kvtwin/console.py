"""How the CLI talks to people: one clear line for bad input, never a traceback."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import typer

from kvtwin.sim.core.errors import ConfigError
from kvtwin.traces.errors import TraceError


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn input errors raised inside a command into ``kvtwin: error: ...`` and exit 2."""
    try:
        yield
    except (ConfigError, TraceError) as err:
        print(f"kvtwin: error: {err}", file=sys.stderr)
        raise typer.Exit(code=2) from None
    except FileNotFoundError as err:
        print(f"kvtwin: error: {err.filename}: no such file", file=sys.stderr)
        raise typer.Exit(code=2) from None
