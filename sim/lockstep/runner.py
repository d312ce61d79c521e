"""The step clock: run a golden case one engine step per tick with a scripted model.

The step clock (docs/architecture.md#one-core-three-clocks). Step ``s`` adds the requests arriving at ``s`` (in file order),
calls ``EngineCore.step`` (schedule, the scripted model samples each request's next
``output_token_ids`` entry once its prefill or recompute is complete, update), and
records what happened. The run ends after the first step at whose end every request has
arrived and finished. This is the exactness check: the same engine the replay and the
executor drive, with nothing but the clock and the model swapped out.

A case with ``async_scheduling`` is stepped by ``EngineCore.step_async``
(docs/semantics.md#asynchronous-scheduling): a step may only schedule, or schedule and apply the oldest
batch; admissions are recorded at the step that scheduled them, finishes at the step whose
update produced the last token, and the run also waits for the batches in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.block_pool import BlockPool
from kvtwin.sim.core.engine import EngineCore, Execution, StepResult
from kvtwin.sim.core.kv_connector import KVConnectorOutput
from kvtwin.sim.core.offload.build import build_offload_tier
from kvtwin.sim.core.offload.connector import OffloadingConnectorMetadata
from kvtwin.sim.core.offload.transfers import StepTransfers
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.lockstep.golden import GoldenCase
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler_output import SchedulerOutput


class ScriptedModel:
    """A model executor that samples each request's predetermined output tokens, one per
    completed step."""

    def __init__(self, outputs: dict[str, tuple[int, ...]]):
        self.outputs = outputs

    def execute(self, output: SchedulerOutput) -> Execution:
        outputs = self.outputs
        # One step is one tick of the step clock. A request that already has all its outputs
        # gets token 0 (async only; vLLM discards it).
        return Execution({rid: [outputs[rid][index] if index < len(outputs[rid]) else 0]
                          for rid, index in output.num_output_tokens.items()}, duration_s=1.0)


class SpecScriptedModel:
    """The scripted model of a speculative-decoding case (scripts/oracle/gen_spec_golden.py):
    a request that verifies ``n`` drafts accepts the next entry of its
    ``num_accepted_tokens`` (0 once used up), at most ``n``; drafts padded onto an
    admission are never accepted. It samples ``1 + accepted`` tokens, its next scripted
    outputs (0 past the end: the scheduler trims them). Tokens are counted per request as
    they are sampled, which is where its outputs stand when they are applied (all sampled
    tokens are applied until it finishes, stale ones too). Synchronous: every request that
    sampled gets ``k`` draft ids."""

    DRAFT_TOKEN = 7

    def __init__(self, case: GoldenCase):
        self.outputs = {r.request_id: r.output_token_ids for r in case.requests}
        self.accept = {r.request_id: list(reversed(r.num_accepted_tokens)) for r in case.requests}
        self.position = {r.request_id: 0 for r in case.requests}
        config = case.scheduler_config
        self.drafts = None if config.async_scheduling else [self.DRAFT_TOKEN] * config.num_speculative_tokens

    def execute(self, output: SchedulerOutput) -> Execution:
        spec = output.scheduled_spec_decode_tokens or {}
        admitted = {r.req_id for r in output.scheduled_new_reqs}
        sampled: dict[str, list[int]] = {}
        for rid in output.num_output_tokens:
            num_drafts = len(spec.get(rid, ()))
            script = self.accept[rid]
            accepted = 0
            if num_drafts and rid not in admitted:
                accepted = min(script.pop() if script else 0, num_drafts)
            outputs, pos = self.outputs[rid], self.position[rid]
            self.position[rid] = pos + 1 + accepted
            sampled[rid] = [outputs[i] if i < len(outputs) else 0 for i in range(pos, pos + 1 + accepted)]
        drafts = None if self.drafts is None else {rid: list(self.drafts) for rid in output.num_output_tokens}
        return Execution(sampled, duration_s=1.0, draft_token_ids=drafts)


def step_record(step: int, result: StepResult, pool: BlockPool, speculative: bool = False) -> dict:
    """One line of ``expected_steps.jsonl``: what a step scheduled and left in the pool
    (``speculative``: also the drafts each request verifies)."""
    out = result.output
    record: dict = {"step": step, "scheduled": dict(out.num_scheduled_tokens)}
    if speculative:
        spec = out.scheduled_spec_decode_tokens or {}
        record["spec_decode_tokens"] = {rid: len(ids) for rid, ids in spec.items()}
    record.update({
        "preempted": list(out.preempted),
        "finished": [r.request_id for r in result.finished],
        "num_free_blocks": pool.get_num_free_blocks(),
        "num_cached_blocks": pool.num_cached_blocks(),
    })
    return record


@dataclass
class RequestRecord:
    request_id: str
    admissions: list[dict] = field(default_factory=list)
    first_scheduled_step: int | None = None
    finish_step: int | None = None
    # Counted as they happen: with async scheduling a preempted request can finish from the
    # waiting queue (its last token was in flight) without another admission.
    num_preemptions: int = 0

    def to_json(self) -> dict:
        return {"request_id": self.request_id, "admissions": self.admissions,
                "num_preemptions": self.num_preemptions,
                "first_scheduled_step": self.first_scheduled_step, "finish_step": self.finish_step}


@dataclass
class LockstepResult:
    requests: list[dict]
    steps: list[dict]


def offload_record(engine: EngineCore, result: StepResult, evicted_before: int) -> dict:
    """The ``offload`` part of a step's line: transfer jobs made and reported, and the tier."""
    # Asynchronous steps may only schedule (no report yet) or only apply (no schedule).
    meta = result.output.kv_connector_metadata or OffloadingConnectorMetadata()
    reported = result.transfers or KVConnectorOutput()
    assert engine.offload is not None
    manager = engine.offload.manager
    return {
        "loads": [[job.req_id, len(job.keys)] for job in meta.load_jobs.values()],
        "stores": [[job.req_id, len(job.keys)] for job in meta.store_jobs.values()],
        "evicted": manager.num_evicted_keys - evicted_before,
        "flushed": sorted(meta.jobs_to_flush),
        "completed": sorted(reported.completed_jobs),
        "cpu_used_chunks": manager.num_used_chunks,
        "waiting_for_kv": sorted(r.request_id for r in engine.scheduler.connector_state.kv_holding_waiting
                                 if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS),
    }


def build_engine(case: GoldenCase) -> EngineCore:
    """The case's engine, with its offload tier (a CPU tier on the step clock) if it has one."""
    offload = None
    if case.offload is not None:
        transfers = StepTransfers(case.offload.load_steps, case.offload.store_steps)
        offload = build_offload_tier(case.kv_cache_config, case.cache_config, transfers,
                                     num_cpu_chunks=case.offload.num_cpu_chunks, policy=case.offload.eviction_policy)
    return EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config, offload)


def scripted_model(case: GoldenCase) -> ScriptedModel | SpecScriptedModel:
    """The case's scripted model: with drafts, one that also accepts and proposes them."""
    if case.scheduler_config.num_speculative_tokens:
        return SpecScriptedModel(case)
    return ScriptedModel({r.request_id: r.output_token_ids for r in case.requests})


def run_case(case: GoldenCase, *, on_step: Callable[[int], None] | None = None,
             max_idle_steps: int = 10_000) -> LockstepResult:
    engine = build_engine(case)
    pool = engine.kv_cache_manager.block_pool
    offloading = engine.offload is not None
    # request id -> (loaded tokens, step the load was issued) of its pending admission.
    loads: dict[str, tuple[int, int]] = {}
    updated_batches = 0  # async: batches applied so far
    model = scripted_model(case)
    records = {r.request_id: RequestRecord(r.request_id) for r in case.requests}
    pending = list(case.requests)
    next_arrival = 0
    steps: list[dict] = []
    idle_steps = 0
    step = 0
    scheduler = engine.scheduler
    async_scheduler = scheduler if isinstance(scheduler, AsyncScheduler) else None
    is_async = async_scheduler is not None
    step_fn = engine.step_async if is_async else engine.step
    speculative = case.scheduler_config.num_speculative_tokens > 0
    while True:
        while next_arrival < len(pending) and pending[next_arrival].arrival_step == step:
            spec = pending[next_arrival]
            # Arrival time = line number: the priority policy's tie-break among equal priorities.
            request = Request(spec.request_id, TokenPrompt(spec.prompt_token_ids), len(spec.output_token_ids),
                              arrival_time=float(next_arrival), priority=spec.priority)
            if not engine.add_request(request):
                rejection = engine.rejected[-1]
                raise ConfigError("requests.jsonl", f"requests the engine accepts ({rejection.code}: "
                                  f"{rejection.detail})", spec.request_id)
            next_arrival += 1
        evicted_before = engine.offload.manager.num_evicted_keys if engine.offload is not None else 0
        batches_before = async_scheduler.num_batches if async_scheduler is not None else 0
        result = step_fn(model)
        out = result.output
        if offloading:
            for request, _, num_external, _ in out.external_hits or ():
                loads[request.request_id] = (num_external, step)
        for admission in out.scheduled_new_reqs:
            record = records[admission.req_id]
            if offloading:
                num_external, load_step = loads.pop(admission.req_id, (0, None))
                record.admissions.append({"step": step, "hit_tokens": admission.num_computed_tokens,
                                          "external_tokens": num_external, "load_step": load_step})
            else:
                record.admissions.append({"step": step, "hit_tokens": admission.hit_tokens})
            if record.first_scheduled_step is None:
                record.first_scheduled_step = step
        for request_id in out.preempted:
            records[request_id].num_preemptions += 1
        for request in result.finished:
            records[request.request_id].finish_step = step
        line = step_record(step, result, pool, speculative)
        if offloading:
            line["offload"] = offload_record(engine, result, evicted_before)
            if is_async:
                # Which batch this step scheduled and which it applied (batches are numbered
                # in schedule order; None: none).
                scheduled_now = async_scheduler is not None and async_scheduler.num_batches > batches_before
                line["offload"]["scheduled_batch"] = batches_before if scheduled_now else None
                line["offload"]["updated_batch"] = updated_batches if result.updated is not None else None
                updated_batches += result.updated is not None
        steps.append(line)
        if on_step is not None:
            on_step(step)
        all_arrived = next_arrival == len(pending)
        # With an offload tier the engine also steps until its transfers are done and the
        # last finished request has been reported (its final store is made then).
        if (all_arrived and not engine.has_unfinished_requests() and not engine.batch_queue
                and not (offloading and (engine.has_pending_transfers() or scheduler.finished_req_ids))):
            break
        idle = not out.num_scheduled_tokens and not any(b.executed for b in engine.batch_queue)
        idle_steps = idle_steps + 1 if (all_arrived and idle) else 0
        if idle_steps > max_idle_steps:
            # Nothing was scheduled for that long with every request arrived: the state no
            # longer changes (docs/semantics.md#no-progress).
            raise engine.no_progress_error("requests.jsonl").with_source(case.name)
        step += 1
    return LockstepResult([records[r.request_id].to_json() for r in case.requests], steps)
