"""Which build of the simulator's hot modules runs: mypyc's compiled extensions or their
Python source.

``setup.py`` compiles the KV core (``kvtwin.sim.core``) when the machine has a C compiler
and writes ``native_manifest.json`` beside the shared library: the SHA-256 of every
compiled module's source. The Python files are installed either way. Where the extensions
live depends on the install:

* a wheel (a regular install) carries them inside the package, beside the sources, and
  Python prefers an extension module to a source file of the same name;
* a checkout (an editable install) never holds them beside its sources: they are built
  into ``build/native/kvtwin/sim/...`` under the checkout's root, and an import finder
  loads them from there.

``kvtwin/__init__.py`` calls ``select_build`` once, before anything under ``kvtwin.sim`` is
imported:

* ``KVTWIN_INTERPRETED=1`` runs the Python source (CI runs the tests both ways);
* compiled modules whose manifest matches the sources on disk run compiled;
* compiled modules whose source changed since the build (an editable install edited in
  place), or with no manifest, run as Python source, with one notice on stderr: a stale
  extension must never run in place of the code next to it.

Either way the results are the same, byte for byte; only the speed differs.
"""

from __future__ import annotations

import hashlib
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
# Where setup.py puts an editable install's extensions, relative to the checkout's root
# (the folder holding ``sim/``), laid out as the installed package.
CHECKOUT_BUILD_DIR = Path("build") / "native"


@dataclass(frozen=True)
class CoreBuild:
    compiled: bool
    reason: str  # why, in words, for ``kvtwin --version``

    def describe(self) -> str:
        return f"core: {'compiled (mypyc)' if self.compiled else 'interpreted'}, {self.reason}"


# The finders are plain classes with ``find_spec``, all ``sys.meta_path`` asks of them:
# ``importlib.abc.MetaPathFinder`` as a base would load importlib.resources (and tempfile)
# into every ``kvtwin`` command, ``--help`` included.


class _SourceFirstFinder:
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


class _BuildTreeFinder:
    """Loads the listed modules (mypyc's group library among them) from extension files
    kept outside the source tree, ahead of the ``.py`` files in the package folders."""

    def __init__(self, extensions: Mapping[str, Path]):
        self.extensions = dict(extensions)

    def find_spec(self, fullname, path=None, target=None):
        extension = self.extensions.get(fullname)
        if extension is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, extension, loader=importlib.machinery.ExtensionFileLoader(fullname, str(extension)))


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


def _extension_files(build_dir: Path) -> dict[str, Path]:
    """Module name → extension file for every extension under a folder laid out as the
    ``kvtwin.sim`` package, mypyc's group library (``...__mypyc``) included."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found = {}
    for path in sorted(build_dir.rglob("*")) if build_dir.is_dir() else ():
        if path.name.endswith(suffixes):
            relative = path.relative_to(build_dir).with_name(path.name.split(".", 1)[0])
            found["kvtwin.sim." + ".".join(relative.parts)] = path
    return found


def _compiled_modules(extensions: Mapping[str, Path]) -> tuple[str, ...]:
    """The extensions that stand for a source module (not the shared group library)."""
    return tuple(name for name in extensions if "__mypyc" not in name)


def _stale_against(sim_dir: Path, build_dir: Path, modules: tuple[str, ...]) -> list[str]:
    """Compiled modules (of a build in ``build_dir``) that must not run for the sources in
    ``sim_dir``: changed since the build, or not made by the build whose manifest is there."""
    try:
        manifest = json.loads((build_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        return ["(no manifest)"]
    listed = {_module_name(path) for path in manifest}
    # An extension the last build did not make is left over from an older one.
    return _stale_modules(sim_dir, manifest) + [name for name in modules if name not in listed]


def _stale_notice(stale: list[str]) -> str:
    return (f"kvtwin: notice: the compiled core is older than its source ({', '.join(stale[:3])}"
            f"{', ...' if len(stale) > 3 else ''}); running the Python source. Reinstall "
            f"(pip install -e .) to compile it again.")


@dataclass(frozen=True)
class BuildChoice:
    build: CoreBuild
    from_source: tuple[str, ...] = ()  # compiled modules beside their .py to load from the .py instead
    # Modules to load from extension files outside the source tree (a checkout's build).
    from_build: tuple[tuple[str, Path], ...] = ()
    notice: str | None = None


def choose_build(sim_dir: Path, environ: Mapping[str, str], build_dir: Path | None = None) -> BuildChoice:
    """The decision of the module docstring for the ``kvtwin.sim`` package at ``sim_dir``;
    ``build_dir`` is where a checkout keeps its extensions (laid out as ``kvtwin.sim``),
    consulted only when none sit beside the sources."""
    beside = _extension_files(sim_dir)
    if beside:
        return _choose_beside(sim_dir, environ, _compiled_modules(beside))
    built = _extension_files(build_dir) if build_dir is not None else {}
    if _compiled_modules(built):
        return _choose_out_of_tree(sim_dir, environ, build_dir, built)
    return BuildChoice(CoreBuild(False, "installed without a C compiler (or with KVTWIN_PURE_PYTHON=1)"))


def _choose_beside(sim_dir: Path, environ: Mapping[str, str], modules: tuple[str, ...]) -> BuildChoice:
    """Extensions installed beside their sources (a wheel): Python would take them, so
    running the source means steering imports to the ``.py`` files."""
    if environ.get(ENV_SWITCH, "") not in ("", "0"):
        return BuildChoice(CoreBuild(False, f"{ENV_SWITCH} is set"), modules)
    stale = _stale_against(sim_dir, sim_dir, modules)
    if stale:
        return BuildChoice(CoreBuild(False, "compiled modules older than their source"), modules,
                           notice=_stale_notice(stale))
    return BuildChoice(CoreBuild(True, f"{len(modules)} modules"))


def _choose_out_of_tree(sim_dir: Path, environ: Mapping[str, str], build_dir: Path,
                        extensions: Mapping[str, Path]) -> BuildChoice:
    """Extensions in a checkout's build folder: Python finds only the sources, so running
    compiled means steering imports to the build."""
    modules = _compiled_modules(extensions)
    if environ.get(ENV_SWITCH, "") not in ("", "0"):
        return BuildChoice(CoreBuild(False, f"{ENV_SWITCH} is set"))
    stale = _stale_against(sim_dir, build_dir, modules)
    if stale:
        return BuildChoice(CoreBuild(False, "compiled modules older than their source"), notice=_stale_notice(stale))
    return BuildChoice(CoreBuild(True, f"{len(modules)} modules, built in {build_dir.parents[1]}"),
                       from_build=tuple(extensions.items()))


def select_build() -> CoreBuild:
    """Decide compiled or interpreted for this process, and make imports follow."""
    spec = importlib.util.find_spec("kvtwin.sim")
    if spec is None or not spec.submodule_search_locations:
        return CoreBuild(False, "kvtwin.sim not found")
    sim_dir = Path(next(iter(spec.submodule_search_locations)))
    choice = choose_build(sim_dir, os.environ, sim_dir.parent / CHECKOUT_BUILD_DIR / "kvtwin" / "sim")
    if choice.from_source:
        sys.meta_path.insert(0, _SourceFirstFinder(frozenset(choice.from_source)))
    if choice.from_build:
        sys.meta_path.insert(0, _BuildTreeFinder(dict(choice.from_build)))
    if choice.notice:
        print(choice.notice, file=sys.stderr)
    return choice.build
