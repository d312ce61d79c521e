#!/usr/bin/env python3
"""Golden cases for the local prefill cadence of a single engine (vLLM 0.33's
``Scheduler.local_prefill_interval``; docs/semantics.md#local-prefill-cadence).

The same driver as gen_dp_throttle_golden.py (its docstring says the step loop) with
``data_parallel_size`` 1: vLLM's engine core never throttles, and its scheduler holds
prefill work until ``prefill_schedule_interval`` executed steps have passed since the last
step that carried prefill (both checked against the scheduler vLLM builds).

Usage (the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_prefill_cadence_golden.py make [--out DIR]      build and run the prefill_cadence_* cases
  gen_prefill_cadence_golden.py --check CASE_DIR...   re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import random
import sys

from gen_dp_throttle_golden import config, run_case  # builds vLLM's environment first
from scripted_cases import FULL, golden_main, workload


def full_hits(seed: int) -> list[dict]:
    """A long decode, then repeats of its 65-token prompt (a full hit: 64 cached tokens, one
    left to compute) arriving on held steps between fresh prompts: each repeat is admitted
    on a held step and must not restart the interval, or the next fresh prompt waits longer."""
    rng = random.Random(seed)
    base = [rng.randrange(1000, 40000) for _ in range(65)]
    reqs, step = [], 0
    for i in range(16):
        repeat = i % 2 == 1
        prompt = list(base) if repeat or i == 0 else [rng.randrange(1000, 40000) for _ in range(rng.randint(30, 90))]
        output = 60 if i == 0 else rng.randint(4, 24)
        reqs.append(dict(request_id=f"r{i:03d}", arrival_step=step, prompt_token_ids=prompt,
                         output_token_ids=[rng.randrange(50000, 60000) for _ in range(output)], priority=0))
        step += 1 if repeat else rng.randint(2, 4)
    return reqs


def cases() -> dict:
    """name -> (config, requests)."""
    def local(interval: int, num_blocks: int, description: str, **kw) -> dict:
        return config(interval, [FULL], num_blocks, description, data_parallel_size=1, **kw)
    return {
        "interval4": (local(4, 400, "one engine, prefill_schedule_interval 4: after a step that carried prefill, "
                               "prefill waits 3 executed steps while others decode; budget 64, prompts in chunks",
                            budget=64), workload(61, 24, prompt=(40, 160), output=(6, 40), gap=3)),
        "interval3_capacity": (local(3, 400, "one engine, interval 3, max_num_seqs 4: a release that cannot drain "
                                     "the queue (capacity bound) stops the hold", max_num_seqs=4),
                               workload(62, 24, gap=1)),
        "interval2_prefix_pressure": (local(2, 48, "one engine, interval 2, 47 usable blocks: preemptions, and "
                                            "full prefix hits (one token left) admitted on held steps without "
                                            "restarting the interval", long_prefill=48),
                                      workload(63, 28, shared=64, gap=2)),
        "interval4_full_hits": (local(4, 200, "one engine, interval 4: full prefix hits (one token left) admitted "
                                      "on held steps between fresh prompts do not restart the interval"),
                                full_hits(65)),
        "interval5_sparse": (local(5, 200, "one engine, interval 5, arrivals far apart: idle steps do not count "
                                   "towards the interval"), workload(64, 12, gap=9)),
    }


def main(argv=None) -> int:
    return golden_main(__doc__, "prefill_cadence", cases, run_case, argv)


if __name__ == "__main__":
    sys.exit(main())
