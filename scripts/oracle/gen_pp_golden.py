#!/usr/bin/env python3
"""Golden cases for vLLM 0.33's pipeline parallelism: the batch queue of depth
``pipeline_parallel_size`` with the synchronous scheduler (``pp_*``), and of depth
``pipeline_parallel_size + 1`` with the asynchronous one (``pp_async_*``).

Synchronous cases build vLLM's *real* v1 ``Scheduler`` from a ``VllmConfig`` whose
``ParallelConfig`` has ``pipeline_parallel_size = N`` and ``async_scheduling = False``
(vLLM's ``--no-async-scheduling``), and check that vLLM itself then says
``max_concurrent_batches == N`` and sets the scheduler's ``use_pp``. Asynchronous cases
build its real ``AsyncScheduler`` with ``async_scheduling = True`` and the model runner
vLLM 0.33 picks by default (``VLLM_USE_V2_MODEL_RUNNER`` must be unset): they check that
vLLM chose the V2 runner, says ``max_concurrent_batches == N + 1`` and spaces decodes
``decode_stagger == N`` schedules apart. No worker is built: only the scheduler and the
engine core's queue loop run, with a scripted model.

One engine step = one ``EngineCore.step_with_batch_queue`` call (v1/engine/core.py):

1. ``add_request()`` every request with ``arrival_step == step``, in file order;
2. if the scheduler has requests: ``schedule()``, queue the batch; if the queue then has
   fewer than N batches and (tokens were scheduled or requests remain) the step ends;
3. otherwise, if the queue is empty the step is idle; else the oldest batch is updated:
   each request that was not a partial prefill chunk when the batch was scheduled samples
   ``output_token_ids[k]``, ``k`` = its outputs at update time (token 0 past the end; as
   ``gen_golden_async.py``'s model for asynchronous cases: vLLM drops tokens of finished
   requests and takes a preempted request's stale token);
4. the step's record: scheduled (this step's schedule), preempted, finished (this
   step's update), ``num_free_blocks``, ``num_cached_blocks``.

The run ends after the first step at whose end every request has arrived and finished
and no batch is in flight. The files are the golden format (tests/golden/README.md), with
``"pipeline_parallel_size": N`` in config.json.

Usage (the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_pp_golden.py make [--out DIR]      build and run the pp_* cases
  gen_pp_golden.py --check CASE_DIR...   re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import collections
import os
import sys

from oracle_common import CaseError, prepare_environment, tiny_model_dir  # standard library only: before vLLM

_CACHE = prepare_environment("kvtwin-pp-oracle")

import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from scripted_cases import FULL, build_groups, golden_main, workload  # noqa: E402  (after vLLM's environment)

VLLM_VERSION = "0.33.0"
CONFIG_KEYS = ["vllm_version", "kv_cache_groups", "block_size", "num_blocks", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill",
               "scheduling_policy", "watermark", "scheduler_reserve_full_isl", "enable_prefix_caching",
               "prefix_caching_hash_algo", "prefix_cache_retention_interval", "async_scheduling",
               "pipeline_parallel_size", "description"]


def build_scheduler(cfg: dict):
    """vLLM's scheduler for the case, its block hasher and the batch queue's depth."""
    if sorted(cfg) != sorted(CONFIG_KEYS):
        raise CaseError(f"config.json keys: want {sorted(CONFIG_KEYS)}, got {sorted(cfg)}")
    if cfg["vllm_version"] != vllm.__version__:
        raise CaseError("a case for the installed vLLM")
    is_async = bool(cfg["async_scheduling"])
    if is_async and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is not None:
        raise CaseError("VLLM_USE_V2_MODEL_RUNNER is set: asynchronous cases run the runner vLLM picks by default")
    pp, bs = int(cfg["pipeline_parallel_size"]), int(cfg["block_size"])
    model_config = ModelConfig(model=tiny_model_dir(_CACHE), skip_tokenizer_init=True,
                               max_model_len=int(cfg["max_model_len"]), dtype="float16")
    scheduler_config = SchedulerConfig(
        max_num_seqs=int(cfg["max_num_seqs"]), max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_model_len=int(cfg["max_model_len"]), enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]), policy=cfg["scheduling_policy"],
        watermark=float(cfg["watermark"]), scheduler_reserve_full_isl=bool(cfg["scheduler_reserve_full_isl"]),
        async_scheduling=is_async, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=bool(cfg["enable_prefix_caching"]),
                               prefix_caching_hash_algo=cfg["prefix_caching_hash_algo"],
                               prefix_cache_retention_interval=cfg["prefix_cache_retention_interval"])
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             parallel_config=ParallelConfig(pipeline_parallel_size=pp),
                             scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"))
    vllm_config.cache_config.num_gpu_blocks = int(cfg["num_blocks"])
    groups = build_groups(cfg["kv_cache_groups"], bs)
    kv_cache_config = KVCacheConfig(num_blocks=int(cfg["num_blocks"]), kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=(
                                        vllm_config.cache_config.prefix_cache_retention_interval))
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    scheduler_class = AsyncScheduler if is_async else Scheduler
    sched = scheduler_class(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                            structured_output_manager=StructuredOutputManager(vllm_config),
                            block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
    depth = pp + 1 if is_async else pp
    # What vLLM made of the settings: exactly what the case says.
    checks = dict(async_scheduling=(bool(vllm_config.scheduler_config.async_scheduling), is_async),
                  max_concurrent_batches=(vllm_config.max_concurrent_batches, depth),
                  use_pp=(sched.use_pp, pp > 1),
                  max_in_flight_tokens=(vllm_config.max_in_flight_tokens, depth * int(cfg["max_num_batched_tokens"])),
                  block_sizes=((sched_bs, hash_bs), (bs, bs)),
                  retention=(sched.kv_cache_manager.coordinator.retention_interval,
                             cfg["prefix_cache_retention_interval"]))
    if is_async:
        # The V2 runner (0.33's default) keeps async on with PP and microbatches decodes.
        checks.update(use_v2_model_runner=(sched.use_v2_model_runner, True), decode_stagger=(sched.decode_stagger, pp))
    for name, (got, want) in checks.items():
        if got != want:
            raise CaseError(f"vLLM changed {name}: asked {want!r}, effective {got!r}")
    hash_fn = get_hash_fn_by_name(cfg["prefix_caching_hash_algo"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return sched, hasher, vllm_config.max_concurrent_batches


def run_case(cfg: dict, requests: list[dict], max_steps: int = 100_000):
    """The step loop of the module docstring; returns (expected requests, expected steps)."""
    sched, hasher, depth = build_scheduler(cfg)
    pool = sched.kv_cache_manager.block_pool
    preempted: list[str] = []
    original_preempt = sched._preempt_request

    def note_preemption(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original_preempt(request, *args, **kwargs)
    sched._preempt_request = note_preemption

    pending = collections.deque(requests)
    reqs: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    info: dict[str, dict] = {}
    queue: collections.deque = collections.deque()  # newest left, oldest right (as vLLM's)
    steps: list[dict] = []
    step = 0
    while pending or sched.get_num_unfinished_requests() > 0 or queue:
        if step >= max_steps:
            raise CaseError(f"no end after {max_steps} steps")
        while pending and pending[0]["arrival_step"] == step:
            spec = pending.popleft()
            rid = spec["request_id"]
            req = Request(request_id=rid, prompt_token_ids=list(spec["prompt_token_ids"]),
                          sampling_params=SamplingParams(max_tokens=len(spec["output_token_ids"]), ignore_eos=True),
                          pooling_params=None, arrival_time=float(len(reqs)), priority=int(spec["priority"]),
                          block_hasher=hasher)
            reqs[rid], outputs[rid] = req, list(spec["output_token_ids"])
            info[rid] = dict(request_id=rid, admissions=[], num_preemptions=0, first_scheduled_step=None,
                             finish_step=None)
            sched.add_request(req)
        if pending and pending[0]["arrival_step"] < step:
            raise CaseError("arrival_step must not decrease")
        rec = dict(step=step, scheduled={}, preempted=[], finished=[])
        update = True
        if sched.has_requests():
            before = {rid: r.status for rid, r in sched.requests.items()}
            preempted.clear()
            so = sched.schedule()
            rec["preempted"] = list(preempted)
            for rid in preempted:
                info[rid]["num_preemptions"] += 1
            samplers = set()
            for rid, n in so.num_scheduled_tokens.items():
                rec["scheduled"][rid] = n
                if before.get(rid) in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    info[rid]["admissions"].append(dict(step=step, hit_tokens=reqs[rid].num_computed_tokens - n))
                    if info[rid]["first_scheduled_step"] is None:
                        info[rid]["first_scheduled_step"] = step
                if not reqs[rid].is_prefill_chunk:
                    samplers.add(rid)
            queue.appendleft((so, samplers))
            if len(queue) < depth and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                update = False
        elif not queue:
            update = False
        if update:
            so, samplers = queue.pop()
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                k = len(reqs[rid].output_token_ids)
                outs = outputs[rid]
                sampled.append([outs[k] if k < len(outs) else 0] if rid in samplers else [])
            sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in
                                                                                         enumerate(ids)},
                                                           sampled_token_ids=sampled))
            for rid in ids:
                req = reqs[rid]
                if req.is_finished() and info[rid]["finish_step"] is None:
                    if list(req.output_token_ids) != outputs[rid]:
                        raise CaseError(f"request {rid} finished with unexpected outputs")
                    info[rid]["finish_step"] = step
                    rec["finished"].append(rid)
        rec["num_free_blocks"] = pool.get_num_free_blocks()
        rec["num_cached_blocks"] = len(pool.cached_block_hash_to_block)
        steps.append(rec)
        step += 1
    for rid, v in info.items():
        if v["finish_step"] is None:
            raise CaseError(f"request {rid} never finished")
    if steps[-1]["num_free_blocks"] != int(cfg["num_blocks"]) - 1:
        raise CaseError("blocks leaked at the end of the run")
    return [info[r["request_id"]] for r in requests], steps


# -- the cases ----------------------------------------------------------------------------



def config(pp: int, groups: list[dict], num_blocks: int, description: str, *, budget: int = 128,
           max_num_seqs: int = 16, long_prefill: int = 0, policy: str = "fcfs", caching: bool = True,
           chunked: bool = True, max_model_len: int = 512, is_async: bool = False) -> dict:
    return {"vllm_version": VLLM_VERSION, "kv_cache_groups": groups, "block_size": 16, "num_blocks": num_blocks,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": long_prefill, "enable_chunked_prefill": chunked,
            "scheduling_policy": policy, "watermark": 0.0, "scheduler_reserve_full_isl": True,
            "enable_prefix_caching": caching, "prefix_caching_hash_algo": "sha256",
            # vLLM's CacheConfig default: sliding-window blocks cached at semantic checkpoints only.
            "prefix_cache_retention_interval": 0, "async_scheduling": is_async,
            "pipeline_parallel_size": pp, "description": description}


def cases() -> dict:
    """name -> (config, requests)."""
    return {
        "pressure_pp2": (config(2, [FULL], 48, "PP=2, full attention, 47 usable blocks for 32 requests: "
                                "preemptions with batches in flight, chunked prefill (budget 128)"),
                         workload(41, 32, gap=1)),
        "prefix_pp4": (config(4, [FULL], 160, "PP=4, full attention, a 64-token prefix shared by every other "
                              "request: hits while its blocks are still in flight; long-prefill threshold 48",
                              long_prefill=48), workload(42, 28, shared=64)),
        "priority_chunked_pp3": (config(3, [FULL], 40, "PP=3, priority policy, 39 usable blocks, budget 64: "
                                        "long prompts in many chunks, priority preemptions", budget=64,
                                        policy="priority"), workload(43, 24, prompt=(60, 200), gap=3)),
        "swa_pressure_pp2": (config(2, [FULL, {"kind": "sliding_window", "sliding_window": 32}], 64,
                                    "PP=2, full attention + sliding window 32, 63 usable blocks: windowed blocks "
                                    "released by tokens processed (not in flight), preemptions"),
                             workload(44, 30, prompt=(30, 150), output=(10, 60), gap=1, shared=48, share_every=3)),
        "async_pressure_pp2": (config(2, [FULL], 48, "PP=2, asynchronous (V2 runner): 3 batches in flight, each "
                                      "request's decodes 2 schedules apart; 47 usable blocks for 32 requests: "
                                      "preemptions with placeholders and stale output in flight", is_async=True),
                               workload(45, 32, gap=1)),
        "async_prefix_pp3": (config(3, [FULL], 160, "PP=3, asynchronous (V2 runner): 4 batches in flight, decodes "
                                    "3 schedules apart; a 64-token prefix shared by every other request, long-prefill "
                                    "threshold 48", long_prefill=48, is_async=True), workload(46, 28, shared=64)),
        "async_swa_pp2": (config(2, [FULL, {"kind": "sliding_window", "sliding_window": 32}], 64,
                                 "PP=2, asynchronous (V2 runner), full attention + sliding window 32, 63 usable "
                                 "blocks: windowed blocks released by tokens processed, admission caps over 3 "
                                 "batches' tokens, preemptions", is_async=True),
                          workload(47, 30, prompt=(30, 150), output=(10, 60), gap=1, shared=48, share_every=3)),
    }


def main(argv=None) -> int:
    return golden_main(__doc__, "pp", cases, run_case, argv)


if __name__ == "__main__":
    sys.exit(main())
