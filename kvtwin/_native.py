"""Which build of the simulator's hot modules runs: mypyc's compiled extensions or their
Python source.

``setup.py`` compiles the KV core (``kvtwin.sim.core``) when the machine has a C compiler
and writes ``native_manifest.json`` beside the shared library: the SHA-256 of every
compiled module's source. The Python files are installed either way, and Python prefers
an extension module to a source file of the same name. ``kvtwin/__init__.py`` calls
``select_build`` once, before anything under ``kvtwin.sim`` is imported:

* ``KVTWIN_INTERPRETED=1`` runs the Python source (CI runs the tests both ways);
* compiled modules whose manifest matches the sources on disk run compiled;
* compiled modules whose source changed since the build (an editable install edited in
  place), or with no manifest, run as Python source, with one notice on stderr: a stale
  extension must never run in place of the code next to it.

Either way the results are the same, byte for byte; only the speed differs.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_SWITCH = "KVTWIN_INTERPRETED"
MANIFEST_NAME = "native_manifest.json"  # written by setup.py


@dataclass(frozen=True)
class CoreBuild:
    compiled: bool
    reason: str  # why, in words, for ``kvtwin --version``

    def describe(self) -> str:
        return f"core: {'compiled (mypyc)' if self.compiled else 'interpreted'}, {self.reason}"


class _SourceFirstFinder(importlib.abc.MetaPathFinder):
    """Finds the listed modules' ``.py`` files, passing over the extensions beside them."""

    def __init__(self, modules: frozenset[str]):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules or not path:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        for folder in path:
            source = Path(folder) / leaf
            if source.is_file():
                return importlib.util.spec_from_file_location(
                    fullname, source, loader=importlib.machinery.SourceFileLoader(fullname, str(source)))
        return None


def _module_name(installed_path: str) -> str:
    return installed_path.removesuffix(".py").replace("/", ".")


def _stale_modules(sim_dir: Path, manifest: dict[str, str]) -> list[str]:
    """Compiled modules whose source on disk no longer matches the one compiled."""
    stale = []
    for installed_path, digest in manifest.items():
        source = sim_dir / Path(installed_path).relative_to("kvtwin/sim")
        if not source.is_file() or hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            stale.append(_module_name(installed_path))
    return stale


def _extension_modules(sim_dir: Path) -> list[str]:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = []
    for path in sorted(sim_dir.rglob("*")):
        if path.name.endswith(suffixes) and "__mypyc" not in path.name:
            relative = path.relative_to(sim_dir).with_name(path.name.split(".", 1)[0])
            found.append("kvtwin.sim." + ".".join(relative.parts))
    return found


@dataclass(frozen=True)
class BuildChoice:
    build: CoreBuild
    from_source: tuple[str, ...] = ()  # compiled modules to load from their .py instead
    notice: str | None = None


def choose_build(sim_dir: Path, environ: Mapping[str, str]) -> BuildChoice:
    """The decision of the module docstring for the ``kvtwin.sim`` package at ``sim_dir``."""
    extensions = tuple(_extension_modules(sim_dir))
    if not extensions:
        return BuildChoice(CoreBuild(False, "installed without a C compiler (or with KVTWIN_PURE_PYTHON=1)"))
    if environ.get(ENV_SWITCH, "") not in ("", "0"):
        return BuildChoice(CoreBuild(False, f"{ENV_SWITCH} is set"), extensions)
    try:
        manifest = json.loads((sim_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict):
        listed = {_module_name(path) for path in manifest}
        # An extension the last build did not make is left over from an older one.
        stale = _stale_modules(sim_dir, manifest) + [name for name in extensions if name not in listed]
    else:
        stale = ["(no manifest)"]
    if stale:
        notice = (f"kvtwin: notice: the compiled core is older than its source ({', '.join(stale[:3])}"
                  f"{', ...' if len(stale) > 3 else ''}); running the Python source. Reinstall "
                  f"(pip install -e .) to compile it again.")
        return BuildChoice(CoreBuild(False, "compiled modules older than their source"), extensions, notice)
    return BuildChoice(CoreBuild(True, f"{len(extensions)} modules"))


def select_build() -> CoreBuild:
    """Decide compiled or interpreted for this process, and make imports follow."""
    spec = importlib.util.find_spec("kvtwin.sim")
    if spec is None or not spec.submodule_search_locations:
        return CoreBuild(False, "kvtwin.sim not found")
    choice = choose_build(Path(next(iter(spec.submodule_search_locations))), os.environ)
    if choice.from_source:
        sys.meta_path.insert(0, _SourceFirstFinder(frozenset(choice.from_source)))
    if choice.notice:
        print(choice.notice, file=sys.stderr)
    return choice.build
