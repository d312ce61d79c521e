"""The installed ``kvtwin`` script exits without the collector's final walk
(``kvtwin.cli.console_main``), and the command's output is whole before it does."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys


def test_the_installed_script_is_console_main():
    scripts = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["kvtwin"] == "kvtwin.cli:console_main"


def test_console_main_freezes_the_heap_before_the_interpreter_exits():
    program = (
        "import atexit, gc, sys\n"
        # atexit handlers run after the script's main returns, before the final collection.
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))\n"
        "from kvtwin.cli import console_main\n"
        "sys.argv = ['kvtwin', '--version']\n"
        "console_main()\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("kvtwin ")
    assert lines[-1] == "frozen True"
