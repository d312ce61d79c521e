"""The scenarios kvtwin ships (``scenarios/``, package data), by name.

``kvtwin scenarios`` lists them, and every command that takes a scenario file accepts a
bundled one's name instead (``kvtwin replay azure-conv-llama8b``, with or without
``.toml``), from any directory: an installed kvtwin has no ``scenarios/`` folder beside
the user's files. A path that exists always wins over a name.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.core.errors import ConfigError


@dataclass(frozen=True)
class BundledScenario:
    name: str
    path: Path
    description: str


def _description(path: Path) -> str:
    """The file's ``description``, else its first comment line: every file opens with one."""
    text = path.read_text()
    try:
        described = tomllib.loads(text).get("description")
    except tomllib.TOMLDecodeError:
        described = None
    if described:
        return str(described)
    for line in text.splitlines():
        if line.startswith("#") and line.lstrip("# ").strip():
            return line.lstrip("# ").strip()
    return ""


def bundled_scenarios() -> list[BundledScenario]:
    """Every bundled scenario, by name (the file's stem)."""
    return [BundledScenario(path.stem, path, _description(path)) for path in sorted(SCENARIOS_DIR.glob("*.toml"))]


def bundled_names() -> list[str]:
    return sorted(path.stem for path in SCENARIOS_DIR.glob("*.toml"))


def find_scenario(given: str | os.PathLike | None, field: str = "SCENARIO.toml") -> Path | None:
    """The scenario file ``given`` names: itself where it is a file, else the bundled scenario
    of that name (a bare name only: a path with a folder in it names a file of the user's);
    None when none was given. Anything else is one ``ConfigError`` listing the names."""
    if given is None:
        return None
    path = Path(given)
    if path.is_file():
        return path
    text = os.fspath(given)
    if path.name == text:
        # A folder of that name (a run directory called after its scenario) is no scenario file.
        bundled = SCENARIOS_DIR / f"{text.removesuffix('.toml')}.toml"
        if bundled.is_file():
            return bundled
    if path.exists():
        return path  # not a file: the reader says what it is
    raise ConfigError(field, f"an existing scenario file or a bundled scenario's name "
                             f"({', '.join(bundled_names())}; kvtwin scenarios)", text)
