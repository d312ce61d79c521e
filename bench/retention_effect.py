"""What vLLM 0.33's default prefix-cache retention costs in hits: every golden case that sets
``prefix_cache_retention_interval`` replayed as it is and again with dense retention (the key
set to null on both sides), hit tokens side by side.

The case as it is matches vLLM exactly (``tests/sim/test_golden.py``); the dense replay is
kvtwin's, on the rules the dense golden cases pin (``scripts/oracle/gen_retention_cases.py
dense`` has vLLM produce the same dense figures). Hits count every admission, re-admissions
after a preemption included, as the golden cases do.

    python bench/retention_effect.py [--cases DIR] [--out bench/out/retention_effect.parquet]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin.sim.core.retention import is_sparse_kind, retention_label
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.lockstep.runner import run_case

ROOT = Path(__file__).resolve().parent.parent


def hit_tokens(case) -> tuple[int, int]:
    """(hit tokens over every admission, preemptions) of a lockstep run of ``case``."""
    result = run_case(case)
    hits = sum(a["hit_tokens"] for r in result.requests for a in r["admissions"])
    return hits, sum(r["num_preemptions"] for r in result.requests)


def as_dense(case):
    kv = dataclasses.replace(case.kv_cache_config, prefix_cache_retention_interval=None)
    cache = dataclasses.replace(case.cache_config, prefix_cache_retention_interval=None)
    return dataclasses.replace(case, kv_cache_config=kv, cache_config=cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, default=ROOT / "tests" / "golden" / "cases")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "retention_effect.parquet")
    args = parser.parse_args()
    rows = []
    for directory in sorted(args.cases.iterdir()):
        if not (directory / "config.json").exists() or "prefix_cache_retention_interval" not in (
                directory / "config.json").read_text():
            continue
        case = load_case(directory)
        interval = case.kv_cache_config.prefix_cache_retention_interval
        thinnable = any(is_sparse_kind(s) for s in case.kv_cache_config.specs)
        if interval is None or not thinnable:
            continue  # dense already, or nothing to thin
        hits, preemptions = hit_tokens(case)
        dense_hits, dense_preemptions = hit_tokens(as_dense(case))
        kind = ("offload" if case.offload is not None else
                "drafts" if case.scheduler_config.num_speculative_tokens else "plain")
        rows.append({"case": directory.name, "kind": kind, "interval": retention_label(interval),
                     "hit_tokens": hits, "dense_hit_tokens": dense_hits,
                     "change": hits / dense_hits - 1 if dense_hits else float("nan"),
                     "preemptions": preemptions, "dense_preemptions": dense_preemptions})
    print(f"{'case':42} {'kind':8} {'interval':>8} {'hits':>7} {'dense':>7} {'change':>8}")
    for r in rows:
        print(f"{r['case']:42} {r['kind']:8} {r['interval']:>8} {r['hit_tokens']:>7} {r['dense_hit_tokens']:>7} "
              f"{r['change']:>+8.1%}")
    plain_zero = [r["change"] for r in rows if r["kind"] == "plain" and r["interval"] == "0"]
    if plain_zero:
        print(f"interval 0, no offload or drafts: {len(plain_zero)} cases, median change "
              f"{statistics.median(plain_zero):+.0%} (from {min(plain_zero):+.0%} to {max(plain_zero):+.0%})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.out)


if __name__ == "__main__":
    main()
