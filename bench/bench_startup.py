"""How long a person waits for the `kvtwin` command line to answer (issue 25, part 3).

Times, each in a fresh process (the installed ``kvtwin`` script), best and median of
``--repeats`` runs:

* ``kvtwin --help``;
* ``kvtwin plan --scenario scenarios/default.toml``;
* ``kvtwin replay scenarios/default.toml --limit 10 --no-report`` into a temporary folder;
* ``kvtwin report`` on that run directory.

The reference loop (``bench/reference_loop.py``) is timed in the same run, before and
after, and each figure is also given as a ratio to it: the machines are shared, and a
ratio moves less than wall seconds do. One more run of each command with
``PYTHONPROFILEIMPORTTIME=1`` (``python -X importtime``) says where its import time goes:
the sum over the modules the command imported at the top level, the heaviest of them,
and which of the heavy libraries (pyarrow, pandas, numpy, matplotlib, simpy, ...) it
loaded at all. Prints a table and writes ``bench/out/startup.parquet`` (``$OUT`` if set).

    python bench/bench_startup.py [--repeats 7]

Timings, not assertions: ``tests/test_lazy_imports.py`` pins which libraries each
command may load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from reference_loop import reference_seconds  # noqa: E402  (a sibling script, not a package)

DEFAULT_SCENARIO = ROOT / "scenarios" / "default.toml"
# The libraries whose import a command should pay for only when it uses them. pydantic
# is typer's (0.29 and later), loaded when a command's options are read.
HEAVY = ("pyarrow", "pandas", "numpy", "matplotlib", "simpy", "torch", "triton", "ray", "rich", "typer", "pydantic")
TOP_IMPORTS = 5


def _kvtwin() -> list[str]:
    """The installed console script beside this interpreter (what a person runs)."""
    script = Path(sys.executable).parent / "kvtwin"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvtwin.cli"]


def _commands(run_dir: Path) -> list[tuple[str, list[str]]]:
    scenario = str(DEFAULT_SCENARIO)
    return [
        ("--help", ["--help"]),
        ("plan", ["plan", "--scenario", scenario]),
        ("replay --limit 10", ["replay", scenario, "--limit", "10", "--no-report", "--quiet", "--out", str(run_dir)]),
        ("report", ["report", str(run_dir)]),
    ]


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"bench_startup: {' '.join(argv)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return result


def _wall_s(argv: list[str], env: dict[str, str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        _run(argv, env)
        times.append(time.perf_counter() - started)
    return times


def parse_importtime(stderr: str) -> tuple[float, list[tuple[str, float]], list[str]]:
    """From ``-X importtime`` lines: the summed cumulative milliseconds of the top-level
    imports, the heaviest top-level imports (name, ms), and the heavy libraries loaded."""
    top: list[tuple[str, float]] = []
    # A failed import prints its line too (pyarrow tries ``import pandas`` where pandas is
    # not installed): a library counts as loaded once one of its submodules was imported,
    # as each of HEAVY's imports some on the way in.
    loaded: set[str] = set()
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "[us]" in line:
            continue
        _, cumulative, name = line.split("|")
        module = name.strip()
        if "." in module:
            loaded.add(module.split(".")[0])
        if name.startswith(" ") and not name.startswith("  "):  # depth 0: imported by the command itself
            top.append((module, int(cumulative) / 1000))
    top.sort(key=lambda item: -item[1])
    return sum(ms for _, ms in top), top[:TOP_IMPORTS], sorted(loaded & set(HEAVY))


def _import_profile(argv: list[str], env: dict[str, str]) -> tuple[float, list[tuple[str, float]], list[str]]:
    return parse_importtime(_run(argv, {**env, "PYTHONPROFILEIMPORTTIME": "1"}).stderr)


def measure(repeats: int) -> list[dict]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    kvtwin = _kvtwin()
    work = Path(tempfile.mkdtemp(prefix="kvtwin-startup-"))
    try:
        reference_before_s = reference_seconds()
        rows = []
        for name, args in _commands(work / "run"):
            _run(kvtwin + ["--help"], env)  # warm the file cache and .pyc files once
            times = _wall_s(kvtwin + args, env, repeats)
            import_ms, top, loaded = _import_profile(kvtwin + args, env)
            rows.append({"command": name, "argv": " ".join(["kvtwin", *args]), "repeats": repeats,
                         "best_s": min(times), "median_s": statistics.median(times), "import_ms": import_ms,
                         "top_imports": ", ".join(f"{module} {ms:,.0f}" for module, ms in top),
                         "heavy_loaded": ",".join(loaded)})
        reference_s = min(reference_before_s, reference_seconds())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for row in rows:
        row["reference_loop_s"] = reference_s
        row["best_ratio_to_reference"] = row["best_s"] / reference_s
    return rows


def _print(rows: list[dict]) -> None:
    table = Table(title=f"kvtwin startup (reference loop {rows[0]['reference_loop_s']:.2f} s)")
    for name in ("command", "best s", "median s", "x reference", "imports ms", "heavy libraries loaded",
                 "heaviest top-level imports (ms)"):
        table.add_column(name, justify="right" if name.endswith(("s", "reference")) else "left")
    for row in rows:
        table.add_row(row["command"], f"{row['best_s']:.3f}", f"{row['median_s']:.3f}",
                      f"{row['best_ratio_to_reference']:.2f}", f"{row['import_ms']:,.0f}", row["heavy_loaded"],
                      row["top_imports"])
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="Runs of each command (best and median).")
    args = parser.parse_args()
    rows = measure(args.repeats)
    _print(rows)
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "startup.parquet")
    print(f"wrote {out / 'startup.parquet'}")


if __name__ == "__main__":
    main()
