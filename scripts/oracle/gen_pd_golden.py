#!/usr/bin/env python3
"""Golden cases for disaggregated prefill/decode: vLLM 0.33's real scheduler with the
real scheduler half of the NIXL connector (pull mode), one prefill and one decode engine.

Two ``Scheduler`` objects (synchronous scheduling; ``AsyncScheduler`` with two batches in
flight when the case's config says ``async_scheduling``, ``AsyncSide``) are built as in
``gen_offload_golden.py`` (same tiny model config, same one-layer KV cache groups), each
with ``kv_transfer_config = NixlConnector, kv_role = kv_both``: the ``NixlConnector`` in
its scheduler role imports and runs without the ``nixl`` library (its handshake thread
only starts when a worker publishes metadata, which never happens here). Faked, as in
the offload harness:

* the model: every scheduled request that is not a partial prefill chunk samples its
  next scripted output token;
* the connector's worker side, in ticks. A tick is: the prefill engine's step
  (``schedule`` then ``update_from_output``), then the hand-over (each request the
  prefill engine finished is added to the decode engine with the ``kv_transfer_params``
  its output carries, as vLLM's proxy does), then the decode engine's step. A read the
  decode engine's metadata asks for in tick ``t`` (``reqs_to_recv`` with blocks to
  load) is reported in ``finished_recving`` with the decode engine's update of tick
  ``t + read_steps``, and the matching ``finished_sending`` with the prefill engine's
  update of the same tick (every read, an empty one included: it is the decode side's
  notification that frees the prefill side's blocks). The reports are sorted lists where
  the real worker hands sets: the prefill side frees in the order it iterates them, and
  a set of strings iterates in an order PYTHONHASHSEED decides.

Nothing in vLLM is altered. Each tick records, per engine: the tokens scheduled per
request and where each started (``num_computed_tokens`` before the step), the reads
(request, blocks per group), the requests finished, the requests waiting for remote KV,
the free block count, and every live request's block table (block ids per group; a
prefill request whose blocks wait for the read included).

Usage (the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_pd_golden.py make [--out DIR] [--only NAME,...]
                                         build the cases, write DIR/<name>.json
  gen_pd_golden.py --check FILE ...      re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OUT = os.path.join(REPO, "tests", "golden", "pd")

import gen_offload_golden as base  # noqa: E402  (sets the oracle's environment, imports vLLM)
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402


def build_groups(group_cfgs: list[dict], block_size: int) -> list:
    """``gen_offload_golden.build_groups``, plus ``"kind": "chunked_local"`` groups (with
    ``attention_chunk_size``; same page as the other attention groups)."""
    groups = []
    for i, g in enumerate(group_cfgs):
        if g.get("kind") == "chunked_local":
            spec = ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                             dtype=base.torch.float16,
                                             attention_chunk_size=int(g["attention_chunk_size"]))
        else:
            spec = base.build_groups([g], block_size)[0].kv_cache_spec
        groups.append(KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec))
    return groups


def build(cfg: dict, num_blocks: int, engine_id: str):
    """One engine's scheduler with the NIXL connector's scheduler half."""
    bs = int(cfg["block_size"])
    groups = build_groups(cfg["kv_cache_groups"], bs)
    model_config = ModelConfig(model=base.tiny_model_dir(), skip_tokenizer_init=True,
                               max_model_len=int(cfg["max_model_len"]), dtype="float16")
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
    scheduler_config = SchedulerConfig(
        max_num_seqs=int(cfg["max_num_seqs"]), max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_model_len=int(cfg["max_model_len"]), enable_chunked_prefill=True, long_prefill_token_threshold=0,
        async_scheduling=bool(cfg.get("async_scheduling", False)), is_encoder_decoder=False)
    kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", engine_id=engine_id)
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"),
                             kv_transfer_config=kv_transfer_config)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    has_mamba = any(g.get("kind") == "mamba" for g in cfg["kv_cache_groups"])
    if has_mamba:
        vllm_config.cache_config.mamba_cache_mode = "align"
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    is_async = bool(cfg.get("async_scheduling", False))
    sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    if sched_cls is not (AsyncScheduler if is_async else Scheduler):
        raise base.CaseError(f"vLLM picked scheduler class {sched_cls.__name__}")
    if vllm_config.max_concurrent_batches != (2 if is_async else 1):
        raise base.CaseError(f"max_concurrent_batches = {vllm_config.max_concurrent_batches}")
    sched = sched_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
    if type(sched.connector).__name__ not in ("NixlConnector", "NixlPullConnector"):
        raise base.CaseError(f"connector {type(sched.connector).__name__}")
    # The prefill side drops this many trailing prompt tokens (on_new_request) and the
    # decode side loads that much less: one with a Mamba group.
    if sched.connector.connector_scheduler._prefill_backoff() != (1 if has_mamba else 0):
        raise base.CaseError("unexpected prefill backoff")
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return sched, get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)


def tables(sched) -> dict:
    """Every live request's block ids per group (finished ones waiting for a read too)."""
    kvm = sched.kv_cache_manager
    return {rid: [list(g) for g in kvm.get_block_ids(rid)] for rid in sorted(sched.requests)}


class Side:
    """One engine in the tick loop."""

    def __init__(self, sched, hasher, outputs: dict[str, list[int]], read_steps: int):
        self.sched = sched
        self.read_steps = read_steps
        self.hasher = hasher
        self.outputs = outputs
        self.reqs: dict[str, Request] = {}
        self.due_recv: dict[int, set[str]] = {}
        self.due_send: dict[int, set[str]] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, params: dict) -> None:
        req = Request(request_id=rid, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     extra_args={"kv_transfer_params": params}),
                      pooling_params=None, arrival_time=float(len(self.reqs)), block_hasher=self.hasher)
        self.reqs[rid] = req
        self.sched.add_request(req)

    def step(self, tick: int) -> tuple[dict, dict]:
        """schedule + model + update; the tick's record and the finished requests' params."""
        sched = self.sched
        so = sched.schedule()
        computed = {rid: self.reqs[rid].num_computed_tokens - n for rid, n in so.num_scheduled_tokens.items()}
        meta = so.kv_connector_metadata
        reads = []
        for rid, rmeta in sorted(getattr(meta, "reqs_to_recv", {}).items()):
            reads.append([rid, [len(g) for g in rmeta.local_block_ids]])
            if rmeta.awaiting_kvs:  # an empty read (a full local hit) only notifies the prefill side
                self.due_recv.setdefault(tick + self.read_steps, set()).add(rid)
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            req = self.reqs[rid]
            req_ids.append(rid)
            sampled.append([] if req.is_prefill_chunk else [self.outputs[rid][req.num_output_tokens]])
        # Sorted lists, not sets: the scheduler frees finished_sending requests in the
        # order it iterates them, and a set's order of strings changes with PYTHONHASHSEED.
        kv_out = KVConnectorOutput(finished_recving=sorted(self.due_recv.pop(tick, set())) or None,
                                   finished_sending=sorted(self.due_send.pop(tick, set())) or None)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[], kv_connector_output=kv_out)
        freed = sorted(kv_out.finished_sending or ())
        outs = sched.update_from_output(so, mro)
        finished, params = [], {}
        for eco in outs.get(0, None).outputs if outs.get(0) else []:
            if eco.finish_reason is not None:
                finished.append(eco.request_id)
                params[eco.request_id] = eco.kv_transfer_params
        record = dict(scheduled=dict(so.num_scheduled_tokens), computed=computed, reads=reads,
                      finished=sorted(finished), freed=freed,
                      waiting_remote=sorted(r for r, q in sched.requests.items()
                                            if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS),
                      free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks(), tables=tables(sched))
        return record, params


class AsyncSide(Side):
    """One engine with two batches in flight (vLLM's ``AsyncScheduler`` stepped as
    ``EngineCore.step_with_batch_queue``, as ``gen_offload_golden.py`` steps it). The
    worker's clock is the batch number: a read issued with batch ``b`` is reported with
    the update of the first batch numbered ``b + read_steps`` or more, and a send due at
    prefill batch ``s`` with the first prefill update of a batch numbered ``s`` or more."""

    def __init__(self, sched, hasher, outputs: dict[str, list[int]], read_steps: int):
        super().__init__(sched, hasher, outputs, read_steps)
        self.queue: collections.deque = collections.deque()
        self.n_batches = 0

    def busy(self) -> bool:
        return bool(self.sched.has_requests() or self.queue)

    def _schedule(self) -> tuple:
        sched = self.sched
        so = sched.schedule()
        batch = self.n_batches
        self.n_batches += 1
        computed = {rid: self.reqs[rid].num_computed_tokens - n for rid, n in so.num_scheduled_tokens.items()}
        reads = []
        for rid, rmeta in sorted(getattr(so.kv_connector_metadata, "reqs_to_recv", {}).items()):
            reads.append([rid, [len(g) for g in rmeta.local_block_ids]])
            if rmeta.awaiting_kvs:
                self.due_recv.setdefault(batch + self.read_steps, set()).add(rid)
        # AsyncScheduler decides at schedule time which requests sample (an output
        # placeholder): every one that is not a partial prefill chunk.
        samplers = {rid for rid in so.num_scheduled_tokens if not self.reqs[rid].is_prefill_chunk}
        self.queue.appendleft((so, samplers, batch))
        return so, batch, computed, reads

    def _due(self, table: dict, batch: int) -> list[str]:
        out: list[str] = []
        for due in sorted(b for b in table if b <= batch):
            out.extend(table.pop(due))
        return sorted(out)

    def _update(self) -> tuple:
        so, samplers, batch = self.queue.pop()
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            req_ids.append(rid)
            if rid in samplers:
                k, outs = self.reqs[rid].num_output_tokens, self.outputs[rid]
                sampled.append([outs[k] if k < len(outs) else 0])  # past the end: vLLM discards it
            else:
                sampled.append([])
        kv_out = KVConnectorOutput(finished_recving=self._due(self.due_recv, batch) or None,
                                   finished_sending=self._due(self.due_send, batch) or None)
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[], kv_connector_output=kv_out)
        outs = self.sched.update_from_output(so, mro)
        finished, params = [], {}
        for eco in outs.get(0).outputs if outs.get(0) else []:
            if eco.finish_reason is not None:
                finished.append(eco.request_id)
                params[eco.request_id] = eco.kv_transfer_params
        return batch, sorted(finished), sorted(kv_out.finished_sending or ()), params

    def step(self, tick: int) -> tuple[dict, dict]:
        """One ``step_with_batch_queue``: schedule a batch if there are requests; if the
        queue then has room and (it computes something or requests remain) that is all,
        else the oldest batch in flight is updated."""
        sched = self.sched
        scheduled, computed, reads, sched_batch = {}, {}, [], None
        update_now = True
        if sched.has_requests():
            so, sched_batch, computed, reads = self._schedule()
            scheduled = dict(so.num_scheduled_tokens)
            if len(self.queue) < 2 and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                update_now = False
        elif not self.queue:
            update_now = False
        upd_batch, finished, freed, params = None, [], [], {}
        if update_now:
            upd_batch, finished, freed, params = self._update()
        record = dict(scheduled=scheduled, computed=computed, reads=reads, finished=finished, freed=freed,
                      waiting_remote=sorted(r for r, q in sched.requests.items()
                                            if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS),
                      free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks(), tables=tables(sched),
                      scheduled_batch=sched_batch, updated_batch=upd_batch)
        return record, params


def run_case_async(case: dict) -> list[dict]:
    """``run_case`` with both engines asynchronous; the run goes on until both are idle."""
    cfg = case["config"]
    read_steps = int(cfg["read_steps"])
    outputs = {r["request_id"]: r["output_token_ids"] for r in case["requests"]}
    p = AsyncSide(*build(cfg, int(cfg["prefill_num_blocks"]), "prefill"), outputs, read_steps)
    d = AsyncSide(*build(cfg, int(cfg["decode_num_blocks"]), "decode"), outputs, read_steps)
    pending = sorted(case["requests"], key=lambda r: r["arrival_tick"])
    prompts = {r["request_id"]: r["prompt_token_ids"] for r in case["requests"]}
    ticks, tick, done = [], 0, 0
    while done < len(case["requests"]) or p.busy() or d.busy():
        while pending and pending[0]["arrival_tick"] <= tick:
            r = pending.pop(0)
            p.add(r["request_id"], r["prompt_token_ids"], 1, {"do_remote_decode": True})
        p_record, params = p.step(tick)
        for rid in p_record["finished"]:
            d.add(rid, prompts[rid], len(outputs[rid]), dict(params[rid]))
        d_record, _ = d.step(tick)
        for rid, _ in d_record["reads"]:
            # The prefill side learns of the read read_steps batches after its next one.
            p.due_send.setdefault(p.n_batches + read_steps - 1, set()).add(rid)
        done += len(d_record["finished"])
        ticks.append(dict(tick=tick, prefill=p_record, decode=d_record))
        tick += 1
        if tick > 5000:
            raise base.CaseError("no progress")
    return ticks


def run_case(case: dict) -> list[dict]:
    cfg = case["config"]
    read_steps = int(cfg["read_steps"])
    outputs = {r["request_id"]: r["output_token_ids"] for r in case["requests"]}
    p = Side(*build(cfg, int(cfg["prefill_num_blocks"]), "prefill"), outputs, read_steps)
    d = Side(*build(cfg, int(cfg["decode_num_blocks"]), "decode"), outputs, read_steps)
    pending = sorted(case["requests"], key=lambda r: r["arrival_tick"])
    prompts = {r["request_id"]: r["prompt_token_ids"] for r in case["requests"]}
    ticks, tick, done = [], 0, 0
    while done < len(case["requests"]):
        while pending and pending[0]["arrival_tick"] <= tick:
            r = pending.pop(0)
            p.add(r["request_id"], r["prompt_token_ids"], 1, {"do_remote_decode": True})
        p_record, params = p.step(tick)
        for rid in p_record["finished"]:
            d.add(rid, prompts[rid], len(outputs[rid]), dict(params[rid]))
        d_record, _ = d.step(tick)
        for rid, _ in d_record["reads"]:
            p.due_send.setdefault(tick + read_steps, set()).add(rid)
        done += len(d_record["finished"])
        ticks.append(dict(tick=tick, prefill=p_record, decode=d_record))
        tick += 1
        if tick > 5000:
            raise base.CaseError("no progress")
    while p.sched.requests:  # the last reads' sends
        p_record, _ = p.step(tick)
        ticks.append(dict(tick=tick, prefill=p_record, decode=None))
        tick += 1
    return ticks


def cases() -> list[dict]:
    out = []

    def req(rng, rid, tick, prompt, n_out):
        return dict(request_id=rid, arrival_tick=tick, prompt_token_ids=prompt,
                    output_token_ids=[rng.randrange(1000, 60000) for _ in range(n_out)])

    for name, groups, seed, read_steps, p_blocks, d_blocks in (
            ("pd_full_basic", [{"kind": "full_attention"}], 1, 1, 64, 64),
            ("pd_full_slow_read", [{"kind": "full_attention"}], 2, 4, 48, 40),
            ("pd_full_tight_decode", [{"kind": "full_attention"}], 3, 2, 64, 24),
            ("pd_hybrid_swa", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 32}],
             4, 2, 96, 80),
            ("pd_hybrid_mamba", [{"kind": "full_attention"}, {"kind": "mamba", "mamba_cache_mode": "align"}],
             5, 2, 96, 80)):
        rng = random.Random(seed)
        system = [rng.randrange(1000, 60000) for _ in range(40)]
        requests = []
        for i in range(8):
            shared = system if i % 2 == 0 else []
            prompt = shared + [rng.randrange(1000, 60000) for _ in range(rng.randrange(5, 70))]
            requests.append(req(rng, f"r{i}", i * rng.randrange(0, 3), prompt, rng.randrange(2, 9)))
        config = dict(vllm_version=base.VLLM_VERSION, block_size=16, kv_cache_groups=groups,
                      prefill_num_blocks=p_blocks, decode_num_blocks=d_blocks, max_model_len=512,
                      max_num_seqs=4, max_num_batched_tokens=64, read_steps=read_steps,
                      description=f"{name}: 1P1D, NIXL pull, synchronous, reads land after {read_steps} ticks")
        out.append(dict(name=name, config=config, requests=requests))
    for name, seed, read_steps, p_blocks, d_blocks in (("pd_async_full_basic", 6, 2, 64, 64),
                                                        ("pd_async_full_tight_decode", 7, 2, 64, 24)):
        rng = random.Random(seed)
        system = [rng.randrange(1000, 60000) for _ in range(40)]
        requests = []
        for i in range(8):
            shared = system if i % 2 == 0 else []
            prompt = shared + [rng.randrange(1000, 60000) for _ in range(rng.randrange(5, 70))]
            requests.append(req(rng, f"r{i}", i * rng.randrange(0, 3), prompt, rng.randrange(2, 9)))
        config = dict(vllm_version=base.VLLM_VERSION, block_size=16, kv_cache_groups=[{"kind": "full_attention"}],
                      prefill_num_blocks=p_blocks, decode_num_blocks=d_blocks, max_model_len=512,
                      max_num_seqs=4, max_num_batched_tokens=64, read_steps=read_steps, async_scheduling=True,
                      description=f"{name}: 1P1D, NIXL pull, asynchronous scheduling (two batches in "
                                  f"flight), reads land {read_steps} batches after they are issued")
        out.append(dict(name=name, config=config, requests=requests))
    # Read sizes: a decode side whose own cache hits prefixes of several lengths (earlier
    # requests' prompts, cached once their reads landed), prompts of every length up to
    # ten blocks past them, against windows and chunks of several sizes; the last case
    # adds a Mamba group, whose per-group local hits let the sliding window's hit lag.
    for name, groups, seed in (
            ("pd_swa8_reads", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 8}], 31),
            ("pd_swa24_reads", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 24}], 32),
            ("pd_swa40_reads", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 40}], 33),
            ("pd_swa64_reads", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 64}], 34),
            ("pd_chunked32_reads", [{"kind": "full_attention"}, {"kind": "chunked_local", "attention_chunk_size": 32}],
             35),
            ("pd_chunked40_reads", [{"kind": "full_attention"}, {"kind": "chunked_local", "attention_chunk_size": 40}],
             36),
            ("pd_swa32_mamba_reads", [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 32},
                                      {"kind": "mamba", "mamba_cache_mode": "align"}], 37)):
        rng = random.Random(seed)
        system = [rng.randrange(1000, 60000) for _ in range(160)]
        requests = []
        for i in range(16):
            shared = system[:16 * rng.randrange(0, 11)]
            prompt = shared + [rng.randrange(1000, 60000) for _ in range(rng.randrange(1, 60))]
            requests.append(req(rng, f"r{i}", 3 * i, prompt, rng.randrange(2, 5)))
        config = dict(vllm_version=base.VLLM_VERSION, block_size=16, kv_cache_groups=groups,
                      prefill_num_blocks=128, decode_num_blocks=128, max_model_len=512,
                      max_num_seqs=4, max_num_batched_tokens=64, read_steps=1,
                      description=f"{name}: 1P1D, NIXL pull, synchronous; the blocks each read moves "
                                  "past the decode side's own hit and skipped prefix")
        out.append(dict(name=name, config=config, requests=requests))
    # Prompts no longer than the backoff: the prefill side keeps them whole and the decode
    # side loads all of them (one token), then recomputes that token.
    rng = random.Random(38)
    requests = [req(rng, f"r{i}", i, [rng.randrange(1000, 60000) for _ in range(n)], rng.randrange(2, 5))
                for i, n in enumerate((1, 2, 1, 17, 1, 16, 3, 1, 33))]
    config = dict(vllm_version=base.VLLM_VERSION, block_size=16,
                  kv_cache_groups=[{"kind": "full_attention"}, {"kind": "mamba", "mamba_cache_mode": "align"}],
                  prefill_num_blocks=64, decode_num_blocks=64, max_model_len=512, max_num_seqs=4,
                  max_num_batched_tokens=64, read_steps=1,
                  description="pd_hybrid_mamba_short_prompts: 1P1D, NIXL pull, synchronous; one-token prompts "
                              "on a Mamba hybrid (backoff 1)")
    out.append(dict(name="pd_hybrid_mamba_short_prompts", config=config, requests=requests))
    return out


def runner(case: dict):
    return run_case_async if case["config"].get("async_scheduling") else run_case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="*")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--only", default="", help="make: only these cases (comma-separated names)")
    args = ap.parse_args(argv)
    if args.check:
        bad = 0
        for path in args.cmd:
            with open(path) as f:
                case = json.load(f)
            same = runner(case)(case) == case["expected_ticks"]
            print(("SAME " if same else "DIFFERENT ") + path)
            bad += not same
        return 1 if bad else 0
    if args.cmd != ["make"]:
        ap.error("make, or --check FILE ...")
    os.makedirs(args.out, exist_ok=True)
    only = {n for n in args.only.split(",") if n}
    unknown = only - {c["name"] for c in cases()}
    if unknown:
        ap.error(f"--only: no case named {sorted(unknown)[0]}")
    for case in cases():
        if only and case["name"] not in only:
            continue
        case["expected_ticks"] = runner(case)(case)
        path = os.path.join(args.out, case["name"] + ".json")
        with open(path, "w") as f:
            json.dump(case, f, indent=None, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path}: {len(case['expected_ticks'])} ticks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
