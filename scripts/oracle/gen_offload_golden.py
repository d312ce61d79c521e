#!/usr/bin/env python3
"""Golden cases for vLLM 0.33's native CPU KV offloading (OffloadingConnector).

Drives vLLM's *real* v1 ``Scheduler`` (synchronous) or ``AsyncScheduler``
(``"async_scheduling": true``: stepped as ``EngineCore.step_with_batch_queue``
does, two batches in flight), its KVCacheManager / coordinators / BlockPool and
the *real* scheduler side of the native ``OffloadingConnector``
(``OffloadingConnectorScheduler`` + ``CPUOffloadingManager`` with the ``lru`` or
``arc`` policy).  Two things are faked:

* the model: each scheduled request that is not a partial prefill chunk samples
  its next scripted output token (asynchronous: chosen when the batch is
  updated);
* the connector's worker side, counting *ticks* (synchronous: steps;
  asynchronous: batches, i.e. schedule() calls, numbered in schedule order): a
  job issued in tick ``t`` is reported finished in the output of tick
  ``t + load_steps`` (load jobs) or ``t + store_steps`` (store jobs); a job named
  in ``jobs_to_flush`` of tick ``t`` is reported in tick ``t`` if it was not
  reported before.  Reports use exactly the real worker's format
  (``KVConnectorOutput.finished_recving`` + ``OffloadingWorkerMetadata``).

Nothing in vLLM is altered.  The harness only observes (it wraps
``prepare_store`` / ``prepare_load`` of the CPU manager and the connector
scheduler's ``update_state_after_alloc`` / ``get_num_new_matched_tokens`` to
count keys, evictions, loads and deferred lookups, the scheduler's
``_preempt_request`` to learn the preemption order, and
``OffloadingSpecFactory.create_spec`` to read the CPU tier's geometry).

``make`` builds seeded multi-turn workloads and re-runs each until no step
finishes two requests (vLLM hands same-step finishes to the connector as a set,
whose order depends on PYTHONHASHSEED; see make_case).

The step loops and every output field are defined in ``README.md`` next to
this file (section "gen_offload_golden.py", "The step" and "Asynchronous mode").

Usage (run with the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_offload_golden.py make [--out DIR] [--only NAME,...]   build + run the cases
  gen_offload_golden.py CASE_DIR [CASE_DIR ...]              re-run, write expected_*
  gen_offload_golden.py --check CASE_DIR [CASE_DIR ...]      re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import random
import sys
import time

from oracle_common import (  # noqa: E402  (standard library only: before torch and vLLM)
    GOLDEN_CASES as DEFAULT_OUT, CaseError, prepare_environment, read_jsonl, tiny_model_dir as _tiny_model_dir,
    write_json, write_jsonl,
)

_CACHE = prepare_environment("kvtwin-offload-oracle")

import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

VLLM_VERSION = "0.33.0"
CONFIG_KEYS = [
    "vllm_version", "kv_cache_groups", "block_size", "num_blocks", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
    "enable_chunked_prefill", "scheduling_policy", "watermark",
    "scheduler_reserve_full_isl", "enable_prefix_caching", "prefix_caching_hash_algo",
    "async_scheduling", "description", "kv_offload",
]
# Optional keys: written to config.json only when the case has them.
# prefix_cache_retention_interval: absent or null = dense (None on CacheConfig and
# KVCacheConfig, so also for the connector), 0 (vLLM's engine default) or a positive
# multiple of block_size (README "Prefix-cache retention").
OPTIONAL_CONFIG_KEYS = ["prefix_cache_retention_interval"]
OFFLOAD_KEYS = ["cpu_bytes_to_use", "eviction_policy", "kv_bytes_per_chunk",
                "num_cpu_chunks", "load_steps", "store_steps"]
REQUEST_KEYS = ["request_id", "arrival_step", "prompt_token_ids", "output_token_ids",
                "priority"]
# Fixed connector settings (vLLM defaults, stated explicitly where vLLM has a key).
ENGINE_ID = "kvtwin-offload-oracle"


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------
def tiny_model_dir() -> str:
    return _tiny_model_dir(_CACHE)


def build_groups(group_cfgs: list[dict], block_size: int) -> list[KVCacheGroupSpec]:
    """KV-cache groups, one layer each; list position = group id.  Page sizes
    (num_kv_heads=1, head_size=8, fp16 -> 512 bytes per attention block; Mamba
    (4, 8) fp32 -> 128 bytes) only matter for the CPU tier's chunk size."""
    groups = []
    for i, g in enumerate(group_cfgs):
        common = dict(num_kv_heads=1, head_size=8, dtype=torch.float16)
        kind = g.get("kind")
        if kind == "full_attention":
            spec = FullAttentionSpec(block_size=block_size, **common)
        elif kind == "sliding_window":
            spec = SlidingWindowSpec(block_size=block_size,
                                     sliding_window=int(g["sliding_window"]), **common)
        elif kind == "mamba":
            if g.get("mamba_cache_mode") != "align":
                raise CaseError(f"group {i}: only mamba_cache_mode 'align' is supported")
            if g.get("num_prefill_checkpoint_blocks") or g.get("prefill_checkpoint_alignment"):
                raise CaseError(f"group {i}: prefill checkpoints are not supported here")
            spec = MambaSpec(block_size=block_size, shapes=((4, 8),),
                             dtypes=(torch.float32,), mamba_cache_mode="align")
        else:
            raise CaseError(f"group {i}: unsupported kind {kind!r}")
        groups.append(KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec))
    return groups


def validate_config(cfg: dict) -> None:
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    extra = [k for k in cfg if k not in CONFIG_KEYS + OPTIONAL_CONFIG_KEYS]
    if missing or extra:
        raise CaseError(f"config.json: missing keys {missing}, unknown keys {extra}")
    validate_retention(cfg)
    ko = cfg["kv_offload"]
    missing = [k for k in OFFLOAD_KEYS if k not in ko]
    extra = [k for k in ko if k not in OFFLOAD_KEYS]
    if missing or extra:
        raise CaseError(f"config.json kv_offload: missing keys {missing}, unknown {extra}")
    if ko["eviction_policy"] not in ("lru", "arc"):
        raise CaseError("kv_offload.eviction_policy must be 'lru' or 'arc'")
    # a store is submitted by the real worker at the start of the next step
    # (batch), so it cannot finish in its own step (batch) unless flushed; a
    # load can (not realistically: README "Asynchronous mode").
    if int(ko["load_steps"]) < 0 or int(ko["store_steps"]) < 1:
        raise CaseError("kv_offload: need load_steps >= 0 and store_steps >= 1")
    if cfg["vllm_version"] != vllm.__version__:
        raise CaseError(f"config.json: vllm_version {cfg['vllm_version']} but "
                        f"installed vllm is {vllm.__version__}")
    if not isinstance(cfg["async_scheduling"], bool):
        raise CaseError("config.json: async_scheduling must be true or false")


def validate_retention(cfg: dict) -> None:
    """prefix_cache_retention_interval: absent / null, 0, or a positive multiple of
    block_size (vLLM raises for other values, and for a positive one without a
    sliding-window or Mamba group)."""
    ri = cfg.get("prefix_cache_retention_interval")
    if ri is None:
        return
    if not isinstance(ri, int) or isinstance(ri, bool) or ri < 0 or \
            (ri > 0 and ri % int(cfg["block_size"]) != 0):
        raise CaseError(f"config.json: prefix_cache_retention_interval {ri!r} is not null, 0 "
                        f"or a positive multiple of block_size {cfg['block_size']}")


def build_scheduler(cfg: dict):
    """vLLM's Scheduler (``AsyncScheduler`` when ``async_scheduling``) with the
    OffloadingConnector (scheduler role).  kv_offload.kv_bytes_per_chunk /
    num_cpu_chunks may be null (filled from what vLLM computed); if given they
    must equal what vLLM computed."""
    validate_config(cfg)
    is_async = bool(cfg["async_scheduling"])
    ko = cfg["kv_offload"]
    bs = int(cfg["block_size"])
    groups = build_groups(cfg["kv_cache_groups"], bs)
    has_mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
    model_config = ModelConfig(
        model=tiny_model_dir(),
        skip_tokenizer_init=True,
        max_model_len=int(cfg["max_model_len"]),
        dtype="float16",
    )
    retention = cfg.get("prefix_cache_retention_interval")
    cache_config = CacheConfig(
        block_size=bs,
        enable_prefix_caching=bool(cfg["enable_prefix_caching"]),
        prefix_caching_hash_algo=cfg["prefix_caching_hash_algo"],
        prefix_cache_retention_interval=retention,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_model_len=int(cfg["max_model_len"]),
        enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]),
        policy=cfg["scheduling_policy"],
        watermark=float(cfg["watermark"]),
        scheduler_reserve_full_isl=bool(cfg["scheduler_reserve_full_isl"]),
        async_scheduling=is_async,
        is_encoder_decoder=False,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=ENGINE_ID,
        kv_connector_extra_config={
            "cpu_bytes_to_use": int(ko["cpu_bytes_to_use"]),
            "eviction_policy": ko["eviction_policy"],
        },
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.cache_config.num_gpu_blocks = int(cfg["num_blocks"])
    if has_mamba:
        vllm_config.cache_config.mamba_cache_mode = "align"
    # one setting on both sides: the engine's planner copies the CacheConfig value into
    # the KVCacheConfig (kv_cache_planning.get_kv_cache_config_from_groups); the GPU
    # coordinator reads the latter, the offloading connector the former.
    kv_cache_config = KVCacheConfig(
        num_blocks=int(cfg["num_blocks"]), kv_cache_tensors=[], kv_cache_groups=groups,
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
    )
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    # The Scheduler creates the connector itself (KVConnectorRole.SCHEDULER,
    # with this kv_cache_config) because kv_transfer_config is set.  Observe
    # the OffloadingSpec the connector builds (spec.num_chunks,
    # spec.kv_bytes_per_chunk); the factory is called through unchanged.
    created_specs = []
    orig_create = OffloadingSpecFactory.__dict__["create_spec"]

    def _create_spec(cls, config):
        spec = orig_create.__func__(cls, config)
        created_specs.append(spec)
        return spec

    OffloadingSpecFactory.create_spec = classmethod(_create_spec)
    sched_cls = vllm_config.scheduler_config.get_scheduler_cls()
    if sched_cls is not (AsyncScheduler if is_async else Scheduler):
        raise CaseError(f"vLLM picked scheduler class {sched_cls.__name__}")
    try:
        sched = sched_cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=False,
        )
    finally:
        OffloadingSpecFactory.create_spec = orig_create
    if len(created_specs) != 1:
        raise CaseError(f"connector built {len(created_specs)} offloading specs")
    spec = created_specs[0]
    sc = vllm_config.scheduler_config
    effective = dict(
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        scheduling_policy=str(getattr(sc.policy, "value", sc.policy)),
        watermark=sc.watermark,
        scheduler_reserve_full_isl=sc.scheduler_reserve_full_isl,
        enable_prefix_caching=vllm_config.cache_config.enable_prefix_caching,
        async_scheduling=bool(sc.async_scheduling),
    )
    for k, v in effective.items():
        if v != cfg[k]:
            raise CaseError(f"vLLM changed {k}: asked {cfg[k]!r}, effective {v!r}")
    if sched_bs != bs or hash_bs != bs:
        raise CaseError(f"unexpected scheduler/hash block size {sched_bs}/{hash_bs}")
    if vllm_config.cache_config.prefix_cache_retention_interval != retention or \
            sched.kv_cache_manager.coordinator.retention_interval != retention:
        raise CaseError(f"vLLM runs prefix_cache_retention_interval "
                        f"{sched.kv_cache_manager.coordinator.retention_interval!r}, case "
                        f"asks {retention!r}")
    # EngineCore.step_with_batch_queue is used with max_concurrent_batches > 1
    batches = vllm_config.max_concurrent_batches
    if batches != (2 if is_async else 1):
        raise CaseError(f"max_concurrent_batches = {batches}")
    if vllm_config.max_in_flight_tokens != batches * sc.max_num_batched_tokens:
        raise CaseError("max_in_flight_tokens != batches * max_num_batched_tokens")
    # kv_role "kv_both" is a KV consumer: with two batches in flight vLLM
    # defers freeing a request's blocks until the batches that may still
    # write them are updated (Scheduler.defer_block_free).
    if sched.defer_block_free != is_async or sched.defer_async_loads:
        raise CaseError(f"defer_block_free {sched.defer_block_free}, defer_async_loads "
                        f"{sched.defer_async_loads}")
    if sched.requires_kv_delivery:
        raise CaseError("connector requires_kv_delivery")
    conn = sched.connector
    if conn is None or type(conn).__name__ != "OffloadingConnector":
        raise CaseError(f"scheduler built connector {type(conn).__name__}")
    if str(getattr(conn._role, "name", conn._role)) != "SCHEDULER":
        raise CaseError(f"connector role {conn._role}")
    csched = conn.connector_scheduler
    oc = csched.config
    # What this harness (and the README) assume about the connector config.
    expect = dict(num_workers=1, blocks_per_chunk=1, tokens_per_hash=bs,
                  offload_prompt_only=True, sync_load_budget_bytes=0,
                  retention_interval=retention, supports_partial_tail=False)
    for k, v in expect.items():
        if getattr(oc, k) != v:
            raise CaseError(f"connector config {k} = {getattr(oc, k)!r}, expected {v!r}")
    if conn._bounding_group_ids:
        raise CaseError(f"groups not offloaded: {conn._bounding_group_ids}")
    got_groups = [g.group_idx for g in oc.kv_group_configs]
    if got_groups != list(range(len(groups))):
        raise CaseError(f"offloaded groups {got_groups}")
    manager = csched.manager
    if type(manager).__name__ != "CPUOffloadingManager":
        raise CaseError(f"manager {type(manager).__name__}")
    if type(spec).__name__ != "CPUOffloadingSpec" or manager._num_chunks != spec.num_chunks:
        raise CaseError(f"spec {type(spec).__name__}: {spec.num_chunks} chunks, manager "
                        f"{manager._num_chunks}")
    if spec.eviction_policy != cfg["kv_offload"]["eviction_policy"]:
        raise CaseError(f"eviction policy {spec.eviction_policy}")
    geometry = dict(num_cpu_chunks=int(spec.num_chunks),
                    kv_bytes_per_chunk=int(spec.kv_bytes_per_chunk))
    if geometry["num_cpu_chunks"] <= 0:
        raise CaseError("vLLM computed no CPU chunks")
    hash_fn = get_hash_fn_by_name(cfg["prefix_caching_hash_algo"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return sched, hasher, geometry


def validate_request(r: dict, cfg: dict, where: str) -> None:
    missing = [k for k in REQUEST_KEYS if k not in r]
    extra = [k for k in r if k not in REQUEST_KEYS]
    if missing or extra:
        raise CaseError(f"{where}: missing keys {missing}, unknown keys {extra}")
    if not r["prompt_token_ids"] or not r["output_token_ids"]:
        raise CaseError(f"{where}: empty prompt_token_ids or output_token_ids")
    if len(r["prompt_token_ids"]) + len(r["output_token_ids"]) > cfg["max_model_len"]:
        raise CaseError(f"{where}: prompt + output longer than max_model_len")
    if int(r["arrival_step"]) < 0:
        raise CaseError(f"{where}: negative arrival_step")


# --------------------------------------------------------------------------
# the worker stand-in
# --------------------------------------------------------------------------
class FakeOffloadWorker:
    """Reports connector jobs the way OffloadingConnectorWorker does, with a
    fixed latency counted in *ticks*: steps (synchronous) or batches
    (asynchronous).  Load jobs issued in tick t finish in tick t + load_steps,
    store jobs in t + store_steps; jobs_to_flush of tick t finish in t.  With
    asynchronous scheduling batch k+1 is submitted before batch k is
    collected; that cannot change batch k's report, since a job issued or
    flushed in tick k+1 is never due before k+1."""

    def __init__(self, load_steps: int, store_steps: int):
        self.load_steps = load_steps
        self.store_steps = store_steps
        # job id -> [is_load, req_id (None for sync loads), due_tick]
        self.pending: dict[int, list] = {}
        self.reported: set[int] = set()
        self.last_collected = -1

    def submit(self, meta: OffloadingConnectorMetadata, tick: int) -> None:
        if tick <= self.last_collected:
            raise CaseError(f"tick {tick} submitted after tick {self.last_collected} "
                            "was collected")
        for jid, job in meta.load_jobs.items():
            if jid in self.pending or jid in self.reported:
                raise CaseError(f"load job {jid} issued twice")
            sync = bool(getattr(job, "sync", False))
            self.pending[jid] = [True, None if sync else job.req_id,
                                 tick if sync else tick + self.load_steps]
        for jid, job in meta.store_jobs.items():
            if jid in self.pending or jid in self.reported:
                raise CaseError(f"store job {jid} issued twice")
            self.pending[jid] = [False, job.req_id, tick + self.store_steps]
        for jid in meta.jobs_to_flush or ():
            if jid in self.pending:
                self.pending[jid][2] = min(self.pending[jid][2], tick)
            elif jid not in self.reported:
                raise CaseError(f"flush of unknown job {jid}")

    def collect(self, tick: int) -> tuple[list[int], KVConnectorOutput]:
        if tick != self.last_collected + 1:
            raise CaseError(f"collect({tick}) after collect({self.last_collected})")
        self.last_collected = tick
        done = sorted(j for j, (_, _, due) in self.pending.items() if due <= tick)
        finished_recving: set[str] = set()
        wmeta = OffloadingWorkerMetadata()
        for jid in done:
            is_load, req_id, _ = self.pending.pop(jid)
            self.reported.add(jid)
            wmeta.mark_completed(jid)
            if is_load and req_id is not None:
                finished_recving.add(req_id)
        out = KVConnectorOutput(
            finished_sending=set(),
            finished_recving=finished_recving,
            kv_connector_worker_meta=wmeta if wmeta.completed_jobs else None,
        )
        return done, out


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------
def run_case(cfg: dict, requests: list[dict], on_finish=None,
             max_stall_steps: int = 3000, max_steps: int = 100_000):
    """Run one case (``requests`` sorted by arrival_step), synchronous or
    asynchronous as ``cfg["async_scheduling"]`` says (README: "The step" /
    "Asynchronous mode").  ``on_finish(spec, step)`` may return new request
    specs arriving after ``step`` (multi-turn workloads); the written
    requests.jsonl is static and replays identically.
    Returns (requests_in_add_order, expected_requests, expected_steps, geometry)."""
    is_async = bool(cfg["async_scheduling"])
    sched, hasher, geometry = build_scheduler(cfg)
    pool = sched.kv_cache_manager.block_pool
    conn = sched.connector
    cs = conn.connector_scheduler
    manager = cs.manager
    ko = cfg["kv_offload"]
    for k in ("num_cpu_chunks", "kv_bytes_per_chunk"):
        if ko.get(k) is not None and int(ko[k]) != geometry[k]:
            raise CaseError(f"kv_offload.{k}: config says {ko[k]}, vLLM computed "
                            f"{geometry[k]}")
    worker = FakeOffloadWorker(int(ko["load_steps"]), int(ko["store_steps"]))

    # ---- observers (call through unchanged) ----
    step_obs = dict(store_keys=0, evicted=0, load_keys=0, store_calls=0,
                    store_failed=0)
    preempt_order: list[str] = []
    cur_step = [0]
    in_schedule = [False]
    # req id -> (external_tokens, load_step, local_tokens) of a load issued
    # and not yet consumed by an admission
    pending_load: dict[str, tuple[int, int, int]] = {}
    totals = dict(store_failed=0, store_calls=0, lookup_deferred=0, deferred_frees=0,
                  cow_copies=0, preempt_gated=0)

    def only_in_schedule(what):
        if not in_schedule[0]:
            raise CaseError(f"step {cur_step[0]}: {what} called outside schedule()")

    orig_prepare_store = manager.prepare_store

    def prepare_store(keys, req_context, _orig=orig_prepare_store):
        only_in_schedule("prepare_store")
        out = _orig(keys, req_context)
        step_obs["store_calls"] += 1
        if out is None:
            step_obs["store_failed"] += 1
        else:
            step_obs["store_keys"] += len(out.keys_to_store)
            step_obs["evicted"] += len(out.evicted_keys)
        return out

    manager.prepare_store = prepare_store

    orig_prepare_load = manager.prepare_load

    def prepare_load(keys, req_context, _orig=orig_prepare_load):
        only_in_schedule("prepare_load")
        step_obs["load_keys"] += len(keys)
        return _orig(keys, req_context)

    manager.prepare_load = prepare_load

    orig_usaa = cs.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens, _orig=orig_usaa):
        only_in_schedule("update_state_after_alloc")
        ret = _orig(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            rid = request.request_id
            if rid in pending_load:
                raise CaseError(f"request {rid}: second load before admission")
            local = int(cs._req_status[rid].num_locally_computed_tokens)
            pending_load[rid] = (int(num_external_tokens), cur_step[0], local)
        return ret

    cs.update_state_after_alloc = update_state_after_alloc

    orig_gnnmt = cs.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens, *a, _orig=orig_gnnmt, **kw):
        ret = _orig(request, num_computed_tokens, *a, **kw)
        if ret[0] is None:
            totals["lookup_deferred"] += 1
        return ret

    cs.get_num_new_matched_tokens = get_num_new_matched_tokens

    orig_preempt = sched._preempt_request

    def _preempt_observer(request, *a, _orig=orig_preempt, **kw):
        preempt_order.append(request.request_id)
        return _orig(request, *a, **kw)

    sched._preempt_request = _preempt_observer

    # (asynchronous mode) count the frees vLLM defers (Scheduler.defer_block_free)
    orig_frb = sched._free_request_blocks

    def _free_request_blocks(request, _orig=orig_frb):
        if not sched._request_blocks_can_be_freed(request):
            if request.status == RequestStatus.RUNNING:
                raise CaseError(f"deferred free of running request {request.request_id}")
            totals["deferred_frees"] += 1
        return _orig(request)

    sched._free_request_blocks = _free_request_blocks

    # (asynchronous mode) the preemption gate: a running request whose blocks
    # a batch in flight may still write is not preempted (the allocation
    # fails instead; schedule() moves on).  Counted where it answers False
    # for a RUNNING request.
    orig_can_free = sched._request_blocks_can_be_freed

    def _request_blocks_can_be_freed(request, _orig=orig_can_free):
        ret = _orig(request)
        if not ret and request.status == RequestStatus.RUNNING:
            totals["preempt_gated"] += 1
        return ret

    sched._request_blocks_can_be_freed = _request_blocks_can_be_freed

    kvm = sched.kv_cache_manager
    orig_take_copies = kvm.take_kv_cache_block_copies

    def take_kv_cache_block_copies(*a, _orig=orig_take_copies, **kw):
        ret = _orig(*a, **kw)
        if ret[0]:
            totals["cow_copies"] += 1
        return ret

    kvm.take_kv_cache_block_copies = take_kv_cache_block_copies

    # ---- state ----
    pending = list(requests)
    for i in range(1, len(pending)):
        if pending[i]["arrival_step"] < pending[i - 1]["arrival_step"]:
            raise CaseError(f"requests.jsonl line {i + 1}: arrival_step decreases")
    pending_keys = [r["arrival_step"] for r in pending]
    added: list[dict] = []
    seen_ids: set[str] = set()
    reqs: dict[str, Request] = {}
    specs: dict[str, dict] = {}
    info: dict[str, dict] = {}
    steps: list[dict] = []
    next_job_id = [0]
    admit_from = (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                  RequestStatus.WAITING_FOR_REMOTE_KVS)

    def arrivals(step):
        while pending and pending[0]["arrival_step"] <= step:
            spec = pending.pop(0)
            pending_keys.pop(0)
            if spec["arrival_step"] != step:
                raise CaseError(f"request {spec['request_id']}: arrival_step "
                                f"{spec['arrival_step']} is in the past at step {step}")
            rid = str(spec["request_id"])
            if rid in seen_ids:
                raise CaseError(f"duplicate request_id {rid!r}")
            seen_ids.add(rid)
            validate_request(spec, cfg, f"request {rid}")
            req = Request(
                request_id=rid,
                prompt_token_ids=list(spec["prompt_token_ids"]),
                sampling_params=SamplingParams(
                    max_tokens=len(spec["output_token_ids"]), ignore_eos=True),
                pooling_params=None,
                arrival_time=float(len(added)),
                priority=int(spec["priority"]),
                block_hasher=hasher,
            )
            added.append(spec)
            reqs[rid] = req
            specs[rid] = spec
            info[rid] = dict(request_id=rid, admissions=[], num_preemptions=0,
                             first_scheduled_step=None, finish_step=None)
            sched.add_request(req)

    def do_schedule(step, tick):
        """One schedule() (the connector builds its metadata inside it); the
        batch's jobs go to the worker.  Returns (scheduler_output, samplers,
        part of the step record)."""
        before = {rid: r.status for rid, r in sched.requests.items()}
        preempt_order.clear()
        in_schedule[0] = True
        try:
            so = sched.schedule()
        finally:
            in_schedule[0] = False
        meta = so.kv_connector_metadata
        if not isinstance(meta, OffloadingConnectorMetadata):
            raise CaseError(f"step {step}: no OffloadingConnectorMetadata")
        if sorted(preempt_order) != sorted(so.preempted_req_ids or []):
            raise CaseError("preemption observer disagrees with SchedulerOutput")
        # connector jobs created in this schedule, in job-id order.  Job ids
        # come from one counter (loads and stores): this schedule's loads,
        # then its stores, take the next ids in that order.
        new_ids = sorted(meta.load_jobs) + sorted(meta.store_jobs)
        if new_ids != list(range(next_job_id[0], cs._job_counter)):
            raise CaseError(f"step {step}: job ids {new_ids} not the next "
                            f"{cs._job_counter - next_job_id[0]} ids from {next_job_id[0]}")
        next_job_id[0] = cs._job_counter
        loads = [[meta.load_jobs[j].req_id, len(cs._jobs[j].keys)]
                 for j in sorted(meta.load_jobs)]
        stores = [[meta.store_jobs[j].req_id, len(cs._jobs[j].keys)]
                  for j in sorted(meta.store_jobs)]
        if sum(n for _, n in loads) != step_obs["load_keys"]:
            raise CaseError(f"step {step}: load keys disagree with prepare_load")
        if sum(n for _, n in stores) != step_obs["store_keys"]:
            raise CaseError(f"step {step}: store keys disagree with prepare_store")
        part = dict(scheduled={}, preempted=list(preempt_order), loads=loads,
                    stores=stores, evicted=step_obs["evicted"],
                    flushed=sorted(meta.jobs_to_flush or ()))
        # the fake model's samplers: every scheduled request that is not a
        # partial prefill chunk (async: vLLM gives it an output placeholder)
        samplers = []
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs[rid]
            part["scheduled"][rid] = n
            st0 = before.get(rid)
            if st0 in admit_from:
                hit = req.num_computed_tokens - n
                ext, load_step, local = pending_load.pop(rid, (0, None, None))
                if ext:
                    # the README's definition: hit = local + external, less one
                    # when that reached num_tokens (vLLM recomputes the last token)
                    full = local + ext
                    if hit != (full - 1 if full == req.num_tokens else full):
                        raise CaseError(f"step {step}: {rid} hit {hit}, local {local}, "
                                        f"external {ext}, num_tokens {req.num_tokens}")
                info[rid]["admissions"].append(dict(
                    step=step, hit_tokens=hit, external_tokens=ext, load_step=load_step))
                if info[rid]["first_scheduled_step"] is None:
                    info[rid]["first_scheduled_step"] = step
            elif st0 != RequestStatus.RUNNING:
                raise CaseError(f"request {rid} scheduled from status {st0}")
            if not is_async and req.is_prefill_chunk != \
                    (req.num_computed_tokens < req.num_tokens):
                raise CaseError(f"request {rid}: is_prefill_chunk disagrees")
            if not req.is_prefill_chunk:
                samplers.append(rid)
        for rid in part["preempted"]:
            info[rid]["num_preemptions"] += 1
        worker.submit(meta, tick)
        return so, samplers, part

    def do_update(step, so, samplers, tick):
        """The batch's model output (with the worker's report for this tick)
        and update_from_output().  Returns (completed job ids, finished)."""
        completed, kv_out = worker.collect(tick)
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            req_ids.append(rid)
            if rid in samplers:
                k = reqs[rid].num_output_tokens
                outs = specs[rid]["output_token_ids"]
                if k < len(outs):
                    sampled.append([outs[k]])
                elif is_async:
                    sampled.append([0])  # vLLM discards it (request finished)
                else:
                    raise CaseError(f"request {rid} sampled past its outputs")
            else:
                sampled.append([])  # partial prefill chunk: nothing sampled
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        sched.update_from_output(so, mro)
        finished, new_specs = [], []
        for rid in so.num_scheduled_tokens:
            req = reqs[rid]
            if req.is_finished() and info[rid]["finish_step"] is None:
                if req.status != RequestStatus.FINISHED_LENGTH_CAPPED or \
                        list(req.output_token_ids) != list(specs[rid]["output_token_ids"]):
                    raise CaseError(f"request {rid} finished abnormally: {req.status}, "
                                    f"{req.num_output_tokens} outputs")
                info[rid]["finish_step"] = step
                finished.append(rid)
                if on_finish is not None:
                    new_specs.extend(on_finish(specs[rid], step) or [])
        for ns in new_specs:
            if ns["arrival_step"] <= step:
                raise CaseError("on_finish returned a request arriving in the past")
            pos = bisect.bisect_right(pending_keys, ns["arrival_step"])
            pending.insert(pos, ns)
            pending_keys.insert(pos, ns["arrival_step"])
        return completed, finished

    # ---- the loop ----
    step = 0
    stall = 0
    queue: collections.deque = collections.deque()  # async: batches in flight
    n_batches = 0
    while True:
        if step >= max_steps:
            raise CaseError(f"no end after {max_steps} steps")
        cur_step[0] = step
        for k in step_obs:
            step_obs[k] = 0
        # 1. arrivals
        arrivals(step)
        part = dict(scheduled={}, preempted=[], loads=[], stores=[], evicted=0,
                    flushed=[])
        completed, finished = [], []
        sched_batch = upd_batch = None
        if not is_async:
            # 2. schedule, 3. fake model + worker, 4. update (one batch per step)
            so, samplers, part = do_schedule(step, step)
            completed, finished = do_update(step, so, samplers, step)
        else:
            # one EngineCore.step_with_batch_queue (2 batches in flight)
            update_now = True
            if sched.has_requests():
                so, samplers, part = do_schedule(step, n_batches)
                queue.appendleft((so, samplers, n_batches))
                sched_batch = n_batches
                n_batches += 1
                executed = so.total_num_scheduled_tokens > 0
                if len(queue) < 2 and (executed or sched.has_requests()):
                    update_now = False  # schedule-only step
            elif not queue:
                update_now = False  # idle step
            if update_now:
                so, samplers, upd_batch = queue.pop()
                completed, finished = do_update(step, so, samplers, upd_batch)
        # record
        rec = dict(step=step, scheduled=part["scheduled"], preempted=part["preempted"],
                   finished=finished,
                   num_free_blocks=pool.get_num_free_blocks(),
                   num_cached_blocks=len(pool.cached_block_hash_to_block))
        rec["offload"] = dict(
            loads=part["loads"],
            stores=part["stores"],
            evicted=part["evicted"],
            flushed=part["flushed"],
            completed=completed,
            cpu_used_chunks=manager._num_allocated_chunks - len(manager._free_list),
            waiting_for_kv=sorted(rid for rid, r in sched.requests.items()
                                  if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS),
        )
        if is_async:
            rec["offload"]["scheduled_batch"] = sched_batch
            rec["offload"]["updated_batch"] = upd_batch
        totals["store_failed"] += step_obs["store_failed"]
        totals["store_calls"] += step_obs["store_calls"]
        steps.append(rec)
        if rec["scheduled"] or completed or part["loads"] or part["stores"] or finished:
            stall = 0
        else:
            stall += 1
            if stall > max_stall_steps and (sched.get_num_unfinished_requests() or cs._jobs):
                raise CaseError(f"stalled at step {step}: {len(cs._jobs)} jobs, "
                                f"{sched.get_num_unfinished_requests()} unfinished")
        step += 1
        # end: every request arrived, not Scheduler.has_requests() (no
        # unfinished request, no finished_req_ids not yet handed to a
        # schedule(), no connector job in flight) and (async) no batch in
        # flight: vLLM's EngineCore.has_work() is False.
        if not pending and not sched.has_requests() and not queue:
            if sched.get_num_unfinished_requests() or cs._jobs or sched.finished_req_ids:
                raise CaseError("has_requests() is False but work remains")
            if not is_async and rec["finished"]:
                raise CaseError("run ends in a step that finished a request")
            break
    # ---- sanity ----
    for rid, v in info.items():
        if v["finish_step"] is None:
            raise CaseError(f"request {rid} never finished")
        if len(v["admissions"]) != v["num_preemptions"] + 1:
            raise CaseError(f"request {rid}: admissions/preemptions mismatch")
    if pending_load:
        raise CaseError(f"loads never consumed by an admission: {sorted(pending_load)}")
    if sched.deferred_frees or sched.deferred_loads:
        raise CaseError("deferred block frees / loads left at the end")
    if steps[-1]["num_free_blocks"] != int(cfg["num_blocks"]) - 1:
        raise CaseError("GPU blocks leaked at the end of the run")
    if worker.pending:
        raise CaseError(f"worker still holds jobs {sorted(worker.pending)}")
    if is_async and worker.last_collected != n_batches - 1:
        raise CaseError("not every batch was updated")
    if cs._jobs or cs._req_status or cs._block_id_to_pending_jobs:
        raise CaseError("connector scheduler still holds jobs / request state")
    if manager._num_write_pending_chunks != 0:
        raise CaseError("CPU chunks still write-pending at the end")
    pinned = [k for k in _resident_keys(manager) if manager._policy.get(k).ref_cnt != 0]
    if pinned:
        raise CaseError(f"{len(pinned)} CPU chunks still pinned at the end")
    if len(_resident_keys(manager)) != steps[-1]["offload"]["cpu_used_chunks"]:
        raise CaseError("CPU used chunks != resident keys")
    exp_requests = [info[str(s["request_id"])] for s in added]
    geometry["store_failed"] = totals["store_failed"]
    geometry["lookup_deferred"] = totals["lookup_deferred"]
    geometry["deferred_frees"] = totals["deferred_frees"]
    geometry["cow_copies"] = totals["cow_copies"]
    geometry["preempt_gated"] = totals["preempt_gated"]
    geometry["batches"] = n_batches if is_async else len(steps)
    return added, exp_requests, steps, geometry


def _resident_keys(manager) -> list:
    pol = manager._policy
    if hasattr(pol, "chunks"):  # LRU
        return list(pol.chunks)
    return list(pol.t1) + list(pol.t2)  # ARC


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------
def full_config(cfg: dict, geometry: dict) -> dict:
    out = {k: cfg[k] for k in CONFIG_KEYS}
    out.update({k: cfg[k] for k in OPTIONAL_CONFIG_KEYS if k in cfg})
    ko = dict(cfg["kv_offload"])
    ko["kv_bytes_per_chunk"] = geometry["kv_bytes_per_chunk"]
    ko["num_cpu_chunks"] = geometry["num_cpu_chunks"]
    out["kv_offload"] = {k: ko[k] for k in OFFLOAD_KEYS}
    return out


def write_case(case_dir: str, cfg: dict, requests: list[dict],
               exp_requests: list[dict], exp_steps: list[dict], geometry: dict) -> None:
    os.makedirs(case_dir, exist_ok=True)
    write_json(os.path.join(case_dir, "config.json"), full_config(cfg, geometry))
    write_jsonl(os.path.join(case_dir, "requests.jsonl"),
                [{k: r[k] for k in REQUEST_KEYS} for r in requests])
    write_jsonl(os.path.join(case_dir, "expected_requests.jsonl"), exp_requests)
    write_jsonl(os.path.join(case_dir, "expected_steps.jsonl"), exp_steps)


def summarize(cfg: dict, exp_requests: list[dict], exp_steps: list[dict],
              geometry: dict) -> dict:
    adm = [a for r in exp_requests for a in r["admissions"]]
    waits = [a["step"] - a["load_step"] for a in adm if a["load_step"] is not None]
    off = [s["offload"] for s in exp_steps]
    return dict(
        requests=len(exp_requests),
        steps=len(exp_steps),
        cpu_chunks=geometry["num_cpu_chunks"],
        admissions_with_external=sum(a["external_tokens"] > 0 for a in adm),
        external_tokens=sum(a["external_tokens"] for a in adm),
        gpu_hit_tokens=sum(a["hit_tokens"] for a in adm),
        load_jobs=sum(len(o["loads"]) for o in off),
        store_jobs=sum(len(o["stores"]) for o in off),
        stored_keys=sum(n for o in off for _, n in o["stores"]),
        evicted=sum(o["evicted"] for o in off),
        flushes=sum(len(o["flushed"]) for o in off),
        flush_steps=sum(bool(o["flushed"]) for o in off),
        max_load_wait=max(waits, default=0),
        load_waits_over_1=sum(w > 1 for w in waits),
        max_cpu_used=max(o["cpu_used_chunks"] for o in off),
        store_failed=geometry.get("store_failed", 0),
        lookup_deferred=geometry.get("lookup_deferred", 0),
        odd_hits=sum(a["hit_tokens"] % 16 != 0 for a in adm),
        preemptions=sum(r["num_preemptions"] for r in exp_requests),
    ) | (dict(
        batches=geometry.get("batches"),
        empty_batches=sum(o["scheduled_batch"] is not None and not s["scheduled"]
                          for s, o in zip(exp_steps, off)),
        schedule_only_steps=sum(o["scheduled_batch"] is not None and
                                o["updated_batch"] is None for o in off),
        update_only_steps=sum(o["scheduled_batch"] is None and
                              o["updated_batch"] is not None for o in off),
        min_load_wait=min(waits, default=0),
        deferred_frees=geometry.get("deferred_frees", 0),
        cow_copies=geometry.get("cow_copies", 0),
        preempt_gated=geometry.get("preempt_gated", 0),
    ) if cfg["async_scheduling"] else {})


# --------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------
def toks(rng, n):
    return [rng.randrange(1000, 40000) for _ in range(n)]


def out_toks(rng, n):
    return [rng.randrange(50000, 60000) for _ in range(n)]


def req(rid, step, prompt, out, prio=0):
    return dict(request_id=rid, arrival_step=step, prompt_token_ids=prompt,
                output_token_ids=out, priority=prio)


def extra_out_tokens(rid: str, n: int) -> list[int]:
    # seeded by the request id (random.Random hashes a str seed with SHA-512,
    # independent of PYTHONHASHSEED)
    rng = random.Random(f"extra-output-{rid}")
    return out_toks(rng, n)


class Conversations:
    """Seeded multi-turn / shared-prefix workload.

    ``n_conv`` conversations start every ~``start_gap`` steps.  A first turn is
    [system prompt] + [shared document] + question; each later turn is the
    previous prompt + its output + a new user message and arrives ``think``
    steps after the previous turn finished (dynamic arrivals; the written
    requests.jsonl is static).  Some conversations re-ask an earlier
    conversation's first prompt (``p_repeat``), so prefixes come back long
    after the GPU pool has reused their blocks.  Prompts are capped at
    ``max_prompt`` tokens (the conversation ends there)."""

    def __init__(self, seed, n_conv, *, turns, first_user, user_len, olen, think,
                 start_gap, n_sys, sys_lens, n_docs, doc_lens, p_doc, p_sys,
                 p_repeat, max_prompt, min_prompt=100, max_model_len=2048, p_aligned=0.0,
                 prefix="c"):
        rng = random.Random(seed)
        self.max_prompt = max_prompt
        self.max_model_len = max_model_len
        systems = [toks(rng, rng.choice(sys_lens)) for _ in range(n_sys)]
        docs = [toks(rng, rng.randint(*doc_lens)) for _ in range(n_docs)]
        self.convs = []
        firsts = []
        step = 0
        for c in range(n_conv):
            T = rng.randint(*turns)
            if firsts and rng.random() < p_repeat:
                first = list(rng.choice(firsts))
            else:
                first = []
                if rng.random() < p_sys:
                    first += rng.choice(systems)
                if rng.random() < p_doc:
                    first += rng.choice(docs)
                first += toks(rng, rng.randint(*first_user))
                if len(first) < min_prompt:
                    first += toks(rng, min_prompt - len(first))
                first = first[:max_prompt]
                if rng.random() < p_aligned:  # block-aligned: a full-prompt hit
                    first = first[:len(first) // 16 * 16]
                firsts.append(first)
            users = [toks(rng, rng.randint(*user_len)) for _ in range(T - 1)]
            outs = [out_toks(rng, rng.randint(*olen)) for _ in range(T)]
            thinks = [rng.randint(*think) for _ in range(T)]
            self.convs.append(dict(id=f"{prefix}{c:03d}", start=step, T=T, first=first,
                                   users=users, outs=outs, think=thinks))
            step += int(rng.expovariate(1.0 / start_gap)) if start_gap > 0 else 0
        self.by_rid = {}
        # request id -> extra output tokens (see make_case: same-step finishes)
        self.extra_out: dict[str, int] = {}

    def _make(self, conv, t, step, prev_prompt=None, prev_out=None):
        if t == 0:
            prompt = conv["first"]
        else:
            prompt = prev_prompt + prev_out + conv["users"][t - 1]
        rid = f"{conv['id']}t{t}"
        o = conv["outs"][t] + extra_out_tokens(rid, self.extra_out.get(rid, 0))
        if len(prompt) > self.max_prompt or len(prompt) + len(o) > self.max_model_len:
            return None  # conversation ends (context full)
        self.by_rid[rid] = (conv, t)
        return req(rid, step, list(prompt), list(o))

    def initial(self):
        return [r for r in (self._make(c, 0, c["start"]) for c in self.convs) if r]

    def on_finish(self, spec, step):
        conv, t = self.by_rid[spec["request_id"]]
        if t + 1 >= conv["T"]:
            return []
        r = self._make(conv, t + 1, step + conv["think"][t],
                       spec["prompt_token_ids"], spec["output_token_ids"])
        return [r] if r else []


FULL = {"kind": "full_attention"}
MAMBA = {"kind": "mamba", "mamba_cache_mode": "align"}


def SWA(w):
    return {"kind": "sliding_window", "sliding_window": w}


def config(groups, num_blocks, max_num_seqs, budget, description, *, cpu_chunks,
           policy, load_steps=1, store_steps=1, bytes_per_chunk, max_model_len=2048,
           reserve=True, async_scheduling=False, retention=0):
    """``retention``: prefix_cache_retention_interval on both sides (CacheConfig, so the
    connector, and KVCacheConfig, so the GPU cache): vLLM's engine default 0; None =
    dense (written as null)."""
    return {
        "vllm_version": VLLM_VERSION,
        "kv_cache_groups": groups,
        "block_size": 16,
        "num_blocks": num_blocks,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "long_prefill_token_threshold": 0,
        "enable_chunked_prefill": True,
        "scheduling_policy": "fcfs",
        "watermark": 0.0,
        "scheduler_reserve_full_isl": reserve,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": "sha256",
        "async_scheduling": async_scheduling,
        "description": description,
        "kv_offload": {
            # sized in whole chunks: vLLM gives cpu_bytes_to_use // kv_bytes_per_chunk
            "cpu_bytes_to_use": cpu_chunks * bytes_per_chunk,
            "eviction_policy": policy,
            "kv_bytes_per_chunk": None,   # filled from what vLLM computes
            "num_cpu_chunks": None,
            "load_steps": load_steps,
            "store_steps": store_steps,
        },
        "prefix_cache_retention_interval": retention,
    }


# vLLM rounds each chunk up to mmap.PAGESIZE; with these page sizes (512-byte
# attention blocks, 128-byte Mamba states) one chunk is one page.
PAGE = 4096


def workload(seed, n_conv=26, **kw):
    base = dict(turns=(1, 4), first_user=(40, 500), user_len=(20, 160), olen=(4, 32),
                think=(20, 90), start_gap=6, n_sys=3, sys_lens=(64, 160, 272),
                n_docs=5, doc_lens=(200, 600), p_doc=0.6, p_sys=0.75, p_repeat=0.25,
                max_prompt=1500, p_aligned=0.3)
    base.update(kw)
    return Conversations(seed, n_conv, **base)


def offload_cases():
    """name -> () -> (config, workload factory).  The factory builds a fresh
    Conversations object (its ``extra_out`` is set by make_case)."""
    cases = {}

    def full(policy, seed):
        return lambda: (config(
            [FULL], 160, 4, 512,
            f"full attention, 159 usable GPU blocks, CPU tier ({policy}, 400 chunks) "
            "smaller than the reused prefixes: GPU-evicted prefixes come back from "
            "the CPU tier; CPU evictions",
            cpu_chunks=400, policy=policy, bytes_per_chunk=PAGE),
            lambda: workload(seed, n_conv=24))

    def swa(policy, seed):
        return lambda: (config(
            [FULL, SWA(64)], 200, 4, 512,
            f"full + sliding window 64, CPU tier ({policy}, 700 chunks): both groups "
            "offloaded per 16-token chunk, SWA chunks only where reachable; SWA "
            "lookups need the window",
            cpu_chunks=700, policy=policy, bytes_per_chunk=PAGE),
            lambda: workload(seed, n_conv=24))

    def mamba(policy, seed):
        return lambda: (config(
            [FULL, MAMBA], 200, 4, 512,
            f"full + mamba (align), CPU tier ({policy}, 500 chunks): Mamba boundary "
            "states offloaded one job per state (take_boundary_state_offloads)",
            cpu_chunks=500, policy=policy, bytes_per_chunk=PAGE),
            lambda: workload(seed, n_conv=24))

    def full_slow():
        return (config(
            [FULL], 130, 6, 512,
            "full attention, slow transfers (loads 3 steps, stores 4 steps), 129 "
            "usable GPU blocks, scheduler_reserve_full_isl false, short outputs: "
            "requests wait for loads, preemptions flush pending stores, GPU blocks "
            "of finished requests reused while their stores are pending flush them",
            cpu_chunks=400, policy="lru", load_steps=3, store_steps=4,
            bytes_per_chunk=PAGE, reserve=False),
            lambda: workload(9115, n_conv=22, start_gap=4, think=(10, 60),
                             olen=(1, 10)))

    cases["offload_full_lru"] = full("lru", 9101)
    cases["offload_full_arc"] = full("arc", 9101)
    cases["offload_swa_lru"] = swa("lru", 9102)
    cases["offload_swa_arc"] = swa("arc", 9102)
    cases["offload_mamba_lru"] = mamba("lru", 9103)
    cases["offload_mamba_arc"] = mamba("arc", 9103)
    cases["offload_full_lru_slow"] = full_slow

    # asynchronous scheduling (AsyncScheduler, two batches in flight); the
    # worker's latencies count batches
    def a_full(policy, seed, n_conv=24):
        return lambda: (config(
            [FULL], 160, 4, 512,
            f"asynchronous scheduling, full attention, 159 usable GPU blocks, CPU tier "
            f"({policy}, 400 chunks) smaller than the reused prefixes: GPU-evicted "
            "prefixes come back from the CPU tier; CPU evictions",
            cpu_chunks=400, policy=policy, bytes_per_chunk=PAGE, async_scheduling=True),
            lambda: workload(seed, n_conv=n_conv))

    def a_swa(policy, seed, n_conv=24):
        return lambda: (config(
            [FULL, SWA(64)], 200, 4, 512,
            f"asynchronous scheduling, full + sliding window 64, CPU tier ({policy}, "
            "700 chunks): both groups offloaded per 16-token chunk, SWA chunks only "
            "where reachable; SWA lookups need the window",
            cpu_chunks=700, policy=policy, bytes_per_chunk=PAGE, async_scheduling=True),
            lambda: workload(seed, n_conv=n_conv))

    def a_mamba(policy, seed, n_conv=24):
        return lambda: (config(
            [FULL, MAMBA], 200, 4, 512,
            f"asynchronous scheduling, full + mamba (align), CPU tier ({policy}, 500 "
            "chunks): Mamba boundary states offloaded one job per state",
            cpu_chunks=500, policy=policy, bytes_per_chunk=PAGE, async_scheduling=True),
            lambda: workload(seed, n_conv=n_conv))

    def a_full_slow():
        return (config(
            [FULL], 130, 6, 512,
            "asynchronous scheduling, full attention, slow transfers (loads 3 batches, "
            "stores 2 batches), ARC, 129 usable GPU blocks, scheduler_reserve_full_isl "
            "false, short outputs: requests wait for loads, pending stores flushed "
            "when their GPU blocks are reused, preemptions",
            cpu_chunks=400, policy="arc", load_steps=3, store_steps=2,
            bytes_per_chunk=PAGE, reserve=False, async_scheduling=True),
            lambda: workload(9115, n_conv=22, start_gap=4, think=(10, 60),
                             olen=(1, 10)))

    # (17 and 18 conversations: keeps each case directory under 400 KB)
    cases["offload_async_full_lru"] = a_full("lru", 9101, n_conv=17)
    cases["offload_async_swa_arc"] = a_swa("arc", 9102, n_conv=18)
    cases["offload_async_mamba_lru"] = a_mamba("lru", 9103)
    cases["offload_async_full_arc_slow"] = a_full_slow

    # dense retention (prefix_cache_retention_interval null on both sides: every
    # reachable sliding-window chunk and Mamba state is cached on the GPU and offered
    # to the connector), the same workloads as their retention-0 namesakes
    def dense(make):
        def fn():
            cfg, wl = make()
            cfg = dict(cfg, prefix_cache_retention_interval=None,
                       description=cfg["description"] + "; dense retention "
                       "(prefix_cache_retention_interval null: GPU cache and connector)")
            return cfg, wl
        return fn

    cases["offload_swa_lru_dense"] = dense(swa("lru", 9102))
    cases["offload_mamba_lru_dense"] = dense(mamba("lru", 9103))
    cases["offload_async_mamba_lru_dense"] = dense(a_mamba("lru", 9103))
    return cases


def make_case(cfg: dict, make_workload, max_rounds: int = 300):
    """Run the workload; while some step finishes two or more requests, give
    one of them (the largest id) one more output token and run again.

    Why: vLLM hands the requests that finished in a step to the connector as a
    Python set (SchedulerOutput.finished_req_ids); the connector scheduler
    iterates it to build their last store jobs and to call the CPU manager's
    on_request_finished, which sets LRU recency / ARC frequency.  The order of
    a set of str depends on PYTHONHASHSEED, so a case with two finishes in one
    step has no hash-seed-independent answer.  Cases here have at most one
    finish per step."""
    extra: dict[str, int] = {}
    for _ in range(max_rounds):
        w = make_workload()
        w.extra_out = dict(extra)
        reqs = sorted(w.initial(), key=lambda r: r["arrival_step"])  # stable
        added, exp_req, exp_steps, geo = run_case(cfg, reqs, on_finish=w.on_finish)
        clash = next((s for s in exp_steps if len(s["finished"]) > 1), None)
        if clash is None:
            geo["extra_out"] = extra
            return added, exp_req, exp_steps, geo
        rid = max(clash["finished"])
        extra[rid] = extra.get(rid, 0) + 1
    raise CaseError(f"could not remove same-step finishes in {max_rounds} rounds")


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def _sizes(d):
    return {f: os.path.getsize(os.path.join(d, f)) for f in
            ("requests.jsonl", "expected_requests.jsonl", "expected_steps.jsonl")}


def cmd_make(args) -> int:
    cases = offload_cases()
    only = [x for x in args.only.split(",") if x]
    unknown = [x for x in only if x not in cases]
    if unknown:
        print(f"unknown case(s): {unknown}; known: {sorted(cases)}")
        return 2
    rc = 0
    for name, fn in cases.items():
        if only and name not in only:
            continue
        t0 = time.time()
        cfg, make_workload = fn()
        try:
            added, exp_req, exp_steps, geo = make_case(cfg, make_workload)
        except Exception as e:  # report and go on with the other cases
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            rc = 1
            continue
        d = os.path.join(args.out, name)
        write_case(d, cfg, added, exp_req, exp_steps, geo)
        summ = summarize(cfg, exp_req, exp_steps, geo)
        summ["extra_output_tokens"] = sum(geo["extra_out"].values())
        summ["bytes"] = _sizes(d)
        summ["seconds"] = round(time.time() - t0, 1)
        print(f"{name}: {json.dumps(summ)}", flush=True)
    return rc


def cmd_run(case_dirs, check: bool) -> int:
    rc = 0
    for d in case_dirs:
        t0 = time.time()
        try:
            with open(os.path.join(d, "config.json")) as f:
                cfg = json.load(f)
            requests = read_jsonl(os.path.join(d, "requests.jsonl"))
            added, exp_req, exp_steps, geo = run_case(cfg, requests)
        except CaseError as e:
            print(f"{d}: ERROR {e}")
            rc = 1
            continue
        if check:
            old_req = read_jsonl(os.path.join(d, "expected_requests.jsonl"))
            old_steps = read_jsonl(os.path.join(d, "expected_steps.jsonl"))
            same = old_req == exp_req and old_steps == exp_steps and \
                full_config(cfg, geo) == cfg
            print(f"{d}: {'SAME' if same else 'DIFFERENT'} ({time.time() - t0:.1f}s)")
            rc |= 0 if same else 1
        else:
            write_json(os.path.join(d, "config.json"), full_config(cfg, geo))
            write_jsonl(os.path.join(d, "expected_requests.jsonl"), exp_req)
            write_jsonl(os.path.join(d, "expected_steps.jsonl"), exp_steps)
            print(f"{d}: {json.dumps(summarize(cfg, exp_req, exp_steps, geo))} "
                  f"({time.time() - t0:.1f}s)")
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make":
        p = argparse.ArgumentParser(prog="gen_offload_golden.py make")
        p.add_argument("--out", default=DEFAULT_OUT)
        p.add_argument("--only", default="")
        return cmd_make(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case_dirs", nargs="+")
    p.add_argument("--check", action="store_true",
                   help="re-run and compare with the existing files")
    args = p.parse_args(argv)
    return cmd_run(args.case_dirs, args.check)


if __name__ == "__main__":
    sys.exit(main())
