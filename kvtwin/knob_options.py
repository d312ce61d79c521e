"""Command-line options made from the settings table (``kvtwin.sim.scenario.knobs``).

``@knob_flags("engine.max_model_len", ...)`` puts one option per setting into a command's
signature, where its ``knobs`` parameter stands, with the table's flag, help and type; the
command receives ``knobs``: ``{"engine.max_model_len": value or None, ...}``, ready for
``Overrides.from_knobs``. A flag is spelt, helped and named in errors in one place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional

import typer

from kvtwin.sim.scenario.knobs import Knob, knob

_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def knob_option(setting: Knob) -> Any:
    """The typer option of one setting (``--x/--no-x`` for a boolean), not given by default."""
    flags = setting.flags
    if setting.kind == "bool":
        flags = tuple(f"{flag}/--no-{flag.removeprefix('--')}" for flag in flags)
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
                                       annotation=Optional[_TYPES[s.kind]]) for s in settings]
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
        return self.command(**values, knobs=knobs)
