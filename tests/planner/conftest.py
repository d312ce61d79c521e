"""Shared helpers for the planner tests: run `kvtwin plan` in-process.

The command is mounted on a local typer app so these tests exercise exactly
``kvtwin.commands.plan`` (``test_cli_wiring`` checks that the real app mounts it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from kvtwin.commands import plan as plan_command


@dataclass
class PlanRun:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        assert self.exit_code in (0, 1), self.stderr
        out = json.loads(self.stdout)
        # A plan that does not fit is printed in full and exits 1, so scripts can gate on it.
        fits = out["fits"] if "fits" in out else out["hybrid_on"]["fits"]
        assert self.exit_code == (0 if fits else 1)
        return out


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("plan")(plan_command.plan)

    @app.command("version")
    def _version() -> None:  # a second command keeps `plan` a subcommand, as in kvtwin
        pass

    return app


@pytest.fixture(scope="session")
def run_plan():
    app = _app()
    runner = CliRunner()

    def run(*args: str) -> PlanRun:
        result = runner.invoke(app, ["plan", *map(str, args)])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return PlanRun(result.exit_code, result.stdout, result.stderr)

    return run
