"""How well the tests pin what users read: apply small, realistic bugs (mutants) one at a
time to a scratch copy of the checkout and run the tests that should catch each.

The mutants live in ``bench/mutants/<area>.toml``, one file per area of the code (the
file's stem is the area's name). Each entry is one bug::

    [[mutant]]
    name = "summary-p99-at-p90"            # unique across all files
    path = "sim/replay/summaries.py"       # the file it changes, from the repository root
    find = "percentile(values, 99)"        # text that occurs exactly once in that file
    replace = "percentile(values, 90)"
    tests = ["tests/replay/test_summary_oracle.py", "tests/replay/test_replay.py"]
    # equivalent = "why no output can change"   (listed with its reason, never run)

``tests`` names the test files (or node ids) that cover the code the mutant changes: the
ones that existed before a new oracle, and the oracle. A mutant is *caught* when those
tests fail (or error, or time out); it *survives* when they pass. Grow the list with every
new module that computes something a user reads.

    python bench/mutation.py [--area AREA ...] [--name NAME ...] [--jobs N]
                             [--tests-ref REV] [--timeout-s S] [--json OUT] [--list]

``--tests-ref`` runs the current source's mutants against the tests of an earlier commit
(test files the commit lacks are left out of each selection): the score *before* a
change to the tests. The tests run on the interpreted core (``KVTWIN_INTERPRETED=1``),
since a mutant changes Python source the compiled core was not built from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS_DIR = ROOT / "bench" / "mutants"
FIELDS = {"name", "path", "find", "replace", "tests", "equivalent"}


@dataclass(frozen=True)
class Mutant:
    area: str
    name: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]
    equivalent: str | None


@dataclass(frozen=True)
class Result:
    mutant: Mutant
    outcome: str  # caught, survived, no tests, equivalent
    detail: str
    wall_s: float


def load_mutants(directory: Path = MUTANTS_DIR) -> list[Mutant]:
    """Every mutant, checked: known fields, a unique name, ``find`` once in its file."""
    mutants: list[Mutant] = []
    seen: dict[str, Path] = {}
    for file in sorted(directory.glob("*.toml")):
        entries = tomllib.loads(file.read_text()).get("mutant", [])
        for index, entry in enumerate(entries):
            where = f"bench/mutants/{file.name}: mutant #{index + 1}"
            unknown = set(entry) - FIELDS
            missing = {"name", "path", "find", "replace", "tests"} - set(entry)
            if unknown or missing:
                raise SystemExit(f"mutation: {where}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
            name = entry["name"]
            if name in seen:
                raise SystemExit(f"mutation: {where}: name {name!r} already used in {seen[name].name}")
            seen[name] = file
            source = ROOT / entry["path"]
            if not source.is_file():
                raise SystemExit(f"mutation: {where} ({name}): no file {entry['path']}")
            count = source.read_text().count(entry["find"])
            if count != 1:
                raise SystemExit(f"mutation: {where} ({name}): `find` occurs {count} times in {entry['path']}, expected once")
            if entry["find"] == entry["replace"]:
                raise SystemExit(f"mutation: {where} ({name}): `replace` equals `find`")
            mutants.append(Mutant(area=file.stem, name=name, path=entry["path"], find=entry["find"],
                                  replace=entry["replace"], tests=tuple(entry["tests"]),
                                  equivalent=entry.get("equivalent")))
    return mutants


def _package_dirs() -> dict[str, str]:
    """The installed package name → its folder in the checkout (pyproject's package-dir)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def make_scratch(parent: Path, tests_ref: str | None) -> Path:
    """A copy of the checkout's files (tracked and untracked, not ignored) that imports as
    ``kvtwin`` from itself, ahead of the editable install (PYTHONPATH)."""
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=parent))
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = scratch / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if tests_ref is not None:
        shutil.rmtree(scratch / "tests")
        archive = subprocess.run(["git", "archive", tests_ref, "tests"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
    # The package's other folders, linked into its own folder as the installed layout has
    # them: a test run from the scratch copy imports kvtwin from there before anything else.
    dirs = _package_dirs()
    for package, folder in dirs.items():
        if package != "kvtwin":
            (scratch / dirs["kvtwin"] / package.removeprefix("kvtwin.")).symlink_to(scratch / folder)
    return scratch


def _env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch)
    env["KVTWIN_INTERPRETED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _selection(scratch: Path, tests: tuple[str, ...]) -> list[str]:
    return [test for test in tests if (scratch / test.split("::")[0]).exists()]


def _pytest(scratch: Path, tests: list[str], timeout_s: float) -> tuple[int | None, str]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(command, cwd=scratch, env=_env(scratch), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else done.stderr.strip()[-200:]


def check_scratch(scratch: Path) -> None:
    """The scratch copy must import as kvtwin from itself, on the interpreted core."""
    probe = "import kvtwin, kvtwin.sim.core.engine as e; print(e.__file__); print(kvtwin.CORE_BUILD.compiled)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=scratch, env=_env(scratch), capture_output=True,
                         text=True, check=True).stdout.split()
    if not out[0].startswith(str(scratch)) or out[1] != "False":
        raise SystemExit(f"mutation: the scratch copy imports kvtwin from {out[0]} (compiled {out[1]})")


def run_mutant(scratch: Path, mutant: Mutant, timeout_s: float) -> Result:
    tests = _selection(scratch, mutant.tests)
    if not tests:
        return Result(mutant, "no tests", "none of its test files exist here", 0.0)
    source = scratch / mutant.path
    original = source.read_text()
    source.write_text(original.replace(mutant.find, mutant.replace, 1))
    start = time.perf_counter()
    try:
        code, last = _pytest(scratch, tests, timeout_s)
    finally:
        source.write_text(original)
    wall_s = time.perf_counter() - start
    if code == 0:
        return Result(mutant, "survived", last, wall_s)
    if code == 5:
        return Result(mutant, "no tests", last, wall_s)
    return Result(mutant, "caught", last if code is not None else "timed out", wall_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--area", action="append", help="only this area (a file stem in bench/mutants)")
    parser.add_argument("--name", action="append", help="only this mutant")
    parser.add_argument("--jobs", type=int, default=1, help="scratch copies testing mutants at once")
    parser.add_argument("--tests-ref", help="run against the tests of this commit (the score before)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per mutant")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    args = parser.parse_args(argv)

    mutants = load_mutants()
    if args.area:
        mutants = [m for m in mutants if m.area in args.area]
    if args.name:
        mutants = [m for m in mutants if m.name in args.name]
    if args.list:
        for mutant in mutants:
            flag = f"  (equivalent: {mutant.equivalent})" if mutant.equivalent else ""
            print(f"{mutant.area:<14} {mutant.name:<48} {mutant.path}{flag}")
        return 0
    to_run = [m for m in mutants if m.equivalent is None]
    results: list[Result] = [Result(m, "equivalent", m.equivalent or "", 0.0) for m in mutants if m.equivalent]

    parent = Path(tempfile.mkdtemp(prefix="kvtwin-mutation-"))
    try:
        jobs = max(1, min(args.jobs, len(to_run) or 1))
        scratches = [make_scratch(parent, args.tests_ref) for _ in range(jobs)]
        check_scratch(scratches[0])
        # Every selection must pass unmutated, or a failure would say nothing about a mutant.
        union = sorted({t for m in to_run for t in _selection(scratches[0], m.tests)})
        code, last = _pytest(scratches[0], union, args.timeout_s * 4) if union else (0, "")
        if code != 0:
            raise SystemExit(f"mutation: the unmutated tests do not pass ({' '.join(union)}): {last}")
        free = list(scratches)
        lock = threading.Lock()
        done_count = [0]

        def work(mutant: Mutant) -> Result:
            with lock:
                scratch = free.pop()
            try:
                result = run_mutant(scratch, mutant, args.timeout_s)
            finally:
                with lock:
                    free.append(scratch)
                    done_count[0] += 1
                    print(f"[{done_count[0]}/{len(to_run)}] {result.outcome:<9} {mutant.area}/{mutant.name}"
                          f" ({result.wall_s:.0f} s)", file=sys.stderr, flush=True)
            return result

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results += list(pool.map(work, to_run))
    finally:
        shutil.rmtree(parent, ignore_errors=True)

    print_scores(results, args.tests_ref)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{"area": r.mutant.area, "name": r.mutant.name, "outcome": r.outcome,
                                          "detail": r.detail, "wall_s": round(r.wall_s, 1)} for r in results],
                                         indent=1))
    return 0


def print_scores(results: list[Result], tests_ref: str | None) -> None:
    by_area: dict[str, list[Result]] = defaultdict(list)
    for result in results:
        by_area[result.mutant.area].append(result)
    against = f"the tests of {tests_ref}" if tests_ref else "the tests in the checkout"
    print(f"mutation score against {against} (equivalent mutants listed apart)")
    print(f"{'area':<16}{'caught':>8}{'of':>5}{'equivalent':>12}")
    total_caught = total_run = 0
    for area in sorted(by_area):
        rows = by_area[area]
        run = [r for r in rows if r.outcome != "equivalent"]
        caught = sum(r.outcome == "caught" for r in run)
        total_caught += caught
        total_run += len(run)
        print(f"{area:<16}{caught:>8}{len(run):>5}{len(rows) - len(run):>12}")
    print(f"{'all':<16}{total_caught:>8}{total_run:>5}")
    for result in sorted(results, key=lambda r: (r.mutant.area, r.mutant.name)):
        if result.outcome in ("survived", "no tests"):
            print(f"  {result.outcome}: {result.mutant.area}/{result.mutant.name}: {result.detail}")
        elif result.outcome == "equivalent":
            print(f"  equivalent: {result.mutant.area}/{result.mutant.name}: {result.detail}")


if __name__ == "__main__":
    raise SystemExit(main())
