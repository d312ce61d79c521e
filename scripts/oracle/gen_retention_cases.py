#!/usr/bin/env python3
"""Golden cases for vLLM 0.33's prefix-cache retention (``prefix_cache_retention_interval``).

Builds chat-like workloads (shared system prompts of aligned and unaligned lengths,
multi-turn conversations whose turns arrive after the previous turn finished, exact resends,
branches, edits, one-shot prompts behind a system prompt), writes the ``retention_*`` case
directories and has vLLM produce their expected files:

* plain cases (the shared golden format): ``config.json`` + ``requests.jsonl`` are written
  here, then the vLLM oracle's ``gen_golden.py`` (synchronous) or ``gen_golden_async.py``
  (``"async_scheduling": true``) is run on the directory in a subprocess;
* offload cases (``retention_offload_*``): this directory's ``gen_offload_golden.py``
  (``make_case`` / ``write_case``: vLLM's real ``OffloadingConnector`` and
  ``CPUOffloadingManager``, no two finishes in one step);
* speculative-decoding cases (``retention_spec_*``): this directory's ``gen_spec_golden.py``
  on the written directory, in a subprocess.

Arrival steps of later turns and of resends / branches / edits are computed by running the
case's scheduler mode (the case's groups, pool and retention setting) with an ``on_finish``
callback: synchronous, the oracle's ``gen_golden.run_case``; asynchronous,
``run_async_with_arrivals`` below; offload cases, the offload harness's own loop with the
connector; speculative cases the same without drafting. The written ``requests.jsonl`` is
static, and every follow-up request arrives after the one it follows finished
(``turn_order_violations`` checks it against the expected files).

After writing a case, ``make`` re-runs it from its files (``check``) and runs a copy with the
key removed (``dense``): vLLM's expected files must differ from the dense run's, except in
the cases marked ``pin`` (chunked-local + full, full only), where they must be identical.

Usage (the oracle venv's python; ORACLE_DIR holds the vLLM oracle's gen_golden.py):
  gen_retention_cases.py --oracle ORACLE_DIR make [--out DIR] [--only NAME,...]
  gen_retention_cases.py --oracle ORACLE_DIR check CASE_DIR...   re-run: SAME / DIFFERENT
  gen_retention_cases.py --oracle ORACLE_DIR dense CASE_DIR...   the key removed: hits, differs?
  gen_retention_cases.py --oracle ORACLE_DIR list                 the case names
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from oracle_common import (  # noqa: E402  (standard library only)
    GOLDEN_CASES as DEFAULT_OUT, CaseError, accept_script, prepare_environment, read_jsonl, write_json,
    write_jsonl,
)

_CACHE = prepare_environment("kvtwin-retention-oracle")

VLLM_VERSION = "0.33.0"
KEY = "prefix_cache_retention_interval"
PLAIN_KEYS = [
    "vllm_version", "kv_cache_groups", "block_size", "num_blocks", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
    "enable_chunked_prefill", "scheduling_policy", "watermark",
    "scheduler_reserve_full_isl", "enable_prefix_caching", "prefix_caching_hash_algo",
    "async_scheduling", "description",
]
REQUEST_KEYS = ["request_id", "arrival_step", "prompt_token_ids", "output_token_ids", "priority"]

FULL = {"kind": "full_attention"}
MAMBA = {"kind": "mamba", "mamba_cache_mode": "align"}
MAMBA_CKPT = {**MAMBA, "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}


def SWA(w: int) -> dict:
    return {"kind": "sliding_window", "sliding_window": w}


def CHUNKED(c: int) -> dict:
    return {"kind": "chunked_local", "attention_chunk_size": c}


# --------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------
def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def out_toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50000, 60000) for _ in range(n)]


def extra_tokens(rid: str, n: int) -> list[int]:
    # seeded by the request id (a str seed is hashed with SHA-512: PYTHONHASHSEED-free)
    return out_toks(random.Random(f"retention-extra-{rid}"), n)


class Chat:
    """Seeded chat workload; every random choice is drawn up front, so only arrival steps
    depend on the run.

    ``n_conv`` conversations start ~``start_gap`` steps apart. A first turn is an optional
    system prompt (``p_sys``; lengths ``sys_lens``, aligned and unaligned to 16) + a user
    message; turn t+1 is turn t's prompt + its output + a new user message and arrives
    ``think`` steps after turn t finished. After a turn finishes, with probabilities
    ``p_resend`` / ``p_branch`` / ``p_edit`` and a delay of ``side_delay`` steps, it is
    followed by an exact resend (id suffix ``r``), a branch (``b``: the same history with a
    different new message; for a first turn, the same system prompt with another user
    message) and an edit (``e``: the prompt cut part-way + new text). ``n_oneshot``
    one-shot prompts (``o###``) behind a system prompt arrive on their own. A conversation
    ends when a prompt would exceed ``max_prompt``. ``priorities``: each request's priority
    is drawn from it (seeded by the request id); else 0. ``extra_out``: request id -> extra
    output tokens (the offload harness's ``make_case`` sets it)."""

    def __init__(self, seed: int, *, n_conv: int, n_oneshot: int = 0, turns=(1, 5),
                 sys_lens=(40, 64, 100, 128, 203, 256), first_user=(16, 200),
                 user_len=(8, 120), olen=(2, 24), think=(2, 15), start_gap=8.0,
                 p_sys=0.8, p_resend=0.2, p_branch=0.25, p_edit=0.2, side_delay=(1, 25),
                 max_prompt=1000, max_model_len=2048, priorities=None, min_first=0):
        rng = random.Random(seed)
        self.max_prompt = max_prompt
        self.max_model_len = max_model_len
        self.priorities = priorities
        self.seed = seed
        self.systems = [toks(rng, n) for n in sys_lens]
        self.convs = []
        step = 0
        for c in range(n_conv):
            T = rng.randint(*turns)
            sys_p = rng.choice(self.systems) if rng.random() < p_sys else []
            first = list(sys_p) + toks(rng, rng.randint(*first_user))
            if len(first) < min_first:
                first += toks(rng, min_first - len(first))
            turns_ = []
            for t in range(T):
                side = {}
                for kind, p in (("r", p_resend), ("b", p_branch), ("e", p_edit)):
                    if rng.random() < p:
                        side[kind] = dict(delay=rng.randint(*side_delay),
                                          text=toks(rng, rng.randint(*user_len)),
                                          cut=rng.uniform(0.15, 0.95),
                                          out=out_toks(rng, rng.randint(*olen)))
                turns_.append(dict(user=toks(rng, rng.randint(*user_len)),
                                   out=out_toks(rng, rng.randint(*olen)),
                                   think=rng.randint(*think), side=side))
            self.convs.append(dict(id=f"c{c:02d}", start=step, sys=sys_p, first=first,
                                   turns=turns_))
            step += int(rng.expovariate(1.0 / start_gap)) if start_gap > 0 else 0
        span = max(step, 1)
        self.oneshots = []
        for o in range(n_oneshot):
            sys_p = rng.choice(self.systems)
            self.oneshots.append(dict(id=f"o{o:03d}", start=rng.randrange(span),
                                      prompt=list(sys_p) + toks(rng, rng.randint(*first_user)),
                                      out=out_toks(rng, rng.randint(*olen))))
        self.by_rid: dict[str, tuple] = {}
        self.extra_out: dict[str, int] = {}

    def _req(self, rid: str, step: int, prompt: list[int], out: list[int]):
        out = list(out) + extra_tokens(rid, self.extra_out.get(rid, 0))
        if len(prompt) > self.max_prompt or len(prompt) + len(out) > self.max_model_len:
            return None
        prio = random.Random(f"retention-prio-{rid}").choice(self.priorities) \
            if self.priorities else 0
        return dict(request_id=rid, arrival_step=step, prompt_token_ids=list(prompt),
                    output_token_ids=out, priority=prio)

    def _turn(self, conv: dict, t: int, step: int, prompt: list[int]):
        rid = f"{conv['id']}t{t}"
        r = self._req(rid, step, prompt, conv["turns"][t]["out"])
        if r is not None:
            self.by_rid[rid] = (conv, t)
        return r

    def initial(self) -> list[dict]:
        reqs = [self._turn(c, 0, c["start"], c["first"]) for c in self.convs]
        reqs += [self._req(o["id"], o["start"], o["prompt"], o["out"]) for o in self.oneshots]
        return sorted((r for r in reqs if r), key=lambda r: r["arrival_step"])

    def on_finish(self, spec: dict, step: int) -> list[dict]:
        got = self.by_rid.get(spec["request_id"])
        if got is None:
            return []  # a one-shot or a side request: nothing follows it
        conv, t = got
        turn = conv["turns"][t]
        prompt, out = spec["prompt_token_ids"], spec["output_token_ids"]
        new = []
        if t + 1 < len(conv["turns"]):
            new.append(self._turn(conv, t + 1, step + turn["think"],
                                  prompt + out + conv["turns"][t + 1]["user"]))
        rid = spec["request_id"]
        for kind, s in turn["side"].items():
            if kind == "r":
                p = list(prompt)
            elif kind == "b":
                if t == 0:
                    if not conv["sys"]:
                        continue
                    p = list(conv["sys"]) + s["text"]
                else:
                    history = prompt[:len(prompt) - len(turn["user"])]
                    p = history + s["text"]
            else:  # edit: cut part-way, new text
                cut = max(1, int(len(prompt) * s["cut"]))
                p = prompt[:cut] + s["text"]
            new.append(self._req(rid + kind, step + s["delay"], p, s["out"]))
        return [r for r in new if r]


def request_accept_script(rid: str, seed: int, k: int, n: int, rate: float = 0.6) -> list[int]:
    """Drafts accepted per verify step of one request (speculative cases), from its own draw."""
    return accept_script(random.Random(f"retention-accept-{seed}-{rid}"), k, rate, n)


# --------------------------------------------------------------------------
# configurations and the case table
# --------------------------------------------------------------------------
def plain_config(groups, num_blocks, max_num_seqs, budget, description, retention, *,
                 async_scheduling=False, policy="fcfs", max_model_len=2048, reserve=True,
                 watermark=0.0, lpt=0) -> dict:
    return {
        "vllm_version": VLLM_VERSION, "kv_cache_groups": groups, "block_size": 16,
        "num_blocks": num_blocks, "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
        "long_prefill_token_threshold": lpt, "enable_chunked_prefill": True,
        "scheduling_policy": policy, "watermark": watermark,
        "scheduler_reserve_full_isl": reserve, "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256", "async_scheduling": async_scheduling,
        "description": description, KEY: retention,
    }


def cases() -> dict:
    """name -> dict(kind='plain'|'offload'|'spec', cfg=() -> config, wl=() -> Chat,
    pin=bool (results must equal the dense run's), k=draft tokens (spec))."""
    c = {}

    def plain(name, cfg, wl, pin=False):
        c[name] = dict(kind="plain", cfg=cfg, wl=wl, pin=pin)

    # ---- sliding window ----
    plain("retention_swa_r0_async", lambda: plain_config(
        [FULL, SWA(64)], 200, 4, 256, "asynchronous scheduling, full + sliding window 64, "
        "prefix_cache_retention_interval 0: window blocks kept only at replay boundaries and "
        "shared-prefix junctions", 0, async_scheduling=True),
        lambda: Chat(7101, n_conv=18, n_oneshot=10, max_prompt=700))
    plain("retention_swa64_r256", lambda: plain_config(
        [FULL, SWA(64)], 220, 4, 256, "full + sliding window 64, prefix_cache_retention_interval "
        "256: 4 window blocks < 16 blocks per segment, so the last 4 blocks of every 256-token "
        "segment are kept, plus the semantic checkpoints", 256),
        lambda: Chat(7102, n_conv=16, n_oneshot=8, first_user=(100, 500), user_len=(30, 200),
                     max_prompt=1200))
    plain("retention_swa_two_windows_r64", lambda: plain_config(
        [FULL, SWA(128), SWA(32)], 220, 4, 256, "full + sliding windows 128 and 32, "
        "prefix_cache_retention_interval 64 (4 blocks): the 128-token window needs 8 >= 4 "
        "blocks, so that group keeps every block (as dense); the 32-token window needs 2 < 4 "
        "and keeps the last 2 blocks of every 64-token segment plus the semantic checkpoints",
        64), lambda: Chat(7103, n_conv=18, n_oneshot=8, max_prompt=900))
    # ---- Mamba ----
    plain("retention_mamba_r0_async", lambda: plain_config(
        [FULL, MAMBA], 120, 4, 128, "asynchronous scheduling, full + mamba (align), "
        "prefix_cache_retention_interval 0: Mamba states kept only at replay boundaries and "
        "shared-prefix junctions", 0, async_scheduling=True),
        lambda: Chat(7201, n_conv=18, n_oneshot=10, max_prompt=700))
    plain("retention_mamba_r64", lambda: plain_config(
        [FULL, MAMBA], 120, 4, 128, "full + mamba (align), prefix_cache_retention_interval 64: "
        "a state every 4 blocks (where the request has one) plus the semantic checkpoints", 64),
        lambda: Chat(7202, n_conv=18, n_oneshot=10, max_prompt=700))
    plain("retention_mamba_ckpt_r0", lambda: plain_config(
        [FULL, MAMBA_CKPT], 180, 4, 256, "full + mamba with prefill checkpoints (Mamba-2 / "
        "GDN style), prefix_cache_retention_interval 0: a checkpoint block is reserved only for "
        "the chunk reaching the end of the prefill", 0),
        lambda: Chat(7203, n_conv=18, n_oneshot=10, max_prompt=800))
    plain("retention_mamba_ckpt_r0_async", lambda: plain_config(
        [FULL, MAMBA_CKPT], 180, 4, 256, "asynchronous scheduling, full + mamba with prefill "
        "checkpoints, prefix_cache_retention_interval 0", 0, async_scheduling=True),
        lambda: Chat(7204, n_conv=18, n_oneshot=10, max_prompt=800))
    plain("retention_mamba_ckpt_r128", lambda: plain_config(
        [FULL, MAMBA_CKPT], 220, 4, 256, "full + mamba with prefill checkpoints, "
        "prefix_cache_retention_interval 128: checkpoints reserved on every chunk, kept in the "
        "cache only at the prompt's boundary, the junction or a multiple of 128; states every "
        "8 blocks", 128),
        lambda: Chat(7205, n_conv=18, n_oneshot=10, max_prompt=900))
    plain("retention_mamba_ckpt_r0_pressure", lambda: plain_config(
        [FULL, MAMBA_CKPT], 100, 4, 128, "full + mamba with prefill checkpoints, "
        "prefix_cache_retention_interval 0, 99 usable blocks, scheduler_reserve_full_isl false: "
        "preemptions; a resumed request replays its outputs (prefill_end = max(num_prompt, "
        "num_tokens - 1))", 0, reserve=False),
        lambda: Chat(7206, n_conv=18, n_oneshot=8, max_prompt=600, olen=(8, 40)))
    # ---- pins: vLLM caches these densely under 0 ----
    plain("retention_chunked64_r0", lambda: plain_config(
        [FULL, CHUNKED(64)], 160, 4, 256, "full + chunked local 64, "
        "prefix_cache_retention_interval 0: no sliding-window or Mamba group, so every block "
        "is cached (results equal the dense run's)", 0),
        lambda: Chat(7301, n_conv=18, n_oneshot=10, max_prompt=700), pin=True)
    plain("retention_full_r0", lambda: plain_config(
        [FULL], 100, 4, 256, "full attention only, prefix_cache_retention_interval 0: no effect "
        "(results equal the dense run's)", 0),
        lambda: Chat(7302, n_conv=18, n_oneshot=10, max_prompt=700), pin=True)
    # ---- three groups ----
    plain("retention_three_groups_r0", lambda: plain_config(
        [FULL, SWA(96), MAMBA], 200, 4, 256, "full + sliding window 96 + mamba, "
        "prefix_cache_retention_interval 0", 0),
        lambda: Chat(7401, n_conv=18, n_oneshot=10, max_prompt=800))
    plain("retention_three_groups_r128", lambda: plain_config(
        [FULL, SWA(96), MAMBA], 220, 4, 256, "full + sliding window 96 + mamba, "
        "prefix_cache_retention_interval 128: the window's 6 blocks < 8 per segment "
        "(segment tails kept), a Mamba state every 8 blocks, plus the semantic checkpoints",
        128), lambda: Chat(7402, n_conv=18, n_oneshot=10, max_prompt=900))
    plain("retention_hybrid_priority_r0", lambda: plain_config(
        [FULL, SWA(128), MAMBA], 110, 4, 256, "priority policy, full + sliding window 128 + "
        "mamba, prefix_cache_retention_interval 0, tight pool: priority preemptions", 0,
        policy="priority"),
        lambda: Chat(7403, n_conv=18, n_oneshot=10, max_prompt=700, priorities=(0, 1, 2)))
    plain("retention_three_groups_r0_pressure_async", lambda: plain_config(
        [FULL, SWA(64), MAMBA], 130, 4, 128, "asynchronous scheduling, full + sliding window 64 "
        "+ mamba, prefix_cache_retention_interval 0, 129 usable blocks, "
        "scheduler_reserve_full_isl false: preemptions, resumed requests replay outputs", 0,
        async_scheduling=True, reserve=False),
        lambda: Chat(7404, n_conv=18, n_oneshot=8, max_prompt=600, olen=(8, 40)))

    # ---- offload (gen_offload_golden.py): CPU tier ----
    def offload(name, groups, gpu_blocks, cpu_chunks, policy, retention, seed, *, desc,
                async_scheduling=False, **wl):
        def cfg():
            og = offload_harness()
            return og.config(groups, gpu_blocks, 4, 512, desc, cpu_chunks=cpu_chunks,
                             policy=policy, bytes_per_chunk=og.PAGE,
                             async_scheduling=async_scheduling, retention=retention)
        c[name] = dict(kind="offload", cfg=cfg, pin=False,
                       wl=lambda: Chat(seed, n_conv=wl.get("n_conv", 16),
                                       n_oneshot=wl.get("n_oneshot", 8),
                                       max_prompt=wl.get("max_prompt", 1000),
                                       think=(10, 60), side_delay=(10, 80),
                                       first_user=(60, 400)))

    offload("retention_offload_swa_r0", [FULL, SWA(64)], 120, 300, "lru", 0, 7501,
            desc="full + sliding window 64, CPU tier (lru, 300 chunks), "
            "prefix_cache_retention_interval 0 on the GPU and the connector: window chunks "
            "stored only at replay boundaries and junctions")
    offload("retention_offload_swa_r0_async", [FULL, SWA(64)], 120, 300, "arc", 0, 7502,
            async_scheduling=True,
            desc="asynchronous scheduling, full + sliding window 64, CPU tier (arc, 300 "
            "chunks), prefix_cache_retention_interval 0")
    offload("retention_offload_swa_r256", [FULL, SWA(64)], 120, 400, "lru", 256, 7503,
            desc="full + sliding window 64, CPU tier (lru, 400 chunks), "
            "prefix_cache_retention_interval 256: window chunks at every 256-token segment end "
            "too, on the GPU and in the connector's stores", max_prompt=1400)
    offload("retention_offload_mamba_r0", [FULL, MAMBA], 120, 300, "lru", 0, 7504,
            desc="full + mamba (align), CPU tier (lru, 300 chunks), "
            "prefix_cache_retention_interval 0: Mamba states cached (and offered to the "
            "connector) only at replay boundaries and junctions")
    offload("retention_offload_mamba_r0_async", [FULL, MAMBA], 120, 300, "lru", 0, 7505,
            async_scheduling=True,
            desc="asynchronous scheduling, full + mamba (align), CPU tier (lru, 300 chunks), "
            "prefix_cache_retention_interval 0")
    offload("retention_offload_mamba_r64", [FULL, MAMBA], 120, 300, "arc", 64, 7506,
            desc="full + mamba (align), CPU tier (arc, 300 chunks), "
            "prefix_cache_retention_interval 64: a Mamba state every 4 blocks too")

    # ---- speculative decoding (gen_spec_golden.py): draft heads, caching on ----
    def spec(name, groups, num_blocks, k, method, seed, *, desc, async_scheduling=False):
        def cfg():
            sp = spec_harness()
            out = sp.config(groups, num_blocks, k, desc, max_num_seqs=4, budget=256,
                            max_model_len=2048, async_scheduling=async_scheduling,
                            method=method)
            out[KEY] = 0
            return out
        c[name] = dict(kind="spec", cfg=cfg, pin=False, k=k,
                       wl=lambda: Chat(seed, n_conv=14, n_oneshot=8, max_prompt=700))

    spec("retention_spec_eagle_swa_r0", [FULL, SWA(64)], 160, 3, "eagle", 7601,
         desc="EAGLE k=3, prefix caching on (lookahead block hashes, no last-block drop), "
         "full + sliding window 64, prefix_cache_retention_interval 0: window tails at the "
         "replay boundary (num_prompt_tokens - 1) and junctions of blocks hashed with the "
         "token after them")
    spec("retention_spec_async_mtp_swa_r0", [FULL, SWA(64)], 160, 1, "mtp", 7602,
         async_scheduling=True,
         desc="asynchronous, single-module MTP k=1, prefix caching on, full + sliding window "
         "64, prefix_cache_retention_interval 0")
    spec("retention_spec_mtp_mamba_r0", [FULL, MAMBA], 160, 3, "mtp", 7603,
         desc="single-module MTP k=3, prefix caching on, full + mamba (align, 3 speculative "
         "blocks), prefix_cache_retention_interval 0")
    spec("retention_spec_async_eagle_mamba_r0", [FULL, MAMBA], 160, 3, "eagle", 7604,
         async_scheduling=True,
         desc="asynchronous, EAGLE k=3, prefix caching on, full + mamba (align, 3 speculative "
         "blocks), prefix_cache_retention_interval 0")
    return c


# --------------------------------------------------------------------------
# the harnesses (imported lazily: they import vLLM)
# --------------------------------------------------------------------------
ORACLE_DIR = None


def oracle():
    if ORACLE_DIR is None:
        raise CaseError("--oracle ORACLE_DIR (the folder holding gen_golden.py) is needed")
    if ORACLE_DIR not in sys.path:
        sys.path.insert(0, ORACLE_DIR)
    import gen_golden  # the vLLM oracle's synchronous driver
    return gen_golden


def offload_harness():
    import gen_offload_golden
    return gen_offload_golden


def spec_harness():
    import gen_spec_golden
    return gen_spec_golden


def script_for(cfg: dict) -> list[str]:
    if "kv_offload" in cfg:
        return [os.path.join(HERE, "gen_offload_golden.py")]
    if "speculative" in cfg:
        return [os.path.join(HERE, "gen_spec_golden.py")]
    if cfg["async_scheduling"]:
        return [os.path.join(ORACLE_DIR, "gen_golden_async.py")]
    return [os.path.join(ORACLE_DIR, "gen_golden.py")]


def run_oracle(case_dir: str, seed: str | None = None) -> None:
    """Run the case's oracle on ``case_dir`` (writes its expected files)."""
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    p = subprocess.run([sys.executable, *script_for(cfg), case_dir], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0 or "ERROR" in p.stdout:
        raise CaseError(f"{case_dir}: oracle failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


EXPECTED = ("expected_requests.jsonl", "expected_steps.jsonl")


def rerun_copy(case_dir: str, edit=None, seed: str | None = None) -> tuple[list, list, dict]:
    """Run the case's oracle on a temporary copy (``edit(cfg)`` may change its config);
    returns (expected_requests, expected_steps, config)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, os.path.basename(case_dir.rstrip("/")))
        os.makedirs(d)
        for f in ("config.json", "requests.jsonl"):
            shutil.copy(os.path.join(case_dir, f), d)
        if edit is not None:
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            edit(cfg)
            write_json(os.path.join(d, "config.json"), cfg)
        run_oracle(d, seed)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        return (read_jsonl(os.path.join(d, EXPECTED[0])), read_jsonl(os.path.join(d, EXPECTED[1])),
                cfg)


def check_case(case_dir: str, seed: str | None = None) -> bool:
    er, es, cfg = rerun_copy(case_dir, seed=seed)
    with open(os.path.join(case_dir, "config.json")) as f:
        same_cfg = json.load(f) == cfg
    return same_cfg and er == read_jsonl(os.path.join(case_dir, EXPECTED[0])) and \
        es == read_jsonl(os.path.join(case_dir, EXPECTED[1]))


def drop_key(cfg: dict) -> None:
    """Dense: the key removed (the offload harness: null, both sides dense)."""
    cfg.pop(KEY, None)


# --------------------------------------------------------------------------
# building a case
# --------------------------------------------------------------------------
def arrivals_plain(cfg: dict, wl: Chat) -> list[dict]:
    """The workload with arrival steps computed by the case's own scheduler mode without
    speculative decoding: synchronous, the oracle's gen_golden.run_case with on_finish;
    asynchronous, ``run_async_with_arrivals``."""
    c = {k: cfg[k] for k in PLAIN_KEYS}
    c[KEY] = cfg.get(KEY)
    if c["async_scheduling"]:
        return run_async_with_arrivals(c, wl.initial(), wl.on_finish)
    added, _, _ = oracle().run_case(c, wl.initial(), on_finish=wl.on_finish)
    return added


def run_async_with_arrivals(cfg: dict, requests: list[dict], on_finish,
                            max_steps: int = 100_000) -> list[dict]:
    """vLLM's AsyncScheduler (built by the oracle's gen_golden_async) stepped as
    EngineCore.step_with_batch_queue with two batches in flight, the fake model of the
    golden format; ``on_finish(spec, step)`` returns the requests that follow a finished one
    (arriving later). Only the requests, with their arrival steps, are returned; the expected
    files come from running gen_golden_async.py on the written static workload."""
    import bisect
    import collections
    oracle()
    import gen_golden_async as gga
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    sched, hasher, qsize, _ = gga.build_async_scheduler(cfg)
    if qsize != 2:
        raise CaseError(f"expected 2 concurrent batches, vLLM says {qsize}")
    pending = sorted(requests, key=lambda r: r["arrival_step"])
    keys = [r["arrival_step"] for r in pending]
    reqs, specs, added = {}, {}, []
    queue: collections.deque = collections.deque()
    step = 0
    while pending or sched.get_num_unfinished_requests() > 0 or queue:
        if step >= max_steps:
            raise CaseError(f"no end after {max_steps} steps")
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.pop(0)
            keys.pop(0)
            rid = spec["request_id"]
            req = Request(request_id=rid, prompt_token_ids=list(spec["prompt_token_ids"]),
                          sampling_params=SamplingParams(max_tokens=len(spec["output_token_ids"]),
                                                         ignore_eos=True),
                          pooling_params=None, arrival_time=float(len(added)),
                          priority=int(spec["priority"]), block_hasher=hasher)
            added.append(spec)
            reqs[rid], specs[rid] = req, spec
            sched.add_request(req)
        update = True
        if sched.has_requests():
            so = sched.schedule()
            samplers = {rid for rid in so.num_scheduled_tokens if not reqs[rid].is_prefill_chunk}
            queue.appendleft((so, samplers))
            if len(queue) < 2 and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                update = False
        elif not queue:
            update = False
        if update:
            so, samplers = queue.pop()
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                if rid in samplers:
                    k, outs = reqs[rid].num_output_tokens, specs[rid]["output_token_ids"]
                    sampled.append([outs[k] if k < len(outs) else 0])
                else:
                    sampled.append([])
            sched.update_from_output(so, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled))
            for rid in ids:
                if reqs[rid].is_finished() and not specs[rid].get("_done"):
                    specs[rid]["_done"] = True
                    for ns in on_finish(specs[rid], step) or []:
                        pos = bisect.bisect_right(keys, ns["arrival_step"])
                        pending.insert(pos, ns)
                        keys.insert(pos, ns["arrival_step"])
        step += 1
    return [{k: r[k] for k in REQUEST_KEYS} for r in added]


def build(name: str, entry: dict, out: str) -> str:
    cfg = entry["cfg"]()
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    if entry["kind"] == "offload":
        og = offload_harness()
        added, exp_req, exp_steps, geo = og.make_case(cfg, entry["wl"])
        og.write_case(d, cfg, added, exp_req, exp_steps, geo)
        return d
    reqs = arrivals_plain(cfg, entry["wl"]())
    if entry["kind"] == "spec":
        seed = entry["wl"]().seed
        reqs = [dict(r, num_accepted_tokens=request_accept_script(
            r["request_id"], seed, entry["k"], len(r["output_token_ids"]))) for r in reqs]
        keys = REQUEST_KEYS + ["num_accepted_tokens"]
    else:
        keys = REQUEST_KEYS
        cfg = {k: cfg[k] for k in PLAIN_KEYS + [KEY]}
    write_json(os.path.join(d, "config.json"), cfg)
    write_jsonl(os.path.join(d, "requests.jsonl"), [{k: r[k] for k in keys} for r in reqs])
    run_oracle(d)
    return d


# --------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------
def stats(exp_req: list[dict], exp_steps: list[dict]) -> dict:
    adm = [a for r in exp_req for a in r["admissions"]]
    out = dict(steps=len(exp_steps), requests=len(exp_req),
               hit_tokens=sum(a["hit_tokens"] for a in adm),
               hit_at_first=sum(r["admissions"][0]["hit_tokens"] > 0 for r in exp_req),
               preemptions=sum(r["num_preemptions"] for r in exp_req))
    if adm and "external_tokens" in adm[0]:
        out["external_tokens"] = sum(a["external_tokens"] for a in adm)
    return out


def turn_order_violations(case_dir: str) -> int:
    """Requests arriving before (or in the step of) the finish of the turn they follow."""
    reqs = read_jsonl(os.path.join(case_dir, "requests.jsonl"))
    fin = {r["request_id"]: r["finish_step"] for r in read_jsonl(os.path.join(case_dir, EXPECTED[0]))}
    bad = 0
    for r in reqs:
        rid = r["request_id"]
        if not rid.startswith("c"):
            continue
        base = rid.rstrip("rbe")
        conv, t = base.split("t")
        prev = base if rid != base else (f"{conv}t{int(t) - 1}" if int(t) > 0 else None)
        if prev is not None and r["arrival_step"] <= fin[prev]:
            bad += 1
    return bad


def report(case_dir: str, pin: bool | None = None) -> dict:
    er = read_jsonl(os.path.join(case_dir, EXPECTED[0]))
    es = read_jsonl(os.path.join(case_dir, EXPECTED[1]))
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    s = stats(er, es)
    s["interval"] = cfg.get(KEY)
    # (a fixed hash seed: the offload harness's dense run may finish two requests in one
    # step, whose order at the connector follows PYTHONHASHSEED)
    der, des, _ = rerun_copy(case_dir, edit=drop_key, seed="0")
    ds = stats(der, des)
    s["dense_multi_finish_steps"] = sum(len(x["finished"]) > 1 for x in des)
    s["dense_hit_tokens"] = ds["hit_tokens"]
    s["dense_steps"] = ds["steps"]
    s["dense_preemptions"] = ds["preemptions"]
    s["differs_from_dense"] = (der, des) != (er, es)
    s["turn_order_violations"] = turn_order_violations(case_dir)
    if pin is not None:
        s["ok"] = s["differs_from_dense"] != pin
    return s


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def cmd_make(out: str, only: list[str], skip_checks: bool) -> int:
    table = cases()
    unknown = [n for n in only if n not in table]
    if unknown:
        print(f"unknown case(s): {unknown}")
        return 2
    rc = 0
    for name, entry in table.items():
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            d = build(name, entry, out)
            s = report(d, entry["pin"])
            if not skip_checks:
                s["check"] = all(check_case(d, seed) for seed in ("3", "99"))
        except CaseError as e:
            print(f"{name}: FAILED: {e}", flush=True)
            rc = 1
            continue
        s["seconds"] = round(time.time() - t0, 1)
        if not s["ok"] or not s.get("check", True) or s["turn_order_violations"]:
            rc = 1
        print(f"{name}: {json.dumps(s)}", flush=True)
    return rc


def main(argv=None) -> int:
    global ORACLE_DIR
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--oracle", default=os.environ.get("KVTWIN_ORACLE_DIR"),
                   help="the vLLM oracle's folder (gen_golden.py, gen_golden_async.py)")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", default=DEFAULT_OUT)
    m.add_argument("--only", default="")
    m.add_argument("--skip-checks", action="store_true",
                   help="do not re-run the written cases under PYTHONHASHSEED 3 and 99")
    for cmd in ("check", "dense"):
        s = sub.add_parser(cmd)
        s.add_argument("case_dirs", nargs="+")
    sub.add_parser("list")
    a = p.parse_args(argv)
    ORACLE_DIR = os.path.abspath(a.oracle) if a.oracle else None
    if a.cmd == "list":
        for name, e in cases().items():
            print(name, e["kind"], "pin" if e["pin"] else "")
        return 0
    if ORACLE_DIR is None:
        p.error("--oracle ORACLE_DIR is required")
    if a.cmd == "make":
        return cmd_make(a.out, [x for x in a.only.split(",") if x], a.skip_checks)
    rc = 0
    for d in a.case_dirs:
        try:
            if a.cmd == "check":
                same = check_case(d)
                print(f"{d}: {'SAME' if same else 'DIFFERENT'}", flush=True)
                rc |= not same
            else:
                print(f"{d}: {json.dumps(report(d))}", flush=True)
        except CaseError as e:
            print(f"{d}: ERROR {e}", flush=True)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
