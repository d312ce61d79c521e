"""Does kvtwin still decide as vLLM does? Generate a family of golden cases, let vLLM's own
scheduler produce their expected results, replay each through kvtwin's lockstep clock and
print a match table.

Not run in CI: it needs the vLLM oracle venv (``scripts/oracle/README.md``, CPU only,
about five minutes once). The oracle scripts (``--oracle-dir``) run vLLM's real ``Scheduler`` /
``AsyncScheduler`` on case directories; everything else (the workloads, the config grid,
the comparison) is this script's.

    python bench/conformance.py [--cases 48] [--seed 0] [--oracle-python PY] [--oracle-dir DIR]
                                [--out bench/out/conformance]

The grid mixes KV cache groups (full attention; sliding window 32-1024; chunked local;
Mamba "align" with and without prefill checkpoints; three-group hybrids), both policies,
watermark, ``scheduler_reserve_full_isl``, ``long_prefill_token_threshold``, chunked
prefill on and off, prefix caching on and off, asynchronous scheduling on and off, and
prefix-cache retention (vLLM's default 0, dense, or every 64-512 tokens).
Each workload mixes fresh prompts, shared prefixes (block-aligned and not), resent prompts
and follow-ups built from an earlier prompt and its output, under enough pool pressure to
preempt. Writes ``OUT/cases/<name>/`` (a complete golden case each) and
``OUT/conformance.parquet`` (one row a case); a mismatching case is a ready regression
case: copy its directory into ``tests/golden/cases/`` once the rule is fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin.sim.core.spec import cdiv
from kvtwin.sim.lockstep.golden import compare_results, load_case, read_jsonl
from kvtwin.sim.lockstep.runner import run_case

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
FULL = {"kind": "full_attention"}
MAMBA = {"kind": "mamba", "mamba_cache_mode": "align"}
MAMBA_CHECKPOINT = {**MAMBA, "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}


def swa(window: int) -> dict:
    return {"kind": "sliding_window", "sliding_window": window}


def chunked(chunk: int) -> dict:
    return {"kind": "chunked_local", "attention_chunk_size": chunk}


LAYOUTS: list[tuple[str, list[dict]]] = [
    ("full", [FULL]),
    *[(f"full+swa{w}", [FULL, swa(w)]) for w in (32, 64, 128, 256, 512, 1024)],
    *[(f"full+chunk{c}", [FULL, chunked(c)]) for c in (64, 256)],
    ("full+mamba", [FULL, MAMBA]),
    ("full+mamba_ckpt", [FULL, MAMBA_CHECKPOINT]),
    ("full+swa128+mamba", [FULL, swa(128), MAMBA]),
    ("full+swa64+mamba_ckpt", [FULL, swa(64), MAMBA_CHECKPOINT]),
]


def _worst_blocks_per_request(groups: list[dict], max_model_len: int, in_flight: int) -> int:
    """Blocks one request of max_model_len may hold at once (the admission caps)."""
    total = 0
    for g in groups:
        if g["kind"] == "sliding_window":
            total += cdiv(min(g["sliding_window"] - 1 + in_flight, max_model_len), BLOCK) + 1
        elif g["kind"] == "chunked_local":
            total += cdiv(min(g["attention_chunk_size"] + in_flight, max_model_len), BLOCK)
        elif g["kind"] == "mamba":
            total += 2 + g.get("num_prefill_checkpoint_blocks", 0)
        else:
            total += cdiv(max_model_len, BLOCK)
    return total


@dataclass(frozen=True)
class CaseSpec:
    name: str
    config: dict
    requests: list[dict]


def _config(rng: random.Random, index: int) -> tuple[str, dict]:
    layout_name, groups = LAYOUTS[index % len(LAYOUTS)]
    asynchronous = rng.random() < 0.35
    has_mamba = any(g["kind"] == "mamba" for g in groups)
    caching = has_mamba or rng.random() < 0.85  # Mamba "align" needs prefix caching
    max_model_len = rng.choice((1024, 2048))
    chunking = rng.random() < 0.8
    budget = rng.choice((128, 256, 512)) if chunking else max_model_len
    in_flight = budget * (2 if asynchronous else 1)
    worst = _worst_blocks_per_request(groups, max_model_len, in_flight)
    pressure = rng.choice((1.3, 2.0, 4.0))
    config = {
        "vllm_version": "0.33.0",
        "kv_cache_groups": groups,
        "block_size": BLOCK,
        "num_blocks": int(worst * pressure) + 1,
        "max_model_len": max_model_len,
        "max_num_seqs": rng.choice((4, 8, 16, 64)),
        "max_num_batched_tokens": budget,
        "long_prefill_token_threshold": rng.choice((0, 0, 64, 128)),
        "enable_chunked_prefill": chunking,
        "scheduling_policy": rng.choice(("fcfs", "fcfs", "priority")),
        "watermark": rng.choice((0.0, 0.0, 0.01, 0.05)),
        "scheduler_reserve_full_isl": rng.random() < 0.7,
        "enable_prefix_caching": caching,
        "prefix_caching_hash_algo": "sha256",
        "async_scheduling": asynchronous,
    }
    knobs = [layout_name, config["scheduling_policy"], f"pool{pressure:g}x", f"budget{budget}"]
    if asynchronous:
        knobs.append("async")
    if not chunking:
        knobs.append("nochunk")
    if not caching:
        knobs.append("nocache")
    if config["long_prefill_token_threshold"]:
        knobs.append(f"lpt{config['long_prefill_token_threshold']}")
    if config["watermark"]:
        knobs.append(f"wm{config['watermark']:g}")
    if not config["scheduler_reserve_full_isl"]:
        knobs.append("noreserve")
    # vLLM's engine default (0), dense (null: every earlier case) or periodic; a positive
    # interval only where a sliding-window or Mamba group can use it.
    thinnable = any(g["kind"] in ("sliding_window", "mamba") for g in groups)
    retention = rng.choice((0, 0, None, 64, 256, 512) if thinnable else (0, None))
    config["prefix_cache_retention_interval"] = retention
    knobs.append("dense" if retention is None else f"retention{retention}")
    config["description"] = "conformance sweep: " + ", ".join(knobs)
    return f"c{index:03d}_{layout_name}", config


def _workload(rng: random.Random, config: dict, num_requests: int) -> list[dict]:
    """Fresh prompts, shared prefixes (aligned or not), resends and follow-ups."""
    max_total = config["max_model_len"]
    priorities = (0, 1, 2, 3) if config["scheduling_policy"] == "priority" else (0,)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(rng.choice((16, 40, 64, 100, 128, 257)))]
                for _ in range(4)]
    history: list[tuple[list[int], list[int]]] = []
    requests = []
    step = 0
    for i in range(num_requests):
        output = [rng.randrange(50000, 60000) for _ in range(rng.randint(1, 40))]
        u = rng.random()
        if history and u < 0.1:
            prompt = list(rng.choice(history[-8:])[0])
        elif history and u < 0.2:
            earlier, its_output = rng.choice(history[-8:])
            prompt = earlier + its_output + [rng.randrange(1000, 40000) for _ in range(rng.randint(1, 64))]
        else:
            length = rng.randint(8, max_total // 3)
            if rng.random() < 0.3:
                length = max(BLOCK, length // BLOCK * BLOCK)
            prompt = [rng.randrange(1000, 40000) for _ in range(length)]
            if rng.random() < 0.5:
                prefix = rng.choice(prefixes)
                prompt = prefix + prompt[len(prefix):] if len(prompt) > len(prefix) else prefix + prompt[:1]
        prompt = prompt[: max_total - len(output)]
        requests.append({"request_id": f"r{i:04d}", "arrival_step": step, "prompt_token_ids": prompt,
                         "output_token_ids": output, "priority": rng.choice(priorities)})
        history.append((prompt, output))
        if rng.random() > 0.25:  # a quarter arrive together with the previous one
            step += int(rng.expovariate(1 / 3))
    return requests


def generate(num_cases: int, seed: int) -> list[CaseSpec]:
    rng = random.Random(seed)
    cases = []
    for index in range(num_cases):
        name, config = _config(rng, index)
        cases.append(CaseSpec(name, config, _workload(rng, config, rng.randint(40, 100))))
    return cases


def _write_case(case: CaseSpec, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("expected_*.jsonl"):
        stale.unlink()
    (directory / "config.json").write_text(json.dumps(case.config, indent=1) + "\n")
    (directory / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in case.requests))


def _run_oracle(python: str, oracle_dir: Path, script: str, dirs: list[Path]) -> None:
    if not dirs:
        return
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([python, str(oracle_dir / script), *map(str, dirs)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        sys.exit(f"conformance: the oracle failed ({script}):\n{done.stderr[-3000:]}")


def _check(directory: Path) -> dict:
    started = time.perf_counter()
    try:
        result = run_case(load_case(directory))
    except Exception as err:  # a crash is a mismatch to report, not a reason to stop the sweep
        return {"match": False, "first_difference": f"kvtwin failed: {type(err).__name__}: {err}",
                "num_differences": -1, "kvtwin_s": time.perf_counter() - started}
    diffs = compare_results(read_jsonl(directory / "expected_requests.jsonl"),
                            read_jsonl(directory / "expected_steps.jsonl"), result.requests, result.steps, limit=0)
    return {"match": not diffs, "first_difference": diffs[0] if diffs else "", "num_differences": len(diffs),
            "kvtwin_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oracle-python", default=str(Path.home() / ".cache/kvtwin-oracle-venv/bin/python"))
    parser.add_argument("--oracle-dir", type=Path, default=ROOT.parent / "shared" / "oracle")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "conformance")
    args = parser.parse_args()
    if not Path(args.oracle_python).exists():
        sys.exit(f"conformance: no oracle Python at {args.oracle_python}; set up the oracle venv as scripts/oracle/README.md says")

    cases = generate(args.cases, args.seed)
    dirs = {case.name: args.out / "cases" / case.name for case in cases}
    for case in cases:
        _write_case(case, dirs[case.name])
    started = time.perf_counter()
    _run_oracle(args.oracle_python, args.oracle_dir, "gen_golden.py",
                [dirs[c.name] for c in cases if not c.config["async_scheduling"]])
    _run_oracle(args.oracle_python, args.oracle_dir, "gen_golden_async.py",
                [dirs[c.name] for c in cases if c.config["async_scheduling"]])
    oracle_s = time.perf_counter() - started

    rows = []
    for case in cases:
        expected = read_jsonl(dirs[case.name] / "expected_requests.jsonl")
        steps = sum(1 for _ in open(dirs[case.name] / "expected_steps.jsonl"))
        rows.append({"case": case.name, "description": case.config["description"],
                     "async_scheduling": case.config["async_scheduling"], "num_requests": len(case.requests),
                     "num_steps": steps, "num_preemptions": sum(r["num_preemptions"] for r in expected),
                     "hit_tokens": sum(a["hit_tokens"] for r in expected for a in r["admissions"]),
                     **_check(dirs[case.name])})
    width = max(len(r["case"]) for r in rows)
    for r in rows:
        verdict = "MATCH" if r["match"] else f"DIFF  {r['first_difference'][:100]}"
        print(f"{r['case']:<{width}}  {r['num_requests']:>4} req {r['num_steps']:>6} steps "
              f"{r['num_preemptions']:>4} preempt {r['hit_tokens']:>7} hit  {verdict}")
    matched = sum(r["match"] for r in rows)
    print(f"{matched}/{len(rows)} cases match vLLM 0.33.0 (oracle {oracle_s:.0f} s); cases in {args.out / 'cases'}")
    args.out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.out / "conformance.parquet")
    sys.exit(0 if matched == len(rows) else 1)


if __name__ == "__main__":
    main()
