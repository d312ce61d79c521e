"""Command-line options made from the settings table (``kvtwin.sim.scenario.knobs``).

``@knob_flags("engine.max_model_len", ...)`` puts one option per setting into a command's
signature, where its ``knobs`` parameter stands, with the table's flag, help and type; the
command receives ``knobs``: ``{"engine.max_model_len": value or None, ...}``, ready for
``Overrides.from_knobs``. A flag is spelt, helped and named in errors in one place.

Numbers are read by ``validators.parse_text``, as sweep values are, not by typer's own
conversion: ``--kv-cache-memory-bytes 500GB`` is the scenario's ``"500GB"``, and
``--rate-scale abc`` one ``kvtwin: error:`` line. A setting's flag reaches the command
as text and is read there (so the line comes out wherever the command is mounted); the
other numeric flags of a command (``number_option``) are read by typer with
``text_parser``, whose refusals ``kvtwin/cli.py`` prints as that line.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

import typer

from kvtwin.console import user_errors
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.knobs import Knob, knob
from kvtwin.sim.scenario.validators import Rule, parse_text

_TYPES = {"int": int, "float": float, "bool": bool, "str": str}
_METAVARS = {"int": "INTEGER", "float": "NUMBER", "bytes": "BYTES", "bytes_per_s": "BYTES/S"}


def text_parser(kind: str, *, unit: str = "", rule: Rule | None = None) -> Callable[[object], object]:
    """A typer ``parser`` reading a flag's text as ``validators.parse_text`` does, then
    checking ``rule`` if given. A refusal is a ``typer.BadParameter`` whose message is the
    rest of the one line (``expected ..., got ...``); typer attaches the flag to it."""

    def parse(value: object) -> object:
        try:
            # typer hands defaults over as they are declared, given values as text.
            parsed = parse_text(value, kind, "flag", unit=unit) if isinstance(value, str) else value
        except ConfigError as err:
            raise typer.BadParameter(f"expected {err.expected}, got {value!r}") from None
        if rule is not None and parsed is not None and not rule[0](parsed):
            raise typer.BadParameter(f"expected {rule[1]}, got {parsed!r}")
        return parsed

    return parse


_ANNOTATED = object()  # no default: the option sits in an ``Annotated[...]`` with the default beside it


def number_option(*flags: str, kind: str, default: Any = _ANNOTATED, rule: Rule | None = None, unit: str = "",
                  help: str = "", metavar: str | None = None) -> Any:
    """A typer option for a number (``kind`` int or float, or a byte ``unit``) read by
    ``text_parser``: for the flags of a command that are not settings of the table."""
    settings = dict(help=help, parser=text_parser(kind, unit=unit, rule=rule),
                    metavar=metavar or _METAVARS[unit or kind])
    if default is _ANNOTATED:
        return typer.Option(*flags, **settings)
    return typer.Option(default, *flags, **settings)


def _read_as_text(setting: Knob) -> bool:
    return setting.kind in ("int", "float") or bool(setting.unit)


def knob_option(setting: Knob) -> Any:
    """The typer option of one setting (``--x/--no-x`` for a boolean), not given by default."""
    flags = setting.flags
    if setting.kind == "bool":
        flags = tuple(f"{flag}/--no-{flag.removeprefix('--')}" for flag in flags)
    if _read_as_text(setting):
        return typer.Option(None, *flags, help=setting.help, metavar=_METAVARS[setting.unit or setting.kind])
    return typer.Option(None, *flags, help=setting.help)


def knob_flags(*keys: str) -> KnobFlags:
    """Decorator: the command's ``knobs`` parameter becomes one option per setting named."""
    return KnobFlags(keys)


class KnobFlags:
    """What ``knob_flags`` returns: applied to a command, the ``KnobCommand`` typer registers."""

    def __init__(self, keys: tuple[str, ...]):
        self.settings = [knob(key) for key in keys]
        missing = [s.key for s in self.settings if not s.flags]
        if missing:
            raise ValueError(f"no command-line flag declared for {', '.join(missing)}")

    def __call__(self, command: Callable[..., None]) -> KnobCommand:
        return KnobCommand(command, self.settings)


class KnobCommand:
    """A command whose knob options are generated: typer reads ``__signature__``; a call
    gathers those options into ``knobs`` and calls the command."""

    def __init__(self, command: Callable[..., None], settings: list[Knob]):
        functools.update_wrapper(self, command)
        self.command = command
        self.settings = settings
        signature = inspect.signature(command)
        generated = [inspect.Parameter(s.param, inspect.Parameter.KEYWORD_ONLY, default=knob_option(s),
                                       annotation=Optional[str if _read_as_text(s) else _TYPES[s.kind]])
                     for s in settings]
        parameters: list[inspect.Parameter] = []
        for parameter in signature.parameters.values():
            if parameter.name == "knobs":
                parameters += generated
            else:
                parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        self.__signature__ = signature.replace(parameters=parameters)
        self.__annotations__ = {**getattr(command, "__annotations__", {}),
                                **{p.name: p.annotation for p in generated}}
        self.__annotations__.pop("knobs", None)

    def __call__(self, **values: Any) -> None:
        knobs = {s.key: values.pop(s.param) for s in self.settings}
        with user_errors():
            for setting in self.settings:
                text = knobs[setting.key]
                if text is not None and _read_as_text(setting):
                    knobs[setting.key] = parse_text(text, setting.kind, setting.flag or setting.key,
                                                    unit=setting.unit)
        return self.command(**values, knobs=knobs)
