"""Where outputs may go, checked before any long work starts.

A bad ``--out`` must fail in the first second with one line, not as a traceback after an
hour of simulation. The checks probe the file system for real (creating and removing an
empty temporary directory) because permission bits say nothing when running as root, and
pseudo file systems such as ``/proc`` refuse writes that ``os.access`` allows.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError

# What kvtwin itself puts in a run or sweep directory. A directory holding anything else is
# not replaced, because replacing a run directory removes the previous one whole.
RUN_DIR_FILES = frozenset({"requests.parquet", "steps.parquet", "summary.parquet", "plan.json", "replicas.parquet",
                           "capacity.parquet", "hit_curve.parquet", "report.html",
                           "validation.parquet", "calibration.toml", "diff.parquet", "diff.html"})
# The files that make a directory a replay run directory, and a capacity (sweep) directory,
# for ``kvtwin report`` and ``kvtwin diff``.
REPLAY_FILES = ("requests.parquet", "steps.parquet", "summary.parquet", "plan.json")
CAPACITY_FILES = ("capacity.parquet",)


def _is_run_output(entry: Path) -> bool:
    name = entry.name
    # Temporary names are what an older, killed run may have left behind.
    return entry.is_file() and (name in RUN_DIR_FILES or name.endswith(".png")
                                or (name.startswith(".") and ".tmp" in name))


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _kind(path: Path) -> str:
    return "a file" if path.is_file() else "a device or other special file"


def _probe_writable(directory: Path, flag: str, path: Path) -> None:
    try:
        probe = tempfile.mkdtemp(prefix=".kvtwin-probe-", dir=directory)
    except OSError as err:
        raise ConfigError(flag, f"a location kvtwin can write (creating a file in {directory} fails: "
                                f"{err.strerror})", str(path)) from None
    os.rmdir(probe)


def _check_parent(path: Path, flag: str) -> None:
    ancestor = _nearest_existing(path.parent)
    if not ancestor.is_dir():
        raise ConfigError(flag, f"a path under a directory ({ancestor} is {_kind(ancestor)})", str(path))
    _probe_writable(ancestor, flag, path)


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> None:
    """Raise ``ConfigError`` unless a run directory can be written at ``path``.

    ``path`` may be missing (it is created), an empty directory, or a previous run
    directory (it is replaced whole, so it may hold only what kvtwin writes there).
    """
    path = Path(path)
    if not path.exists():
        _check_parent(path, flag)
        return
    if not path.is_dir():
        raise ConfigError(flag, f"a directory for the run, not {_kind(path)}", str(path))
    foreign = sorted(entry.name for entry in path.iterdir() if not _is_run_output(entry))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(flag, f"a new or empty directory or a previous run directory, which is replaced whole "
                                f"(this one also holds {shown})", str(path))
    # Replacing the directory renames it inside its parent.
    _probe_writable(path.resolve().parent, flag, path)


def check_out_file(path: str | os.PathLike, flag: str = "--output") -> None:
    """Raise ``ConfigError`` unless a file can be written (via a temp name and a rename) at ``path``."""
    path = Path(path)
    if path.exists():
        if path.is_dir():
            raise ConfigError(flag, "a file path, not a directory", str(path))
        if not path.is_file():
            # A rename over /dev/null would replace the device itself.
            raise ConfigError(flag, f"a regular file path, not {_kind(path)}", str(path))
    _check_parent(path, flag)
