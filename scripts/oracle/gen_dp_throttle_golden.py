#!/usr/bin/env python3
"""Golden cases for prefill throttling under data parallelism: one rank of a DP group
that runs in lockstep (vLLM 0.33's ``DPEngineCoreProc``, a MoE model); and, with
``data_parallel_size`` 1 in the config (gen_prefill_cadence_golden.py), the scheduler's own
local cadence of a single engine.

Builds vLLM's *real* v1 ``Scheduler`` from a ``VllmConfig`` whose ``ParallelConfig`` has
the case's ``data_parallel_size`` (2: the scheduler leaves the cadence to the engine core,
``local_prefill_interval == 1``; 1: it keeps its own, ``local_prefill_interval == N``;
both checked) and whose ``SchedulerConfig`` has ``prefill_schedule_interval = N``. A
single engine's core never throttles (``EngineCore._should_throttle_prefills``): its
steps call ``schedule(False)``. For a DP rank: The engine core's rule is applied here as
``DPEngineCoreProc._should_throttle_prefills`` applies it (v1/engine/core.py): a step
throttles when ``N > 1 and step_counter % N != 0``. The counter is a single rank's view
of the group's shared ``step_counter``: the case is one wave (the other ranks keep it
going while this one idles, so the counter is never reset within the case), the counter
is 0 at step 0 and ``_has_global_unfinished_reqs`` adds one after every step, so step
``s`` runs with ``step_counter == s``. A step on which this rank has no requests calls no
``schedule()`` (``EngineCore.step`` returns early; the rank runs a dummy batch), and is
still a step of the counter.

One step (``EngineCore.step`` for one rank):

1. ``add_request()`` every request with ``arrival_step == step``, in file order;
2. if the scheduler has requests: ``schedule(throttle_prefills)``; the scripted model
   samples ``output_token_ids[k]`` for each request past its prompt; ``update_from_output``;
3. the step's record: scheduled, preempted, finished, ``num_free_blocks``,
   ``num_cached_blocks``.

The run ends after the first step at whose end every request has arrived and finished.
The files are the golden format (tests/golden/README.md) with
``"prefill_schedule_interval": N`` and ``"data_parallel_size"`` in config.json.

Usage (the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_dp_throttle_golden.py make [--out DIR]      build and run the dp_throttle_* cases
  gen_dp_throttle_golden.py --check CASE_DIR...   re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import collections
import sys

from oracle_common import CaseError, prepare_environment, tiny_model_dir  # standard library only: before vLLM

_CACHE = prepare_environment("kvtwin-dp-throttle-oracle")

import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
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
               "prefill_schedule_interval", "data_parallel_size", "description"]


def build_scheduler(cfg: dict):
    """vLLM's scheduler for one DP rank of the case, and its block hasher."""
    if sorted(cfg) != sorted(CONFIG_KEYS):
        raise CaseError(f"config.json keys: want {sorted(CONFIG_KEYS)}, got {sorted(cfg)}")
    if cfg["vllm_version"] != vllm.__version__ or cfg["async_scheduling"]:
        raise CaseError("a synchronous case for the installed vLLM")
    bs = int(cfg["block_size"])
    model_config = ModelConfig(model=tiny_model_dir(_CACHE), skip_tokenizer_init=True,
                               max_model_len=int(cfg["max_model_len"]), dtype="float16")
    scheduler_config = SchedulerConfig(
        max_num_seqs=int(cfg["max_num_seqs"]), max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_model_len=int(cfg["max_model_len"]), enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]), policy=cfg["scheduling_policy"],
        watermark=float(cfg["watermark"]), scheduler_reserve_full_isl=bool(cfg["scheduler_reserve_full_isl"]),
        prefill_schedule_interval=int(cfg["prefill_schedule_interval"]),
        async_scheduling=False, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=bool(cfg["enable_prefix_caching"]),
                               prefix_caching_hash_algo=cfg["prefix_caching_hash_algo"],
                               prefix_cache_retention_interval=cfg["prefix_cache_retention_interval"])
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             parallel_config=ParallelConfig(data_parallel_size=int(cfg["data_parallel_size"])),
                             scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"))
    vllm_config.cache_config.num_gpu_blocks = int(cfg["num_blocks"])
    groups = build_groups(cfg["kv_cache_groups"], bs)
    kv_cache_config = KVCacheConfig(num_blocks=int(cfg["num_blocks"]), kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=(
                                        vllm_config.cache_config.prefix_cache_retention_interval))
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
    # What vLLM made of the settings: exactly what the case says, and the cadence is the
    # engine core's for a DP rank, the scheduler's own for a single engine.
    dp = int(cfg["data_parallel_size"])
    interval = int(cfg["prefill_schedule_interval"])
    checks = dict(async_scheduling=(bool(vllm_config.scheduler_config.async_scheduling), False),
                  data_parallel_size=(vllm_config.parallel_config.data_parallel_size, dp),
                  local_prefill_interval=(sched.local_prefill_interval, interval if dp == 1 else 1),
                  prefill_schedule_interval=(vllm_config.scheduler_config.prefill_schedule_interval,
                                             int(cfg["prefill_schedule_interval"])),
                  max_in_flight_tokens=(vllm_config.max_in_flight_tokens, int(cfg["max_num_batched_tokens"])),
                  block_sizes=((sched_bs, hash_bs), (bs, bs)),
                  retention=(sched.kv_cache_manager.coordinator.retention_interval,
                             cfg["prefix_cache_retention_interval"]))
    for name, (got, want) in checks.items():
        if got != want:
            raise CaseError(f"vLLM changed {name}: asked {want!r}, effective {got!r}")
    hash_fn = get_hash_fn_by_name(cfg["prefix_caching_hash_algo"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return sched, hasher


def throttles(interval: int, step_counter: int) -> bool:
    """``DPEngineCoreProc._should_throttle_prefills`` (v1/engine/core.py), restated."""
    return interval > 1 and step_counter % interval != 0


def run_case(cfg: dict, requests: list[dict], max_steps: int = 100_000):
    """The step loop of the module docstring; returns (expected requests, expected steps)."""
    sched, hasher = build_scheduler(cfg)
    interval = int(cfg["prefill_schedule_interval"])
    dp_rank = int(cfg["data_parallel_size"]) > 1
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
    steps: list[dict] = []
    step = 0
    while pending or sched.get_num_unfinished_requests() > 0:
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
        if sched.has_requests():
            before = {rid: r.status for rid, r in sched.requests.items()}
            preempted.clear()
            so = sched.schedule(throttles(interval, step) if dp_rank else False)
            rec["preempted"] = list(preempted)
            for rid in preempted:
                info[rid]["num_preemptions"] += 1
            ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                req = reqs[rid]
                rec["scheduled"][rid] = so.num_scheduled_tokens[rid]
                if before.get(rid) in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    hit = req.num_computed_tokens - so.num_scheduled_tokens[rid]
                    info[rid]["admissions"].append(dict(step=step, hit_tokens=hit))
                    if info[rid]["first_scheduled_step"] is None:
                        info[rid]["first_scheduled_step"] = step
                samples = req.num_computed_tokens >= req.num_tokens
                sampled.append([outputs[rid][len(req.output_token_ids)]] if samples else [])
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



def config(interval: int, groups: list[dict], num_blocks: int, description: str, *, budget: int = 128,
           max_num_seqs: int = 16, long_prefill: int = 0, policy: str = "fcfs", caching: bool = True,
           max_model_len: int = 512, data_parallel_size: int = 2) -> dict:
    return {"vllm_version": VLLM_VERSION, "kv_cache_groups": groups, "block_size": 16, "num_blocks": num_blocks,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": long_prefill, "enable_chunked_prefill": True,
            "scheduling_policy": policy, "watermark": 0.0, "scheduler_reserve_full_isl": True,
            "enable_prefix_caching": caching, "prefix_caching_hash_algo": "sha256",
            "prefix_cache_retention_interval": 0, "async_scheduling": False,
            "prefill_schedule_interval": interval, "data_parallel_size": data_parallel_size,
            "description": description}


def cases() -> dict:
    """name -> (config, requests)."""
    return {
        "interval4": (config(4, [FULL], 400, "DP rank, prefill_schedule_interval 4: prefills and their chunks "
                             "only on every 4th step while others decode; budget 64, long prompts in chunks",
                             budget=64), workload(51, 24, prompt=(40, 160), output=(6, 40), gap=3)),
        "interval3_capacity": (config(3, [FULL], 400, "DP rank, interval 3, max_num_seqs 4: release steps that "
                                      "cannot drain the queue (capacity bound) stop the throttle",
                                      max_num_seqs=4), workload(52, 24, gap=1)),
        "interval2_prefix_pressure": (config(2, [FULL], 48, "DP rank, interval 2, 47 usable blocks: preemptions, "
                                             "and prefix hits that leave one prompt token (admitted on a "
                                             "throttled step)", long_prefill=48),
                                      workload(53, 28, shared=64, gap=2)),
        "interval1": (config(1, [FULL], 200, "DP rank, interval 1 (vLLM's default): never throttles"),
                      workload(54, 16)),
    }


def main(argv=None) -> int:
    return golden_main(__doc__, "dp_throttle", cases, run_case, argv)


if __name__ == "__main__":
    sys.exit(main())
