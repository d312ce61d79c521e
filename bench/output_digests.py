"""Fingerprints of what kvtwin decides: the SHA-256 of every output table of a set of
replays over the bundled traces, and of every golden case's lockstep result.

A speed change must not change a single byte of these. Run the script before and after a
change, compiled and with ``KVTWIN_INTERPRETED=1``, and compare the lines (``diff``), or
give ``--expect`` a parquet file an earlier run wrote and it says which digests differ.

    python bench/output_digests.py [--quick] [--out bench/out/output_digests.parquet]
                                   [--expect earlier.parquet]

``--quick`` replays only the first 2,000 requests of each trace (seconds instead of
minutes); the golden cases always run whole.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin import CORE_BUILD, __version__
from kvtwin.scenarios import SCENARIOS_DIR
from kvtwin.sim.lockstep.golden import load_case
from kvtwin.sim.lockstep.runner import run_case
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.resolve import Overrides, resolve_scenario

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIRS = [ROOT / "tests" / "golden" / "cases"]

# Every bundled trace, the hybrid and offload layouts, speculative decoding, disaggregated
# prefill/decode, pipeline stages and data-parallel MoE groups (sync and async, with and
# without EP and EPLB), each through the replay path.
REPLAYS: list[tuple[str, str, dict]] = [
    ("default", "default.toml", {}),
    ("mooncake-h100-overload", "mooncake-llama8b-h100-overload.toml", {}),
    ("azure-conv-a100", "azure-conv-llama8b.toml", {"gpu": "a100-80gb"}),
    ("azure-code", "azure-conv-llama8b.toml", {"trace": "bundled:AzureLLMInferenceTrace_code.csv"}),
    ("burstgpt", "default.toml", {"trace": "bundled:burstgpt1_first400.csv"}),
    ("jamba-mini", "replay-jamba-mini.toml", {}),
    ("qwen3-next", "replay-qwen3-next.toml", {}),
    ("gemma3-27b", "replay-gemma3-27b.toml", {}),
    ("gpt-oss-20b", "replay-gpt-oss-20b.toml", {}),
    ("offload-b200", "mooncake-llama8b-b200-offload.toml", {}),
    ("spec-eagle3", "mooncake-llama8b-h100-eagle3.toml", {}),
    ("pd-2p1d", "mooncake-llama8b-h100-pd.toml", {}),
    ("llama8b-pp2", "mooncake-llama8b-h100-overload.toml", {"engine": {"pipeline_parallel_size": 2}}),
    ("gpt-oss-20b-dp4-sync", "replay-gpt-oss-20b.toml",
     {"engine": {"data_parallel_size": 4, "max_model_len": 32768, "async_scheduling": False}}),
    ("gpt-oss-20b-dp4-ep-cadence", "replay-gpt-oss-20b.toml",
     {"engine": {"data_parallel_size": 4, "enable_expert_parallel": True, "max_model_len": 32768,
                 "prefill_schedule_interval": 2}}),
    ("dsv3-dp16-ep-eplb", "mooncake-deepseek-v3-h200-dp16-ep.toml",
     {"engine": {"enable_eplb": True, "num_redundant_experts": 32}}),
    ("llama8b-cadence", "mooncake-llama8b-h100-overload.toml", {"engine": {"prefill_schedule_interval": 3}}),
]


def _table_digest(table: pa.Table) -> str:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def replay_digests(quick: bool) -> list[dict]:
    rows = []
    for name, scenario, flags in REPLAYS:
        started = time.perf_counter()
        resolved = resolve_scenario(SCENARIOS_DIR / scenario, Overrides(limit=2000 if quick else None, **flags))
        planned = resolved.plan()
        result = run_replay(planned, resolved.require_workload().load(), deployment=resolved.deployment,
                            efficiency=resolved.efficiency, slo=resolved.slo, time_limit_s=resolved.time_limit_s,
                            offload=resolved.offload_for(planned), speculative=resolved.speculative,
                            disaggregation=resolved.disaggregation)
        wall_s = time.perf_counter() - started
        for table_name in ("steps", "requests", "summary", "replicas"):
            table = getattr(result, table_name)
            if table is not None:
                rows.append({"kind": "replay", "name": name, "table": table_name, "rows": table.num_rows,
                             "sha256": _table_digest(table), "wall_s": wall_s})
    return rows


def golden_digests() -> list[dict]:
    rows = []
    for case_dir in sorted(d for root in GOLDEN_DIRS for d in root.iterdir() if d.is_dir()):
        started = time.perf_counter()
        result = run_case(load_case(case_dir))
        text = json.dumps({"requests": result.requests, "steps": result.steps}, sort_keys=True)
        rows.append({"kind": "golden", "name": case_dir.name, "table": "lockstep", "rows": len(result.steps),
                     "sha256": hashlib.sha256(text.encode()).hexdigest(),
                     "wall_s": time.perf_counter() - started})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="replay the first 2,000 requests of each trace")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "output_digests.parquet")
    parser.add_argument("--expect", type=Path, help="digests an earlier run wrote: report every difference")
    args = parser.parse_args()

    print(f"kvtwin {__version__}, {CORE_BUILD.describe()}", file=sys.stderr)
    rows = golden_digests() + replay_digests(args.quick)
    for row in rows:
        print(f"{row['kind']:7} {row['name']:28} {row['table']:9} {row['rows']:>9,} {row['sha256'][:16]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows).replace_schema_metadata(
        {"kvtwin_version": __version__, "core": CORE_BUILD.describe(), "quick": str(args.quick)}), args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.expect:
        actual = {(r["kind"], r["name"], r["table"]): r["sha256"] for r in rows}
        expected = {(r["kind"], r["name"], r["table"]): r["sha256"] for r in pq.read_table(args.expect).to_pylist()}
        differ = [key for key in expected if key in actual and actual[key] != expected[key]]
        missing = [key for key in expected if key not in actual]
        for key in differ:
            print(f"DIFFERS: {' '.join(key)}")
        for key in missing:
            print(f"MISSING: {' '.join(key)}")
        print(f"{len(expected) - len(differ) - len(missing)} of {len(expected)} digests identical")
        sys.exit(1 if differ or missing else 0)

if __name__ == "__main__":
    main()
