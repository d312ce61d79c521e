"""Running the command line in-process, and the one-line refusal every bad input gets
(a `kvtwin: error:` line, exit code 2, no traceback, no usage dump), shared by the tests
that feed kvtwin bad flags, keys and values."""

from typer.testing import CliRunner

from kvtwin.cli import app


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(result, *needles: str) -> str:
    """The refusal's single line, checked to contain every needle."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtwin: error: ") and "Usage:" not in result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
