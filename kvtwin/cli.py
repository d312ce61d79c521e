"""The `kvtwin` command line: one typer app, one module per command under `commands/`.

A command's module is imported only when that command runs (or shows its own help): the
commands table below names each one's module, function and the line ``kvtwin --help``
lists, so ``kvtwin --help`` imports no command and ``kvtwin plan`` no simulator
(``tests/cli/test_lazy_imports.py`` pins both, and that the listing equals the docstrings;
``bench/bench_startup.py`` times them).

Help texts are plain text (``rich_markup_mode=None``): they name TOML tables such as
``[model]``, which rich markup would swallow.
"""

from __future__ import annotations

import gc
import importlib
from dataclasses import dataclass

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from kvtwin import CORE_BUILD, __version__
from kvtwin.console import guard_all, guarded, one_line_usage_errors


@dataclass(frozen=True)
class CommandEntry:
    name: str
    module: str  # under kvtwin.commands
    attribute: str  # the command's function, or a typer sub-app
    help: str  # the first paragraph of its help: the function's docstring, or the sub-app's help


COMMANDS = (
    CommandEntry("kernels", "kernels", "kernels", "Which kernel backends are usable here, and why not."),
    CommandEntry("lockstep", "lockstep", "lockstep",
                 "Run a golden case through kvtwin's scheduler with a step clock and a scripted model."),
    CommandEntry("models", "presets", "models",
                 "The model presets --model and [model] preset accept, one line of facts each."),
    CommandEntry("gpus", "presets", "gpus", "The GPU presets --gpu and [hardware] gpu accept, one line of facts each."),
    CommandEntry("scenarios", "scenarios", "scenarios",
                 "The bundled scenarios, which every command accepts by name."),
    CommandEntry("plan", "plan", "plan",
                 "What fits: KV cache groups, blocks, tokens, concurrency and memory, as vLLM 0.33 plans them."),
    CommandEntry("replay", "replay", "replay",
                 "Replay a trace against vLLM's KV cache manager and scheduler in simulated time."),
    CommandEntry("capacity", "capacity", "capacity",
                 "Sweep a scenario over settings; with --find-max-rate, the largest rate each point holds."),
    CommandEntry("validate", "validate", "validate",
                 "Run the engine on a device and check prefix hits, memory and step times against the simulator."),
    CommandEntry("calibrate", "calibrate", "calibrate",
                 "Fit the cost model to your server's measurements and write a calibration file."),
    CommandEntry("diff", "diff", "diff",
                 "Compare two replay runs: every figure side by side with its change, and what differs."),
    CommandEntry("report", "report", "report",
                 "Write DIR/report.html: the plan, key metrics and plots of a replay or capacity run."),
    CommandEntry("trace", "trace", "trace_app", "Inspect, convert and synthesise request traces."),
)


def load_command(entry: CommandEntry) -> TyperCommand | TyperGroup:
    """Import ``entry``'s module and build its click command as typer registers it, every
    callback wrapped by ``console.guarded``."""
    target = getattr(importlib.import_module(f"kvtwin.commands.{entry.module}"), entry.attribute)
    if isinstance(target, typer.Typer):
        guard_all(target)
        return typer.main.get_group(target)  # as add_typer mounts it: no completion options of its own
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    single.command(entry.name)(guarded(target))
    return typer.main.get_command(single)


class _NotLoaded(TyperCommand):
    """Stands in for a command whose module is not imported: its name and one-line help."""

    def __init__(self, entry: CommandEntry):
        super().__init__(name=entry.name, help=entry.help, rich_markup_mode=None)
        self.entry = entry


class LazyGroup(TyperGroup):
    """The top-level group: typer's own, with each command loaded on first use. The
    listing, the "Did you mean" suggestions and the usage errors read the stand-ins. A
    usage error anywhere below it is one ``kvtwin: error:`` line (``console.usage_error_line``)."""

    def __init__(self, **settings):
        super().__init__(**settings)
        for entry in COMMANDS:
            self.commands.setdefault(entry.name, _NotLoaded(entry))

    # Reading the command line happens in these two: the group's own options here, a
    # command's flags (and the command itself) inside ``invoke``.
    def make_context(self, info_name, args, parent=None, **extra):
        with one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with one_line_usage_errors():
            return super().invoke(ctx)

    def get_command(self, ctx, cmd_name: str):
        command = self.commands.get(cmd_name)
        if isinstance(command, _NotLoaded):
            command = self.commands[cmd_name] = load_command(command.entry)
        return command

    def format_commands(self, ctx, formatter) -> None:
        # typer's listing of the same commands, as they stand: the stand-ins' lines, no imports.
        TyperGroup(commands=dict(self.commands), rich_markup_mode=None).format_commands(ctx, formatter)


app = typer.Typer(
    name="kvtwin",
    help="A digital twin of an LLM server's KV cache (vLLM v1 semantics).",
    cls=LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        print(f"kvtwin {__version__} ({CORE_BUILD.describe()})")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """kvtwin: plan, replay and validate vLLM KV cache behaviour."""


def console_main() -> None:
    """The installed ``kvtwin`` script: the app, then an exit without the collector's final
    walk over every object the command built (``gc.freeze``; 0.2-0.3 s of a 10-request
    replay, whose pools alone hold 600,000 blocks). Nothing is left to collect that
    matters: outputs are written and closed by then. Tests call ``app`` itself, keeping
    their process's collector as it was."""
    try:
        app()
    finally:
        gc.freeze()


if __name__ == "__main__":
    console_main()
