"""Time vLLM 0.33's own scheduler and KV cache manager on golden cases (for
``bench/bench_core.py``, which runs kvtwin on the same cases and reports the ratio).

Runs under the oracle venv (``scripts/oracle/README.md``) and drives the oracle's
``run_case`` (synchronous cases) and ``run_case_async`` (asynchronous ones), the very loops
that produced the cases, so both sides do the same work: schedule, step the fake model,
update, and record every step's line. Import and start-up are not timed; each case is run
``--repeats`` times and its fastest run kept. Offload cases need this project's own
connector harness and are left out. Prints one JSON object: case name -> seconds.

    ~/.cache/kvtwin-oracle-venv/bin/python scripts/oracle/time_vllm_cases.py \
        --oracle ORACLE_DIR CASE_DIR...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case_dirs", nargs="+")
    parser.add_argument("--oracle", required=True, help="the folder holding gen_golden.py")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.abspath(args.oracle))
    import gen_golden  # noqa: E402  (the oracle's module, found through --oracle)
    import gen_golden_async  # noqa: E402

    seconds: dict[str, float] = {}
    for case_dir in args.case_dirs:
        with open(os.path.join(case_dir, "config.json")) as f:
            cfg = json.load(f)
        if "kv_offload" in cfg:
            continue
        requests = gen_golden.read_jsonl(os.path.join(case_dir, "requests.jsonl"))
        run = gen_golden_async.run_case_async if cfg.get("async_scheduling") else gen_golden.run_case
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            run(cfg, [dict(r) for r in requests])
            best = min(best, time.perf_counter() - started)
        seconds[os.path.basename(os.path.normpath(case_dir))] = best
    print(json.dumps(seconds))


if __name__ == "__main__":
    main()
