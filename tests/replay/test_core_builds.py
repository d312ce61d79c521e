"""The compiled core and its Python source are one program: a replay run both ways writes
the same bytes, and a compiled module never runs in place of a changed source."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtwin import CORE_BUILD
from kvtwin._native import CHECKOUT_BUILD_DIR, ENV_SWITCH, MANIFEST_NAME, choose_build

REPO = Path(__file__).parents[2]


def _replay(out: Path, interpreted: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV_SWITCH: "1" if interpreted else "0"}
    return subprocess.run([sys.executable, "-c", "from kvtwin.cli import app; app()", "replay",
                           str(REPO / "scenarios" / "mooncake-llama8b-h100-overload.toml"), "--limit", "400",
                           "--quiet", "--no-report", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.skipif(not CORE_BUILD.compiled, reason=f"this run does not use the compiled core ({CORE_BUILD.reason})")
def test_compiled_and_interpreted_replays_write_the_same_bytes(tmp_path):
    runs = {}
    for interpreted in (False, True):
        out = tmp_path / ("interpreted" if interpreted else "compiled")
        done = _replay(out, interpreted)
        assert done.returncode == 0, done.stderr
        runs[interpreted] = {name: (out / name).read_bytes()
                             for name in ("steps.parquet", "requests.parquet", "summary.parquet")}
    assert len(runs[False]["steps.parquet"]) > 1000  # a replay that did something
    assert runs[False] == runs[True]


def _fake_install(tmp_path: Path, sources: dict[str, str], compiled: list[str]) -> Path:
    """A ``kvtwin.sim`` folder with these sources, extension files for ``compiled`` and a
    manifest of the sources as they are now."""
    sim = tmp_path / "sim"
    for relative, text in sources.items():
        (sim / relative).parent.mkdir(parents=True, exist_ok=True)
        (sim / relative).write_text(text)
    for relative in compiled:
        (sim / relative.replace(".py", ".cpython-311-x86_64-linux-gnu.so")).write_bytes(b"")
    (sim / "native__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    manifest = {f"kvtwin/sim/{r}": hashlib.sha256((sim / r).read_bytes()).hexdigest() for r in compiled}
    (sim / MANIFEST_NAME).write_text(json.dumps(manifest))
    return sim


def test_a_fresh_build_runs_compiled(tmp_path):
    sim = _fake_install(tmp_path, {"core/block_pool.py": "A = 1\n", "core/spec.py": "B = 2\n"}, ["core/block_pool.py"])
    choice = choose_build(sim, {})
    assert choice.build.compiled and not choice.from_source and choice.notice is None


def test_a_source_edited_after_the_build_runs_as_source_with_one_notice(tmp_path):
    sim = _fake_install(tmp_path, {"core/block_pool.py": "A = 1\n", "core/scheduler.py": "C = 3\n"},
                        ["core/block_pool.py", "core/scheduler.py"])
    (sim / "core" / "scheduler.py").write_text("C = 4\n")
    choice = choose_build(sim, {})
    assert not choice.build.compiled
    assert set(choice.from_source) == {"kvtwin.sim.core.block_pool", "kvtwin.sim.core.scheduler"}
    assert choice.notice.startswith("kvtwin: notice:") and "kvtwin.sim.core.scheduler" in choice.notice
    assert "kvtwin.sim.core.block_pool" not in choice.notice  # only the changed one is named


def test_compiled_modules_without_a_manifest_run_as_source(tmp_path):
    sim = _fake_install(tmp_path, {"core/block_pool.py": "A = 1\n"}, ["core/block_pool.py"])
    (sim / MANIFEST_NAME).unlink()
    choice = choose_build(sim, {})
    assert not choice.build.compiled and choice.from_source == ("kvtwin.sim.core.block_pool",)
    assert "no manifest" in choice.notice


def test_the_switch_runs_the_source_quietly(tmp_path):
    sim = _fake_install(tmp_path, {"core/block_pool.py": "A = 1\n"}, ["core/block_pool.py"])
    choice = choose_build(sim, {ENV_SWITCH: "1"})
    assert not choice.build.compiled and choice.from_source == ("kvtwin.sim.core.block_pool",)
    assert choice.notice is None
    assert choose_build(sim, {ENV_SWITCH: "0"}).build.compiled


def test_no_extensions_is_the_interpreted_install(tmp_path):
    sim = tmp_path / "sim"
    (sim / "core").mkdir(parents=True)
    (sim / "core" / "block_pool.py").write_text("A = 1\n")
    choice = choose_build(sim, {})
    assert not choice.build.compiled and not choice.from_source and choice.notice is None


def test_the_switch_makes_imports_take_the_source():
    env = {**os.environ, ENV_SWITCH: "1"}
    done = subprocess.run([sys.executable, "-c", "import kvtwin.sim.core.block_pool as m, kvtwin; "
                           "print(m.__file__); print(kvtwin.CORE_BUILD.compiled)"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    path, compiled = done.stdout.split()
    assert path.endswith("block_pool.py") and compiled == "False"


def test_an_extension_the_last_build_did_not_make_is_stale(tmp_path):
    sim = _fake_install(tmp_path, {"core/block_pool.py": "A = 1\n", "replay/workload.py": "W = 1\n"},
                        ["core/block_pool.py"])
    (sim / "replay" / "workload.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # from an older build
    choice = choose_build(sim, {})
    assert not choice.build.compiled and "kvtwin.sim.replay.workload" in choice.notice


# A checkout (editable install): the extensions live in build/native, never beside the sources.

def _fake_checkout(tmp_path: Path, sources: dict[str, str], compiled: list[str]) -> tuple[Path, Path]:
    """A checkout's ``sim`` folder with these sources, and its build folder holding
    extensions for ``compiled``, mypyc's group library and a manifest of the sources now."""
    sim = tmp_path / "sim"
    build = tmp_path / CHECKOUT_BUILD_DIR / "kvtwin" / "sim"
    for relative, text in sources.items():
        (sim / relative).parent.mkdir(parents=True, exist_ok=True)
        (sim / relative).write_text(text)
    for relative in compiled:
        (build / relative).parent.mkdir(parents=True, exist_ok=True)
        (build / relative.replace(".py", ".cpython-311-x86_64-linux-gnu.so")).write_bytes(b"")
    (build / "native__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    manifest = {f"kvtwin/sim/{r}": hashlib.sha256((sim / r).read_bytes()).hexdigest() for r in compiled}
    (build / MANIFEST_NAME).write_text(json.dumps(manifest))
    return sim, build


def test_a_fresh_checkout_build_loads_from_the_build_folder(tmp_path):
    sim, build = _fake_checkout(tmp_path, {"core/block_pool.py": "A = 1\n", "core/spec.py": "B = 2\n"},
                                ["core/block_pool.py"])
    choice = choose_build(sim, {}, build)
    assert choice.build.compiled and choice.notice is None and not choice.from_source
    assert dict(choice.from_build) == {
        "kvtwin.sim.core.block_pool": build / "core" / "block_pool.cpython-311-x86_64-linux-gnu.so",
        "kvtwin.sim.native__mypyc": build / "native__mypyc.cpython-311-x86_64-linux-gnu.so"}


def test_a_checkout_source_edited_after_the_build_runs_as_source_with_one_notice(tmp_path):
    sim, build = _fake_checkout(tmp_path, {"core/block_pool.py": "A = 1\n", "core/scheduler.py": "C = 3\n"},
                                ["core/block_pool.py", "core/scheduler.py"])
    (sim / "core" / "scheduler.py").write_text("C = 4\n")
    choice = choose_build(sim, {}, build)
    assert not choice.build.compiled and not choice.from_build and not choice.from_source
    assert choice.notice.startswith("kvtwin: notice:") and "kvtwin.sim.core.scheduler" in choice.notice
    assert "kvtwin.sim.core.block_pool" not in choice.notice


def test_a_checkout_build_without_a_manifest_or_with_the_switch_runs_as_source(tmp_path):
    sim, build = _fake_checkout(tmp_path, {"core/block_pool.py": "A = 1\n"}, ["core/block_pool.py"])
    quiet = choose_build(sim, {ENV_SWITCH: "1"}, build)
    assert not quiet.build.compiled and not quiet.from_build and quiet.notice is None
    (build / MANIFEST_NAME).unlink()
    choice = choose_build(sim, {}, build)
    assert not choice.build.compiled and not choice.from_build and "no manifest" in choice.notice


def test_extensions_beside_the_sources_win_over_a_build_folder(tmp_path):
    """A wheel's layout; a build folder next to it is not consulted."""
    sim, build = _fake_checkout(tmp_path, {"core/block_pool.py": "A = 1\n"}, ["core/block_pool.py"])
    (sim / "core" / "block_pool.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (sim / MANIFEST_NAME).write_text((build / MANIFEST_NAME).read_text())
    choice = choose_build(sim, {}, build)
    assert choice.build.compiled and not choice.from_build


def test_the_checkout_holds_no_extensions_beside_its_sources():
    suffixes = (".so", ".pyd")
    beside = [p for folder in ("sim", "kvtwin") for p in (REPO / folder).rglob("*") if p.name.endswith(suffixes)]
    assert not beside and not (REPO / "sim" / MANIFEST_NAME).exists()


@pytest.mark.skipif(not CORE_BUILD.compiled, reason=f"this run does not use the compiled core ({CORE_BUILD.reason})")
def test_compiled_modules_and_the_group_library_load_from_outside_the_sources():
    done = subprocess.run([sys.executable, "-c", "import sys, kvtwin.sim.core.block_pool as m; "
                           "print(m.__file__); print(sys.modules['kvtwin.sim.native__mypyc'].__file__)"],
                          capture_output=True, text=True, env={**os.environ, ENV_SWITCH: "0"}, timeout=120)
    assert done.returncode == 0, done.stderr
    module, group = map(Path, done.stdout.split())
    assert module.name.startswith("block_pool.") and not module.name.endswith(".py")
    assert group.name.startswith("native__mypyc.")
    assert REPO / "sim" not in module.parents and REPO / "sim" not in group.parents
