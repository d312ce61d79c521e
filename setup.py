"""Build hook: compile the simulator's hot modules with mypyc, from the same Python source.

Everything else about the package lives in ``pyproject.toml``. The Python files stay the
source of truth and are installed either way.

* The build needs mypy (a build requirement) and a working C compiler. Without either,
  or with ``KVTWIN_PURE_PYTHON=1`` set, it installs the interpreted modules and prints one
  notice. ``kvtwin version`` says which core a machine runs.
* The repository maps ``kvtwin.sim`` onto the top-level ``sim/`` folder, while mypyc names a
  module after the folders above it. So the compiled files are first copied into a staging
  tree laid out as the installed package (``build/mypyc-src/kvtwin/sim/...``).
* Where the extension modules go:

  - a wheel (``pip wheel .``, ``pip install .``) carries them inside the package, beside
    the sources, where Python imports an extension before a source file of the same name;
  - an editable install (``pip install -e .``) builds them out of the source tree, into
    ``build/native/kvtwin/sim/...`` (ignored by git), so a checkout never holds ``.so``
    files beside its sources. ``kvtwin._native`` loads them from there, mypyc's group
    library (``kvtwin.sim.native__mypyc``) included. Extensions an older build left beside
    the sources are removed.

* A manifest of the compiled sources' SHA-256 is written beside the shared library.
  ``kvtwin._native`` reads it at import and falls back to the interpreted modules when a
  source has changed since the build (an editable install edited in place), so a stale
  extension never runs in place of the code on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
STAGE = ROOT / "build" / "mypyc-src"
# An editable install's extensions, laid out as the installed package; kvtwin/_native.py
# (CHECKOUT_BUILD_DIR) looks for them here.
NATIVE = ROOT / "build" / "native"
MANIFEST_NAME = "native_manifest.json"  # read by kvtwin/_native.py

# The modules worth compiling: the KV core and scheduler (every step runs through them)
# and the replay's per-step loop. Package ``__init__`` files stay interpreted.
COMPILED_PACKAGES = {"sim/core": "kvtwin/sim/core", "sim/core/offload": "kvtwin/sim/core/offload",
                     "sim/replay": "kvtwin/sim/replay", "sim/replay/clock": "kvtwin/sim/replay/clock"}
# Off the per-step path (validation, config, sweeps, calibration): compiling them buys nothing.
INTERPRETED = {"spec.py", "config.py", "errors.py", "__init__.py",
               "client_side.py", "reuse_curve.py",
               # The column sets and the tables' assembly: once per run.
               "output_columns.py", "run_tables.py",
               "rate_search.py", "capacity_points.py", "capacity_sweep.py", "capacity_table.py", "sweep_backends.py",
               "summaries.py", "sustained.py", "load_curve.py", "trace_requests.py", "router.py",
               # Each replica's connector tier: built once per run.
               "connector_tiers.py",
               # The SimPy clock's generator processes: compiled, they crash the garbage
               # collector (mypy 2.4.1). Its per-batch objects (cluster.py, replica.py,
               # timeline.py, progress.py) are compiled.
               "arrivals.py", "engine_processes.py", "dp_group.py", "dp_async.py",
               # A DP plan's wiring: once per run.
               "data_parallel.py",
               # P/D: the front's generator process (pd_front.py), its summaries and router.
               "pd_front.py", "pd_summaries.py", "pd_router.py",
               # P/D sides as DP engines: wired once per run.
               "pd_sides.py"}


def _notice(message: str) -> None:
    print(f"kvtwin: notice: {message}", file=sys.stderr)


def _compiled_sources() -> dict[str, Path]:
    """Installed module path (``kvtwin/sim/core/block_pool.py``) → source file."""
    sources: dict[str, Path] = {}
    for folder, target in COMPILED_PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name not in INTERPRETED:
                sources[f"{target}/{path.name}"] = path
    return sources


def _compiler_works() -> bool:
    """Whether a C file that includes Python.h compiles here (a compiler and the headers)."""
    from setuptools._distutils import ccompiler, sysconfig

    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.c"
        probe.write_text("#include <Python.h>\nint kvtwin_probe(void) { return 0; }\n")
        try:
            compiler = ccompiler.new_compiler()
            sysconfig.customize_compiler(compiler)
            compiler.compile([str(probe)], output_dir=tmp, include_dirs=[sysconfig.get_python_inc()])
        except Exception:  # whichever distutils raises it: no working compiler either way
            return False
    return True


def _stage(sources: dict[str, Path]) -> list[str]:
    """Copy the compiled packages into a tree shaped like the installed package (every
    module of them, so the compiled ones see the types of those left interpreted);
    returns the staged paths of the modules to compile."""
    shutil.rmtree(STAGE, ignore_errors=True)
    for folder, target in COMPILED_PACKAGES.items():
        (STAGE / target).mkdir(parents=True, exist_ok=True)
        for path in (ROOT / folder).glob("*.py"):
            shutil.copyfile(path, STAGE / target / path.name)
    for target in sources:
        for parent in Path(target).parents:
            if str(parent) != ".":
                (STAGE / parent / "__init__.py").touch(exist_ok=True)
    return sorted(sources)


def _native_extensions() -> list:
    if os.environ.get("KVTWIN_PURE_PYTHON", "") not in ("", "0"):
        _notice("KVTWIN_PURE_PYTHON is set; installing the interpreted core")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _notice("mypy is not installed in the build environment; installing the interpreted core")
        return []
    if not _compiler_works():
        _notice("no working C compiler; installing the interpreted core (replays run about 2x slower)")
        return []
    staged = _stage(_compiled_sources())
    cwd = os.getcwd()
    os.chdir(STAGE)  # mypyc derives module names from paths relative to here
    try:
        # Third-party packages are typed as Any whatever the build environment has
        # installed (--no-site-packages), so every environment compiles the same code.
        return mypycify(staged + ["--ignore-missing-imports", "--follow-imports=silent", "--no-site-packages",
                                  "--disable-error-code=annotation-unchecked"],
                        opt_level="3", debug_level="0", group_name="kvtwin.sim.native",
                        target_dir=str(ROOT / "build" / "mypyc-c"))
    finally:
        os.chdir(cwd)


class BuildNative(build_ext):
    """``build_ext`` that also writes the source manifest beside the shared library, and
    puts an editable install's extensions under ``build/native`` instead of beside the
    sources."""

    def run(self) -> None:
        package_dir = self._sim_package_dir()
        if self.inplace:
            _remove_extensions_beside_sources()
        self._remove_stale_extensions(package_dir)
        super().run()
        if not self.extensions:
            return
        manifest = {target: hashlib.sha256(source.read_bytes()).hexdigest()
                    for target, source in _compiled_sources().items()}
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")

    def _get_inplace_equivalent(self, build_py, ext) -> tuple[str, str]:
        """Where ``--inplace`` (an editable install) copies an extension: under
        ``build/native``, never into the package folder (setuptools' choice)."""
        _, regular_file = super()._get_inplace_equivalent(build_py, ext)
        target = NATIVE / self.get_ext_filename(self.get_ext_fullname(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        return str(target), regular_file

    def _sim_package_dir(self) -> Path:
        if self.inplace:
            return NATIVE / "kvtwin" / "sim"
        return Path(self.build_lib) / "kvtwin" / "sim"

    def _remove_stale_extensions(self, package_dir: Path) -> None:
        """Extensions an earlier build left that this one does not make (a module taken off
        the list): a wheel must not ship them, nor an editable install keep them."""
        wanted = {ext.name for ext in self.extensions}
        for path in _extensions_under(package_dir):
            module = path.relative_to(package_dir).with_name(path.name.split(".", 1)[0])
            if "kvtwin.sim." + ".".join(module.parts) not in wanted:
                path.unlink()


def _extensions_under(folder: Path) -> list[Path]:
    suffixes = tuple(EXTENSION_SUFFIXES)
    return [path for path in folder.rglob("*") if path.name.endswith(suffixes)] if folder.is_dir() else []


def _remove_extensions_beside_sources() -> None:
    """An editable build from before ``build/native`` left its extensions and manifest in
    the source folders, where they would shadow the sources: remove them."""
    for path in _extensions_under(ROOT / "sim"):
        path.unlink()
    (ROOT / "sim" / MANIFEST_NAME).unlink(missing_ok=True)


# pip runs this file for its metadata hooks too; compile (and say so) only when building.
_BUILDING = bool({"bdist_wheel", "editable_wheel", "build_ext", "build", "install", "develop"} & set(sys.argv[1:]))

_EXTENSIONS = _native_extensions() if _BUILDING else []
if not _EXTENSIONS and "editable_wheel" in sys.argv[1:]:
    # An interpreted editable install: no build_ext runs to clear an earlier compiled build,
    # which kvtwin._native would otherwise still load.
    shutil.rmtree(NATIVE, ignore_errors=True)
    _remove_extensions_beside_sources()
setup(ext_modules=_EXTENSIONS, cmdclass={"build_ext": BuildNative})
