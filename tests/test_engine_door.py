"""One door into the engine: nothing outside ``sim/core`` reads an engine's connector parts.

An engine holds one connector tier (``sim/core/connector_tier.py``;
docs/architecture.md#a-new-kv-connector) and answers the clocks through its own methods
(``next_transfer_event_s``, ``waits_for_transfers``) and its batch records' ``stats``. Code that built a
tier keeps its own reference to it. This test parses every Python file of the repository
outside ``sim/core`` and fails on any access to an attribute ``offload``, ``pd`` or
``transfers`` of something called ``engine`` (a name ``engine`` or ``*_engine``, an
attribute ``x.engine``, an item of ``engines``): the attributes the engine once exposed
for its two connectors, each read from outside being a feature reaching past the core.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]["kvtwin.sim"] / "core"
FORBIDDEN = frozenset({"offload", "pd", "transfers"})
# Not the repository's code: virtual environments (CI makes ``.ci/venv``), builds, caches.
SKIPPED_DIRS = {".venv", ".ci", "build", ".git", "node_modules", "site-packages", "__pycache__"}


def _is_engine(node: ast.expr) -> bool:
    """Whether ``node`` names an engine: ``engine``, ``prefill_engine``, ``replica.engine``,
    ``self.engine``, ``engines[i]``."""
    if isinstance(node, ast.Name):
        return node.id == "engine" or node.id.endswith("_engine")
    if isinstance(node, ast.Attribute):
        return node.attr == "engine" or node.attr.endswith("_engine")
    if isinstance(node, ast.Subscript):
        value = node.value
        return (isinstance(value, ast.Name) and value.id.endswith("engines")) or \
            (isinstance(value, ast.Attribute) and value.attr.endswith("engines"))
    return False


def engine_reads(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, ``engine.attr``) for each access to a forbidden attribute of an engine."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN and _is_engine(node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


def _files_outside_core() -> list[Path]:
    files = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if SKIPPED_DIRS.intersection(rel.parts) or path.is_relative_to(CORE):
            continue
        files.append(path)
    return files


def test_the_detector_finds_each_kind_of_read() -> None:
    source = ("a = engine.pd\n"
              "b = self.engine.offload.manager\n"
              "replica.engine.transfers.on_read = f\n"
              "c = prefill_engine.pd\n"
              "d = engines[0].transfers\n"
              "e = result.transfers\n"  # a step result's report: not the engine's
              "f = engine.make_stats().offload_counters\n"
              "g = engine.scheduler\n")
    assert engine_reads(source) == [(1, "engine.pd"), (2, "self.engine.offload"),
                                    (3, "replica.engine.transfers"), (4, "prefill_engine.pd"),
                                    (5, "engines[0].transfers")]


def test_the_scan_covers_the_clocks_and_the_runner() -> None:
    # The modules that read the engine's connector parts before the slot: if the scan
    # skipped them, the test below could not fail.
    scanned = {p.relative_to(REPO).as_posix() for p in _files_outside_core()}
    assert {"sim/replay/clock/replica.py", "sim/replay/clock/engine_processes.py",
            "sim/replay/clock/pd_front.py", "sim/lockstep/runner.py", "tests/replay/test_pd.py"} <= scanned
    assert not any(name.startswith("sim/core/") for name in scanned)


def test_nothing_outside_the_core_reads_an_engines_connector_parts() -> None:
    found = [f"{path.relative_to(REPO)}:{line}: {what}"
             for path in _files_outside_core() if path != Path(__file__).resolve()
             for line, what in engine_reads(path.read_text(), str(path))]
    assert not found, "read the engine through its methods, or keep the tier you built:\n" + "\n".join(found)


# The replay's clocks and routers, the executor and the commands reach the engine through its
# own methods only; the step-clock harness (``sim/lockstep``) and the tests mirror vLLM's
# internal state on purpose and are not held to this.
CLIENT_DIRS = ("sim/replay", "sim/scenario", "sim/planner", "sim/calibration", "executor", "kvtwin", "reports")
INTERNALS = frozenset({"scheduler", "kv_cache_manager", "batch_queue"})
# ``plan.engine`` is the planned engine config, not an ``EngineCore``.
CONFIG_HOLDERS = frozenset({"plan", "planned", "eng"})


def internal_reads(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, ``engine.attr``) for each read of an engine's scheduler, KV cache manager or
    batch queue."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS and _is_engine(node.value):
            holder = node.value.value if isinstance(node.value, ast.Attribute) else None
            base = holder.attr if isinstance(holder, ast.Attribute) else holder.id if isinstance(holder, ast.Name) else None
            if base in CONFIG_HOLDERS:
                continue
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


def test_the_internals_detector_finds_what_the_replay_used_to_read() -> None:
    source = ("a = replica.engine.scheduler.config.async_scheduling\n"
              "b = self.engine.kv_cache_manager.coordinator\n"
              "c = [engine.kv_cache_manager.block_pool for engine in engines]\n"
              "d = r.engine.scheduler.connector_state.delayed_free\n"
              "e = plan.engine.scheduler.num_speculative_tokens\n"
              "f = self.planned.engine.scheduler\n")
    assert internal_reads(source) == [(1, "replica.engine.scheduler"), (2, "self.engine.kv_cache_manager"),
                                      (3, "engine.kv_cache_manager"), (4, "r.engine.scheduler")]


def test_no_client_of_the_engine_reads_its_parts() -> None:
    breaches = []
    for folder in CLIENT_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            breaches += [f"{path.relative_to(REPO)}:{line}: {what}"
                         for line, what in internal_reads(path.read_text(), str(path))]
    assert not breaches, "\n".join(breaches)
