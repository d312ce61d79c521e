"""The shape of the code in ``sim/`` and ``kvtwin/``: no function or method over 80 lines,
no closure nests (a function defined inside a function that is itself defined inside a
function), and no file of the KV core (``sim/core``) over 600 lines. A long function or a
nest of closures over shared state hides its decision points; small classes and methods
name them.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_PACKAGE_DIRS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = (_PACKAGE_DIRS["kvtwin.sim"], _PACKAGE_DIRS["kvtwin"])
MAX_LINES = 80
MAX_DEPTH = 2  # a top-level function or method is depth 1, a def inside it depth 2
CORE = REPO / _PACKAGE_DIRS["kvtwin.sim"] / "core"
MAX_CORE_FILE_LINES = 600

@dataclass(frozen=True)
class Function:
    file: str  # relative to the repository
    name: str  # qualified: Class.method, outer.inner
    lines: int  # from the def line to its last line
    depth: int  # functions it sits in, itself included

    @property
    def key(self) -> tuple[str, str]:
        return (self.file, self.name)


def _functions(node: ast.AST, file: str, outer: tuple[str, ...] = (), depth: int = 0) -> Iterator[Function]:
    """Every function and method under ``node``; a class adds to the name, not the depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = (*outer, child.name)
            yield Function(file, ".".join(name), child.end_lineno - child.lineno + 1, depth + 1)
            yield from _functions(child, file, name, depth + 1)
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, file, (*outer, child.name), depth)
        else:
            yield from _functions(child, file, outer, depth)


def _all_functions() -> list[Function]:
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            file = path.relative_to(REPO).as_posix()
            found += _functions(ast.parse(path.read_text(), filename=file), file)
    return found


FUNCTIONS = _all_functions()


def test_no_function_over_the_line_limit() -> None:
    broken = [f"{f.file}: {f.name} is {f.lines} lines (limit {MAX_LINES})"
              for f in FUNCTIONS if f.lines > MAX_LINES]
    assert not broken, "\n".join(broken)


def test_no_closure_nests() -> None:
    broken = [f"{f.file}: {f.name} is a def {f.depth} deep (limit {MAX_DEPTH})"
              for f in FUNCTIONS if f.depth > MAX_DEPTH]
    assert not broken, "\n".join(broken)


def test_no_core_file_over_the_line_limit() -> None:
    """A KV core file past 600 lines holds more than one concept; split it by concept."""
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 20 and CORE / "offload" / "connector.py" in files  # the whole core, offload tiers included
    broken = [f"{path.relative_to(REPO)} is {n} lines (limit {MAX_CORE_FILE_LINES})"
              for path in files if (n := len(path.read_text().splitlines())) > MAX_CORE_FILE_LINES]
    assert not broken, "\n".join(broken)


def test_the_measure_counts_lines_and_depth() -> None:
    source = ("def top():\n    def inner():\n        def deepest():\n            pass\n"
              "class C:\n    def method(self):\n        return 1\n")
    found = {f.name: f for f in _functions(ast.parse(source), "x.py")}
    assert (found["top"].lines, found["top"].depth) == (4, 1)
    assert found["top.inner.deepest"].depth == 3 and found["top.inner"].depth == 2
    assert (found["C.method"].lines, found["C.method"].depth) == (2, 1)


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_folders_exist(folder: str) -> None:
    assert any((REPO / folder).rglob("*.py"))


# The SimPy clock names what each process and front is handed (the ``Cluster``, a
# ``Replica``, a protocol where an import would close a cycle): an ``Any`` there once let
# a second cluster pass itself to the processes in the cluster's place.
CLOCK = REPO / _PACKAGE_DIRS["kvtwin.sim"] / "replay" / "clock"


def any_uses(source: str, filename: str = "<source>") -> list[int]:
    """The lines that name ``typing.Any`` (``Any`` or ``typing.Any``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Name) and node.id == "Any" or \
                isinstance(node, ast.Attribute) and node.attr == "Any":
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "Any" for alias in node.names):
            found.append(node.lineno)
    return sorted(found)


def test_the_clock_types_what_it_is_handed() -> None:
    files = sorted(CLOCK.glob("*.py"))
    assert {"cluster.py", "engine_processes.py", "arrivals.py"} <= {path.name for path in files}
    broken = [f"{path.relative_to(REPO)}:{line}: Any" for path in files
              for line in any_uses(path.read_text(), str(path))]
    assert not broken, "\n".join(broken)


def test_the_any_finder_finds_each_spelling() -> None:
    source = ("from typing import Any, Protocol\n"
              "import typing\n"
              "def run(arrivals, view: Any = None): pass\n"
              "x: typing.Any = 1\n"
              "def ok(cluster: Cluster) -> None: pass\n")
    assert any_uses(source) == [1, 3, 4]
