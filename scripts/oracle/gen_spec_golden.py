#!/usr/bin/env python3
"""Golden cases for vLLM 0.33's speculative decoding (n-gram drafting, k draft tokens).

Drives vLLM's *real* v1 ``Scheduler`` (synchronous: ``EngineCore.step`` followed by
``post_step``, which hands the drafts to ``update_draft_token_ids``) or its
``AsyncScheduler`` (``"async_scheduling": true``: ``EngineCore.step_with_batch_queue``, two
batches in flight, draft placeholders kept by the scheduler itself), built from a
``VllmConfig`` with a real ``SpeculativeConfig(method="ngram", num_speculative_tokens=k)``.
An n-gram drafter has no model of its own, so nothing is loaded; the scheduler sees
exactly what it sees in a served engine (``num_spec_tokens = k``, no lookahead slots).

Only the model is scripted (README.md next to this file, "gen_spec_golden.py"):

* a scheduled request samples when its batch was not a partial prefill chunk;
* if the batch holds drafts for it (``scheduled_spec_decode_tokens``) and it was not
  admitted in that batch, the number accepted is the next entry of its
  ``num_accepted_tokens`` list (0 once the list is used up), capped at the drafts
  scheduled; drafts padded onto an admission are never accepted (they are placeholders);
* it samples ``1 + accepted`` tokens: its next scripted output tokens (token 0 past the
  end: vLLM trims them at the stop check); asynchronous: chosen when the batch is updated;
* synchronous: after each step that ran the model, every scheduled request gets ``k``
  draft ids (``update_draft_token_ids`` drops those of prefill chunks).

Usage (the oracle venv's python, PYTHONWARNINGS=ignore):
  gen_spec_golden.py make [--out DIR] [--only NAME,...]   build + run the spec_* cases
  gen_spec_golden.py CASE_DIR [CASE_DIR ...]              re-run, write expected_*
  gen_spec_golden.py --check CASE_DIR [CASE_DIR ...]      re-run, SAME / DIFFERENT
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import time
import types

from oracle_common import (  # noqa: E402  (standard library only: before torch and vLLM)
    GOLDEN_CASES as DEFAULT_OUT, CaseError, accept_script, atomic_write, prepare_environment, read_jsonl,
    tiny_model_dir as _tiny_model_dir, write_jsonl,
)

_CACHE = prepare_environment("kvtwin-spec-oracle")

import torch  # noqa: E402

import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         SchedulerConfig, SpeculativeConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,  # noqa: E402
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

VLLM_VERSION = "0.33.0"
CONFIG_KEYS = [
    "vllm_version", "kv_cache_groups", "block_size", "num_blocks", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
    "enable_chunked_prefill", "scheduling_policy", "watermark",
    "scheduler_reserve_full_isl", "enable_prefix_caching", "prefix_caching_hash_algo",
    "async_scheduling", "description", "speculative",
]
# Optional: prefix_cache_retention_interval (absent / null = dense, 0, or a positive multiple
# of block_size), set on CacheConfig and copied into KVCacheConfig as vLLM's planner does.
OPTIONAL_CONFIG_KEYS = ["prefix_cache_retention_interval"]
SPEC_KEYS = ["method", "num_speculative_tokens"]
REQUEST_KEYS = ["request_id", "arrival_step", "prompt_token_ids", "output_token_ids",
                "priority", "num_accepted_tokens"]
DRAFT_TOKEN = 7  # the value of every draft id (never hashed, never compared)


def tiny_model_dir() -> str:
    return _tiny_model_dir(_CACHE)


def build_groups(group_cfgs: list[dict], block_size: int, k: int) -> list[KVCacheGroupSpec]:
    """The case's groups; a Mamba group (align mode) gets ``num_speculative_blocks = k``, as
    vLLM 0.33's ``MambaBase.get_kv_cache_spec`` sets it from the speculative config."""
    groups = []
    for i, g in enumerate(group_cfgs):
        common = dict(num_kv_heads=1, head_size=8, dtype=torch.float16)
        if g.get("kind") == "full_attention":
            spec = FullAttentionSpec(block_size=block_size, **common)
        elif g.get("kind") == "sliding_window":
            spec = SlidingWindowSpec(block_size=block_size, sliding_window=int(g["sliding_window"]), **common)
        elif g.get("kind") == "mamba" and g.get("mamba_cache_mode") in ("align", "none"):
            # "none": one state block of the group's own block_size (vLLM: max_model_len).
            spec = MambaSpec(block_size=int(g.get("block_size", block_size)), shapes=((4, 8),),
                             dtypes=(torch.float32,), mamba_cache_mode=g["mamba_cache_mode"],
                             num_speculative_blocks=k,
                             num_prefill_checkpoint_blocks=int(g.get("num_prefill_checkpoint_blocks", 0)),
                             prefill_checkpoint_alignment=g.get("prefill_checkpoint_alignment"))
        else:
            raise CaseError(f"group {i}: unsupported kind {g.get('kind')!r} (full_attention, sliding_window, "
                            "mamba in align or none mode)")
        groups.append(KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec))
    return groups


HEAD_METHODS = ("eagle", "eagle3", "mtp")  # draft heads with their own KV (vLLM's use_eagle())


def validate_config(cfg: dict) -> None:
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    extra = [k for k in cfg if k not in CONFIG_KEYS + OPTIONAL_CONFIG_KEYS]
    if missing or extra:
        raise CaseError(f"config.json: missing keys {missing}, unknown keys {extra}")
    ri = cfg.get("prefix_cache_retention_interval")
    if ri is not None and (not isinstance(ri, int) or isinstance(ri, bool) or ri < 0
                           or ri % int(cfg["block_size"]) != 0):
        raise CaseError(f"prefix_cache_retention_interval {ri!r}: null, 0 or a positive multiple of block_size")
    sp = cfg["speculative"]
    keys = sorted(k for k in sp if k != "num_nextn_predict_layers")
    if keys != sorted(SPEC_KEYS) or sp["method"] not in ("ngram", *HEAD_METHODS) or \
            int(sp["num_speculative_tokens"]) < 1 or \
            ("num_nextn_predict_layers" in sp and (sp["method"] != "mtp" or int(sp["num_nextn_predict_layers"]) < 1)):
        raise CaseError("config.json speculative: {method: 'ngram', 'eagle', 'eagle3' or 'mtp', "
                        "num_speculative_tokens >= 1, for mtp optionally num_nextn_predict_layers >= 1}")
    k, mtp_layers = int(sp["num_speculative_tokens"]), int(sp.get("num_nextn_predict_layers", 1))
    if k > mtp_layers and k % mtp_layers:
        # vLLM's SpeculativeConfig refuses this for an MTP draft model (config/speculative.py
        # ~l.1600-1612: k must divide evenly over the n_predict modules it reuses); as_draft_head
        # bypasses that validation, so the harness applies it.
        raise CaseError(f"config.json speculative: num_speculative_tokens {k} must be at most "
                        f"num_nextn_predict_layers {mtp_layers} or a multiple of it (vLLM refuses it)")
    if cfg["vllm_version"] != vllm.__version__:
        raise CaseError(f"vllm_version {cfg['vllm_version']} but vllm {vllm.__version__} is installed")


def build_scheduler(cfg: dict):
    """vLLM's scheduler for the case; returns (scheduler, block hasher, k)."""
    validate_config(cfg)
    bs = int(cfg["block_size"])
    k = int(cfg["speculative"]["num_speculative_tokens"])
    method = cfg["speculative"]["method"]
    mtp_layers = int(cfg["speculative"].get("num_nextn_predict_layers", 1))
    multi = method == "mtp" and min(mtp_layers, k) > 1  # vLLM's use_multi_module_mtp()
    groups = build_groups(cfg["kv_cache_groups"], bs, k)
    model_config = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True,
                               max_model_len=int(cfg["max_model_len"]), dtype="float16")
    spec_config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                                    prompt_lookup_min=1, target_model_config=model_config,
                                    target_parallel_config=ParallelConfig())
    is_async = bool(cfg["async_scheduling"])
    scheduler_config = SchedulerConfig(
        max_num_seqs=int(cfg["max_num_seqs"]), max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        max_model_len=int(cfg["max_model_len"]), enable_chunked_prefill=bool(cfg["enable_chunked_prefill"]),
        long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]), policy=cfg["scheduling_policy"],
        watermark=float(cfg["watermark"]), scheduler_reserve_full_isl=bool(cfg["scheduler_reserve_full_isl"]),
        async_scheduling=is_async, is_encoder_decoder=False)
    caching = bool(cfg["enable_prefix_caching"])
    vllm_config = VllmConfig(model_config=model_config,
                             cache_config=CacheConfig(block_size=bs, enable_prefix_caching=caching,
                                                      prefix_caching_hash_algo=cfg["prefix_caching_hash_algo"],
                                                      prefix_cache_retention_interval=cfg.get(
                                                          "prefix_cache_retention_interval")),
                             scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"),
                             speculative_config=spec_config)
    vllm_config.cache_config.num_gpu_blocks = int(cfg["num_blocks"])
    for g in groups:
        if isinstance(g.kv_cache_spec, MambaSpec):
            vllm_config.cache_config.mamba_cache_mode = g.kv_cache_spec.mamba_cache_mode
    if method in HEAD_METHODS:
        as_draft_head(spec_config, method, mtp_layers)
    retain_prefill_lookahead(groups, vllm_config)
    kv_cache_config = KVCacheConfig(num_blocks=int(cfg["num_blocks"]), kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=(  # as kv_cache_planning sets it
                                        vllm_config.cache_config.prefix_cache_retention_interval))
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    cls = AsyncScheduler if is_async else Scheduler
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
    sc = vllm_config.scheduler_config
    head = method in HEAD_METHODS
    # Nothing we asked for may have been changed behind our back; the draft head's
    # derived settings are what vLLM 0.33 derives for a single- or multi-module head.
    prefill_lookahead = (k if multi else 1) if head else 0
    hash_lookahead = prefill_lookahead if caching else 0
    checks = dict(num_spec_tokens=(sched.num_spec_tokens, k),
                  num_lookahead_tokens=(sched.num_lookahead_tokens, k if method in HEAD_METHODS else 0),
                  num_prefill_lookahead=(sched.num_prefill_lookahead, prefill_lookahead),
                  num_hash_lookahead_tokens=(vllm_config.num_hash_lookahead_tokens, hash_lookahead),
                  scheduler_hash_lookahead=(sched.num_hash_lookahead_tokens, hash_lookahead),
                  pool_hash_lookahead=(sched.kv_cache_manager.block_pool.num_hash_lookahead_tokens, hash_lookahead),
                  block_drop=(sched.use_eagle_block_drop, head and not caching),
                  reprefillable=(sched.kv_cache_manager.coordinator.num_reprefillable_tokens,
                                 max(0, prefill_lookahead - 1)),
                  extra_retained_tokens=([m.extra_retained_tokens
                                          for m in sched.kv_cache_manager.coordinator.single_type_managers
                                          if hasattr(m, "extra_retained_tokens")],
                                         [max(0, prefill_lookahead - 1)] * sum(
                                             g.get("kind") == "sliding_window" for g in cfg["kv_cache_groups"])),
                  draft_slots=(spec_config.max_num_new_slots_for_drafting, 0),
                  max_num_scheduled_tokens=(sched.max_num_scheduled_tokens, sc.max_num_batched_tokens),
                  max_num_batched_tokens=(sc.max_num_batched_tokens, int(cfg["max_num_batched_tokens"])),
                  async_scheduling=(bool(sc.async_scheduling), is_async),
                  long_prefill_token_threshold=(sc.long_prefill_token_threshold,
                                                int(cfg["long_prefill_token_threshold"])),
                  enable_chunked_prefill=(sc.enable_chunked_prefill, bool(cfg["enable_chunked_prefill"])),
                  enable_prefix_caching=(vllm_config.cache_config.enable_prefix_caching, caching),
                  block_sizes=((sched_bs, hash_bs), (bs, bs)),
                  retention=((vllm_config.cache_config.prefix_cache_retention_interval,
                              sched.kv_cache_manager.coordinator.retention_interval),
                             (cfg.get("prefix_cache_retention_interval"),) * 2))
    for name, (got, want) in checks.items():
        if got != want:
            raise CaseError(f"vLLM changed {name}: asked {want!r}, effective {got!r}")
    hash_fn = get_hash_fn_by_name(cfg["prefix_caching_hash_algo"])
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return sched, hasher, k


def retain_prefill_lookahead(groups: list[KVCacheGroupSpec], vllm_config: VllmConfig) -> None:
    """What vLLM 0.33's planner does to the layer specs before grouping them
    (``v1/core/kv_cache_planning.py`` ~l.1636): every ``SlidingWindowSpec`` gets
    ``extra_retained_tokens = max(0, num_prefill_lookahead_tokens - 1)`` (k - 1 for
    multi-module MTP, else 0). The harness builds its groups by hand instead of running the
    planner, so it sets the field the same way, from the ``VllmConfig`` (after
    ``as_draft_head``, which decides the prefill lookahead)."""
    extra = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
    for g in groups:
        if isinstance(g.kv_cache_spec, SlidingWindowSpec):
            g.kv_cache_spec = dataclasses.replace(g.kv_cache_spec, extra_retained_tokens=extra)


def as_draft_head(spec_config, method: str, mtp_layers: int = 1) -> None:
    """Turn the validated n-gram ``SpeculativeConfig`` into a draft-head one (``method``).

    A real EAGLE / EAGLE-3 / MTP config needs the draft model's own config (its Hugging Face
    files), which this offline harness does not have; so the config is validated as n-gram
    and then only its ``method`` field is replaced, before the scheduler is built. What is
    bypassed is the draft model's validation and loading (``draft_model_config``,
    ``draft_parallel_config``): nothing the scheduler or the KV cache manager reads. They
    read the speculative config only through ``use_eagle()``, ``needs_eagle_block_drop()``,
    ``use_eagle_block_drop()``, ``use_multi_module_mtp()`` (False: no draft model config, i.e.
    a single-module MTP head, which is also what eagle/eagle3 are) and the ``VllmConfig``
    properties built on them (``num_lookahead_tokens`` = k, ``num_prefill_lookahead_tokens``
    = 1, ``num_hash_lookahead_tokens`` = 1 with caching on and no KV connector, else 0), all
    of which now follow from ``method`` exactly as in a served engine, and are checked by
    ``build_scheduler``. ``max_num_new_slots_for_drafting`` stays 0 (sequential drafting).
    With caching off vLLM leaves ``use_eagle_block_drop`` on (no lookahead hashes), which
    moves a Mamba align-mode checkpoint stop one block earlier
    (``get_mamba_prefill_checkpoint_position``); ``build_scheduler`` checks the flag.

    Multi-module MTP (``"num_nextn_predict_layers": n > 1`` with ``"method": "mtp"``, caching
    on or off): ``use_multi_module_mtp()`` reads only the draft model's
    ``hf_config.num_nextn_predict_layers``, so ``draft_model_config`` is set to a stand-in
    holding just that; vLLM then derives a prefill lookahead, a hash lookahead (caching on)
    of k and a re-prefillable tail of k - 1, checked by ``build_scheduler``."""
    object.__setattr__(spec_config, "method", method)
    if mtp_layers > 1:
        hf_config = types.SimpleNamespace(num_nextn_predict_layers=mtp_layers, model_type="mtp_stand_in")
        object.__setattr__(spec_config, "draft_model_config", types.SimpleNamespace(hf_config=hf_config))
    multi = method == "mtp" and min(mtp_layers, spec_config.num_speculative_tokens) > 1
    if not (spec_config.use_eagle() and spec_config.use_eagle_block_drop()
            and spec_config.use_multi_module_mtp() == multi):
        raise CaseError(f"vLLM does not take method {method!r} ({mtp_layers} modules) as that draft head")


def validate_request(r: dict, cfg: dict, where: str) -> None:
    missing = [key for key in REQUEST_KEYS if key not in r]
    extra = [key for key in r if key not in REQUEST_KEYS]
    if missing or extra:
        raise CaseError(f"{where}: missing keys {missing}, unknown keys {extra}")
    if not r["prompt_token_ids"] or not r["output_token_ids"]:
        raise CaseError(f"{where}: empty prompt or output")
    if len(r["prompt_token_ids"]) + len(r["output_token_ids"]) > cfg["max_model_len"]:
        raise CaseError(f"{where}: prompt + output longer than max_model_len")
    if any(not isinstance(a, int) or a < 0 for a in r["num_accepted_tokens"]):
        raise CaseError(f"{where}: num_accepted_tokens must be non-negative integers")


class ScriptedModel:
    """The scripted target model + drafter (the module docstring's rules)."""

    def __init__(self):
        self.specs: dict[str, dict] = {}
        self.accept_scripts: dict[str, collections.deque] = {}

    def add(self, rid: str, spec: dict) -> None:
        self.specs[rid] = spec
        self.accept_scripts[rid] = collections.deque(spec["num_accepted_tokens"])

    def accepted(self, rid: str, num_drafts: int, admitted: bool) -> int:
        """Decided in schedule order, once per batch that holds drafts for ``rid``."""
        if num_drafts == 0 or admitted:
            return 0
        script = self.accept_scripts[rid]
        return min(script.popleft() if script else 0, num_drafts)

    def tokens(self, req: Request, num: int) -> list[int]:
        outs = self.specs[req.request_id]["output_token_ids"]
        pos = len(req.output_token_ids)
        return [outs[pos + i] if pos + i < len(outs) else 0 for i in range(num)]


class Run:
    """The state of one case run: requests, records, the preemption observer."""

    def __init__(self, cfg: dict, requests: list[dict]):
        self.cfg = cfg
        self.sched, self.hasher, self.k = build_scheduler(cfg)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.pending = collections.deque(requests)
        self.reqs: dict[str, Request] = {}
        self.specs: dict[str, dict] = {}
        self.info: dict[str, dict] = {}
        self.added: list[dict] = []
        self.model = ScriptedModel()
        self.preempt_order: list[str] = []
        orig = self.sched._preempt_request

        def observer(request, *a, _o=orig, **kw):
            self.preempt_order.append(request.request_id)
            return _o(request, *a, **kw)
        self.sched._preempt_request = observer

    def arrivals(self, step: int) -> None:
        while self.pending and self.pending[0]["arrival_step"] <= step:
            spec = self.pending.popleft()
            if spec["arrival_step"] != step:
                raise CaseError("arrival_step decreases")
            rid = str(spec["request_id"])
            if rid in self.specs:
                raise CaseError(f"duplicate request_id {rid!r}")
            validate_request(spec, self.cfg, f"request {rid}")
            req = Request(request_id=rid, prompt_token_ids=list(spec["prompt_token_ids"]),
                          sampling_params=SamplingParams(max_tokens=len(spec["output_token_ids"]), ignore_eos=True),
                          pooling_params=None, arrival_time=float(len(self.added)), priority=int(spec["priority"]),
                          block_hasher=self.hasher)
            self.added.append(spec)
            self.reqs[rid], self.specs[rid] = req, spec
            self.model.add(rid, spec)
            self.info[rid] = dict(request_id=rid, admissions=[], num_preemptions=0, first_scheduled_step=None,
                                  finish_step=None)
            self.sched.add_request(req)

    def schedule(self, step: int, rec: dict):
        """schedule() and the batch's sampling plan: rid -> tokens to sample (None: none)."""
        before = {rid: r.status for rid, r in self.sched.requests.items()}
        self.preempt_order.clear()
        so = self.sched.schedule()
        rec["preempted"] = list(self.preempt_order)
        for rid in rec["preempted"]:
            self.info[rid]["num_preemptions"] += 1
        plan: dict[str, int | None] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            rec["scheduled"][rid] = n
            admitted = before.get(rid) in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if admitted:
                self.info[rid]["admissions"].append(dict(step=step, hit_tokens=req.num_computed_tokens - n))
                if self.info[rid]["first_scheduled_step"] is None:
                    self.info[rid]["first_scheduled_step"] = step
            elif before.get(rid) != RequestStatus.RUNNING:
                raise CaseError(f"request {rid} scheduled from status {before.get(rid)}")
            drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
            if drafts:
                rec["spec_decode_tokens"][rid] = drafts
            plan[rid] = None if req.is_prefill_chunk else 1 + self.model.accepted(rid, drafts, admitted)
        return so, plan

    def update(self, so, plan: dict, step: int, rec: dict) -> None:
        ids = list(so.num_scheduled_tokens)
        sampled = [self.model.tokens(self.reqs[rid], plan[rid]) if plan[rid] is not None else [] for rid in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        self.sched.update_from_output(so, mro)
        for rid in ids:
            req = self.reqs[rid]
            if req.is_finished() and self.info[rid]["finish_step"] is None:
                if req.status != RequestStatus.FINISHED_LENGTH_CAPPED or \
                        list(req.output_token_ids) != list(self.specs[rid]["output_token_ids"]):
                    raise CaseError(f"request {rid} finished abnormally: {req.status}, {req.num_output_tokens}")
                self.info[rid]["finish_step"] = step
                rec["finished"].append(rid)

    def record(self, rec: dict, steps: list[dict]) -> None:
        rec["num_free_blocks"] = self.pool.get_num_free_blocks()
        rec["num_cached_blocks"] = len(self.pool.cached_block_hash_to_block)
        steps.append(rec)

    def results(self, steps: list[dict]):
        for rid, v in self.info.items():
            if v["finish_step"] is None:
                raise CaseError(f"request {rid} never finished")
        if steps[-1]["num_free_blocks"] != int(self.cfg["num_blocks"]) - 1:
            raise CaseError("blocks leaked at the end of the run")
        return self.added, [self.info[str(s["request_id"])] for s in self.added], steps


def new_record(step: int) -> dict:
    return dict(step=step, scheduled={}, spec_decode_tokens={}, preempted=[], finished=[])


def run_sync(cfg: dict, requests: list[dict], max_steps: int = 20_000):
    run = Run(cfg, requests)
    steps: list[dict] = []
    step = 0
    while run.pending or run.sched.get_num_unfinished_requests() > 0:
        if step >= max_steps:
            raise CaseError(f"no end after {max_steps} steps")
        run.arrivals(step)
        rec = new_record(step)
        so, plan = run.schedule(step, rec)
        run.update(so, plan, step, rec)
        if so.total_num_scheduled_tokens > 0:
            # EngineCore.post_step: the drafter's proposals for the batch's requests.
            ids = list(so.num_scheduled_tokens)
            run.sched.update_draft_token_ids(DraftTokenIds(
                req_ids=ids, draft_token_ids=[[DRAFT_TOKEN] * run.k if plan[r] is not None else [] for r in ids]))
        run.record(rec, steps)
        step += 1
    return run.results(steps)


def run_async(cfg: dict, requests: list[dict], max_steps: int = 40_000):
    run = Run(cfg, requests)
    steps: list[dict] = []
    queue: collections.deque = collections.deque()
    step = 0
    while run.pending or run.sched.get_num_unfinished_requests() > 0 or queue:
        if step >= max_steps:
            raise CaseError(f"no end after {max_steps} steps")
        run.arrivals(step)
        rec = new_record(step)
        do_update = True
        if run.sched.has_requests():
            so, plan = run.schedule(step, rec)
            queue.appendleft((so, plan))
            if len(queue) < 2 and (so.total_num_scheduled_tokens > 0 or run.sched.has_requests()):
                do_update = False
        elif not queue:
            do_update = False
        if do_update:
            so, plan = queue.pop()
            run.update(so, plan, step, rec)
        run.record(rec, steps)
        step += 1
    return run.results(steps)


def run_case(cfg: dict, requests: list[dict]):
    return (run_async if cfg["async_scheduling"] else run_sync)(cfg, requests)


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------
def write_case(case_dir: str, cfg: dict, requests: list[dict], exp_requests: list[dict],
               exp_steps: list[dict]) -> None:
    os.makedirs(case_dir, exist_ok=True)
    atomic_write(os.path.join(case_dir, "config.json"), json.dumps(
        {k: cfg[k] for k in CONFIG_KEYS + [k for k in OPTIONAL_CONFIG_KEYS if k in cfg]}, indent=1) + "\n")
    write_jsonl(os.path.join(case_dir, "requests.jsonl"), [{k: r[k] for k in REQUEST_KEYS} for r in requests])
    write_jsonl(os.path.join(case_dir, "expected_requests.jsonl"), exp_requests)
    write_jsonl(os.path.join(case_dir, "expected_steps.jsonl"), exp_steps)


def summarize(exp_requests: list[dict], exp_steps: list[dict]) -> dict:
    return dict(requests=len(exp_requests), steps=len(exp_steps),
                preemptions=sum(r["num_preemptions"] for r in exp_requests),
                verify_steps=sum(len(s["spec_decode_tokens"]) for s in exp_steps),
                drafts=sum(sum(s["spec_decode_tokens"].values()) for s in exp_steps),
                min_free_blocks=min(s["num_free_blocks"] for s in exp_steps),
                hits=sum(a["hit_tokens"] for r in exp_requests for a in r["admissions"]))


# --------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------
FULL = {"kind": "full_attention"}
MAMBA = {"kind": "mamba", "mamba_cache_mode": "align"}
MAMBA_CHECKPOINT = {**MAMBA, "num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}


def SWA(window: int) -> dict:
    return {"kind": "sliding_window", "sliding_window": window}


def workload(seed: int, k: int, *, n: int = 16, prompt=(20, 90), output=(6, 40), gap: int = 2,
             rate: float = 0.6, shared: int = 32, max_model_len: int | None = None) -> list[dict]:
    """Seeded requests: a shared prefix for half of them, ``rate`` acceptance per draft."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 40000) for _ in range(shared)]
    reqs, step = [], 0
    for i in range(n):
        plen = rng.randint(*prompt)
        prompt_ids = (prefix if i % 2 else []) + [rng.randrange(1000, 40000) for _ in range(plen)]
        olen = rng.randint(*output)
        if max_model_len is not None:
            olen = max_model_len - len(prompt_ids)  # run into the model length
        outs = [rng.randrange(50000, 60000) for _ in range(olen)]
        reqs.append(dict(request_id=f"r{i:03d}", arrival_step=step, prompt_token_ids=prompt_ids,
                         output_token_ids=outs, priority=rng.randint(0, 2),
                         num_accepted_tokens=accept_script(rng, k, rate, olen)))
        step += rng.randint(0, gap)
    return reqs


def config(groups, num_blocks: int, k: int, description: str, *, max_num_seqs: int = 8, budget: int = 64,
           max_model_len: int = 512, async_scheduling: bool = False, policy: str = "fcfs",
           caching: bool = True, method: str = "ngram", mtp_layers: int = 1) -> dict:
    return {"vllm_version": VLLM_VERSION, "kv_cache_groups": groups, "block_size": 16, "num_blocks": num_blocks,
            "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": 0, "enable_chunked_prefill": True, "scheduling_policy": policy,
            "watermark": 0.0, "scheduler_reserve_full_isl": True, "enable_prefix_caching": caching,
            "prefix_caching_hash_algo": "sha256", "async_scheduling": async_scheduling,
            "description": description, "speculative": {"method": method, "num_speculative_tokens": k,
                                                        **({"num_nextn_predict_layers": mtp_layers}
                                                           if mtp_layers > 1 else {})}}


def spec_cases() -> dict:
    """name -> (config, requests)."""
    cases = {}
    for k in (1, 3, 5):
        cases[f"spec_full_k{k}"] = (config([FULL], 96, k, f"n-gram drafts, k={k}, full attention, roomy pool"),
                                    workload(100 + k, k))
    cases["spec_swa_full_k3"] = (config([SWA(32), FULL], 120, 3, "k=3, sliding window 32 + full attention"),
                                 workload(201, 3))
    cases["spec_pressure_k3"] = (config([FULL], 28, 3, "k=3, 27 usable blocks: preemptions", budget=96),
                                 workload(301, 3, n=18, gap=1))
    cases["spec_priority_pressure_k5"] = (
        config([FULL], 30, 5, "k=5, priority policy under pressure", budget=96, policy="priority"),
        workload(302, 5, n=18, gap=1))
    cases["spec_max_model_len_k5"] = (
        config([FULL], 96, 5, "k=5, every request runs into max_model_len 128", max_model_len=128),
        workload(401, 5, n=10, prompt=(30, 80), max_model_len=128))
    cases["spec_async_k3"] = (config([FULL], 96, 3, "k=3, asynchronous scheduling", async_scheduling=True),
                              workload(501, 3))
    cases["spec_async_pressure_k3"] = (
        config([FULL], 28, 3, "k=3, asynchronous, 27 usable blocks: preemptions", budget=96,
               async_scheduling=True), workload(502, 3, n=18, gap=1))
    cases["spec_async_swa_full_k5"] = (
        config([SWA(32), FULL], 120, 5, "k=5, asynchronous, sliding window 32 + full", async_scheduling=True),
        workload(503, 5))
    cases["spec_nocache_k3"] = (config([FULL], 96, 3, "k=3, prefix caching off", caching=False), workload(601, 3))
    cases["spec_budget_k5"] = (
        config([FULL], 160, 5, "k=5, budget 27 for up to 12 requests: drafts clipped by the budget",
               max_num_seqs=12, budget=27), workload(701, 5, n=16, prompt=(10, 40), output=(60, 120), gap=0, rate=0.5))
    cases["spec_padding_k3"] = (config([FULL], 96, 3, "k=3, repeated prompts of 2 blocks + 1 token: full hits "
                                       "admitted as padded decodes"), padding_workload(801, 3))
    cases["spec_async_padding_k3"] = (
        config([FULL], 96, 3, "k=3, asynchronous, repeated prompts of 2 blocks + 1 token", async_scheduling=True),
        padding_workload(802, 3))
    cases["spec_eagle_nocache_k3"] = (
        config([FULL], 40, 3, "EAGLE-style drafter, k=3: 3 lookahead slots per step, caching off, tight pool",
               caching=False, budget=96, method="eagle"), workload(1001, 3, n=16, gap=1))
    cases["spec_async_eagle_nocache_k5"] = (
        config([FULL], 40, 5, "EAGLE-style drafter, k=5, asynchronous, caching off, tight pool", caching=False,
               budget=96, method="eagle", async_scheduling=True), workload(1002, 5, n=16, gap=1))
    cases["spec_eagle_swa_nocache_k3"] = (
        config([SWA(32), FULL], 120, 3, "EAGLE-style drafter, k=3, sliding window 32 + full, caching off",
               caching=False, method="eagle", max_model_len=128), workload(1003, 3, n=12, prompt=(20, 60),
                                                                         max_model_len=128))
    cases["spec_async_priority_pressure_k1"] = (
        config([FULL], 28, 1, "k=1, asynchronous, priority policy, 27 usable blocks: preemptions", budget=96,
               async_scheduling=True, policy="priority"), workload(901, 1, n=18, gap=1))
    cfg = config([FULL], 96, 3, "k=3, chunked prefill off (budget 512 >= max_model_len), repeated prompts",
                 budget=512)
    cfg["enable_chunked_prefill"] = False
    cases["spec_no_chunking_k3"] = (cfg, padding_workload(902, 3))
    cfg = config([FULL], 96, 3, "k=3, long_prefill_token_threshold 24, budget 64")
    cfg["long_prefill_token_threshold"] = 24
    cases["spec_long_prefill_k3"] = (cfg, workload(903, 3))
    cases["spec_async_eagle_swa8_budget4_k3"] = swa_lookahead_case()
    cases.update(mamba_cases())
    cases.update(eagle_cache_cases())
    cases.update(mtp_swa_cases())
    return cases


def mtp_swa_cases() -> dict:
    """Multi-module MTP on sliding-window layouts under pressure: vLLM's planner makes every
    sliding-window group retain the ``k - 1`` tokens below its window that the drafter may
    re-prefill (``extra_retained_tokens``, ``retain_prefill_lookahead``), so window blocks
    are freed later and the admission cap is larger. Each case differs from the same run
    without the retained tail (admissions, scheduled tokens, free blocks)."""
    text = "3-module MTP k=3, the sliding window retains 2 more tokens: "
    return {
        "spec_mtp3_cache_swa_pressure_k3": (
            config([SWA(32), FULL], 24, 3, text + "sliding window 32 + full, 23 usable blocks, preemptions",
                   method="mtp", budget=48, mtp_layers=3), workload(1301, 3, n=16, gap=1)),
        "spec_async_mtp3_swa_pressure_nocache_k3": (
            config([SWA(32), FULL], 24, 3, text + "asynchronous, caching off, sliding window 32 + full, 23 usable "
                   "blocks, preemptions", method="mtp", budget=48, mtp_layers=3, caching=False,
                   async_scheduling=True), workload(1302, 3, n=16, gap=1)),
        "spec_mtp3_swa_only_nocache_k3": (
            config([SWA(32)], 8, 3, text + "sliding window 32 alone, caching off, 7 usable blocks: the admission "
                   "cap (7 blocks, 6 without the tail) is the whole pool", method="mtp", budget=48, mtp_layers=3,
                   caching=False), workload(1303, 3, n=12, gap=1)),
    }


def swa_lookahead_case() -> tuple[dict, list[dict]]:
    """A head's lookahead reaching past the sliding window's admission cap (found by the
    twin's hypothesis tests): with a 4-token budget and 3 lookahead slots a request holds 3
    window blocks, where the cap (window plus the batches' tokens in flight) gives 2."""
    cfg = config([FULL, SWA(8)], 15, 3, "EAGLE k=3, asynchronous, caching off, a 4-token budget: the head's "
                 "3 lookahead slots reach past the sliding window's admission cap", max_num_seqs=1, budget=4,
                 max_model_len=48, async_scheduling=True, caching=False, method="eagle")

    def digits(text: str) -> list[int]:
        return [int(c) for c in text]

    requests = [
        dict(request_id="r0", arrival_step=3, prompt_token_ids=digits("1101211111202010021222010202112011122021122021"),
             output_token_ids=[2, 1], priority=2, num_accepted_tokens=[]),
        dict(request_id="r1", arrival_step=3, prompt_token_ids=digits("1101211110002"),
             output_token_ids=digits("210121202120222110211201000022"), priority=1, num_accepted_tokens=[0, 2]),
    ]
    return cfg, requests


def eagle_cache_cases() -> dict:
    """Draft heads with prefix caching on: lookahead block hashes (docs/semantics.md)."""
    def cfg(groups, blocks, k, text, **kw):
        return config(groups, blocks, k, "prefix caching on, lookahead block hashes: " + text, **kw)
    return {
        "spec_eagle_cache_k1": (cfg([FULL], 96, 1, "EAGLE k=1, shared-prefix families, roomy pool",
                                    method="eagle"), eagle_cache_workload(1201, 1)),
        "spec_eagle_cache_k3": (cfg([FULL], 96, 3, "EAGLE-3 k=3, shared-prefix families, roomy pool",
                                    method="eagle3", budget=96), eagle_cache_workload(1202, 3)),
        "spec_async_eagle_cache_k3": (cfg([FULL], 96, 3, "EAGLE k=3, asynchronous, shared-prefix families",
                                          method="eagle", budget=96, async_scheduling=True),
                                      eagle_cache_workload(1203, 3)),
        "spec_eagle_cache_pressure_k3": (cfg([FULL], 14, 3, "EAGLE k=3, 13 usable blocks: preemptions",
                                             method="eagle", budget=96), eagle_cache_workload(1204, 3, gap=1)),
        "spec_async_eagle_cache_pressure_k1": (
            cfg([FULL], 14, 1, "EAGLE-3 k=1, asynchronous, 13 usable blocks: preemptions", method="eagle3",
                budget=96, async_scheduling=True), eagle_cache_workload(1205, 1, gap=1)),
        "spec_mtp_cache_k3": (cfg([FULL], 96, 3, "single-module MTP k=3, shared-prefix families",
                                  method="mtp", budget=96), eagle_cache_workload(1206, 3)),
        "spec_eagle_cache_swa_full_k3": (cfg([SWA(32), FULL], 120, 3, "EAGLE k=3, sliding window 32 + full",
                                             method="eagle", budget=96), eagle_cache_workload(1207, 3)),
        "spec_eagle_cache_mamba_full_k3": (cfg([FULL, MAMBA], 120, 3, "EAGLE k=3, full attention + Mamba (align)",
                                               method="eagle", budget=96), eagle_cache_workload(1208, 3)),
        "spec_mtp3_cache_k3": (cfg([FULL], 96, 3, "3-module MTP k=3: hashes cover 3 tokens, the last 2 computed "
                                   "tokens are not cached, no chunk ends within 3 of the prefill end",
                                   method="mtp", budget=40, mtp_layers=3), eagle_cache_workload(1210, 3, near=2)),
        "spec_async_mtp3_cache_pressure_k3": (
            cfg([FULL], 16, 3, "3-module MTP k=3, asynchronous, 15 usable blocks: preemptions", method="mtp",
                budget=40, mtp_layers=3, async_scheduling=True), eagle_cache_workload(1211, 3, gap=1, near=1)),
        "spec_mtp2_cache_swa_full_k4": (
            cfg([SWA(32), FULL], 120, 4, "2-module MTP k=4 (each module runs twice; still a lookahead of k = 4), "
                "sliding window 32 + full: the hybrid coordinator caches the re-prefillable tail, the window "
                "retains it", method="mtp", budget=40, mtp_layers=2),
            eagle_cache_workload(1212, 4, near=2)),
        "spec_mtp3_nocache_k3": (
            config([FULL], 40, 3, "3-module MTP k=3, caching off: only the prefill-lookahead chunk rule",
                   method="mtp", budget=40, mtp_layers=3, caching=False), eagle_cache_workload(1213, 3)),
        "spec_eagle_cache_mamba_checkpoint_k3": (
            cfg([FULL, MAMBA_CHECKPOINT], 60, 3, "EAGLE k=3, full attention + Mamba-2 style (align, prefill "
                "checkpoint), tight pool", method="eagle", budget=96), eagle_cache_workload(1209, 3, gap=1)),
    }


def eagle_cache_workload(seed: int, k: int, *, gap: int = 3, rate: float = 0.6, near: int = 0) -> list[dict]:
    """Prompt families whose hits depend on the token after each block: per base prompt
    (block-aligned 32 / 48 tokens, unaligned 37 / 53), its resend, a sibling that diverges
    right at a block boundary, one that diverges inside a block, and the next turn of a
    conversation (base prompt + the base's outputs + new tokens); with ``near``, also one that
    diverges ``near`` tokens after a block boundary (inside a multi-token hash lookahead)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    bases = [toks(n) for n in (32, 48, 37, 53)]
    outs = [[rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))] for _ in bases]
    prompts: list[tuple[list[int], list[int]]] = []
    for base, out in zip(bases, outs):
        prompts.append((base, out))
        cut = len(base) // 16 * 16
        prompts.append((list(base), [rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))]))
        prompts.append((base[:cut] + toks(9), [rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))]))
        prompts.append((base[:cut - 5] + toks(12), [rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))]))
        prompts.append((base + out + toks(7), [rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))]))
        if near:
            at = (len(base) - 1) // 16 * 16 + near - 16
            prompts.append((base[:at] + toks(10), [rng.randrange(50000, 60000) for _ in range(rng.randint(6, 24))]))
    reqs, step = [], 0
    for i, (prompt, out) in enumerate(prompts):
        reqs.append(dict(request_id=f"r{i:03d}", arrival_step=step, prompt_token_ids=prompt, output_token_ids=out,
                         priority=rng.randint(0, 2), num_accepted_tokens=accept_script(rng, k, rate, len(out))))
        step += rng.randint(1, gap) if i % (6 if near else 5) else 6 * gap
    return reqs


def mamba_cases() -> dict:
    """Full attention + a Mamba group in align mode: the Mamba group keeps k speculative
    state blocks per request besides its running state (docs/semantics.md)."""
    return {
        "spec_mamba_full_k3": (config([FULL, MAMBA], 120, 3, "k=3, full attention + Mamba (align), roomy pool"),
                               workload(1101, 3)),
        "spec_async_mamba_full_k3": (
            config([FULL, MAMBA], 120, 3, "k=3, asynchronous, full attention + Mamba (align)",
                   async_scheduling=True), workload(1102, 3)),
        "spec_mamba_pressure_k3": (
            config([FULL, MAMBA], 40, 3, "k=3, full attention + Mamba (align), 39 usable blocks: preemptions",
                   budget=96), workload(1103, 3, n=18, gap=1)),
        "spec_mamba_checkpoint_k3": (
            config([FULL, MAMBA_CHECKPOINT], 60, 3, "k=3, full attention + Mamba-2 style (align, one prefill "
                   "checkpoint block, alignment 1), tight pool", budget=96), workload(1104, 3, n=18, gap=1)),
        "spec_eagle_mamba_nocache_k3": (
            config([FULL, MAMBA], 48, 3, "EAGLE k=3, full attention + Mamba (align), caching off: the Mamba "
                   "group ignores the lookahead slots, and the trailing-block drop moves the checkpoint stop "
                   "one block earlier", caching=False, budget=96, method="eagle"),
            workload(1105, 3, n=16, gap=1)),
        "spec_mamba_long_prefill2_k3": (
            long_prefill(config([FULL, MAMBA], 120, 3, "k=3, full attention + Mamba (align), "
                                "long_prefill_token_threshold 2 below 1 + k: a padded one-token admission cut by "
                                "the threshold schedules its one token unpadded"), 2),
            padding_workload(1107, 3)),
        "spec_eagle_mamba_checkpoint_nocache_k3": (
            config([FULL, MAMBA_CHECKPOINT], 60, 3, "EAGLE k=3, full attention + Mamba-2 style (align, one prefill "
                   "checkpoint block), caching off: the trailing-block drop moves the exported checkpoint one "
                   "block earlier", caching=False, budget=96, method="eagle"),
            workload(1106, 3, n=18, gap=1)),
    }


def long_prefill(cfg: dict, threshold: int) -> dict:
    """``cfg`` with a long-prefill token threshold."""
    cfg["long_prefill_token_threshold"] = threshold
    return cfg


def padding_workload(seed: int, k: int) -> list[dict]:
    """Prompts of 33 tokens (2 blocks + 1), each asked again later: the repeat hits 32 tokens
    and has one left to compute, which vLLM pads to 1 + k when others are running."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(33)] for _ in range(4)]
    reqs = []
    for i in range(14):
        prompt = prompts[i % 4] if i >= 2 else prompts[i]
        olen = rng.randint(8, 30)
        reqs.append(dict(request_id=f"r{i:03d}", arrival_step=3 * i, prompt_token_ids=list(prompt),
                         output_token_ids=[rng.randrange(50000, 60000) for _ in range(olen)], priority=0,
                         num_accepted_tokens=accept_script(rng, k, 0.6, olen)))
    return reqs


def cmd_make(out: str, only: set[str] | None) -> int:
    for name, (cfg, reqs) in spec_cases().items():
        if only and name not in only:
            continue
        t = time.time()
        added, er, es = run_case(cfg, reqs)
        write_case(os.path.join(out, name), cfg, added, er, es)
        print(name, json.dumps(summarize(er, es)), f"({time.time() - t:.1f}s)", flush=True)
    return 0


def cmd_run(case_dirs: list[str], check: bool) -> int:
    rc = 0
    for d in case_dirs:
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        try:
            _, er, es = run_case(cfg, read_jsonl(os.path.join(d, "requests.jsonl")))
        except CaseError as e:
            print(f"{d}: ERROR {e}")
            rc = 1
            continue
        if check:
            same = er == read_jsonl(os.path.join(d, "expected_requests.jsonl")) and \
                es == read_jsonl(os.path.join(d, "expected_steps.jsonl"))
            print(f"{d}: {'SAME' if same else 'DIFFERENT'}")
            rc |= not same
        else:
            write_jsonl(os.path.join(d, "expected_requests.jsonl"), er)
            write_jsonl(os.path.join(d, "expected_steps.jsonl"), es)
            print(d, json.dumps(summarize(er, es)))
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "make":
        p = argparse.ArgumentParser(prog="gen_spec_golden.py make")
        p.add_argument("--out", default=DEFAULT_OUT)
        p.add_argument("--only", default="")
        a = p.parse_args(argv[1:])
        return cmd_make(a.out, set(a.only.split(",")) - {""} or None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("case_dirs", nargs="+")
    a = p.parse_args(argv)
    return cmd_run(a.case_dirs, a.check)


if __name__ == "__main__":
    sys.exit(main())
