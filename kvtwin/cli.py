"""The `kvtwin` command line: one typer app, one module per command under `commands/`.

Help texts are plain text (``rich_markup_mode=None``): they name TOML tables such as
``[model]``, which rich markup would swallow.
"""

from __future__ import annotations

import typer

from kvtwin import CORE_BUILD, __version__
from kvtwin.commands import calibrate
from kvtwin.commands import capacity
from kvtwin.commands import kernels
from kvtwin.commands import presets
from kvtwin.commands import lockstep
from kvtwin.commands import plan
from kvtwin.commands import replay
from kvtwin.commands import report
from kvtwin.commands import validate
from kvtwin.commands.trace import trace_app
from kvtwin.console import guard_all

app = typer.Typer(
    name="kvtwin",
    help="A digital twin of an LLM server's KV cache (vLLM v1 semantics).",
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


app.command("kernels")(kernels.kernels)
app.command("lockstep")(lockstep.lockstep)
app.command("models")(presets.models)
app.command("gpus")(presets.gpus)
app.command("plan")(plan.plan)
app.command("replay")(replay.replay)
app.command("capacity")(capacity.capacity)
app.command("validate")(validate.validate)
app.command("calibrate")(calibrate.calibrate)
app.command("report")(report.report)
app.add_typer(trace_app, name="trace")
guard_all(app)

if __name__ == "__main__":
    app()
