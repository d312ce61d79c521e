"""How the CLI talks to people: one clear line for bad input, never a traceback.

Also the two ways a command ends early that are not errors in the command: Ctrl-C (exit
130, with one line saying what was and was not written) and a closed stdout, as in
``kvtwin replay | head -2`` (quietly, exit 0). ``guarded`` wraps every command once, in
``kvtwin/cli.py``; a command that knows more about its state says so with
``interrupt_note``. A command runs with the garbage collector at a run's pace
(``relaxed_collection``): reading a trace and building block pools allocate hundreds of
thousands of long-lived objects, which the default pace walks again and again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator

import typer

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.replay.clock.collector import relaxed_collection
from kvtwin.traces.errors import TraceError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

# A plain progress line this often (wall seconds) when stderr is a log, not a terminal.
PLAIN_PROGRESS_EVERY_S = 5.0


@contextlib.contextmanager
def progress_display(name: str, total: int, *, quiet: bool, started: float, done: Callable[[], int],
                     line: Callable[[], str], info: Callable[[], str],
                     every_s: Callable[[], float] = lambda: PLAIN_PROGRESS_EVERY_S
                     ) -> Iterator[Callable[..., None]]:
    """Yield ``update(final=False)``, called whenever the count of things ``done()`` out of
    ``total`` may have moved: a bar (``info()`` beside it) when stderr is a terminal; off
    one (a log), a ``kvtwin: NAME: line(), N s wall`` line at most every ``every_s()``
    seconds, and on a ``final`` update; nothing when ``quiet``."""
    if quiet:
        yield lambda final=False: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        last = {"wall_s": started}

        def update(final: bool = False) -> None:
            now = time.perf_counter()
            if final or now - last["wall_s"] >= every_s():
                last["wall_s"] = now
                print(f"kvtwin: {name}: {line()}, {now - started:,.0f} s wall", file=sys.stderr, flush=True)

        yield update
        return
    with Progress(TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(name, total=max(total, 1), info="")

        def update(final: bool = False) -> None:
            bar.update(task, completed=done(), info=info())

        yield update


def require_extra(module: str, extra: str, *, field: str, needed_for: str) -> None:
    """Refuse a command (or an option, ``field``) whose ``module`` comes with an optional
    extra of kvtwin (``pyproject.toml``) that is not installed: one line naming the extra,
    before the command does anything that would import it."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module hidden as None
        found = False
    if not found:
        raise ConfigError(field, f"{module} installed for {needed_for}: pip install 'kvtwin[{extra}]'",
                          f"no {module}")


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
    except BrokenPipeError:
        raise  # not the user's input: ``guarded`` ends quietly
    except OSError as err:
        # A path the user named that cannot be written or read (full disk, permissions).
        print(f"kvtwin: error: {err.filename or 'output'}: {err.strerror or err}", file=sys.stderr)
        raise typer.Exit(code=2) from None


def report_trace_notes(table) -> None:
    """A trace's notes and skipped-line reasons (``TraceMeta``), one plain line each on
    stderr, never wrapped: what reading it assumed or changed, said before it is used."""
    from kvtwin.traces import schema  # pyarrow: only where a trace was read

    meta = schema.trace_meta(table)
    for note in meta.notes:
        print(f"kvtwin: note: {note}", file=sys.stderr)
    for reason in meta.bad_line_reasons:
        print(f"kvtwin: skipped: {reason}", file=sys.stderr)


def _is_click_error(err: BaseException) -> bool:
    # typer has shipped click as a dependency and as its own copy (``typer._click``): the
    # class is known by name, whichever module holds it.
    return any(cls.__name__ == "ClickException" for cls in type(err).__mro__)


def _param_name(err: BaseException) -> str | None:
    """The flag (its first spelling, as the settings table names it) or argument an error
    is about, if it says."""
    param = getattr(err, "param", None)
    if param is not None:
        opts = [opt for opt in getattr(param, "opts", ()) if opt.startswith("-")]
        if opts:
            return ([opt for opt in opts if opt.startswith("--")] or opts)[0]
        return getattr(param, "metavar", None) or str(getattr(param, "name", "")).upper() or None
    hint = getattr(err, "param_hint", None) or getattr(err, "option_name", None)
    if hint is None or isinstance(hint, str):
        return hint
    return " / ".join(hint)


def usage_error_line(err: BaseException) -> str:
    """One ``kvtwin: error:`` line for an error typer (click) raised while reading the
    command line: a flag's value it refused, an unknown option, a missing value."""
    ctx = getattr(err, "ctx", None)
    command = getattr(ctx, "command_path", None) or "kvtwin"
    message = " ".join(str(getattr(err, "message", None) or err).split())
    name = _param_name(err)
    kind = type(err).__name__
    if kind == "MissingParameter":
        text = f"{name or command}: expected a value (it is required; {command} --help)"
    elif kind == "NoSuchOption":
        option = getattr(err, "option_name", None) or name or "?"
        maybe = sorted(getattr(err, "possibilities", None) or ())
        hint = f"; did you mean {' or '.join(maybe)}?" if maybe else ""
        text = f"{option}: expected an option of {command} ({command} --help lists them{hint}), got {option!r}"
    elif kind == "BadOptionUsage" and "requires an argument" in message:
        text = f"{name}: expected a value after it"
    elif message.startswith("No such command"):
        got = message.removeprefix("No such command").strip(" .")
        text = f"{command}: expected one of its commands ({command} --help lists them), got {got}"
    elif name:
        text = f"{name}: {message if message.startswith('expected') else f'expected a valid value ({message})'}"
    else:
        text = f"{command}: {message} ({command} --help)"
    return f"kvtwin: error: {text}"


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Print what typer would show as a usage block and an ``Error:`` line as one
    ``kvtwin: error:`` line instead, exit code 2 (docs/commands.md#exit-codes). ``--help`` and a
    bare group's help pass through."""
    try:
        yield
    except Exception as err:
        if not _is_click_error(err) or type(err).__name__ == "NoArgsIsHelpError":
            raise
        print(usage_error_line(err), file=sys.stderr)
        raise typer.Exit(code=2) from None


def _interrupted(text: str) -> None:
    print(f"kvtwin: {text}", file=sys.stderr)
    raise typer.Exit(code=EXIT_INTERRUPTED)


@contextlib.contextmanager
def interrupt_note(note: Callable[[], str]) -> Iterator[None]:
    """On Ctrl-C inside the block, report ``note()`` (e.g. what was written) and exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        _interrupted(note())


def _stdout_to_devnull() -> None:
    # Python flushes stdout again at exit; without this the flush fails a second time and
    # the interpreter prints "Exception ignored" and exits 120.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # not a real file descriptor (a test runner's buffer): nothing left to flush


def guarded(command: Callable) -> Callable:
    """Wrap a command: Ctrl-C exits 130 with one line; a closed stdout ends quietly with 0."""
    if getattr(command, "__kvtwin_guarded__", False):
        return command

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            with relaxed_collection():
                result = command(*args, **kwargs)
            # Output still buffered would otherwise meet a closed pipe at exit, outside this guard.
            sys.stdout.flush()
            return result
        except KeyboardInterrupt:
            _interrupted("interrupted")
        except BrokenPipeError:
            _stdout_to_devnull()
            raise typer.Exit(code=0) from None
        except SystemExit as exit_:
            # rich's Console meets a closed pipe by pointing stdout at devnull and exiting 1.
            if isinstance(exit_.__context__, BrokenPipeError):
                raise typer.Exit(code=0) from None
            raise

    run.__kvtwin_guarded__ = True
    return run


def guard_all(app: typer.Typer) -> None:
    """Apply ``guarded`` to every command of ``app`` and of its sub-apps."""
    for info in app.registered_commands:
        info.callback = guarded(info.callback)
    for group in app.registered_groups:
        guard_all(group.typer_instance)
