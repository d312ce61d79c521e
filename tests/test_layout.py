"""The import arrows of DESIGN.md, checked by parsing every module's imports.

``kvtwin → {executor, reports} → sim → traces``; ``executor → kernels``. Inside ``sim``:
``core`` is the standard library only, ``planner`` and ``lockstep`` build on ``core``
alone. A failure names the module, the line and the import that breaks an arrow.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
# Folder names that would be top-level modules if imported bare (the old layout).
BARE_NAMES = {"sim", "traces", "reports", "kernels", "executor", "scenarios"}


def _module_name(path: Path) -> str:
    """``sim/core/spec.py`` → ``kvtwin.sim.core.spec``, by the pyproject mapping."""
    rel = path.relative_to(REPO)
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if rel.parts[: len(Path(folder).parts)] == Path(folder).parts:
            rest = rel.parts[len(Path(folder).parts):]
            parts = package.split(".") + [p for p in rest]
            parts[-1] = parts[-1].removesuffix(".py")
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise AssertionError(f"{rel} is not under a mapped package folder")


def _package_files() -> list[Path]:
    files = []
    for folder in PACKAGE_DIRS.values():
        files += sorted((REPO / folder).rglob("*.py"))
    return files


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # `from kvtwin import kernels` imports the subpackage.
            out += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if name == "kvtwin"]
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _allowed(module: str, name: str) -> bool:
    top = name.split(".")[0]
    if _under(module, "kvtwin.sim.core"):
        return top in STDLIB or _under(name, "kvtwin.sim.core")
    if _under(module, "kvtwin.sim.planner") or _under(module, "kvtwin.sim.lockstep"):
        own = ".".join(module.split(".")[:3])
        return top in STDLIB or _under(name, "kvtwin.sim.core") or _under(name, own)
    if _under(module, "kvtwin.sim"):
        forbidden = ("kvtwin.cli", "kvtwin.commands", "kvtwin.console", "kvtwin.reports", "kvtwin.executor",
                     "kvtwin.kernels")
        return top not in ("torch", "triton") and not any(_under(name, f) for f in forbidden)
    if _under(module, "kvtwin.kernels"):
        return not _under(name, "kvtwin.sim")
    if _under(module, "kvtwin.traces"):
        return top != "kvtwin" or _under(name, "kvtwin.traces")
    return True


CASES = [(path, _module_name(path)) for path in _package_files()]


@pytest.mark.parametrize("path,module", CASES, ids=[m for _, m in CASES])
def test_import_arrows(path: Path, module: str) -> None:
    broken = [f"{path.relative_to(REPO)}:{line}: {module} imports {name}"
              for line, name in _imports(path, module) if not _allowed(module, name)]
    assert not broken, "\n".join(broken)


def test_no_bare_top_level_imports() -> None:
    """Everything imports through ``kvtwin.*``: a bare ``import sim`` would load a second
    copy of the module (different classes, silently failing isinstance checks)."""
    files = _package_files() + sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
    broken = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            broken += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE_NAMES]
    assert not broken, "\n".join(broken)


def test_every_package_is_installed() -> None:
    """A folder with an ``__init__.py`` missing from ``packages`` would be left out of the wheel."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {_module_name(p) for p in _package_files() if p.name == "__init__.py"}
    assert found - listed == set()
    assert listed - found == set()


def test_the_arrow_checker_catches_a_wrong_import() -> None:
    """The rules themselves: each forbidden arrow is refused, each allowed one accepted."""
    assert not _allowed("kvtwin.sim.core.scheduler", "kvtwin.sim.planner.plan")
    assert not _allowed("kvtwin.sim.core.scheduler", "simpy")
    assert _allowed("kvtwin.sim.core.scheduler", "collections")
    assert not _allowed("kvtwin.sim.planner.plan", "kvtwin.sim.replay.cost_model")
    assert _allowed("kvtwin.sim.planner.plan", "kvtwin.sim.core.spec")
    assert not _allowed("kvtwin.sim.replay.run", "torch")
    assert not _allowed("kvtwin.sim.replay.run", "kvtwin.reports.run_dir")
    assert not _allowed("kvtwin.sim.replay.run", "kvtwin.commands.replay")
    assert _allowed("kvtwin.sim.replay.run", "kvtwin.traces.load")
    assert not _allowed("kvtwin.kernels.ops", "kvtwin.sim.core.spec")
    assert not _allowed("kvtwin.traces.load", "kvtwin.sim.core.errors")
