"""What the scripted golden-case drivers share (``gen_pp_golden.py``,
``gen_dp_throttle_golden.py``): the KV cache groups a case names, seeded workloads, the
case files, and the ``make`` / ``--check`` command line. Import it after
``oracle_common.prepare_environment``: it loads torch and vLLM."""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from oracle_common import GOLDEN_CASES as DEFAULT_OUT, CaseError, atomic_write, read_jsonl, write_jsonl

REQUEST_KEYS = ["request_id", "arrival_step", "prompt_token_ids", "output_token_ids", "priority"]
FULL = {"kind": "full_attention"}


def build_groups(group_cfgs: list[dict], block_size: int) -> list[KVCacheGroupSpec]:
    groups = []
    for i, g in enumerate(group_cfgs):
        common = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
        if g["kind"] == "full_attention":
            spec = FullAttentionSpec(**common)
        elif g["kind"] == "sliding_window":
            spec = SlidingWindowSpec(sliding_window=int(g["sliding_window"]), **common)
        else:
            raise CaseError(f"group {i}: kind {g['kind']!r} (full_attention or sliding_window here)")
        groups.append(KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec))
    return groups


def workload(seed: int, n: int, *, prompt=(20, 120), output=(4, 40), gap: int = 2, shared: int = 0,
             share_every: int = 2) -> list[dict]:
    """Seeded requests; with ``shared`` tokens, every ``share_every``-th request starts with
    one common prefix (prefix cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 40000) for _ in range(shared)]
    reqs, step = [], 0
    for i in range(n):
        prompt_ids = (prefix if shared and i % share_every == 0 else []) + \
            [rng.randrange(1000, 40000) for _ in range(rng.randint(*prompt))]
        reqs.append(dict(request_id=f"r{i:03d}", arrival_step=step, prompt_token_ids=prompt_ids,
                         output_token_ids=[rng.randrange(50000, 60000) for _ in range(rng.randint(*output))],
                         priority=rng.randint(0, 2)))
        step += rng.randint(0, gap)
    return reqs


def write_case(case_dir: str, cfg: dict, requests: list[dict], exp_requests: list[dict], exp_steps: list[dict]):
    os.makedirs(case_dir, exist_ok=True)
    atomic_write(os.path.join(case_dir, "config.json"), json.dumps(cfg, indent=1) + "\n")
    write_jsonl(os.path.join(case_dir, "requests.jsonl"), [{k: r[k] for k in REQUEST_KEYS} for r in requests])
    write_jsonl(os.path.join(case_dir, "expected_requests.jsonl"), exp_requests)
    write_jsonl(os.path.join(case_dir, "expected_steps.jsonl"), exp_steps)


def summary(exp_requests: list[dict], exp_steps: list[dict]) -> str:
    return json.dumps(dict(steps=len(exp_steps), preemptions=sum(r["num_preemptions"] for r in exp_requests),
                           hits=sum(a["hit_tokens"] for r in exp_requests for a in r["admissions"]),
                           min_free_blocks=min(s["num_free_blocks"] for s in exp_steps)))


def golden_main(doc: str, prefix: str, cases: Callable[[], dict], run_case: Callable, argv=None) -> int:
    """``make``: build and run every case of ``cases()`` into ``<out>/<prefix>_<name>``;
    a list of case directories: re-run each and rewrite its expected files, or with
    ``--check`` say SAME / DIFFERENT (exit 1 on any difference)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", help="'make', or a case directory")
    ap.add_argument("dirs", nargs="*")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "make":
        for name, (cfg, reqs) in cases().items():
            exp_requests, exp_steps = run_case(cfg, reqs)
            write_case(os.path.join(args.out, f"{prefix}_{name}"), cfg, reqs, exp_requests, exp_steps)
            print(f"{prefix}_{name}", summary(exp_requests, exp_steps), flush=True)
        return 0
    status = 0
    for d in [args.cmd, *args.dirs]:
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        reqs = read_jsonl(os.path.join(d, "requests.jsonl"))
        exp_requests, exp_steps = run_case(cfg, reqs)
        same = (exp_requests == read_jsonl(os.path.join(d, "expected_requests.jsonl"))
                and exp_steps == read_jsonl(os.path.join(d, "expected_steps.jsonl")))
        if args.check:
            print(d, "SAME" if same else "DIFFERENT")
            status |= not same
        else:
            write_jsonl(os.path.join(d, "expected_requests.jsonl"), exp_requests)
            write_jsonl(os.path.join(d, "expected_steps.jsonl"), exp_steps)
            print(d, summary(exp_requests, exp_steps))
    return status
