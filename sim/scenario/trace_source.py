"""How a trace is read, as a scenario's ``[workload]`` keys or a command's flags give it:
``kvtwin.traces.options`` declares and checks the options; this turns its ``OptionError``
into the ``ConfigError`` every command prints, naming the option as its user set it
(``workload.map``, ``--map``)."""

from __future__ import annotations

from collections.abc import Mapping

from kvtwin.sim.core.errors import ConfigError
from kvtwin.traces.options import LoadOptions, OptionError, load_options


def trace_options(given: Mapping[str, object], named_by: str, base: LoadOptions = LoadOptions()) -> LoadOptions:
    """``base`` read as ``given`` says (``OPTIONS`` name -> value, from ``named_by``)."""
    try:
        return load_options(given, named_by, base)
    except OptionError as err:
        raise option_error(err, named_by) from None


def option_error(err: OptionError, named_by: str) -> ConfigError:
    return ConfigError(err.spelled(named_by), err.expected, err.got)
