"""The step clock: run a golden case one engine step per tick with a scripted model.

The step clock (docs/architecture.md#one-core-three-clocks). Step ``s`` adds the requests arriving at ``s`` (in file order),
calls ``EngineCore.step`` (schedule, the scripted model samples each request's next
``output_token_ids`` entry once its prefill or recompute is complete, update), and
records what happened. The run ends after the first step at whose end every request has
arrived and finished. This is the exactness check: the same engine the replay and the
executor drive, with nothing but the clock and the model swapped out.

A case with ``async_scheduling``, or with ``pipeline_parallel_size`` > 1 (a batch queue of
that depth, docs/semantics.md#pipeline-parallelism), is stepped by ``EngineCore.step_async``
(docs/semantics.md#asynchronous-scheduling): a step may only schedule, or schedule and apply the oldest
batch; admissions are recorded at the step that scheduled them, finishes at the step whose
update produced the last token, and the run also waits for the batches in flight.

A P/D case (``PDCase``, docs/semantics.md#disaggregated-prefill-and-decode) runs a
prefill and a decode engine in the same ticks with the same scripted model and the step
clock's worker (``StepPDTransfers``), as scripts/oracle/gen_pd_golden.py runs vLLM's: each
tick steps the prefill engine, hands what it finished to the decode engine, steps that, and
tells the prefill side when each read it issued lands. It records each engine's tick.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.block_pool import BlockPool
from kvtwin.sim.core.engine import EngineCore, Execution, BatchRecord, ModelExecutor
from kvtwin.sim.core.kv_connector import KVConnectorOutput
from kvtwin.sim.core.offload.build import OffloadTier, build_offload_tier
from kvtwin.sim.core.offload.connector_metadata import OffloadingConnectorMetadata
from kvtwin.sim.core.offload.transfers import StepTransfers
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.pd_connector import (PDConnector, PDTier, RemoteRead, StepPDTransfers, remote_prefill_tokens,
                                          truncated_prompt)
from kvtwin.sim.core.prefill_throttle import throttles_prefills
from kvtwin.sim.lockstep.golden import GoldenCase, PDCase
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig


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


def step_record(step: int, result: BatchRecord, pool: BlockPool, speculative: bool = False) -> dict:
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
    # What a record counts: "step", or "tick" for a P/D case (no per-request records).
    unit: str = "step"

    def files(self) -> dict[str, list[dict]]:
        """The files a run writes, in the golden format: ``actual_requests.jsonl`` and
        ``actual_steps.jsonl``, or a P/D case's ``actual_ticks.jsonl``."""
        if self.unit == "tick":
            return {"actual_ticks.jsonl": self.steps}
        return {"actual_requests.jsonl": self.requests, "actual_steps.jsonl": self.steps}

    def summary(self) -> str:
        """One line on what the run did."""
        if self.unit == "tick":
            reads = [read for tick in self.steps if tick["decode"] for read in tick["decode"]["reads"]]
            return f"{len(self.steps)} ticks, {len(reads)} reads of {sum(sum(b) for _, b in reads)} blocks"
        hits = sum(a["hit_tokens"] for r in self.requests for a in r["admissions"])
        preemptions = sum(r["num_preemptions"] for r in self.requests)
        return (f"{len(self.requests)} requests, {len(self.steps)} steps, {hits} hit tokens, "
                f"{preemptions} preemptions")


def offload_record(engine: EngineCore, tier: OffloadTier, result: BatchRecord, evicted_before: int) -> dict:
    """The ``offload`` part of a step's line: transfer jobs made and reported, and the tier
    (the one ``engine`` was built with)."""
    # Asynchronous steps may only schedule (no report yet) or only apply (no schedule).
    meta = result.output.kv_connector_metadata or OffloadingConnectorMetadata()
    reported = result.connector_output or KVConnectorOutput()
    counters = tier.manager.counters()
    return {
        "loads": [[job.req_id, len(job.keys)] for job in meta.load_jobs.values()],
        "stores": [[job.req_id, len(job.keys)] for job in meta.store_jobs.values()],
        "evicted": counters["offload_cpu_evicted_keys"] - evicted_before,
        "flushed": sorted(meta.jobs_to_flush),
        "completed": sorted(reported.completed_jobs),
        "cpu_used_chunks": counters["offload_cpu_used_chunks"],
        "waiting_for_kv": sorted(r.request_id for r in engine.scheduler.connector_state.kv_holding_waiting
                                 if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS),
    }


def build_engine(case: GoldenCase) -> tuple[EngineCore, OffloadTier | None]:
    """The case's engine, with its offload tier (a CPU tier on the step clock) if it has one,
    and that tier (the runner reads its counters from it, not from the engine)."""
    offload = None
    if case.offload is not None:
        transfers = StepTransfers(case.offload.load_steps, case.offload.store_steps)
        offload = build_offload_tier(case.kv_cache_config, case.cache_config, transfers,
                                     num_cpu_chunks=case.offload.num_cpu_chunks, policy=case.offload.eviction_policy)
    return EngineCore(case.kv_cache_config, case.scheduler_config, case.cache_config, offload), offload


def scripted_model(case: GoldenCase) -> ScriptedModel | SpecScriptedModel:
    """The case's scripted model: with drafts, one that also accepts and proposes them."""
    if case.scheduler_config.num_speculative_tokens:
        return SpecScriptedModel(case)
    return ScriptedModel({r.request_id: r.output_token_ids for r in case.requests})


def run_case(case: GoldenCase | PDCase, *, on_step: Callable[[int], None] | None = None,
             max_idle_steps: int = 10_000) -> LockstepResult:
    """Run ``case`` (module docstring); ``on_step`` is told each step (tick) run."""
    if isinstance(case, PDCase):
        return run_pd_case(case, on_step=on_step)
    return _run_engine_case(case, on_step, max_idle_steps)


def _stepper(case: GoldenCase, engine: EngineCore, is_async: bool) -> Callable[[ModelExecutor, int], BatchRecord]:
    """How the case steps its engine at a step number. A case with a prefill cadence and a
    DP size is one rank of a DP group in one wave, the group's step counter being the step
    number (docs/semantics.md#data-parallel-lockstep); without a DP size its scheduler
    keeps the cadence itself (docs/semantics.md#local-prefill-cadence)."""
    interval = case.scheduler_config.prefill_schedule_interval
    if interval == 1 or case.scheduler_config.data_parallel_size == 1:
        step_fn = engine.step_async if is_async else engine.step
        return lambda model, step: step_fn(model)
    if is_async:
        raise ConfigError("prefill_schedule_interval", "1 with async_scheduling (a throttled case is one "
                          "synchronous DP rank)", interval).with_source(case.name)
    return lambda model, step: engine.step(model, throttles_prefills(interval, step))


def _run_engine_case(case: GoldenCase, on_step: Callable[[int], None] | None, max_idle_steps: int) -> LockstepResult:
    """A case of one engine, step by step."""
    engine, tier = build_engine(case)
    pool = engine.kv_cache_manager.block_pool
    offloading = tier is not None
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
    step_fn = _stepper(case, engine, is_async)
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
        evicted_before = tier.manager.counters()["offload_cpu_evicted_keys"] if tier is not None else 0
        batches_before = async_scheduler.num_batches if async_scheduler is not None else 0
        result = step_fn(model, step)
        out = result.output
        if offloading:
            for request_id, _, num_external, _ in out.external_hits or ():
                loads[request_id] = (num_external, step)
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
        if tier is not None:
            line["offload"] = offload_record(engine, tier, result, evicted_before)
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


# -- P/D cases -------------------------------------------------------------------------------

class PDEngine:
    """One engine of a P/D case with the connector and worker it was built with (the
    runner holds them rather than reading them back from the engine); asynchronous, its
    batches are numbered as the oracle numbers them: scheduled in order, updated in order."""

    def __init__(self, kv_cache_config: KVCacheConfig, case: PDCase):
        self.connector = PDConnector(kv_cache_config)
        self.transfers = StepPDTransfers(case.read_steps)
        self.engine = EngineCore(kv_cache_config, case.scheduler_config, case.cache_config,
                                 PDTier(self.connector, self.transfers))
        self.is_async = case.scheduler_config.async_scheduling
        self.num_updated = 0

    def step(self, model: ScriptedModel) -> dict:
        """Step once (``EngineCore.step``, or ``step_async`` as vLLM's ``step_with_batch_queue``)
        and record the tick."""
        if not self.is_async:
            return self.record(self.engine.step(model), self.transfers.last_reads)
        before = self.transfers.next_batch
        result = self.engine.step_async(model)
        scheduled = before if self.transfers.next_batch > before else None
        # An asynchronous step that scheduled nothing issued no read.
        line = self.record(result, self.transfers.last_reads if scheduled is not None else [])
        updated = None
        if result.updated is not None:
            updated, self.num_updated = self.num_updated, self.num_updated + 1
        line.update(scheduled_batch=scheduled, updated_batch=updated)
        return line

    def record(self, result: BatchRecord, issued: list[RemoteRead]) -> dict:
        """The engine's part of a tick, as the oracle writes it."""
        out = result.output
        scheduler = self.engine.scheduler
        manager = self.engine.kv_cache_manager
        # Finished prefill requests whose blocks wait for their read keep their tables.
        live = set(scheduler.requests) | set(scheduler.connector_state.delayed_free)
        return {
            "scheduled": dict(out.num_scheduled_tokens),
            "computed": dict(zip(out.num_scheduled_tokens, out.num_computed_tokens)),
            "reads": [[r.req_id, list(r.num_blocks)] for r in sorted(issued, key=lambda r: r.req_id)],
            "finished": sorted(r.request_id for r in result.finished),
            "freed": sorted(result.connector_output.finished_sending) if result.connector_output is not None else [],
            "waiting_remote": sorted(rid for rid, r in scheduler.requests.items()
                                     if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS),
            "free_blocks": manager.block_pool.get_num_free_blocks(),
            "tables": {rid: [list(g) for g in manager.get_block_ids(rid)] for rid in sorted(live)},
        }

    def holds_requests(self) -> bool:
        """Requests queued or running, or finished ones whose blocks wait for a read."""
        scheduler = self.engine.scheduler
        return bool(scheduler.requests or scheduler.connector_state.delayed_free)

    def busy(self) -> bool:
        return self.engine.has_requests() or bool(self.engine.batch_queue)

    def admit(self, request: Request, side: str, source: str) -> None:
        """Queue ``request``; one the engine rejects (it could never run) refuses the case."""
        if not self.engine.add_request(request):
            rejection = self.engine.rejected[-1]
            raise ConfigError(f"requests.{request.request_id}", f"a request the {side} engine can run",
                              f"{rejection.code}: {rejection.detail}", source=source)


def _require_pools(case: PDCase, prefill: PDEngine, decode: PDEngine) -> None:
    """Refuse, before the first tick, a case whose prefill or decode pool cannot hold its
    longest request: vLLM refuses to start an engine whose pool cannot hold one request
    (of ``max_model_len``; the cases size their pools for their own requests, below
    that), and its scheduler would keep such a request waiting forever
    (docs/semantics.md#room-for-one-request)."""
    backoff = prefill.connector.prefill_backoff_tokens
    try:
        prefill.engine.require_pool_holds(
            max(remote_prefill_tokens(len(r.prompt_token_ids), backoff) + 1 for r in case.requests),
            "config.prefill_num_blocks")
        decode.engine.require_pool_holds(max(len(r.prompt_token_ids) + len(r.output_token_ids)
                                             for r in case.requests), "config.decode_num_blocks")
    except ConfigError as err:
        raise err.with_source(case.source) from None


def run_pd_case(case: PDCase, *, on_step: Callable[[int], None] | None = None,
                max_ticks: int = 5000) -> LockstepResult:
    """Run a P/D case (module docstring). Synchronous: until the decode engine has finished
    every request, then the prefill engine alone until it holds nothing; asynchronous
    (two batches in flight on each engine, the oracle's ``run_case_async``): until every
    request has finished and both engines are idle. A read issued by decode batch ``k``
    lands with its batch ``k + read_steps``; the prefill side hears of it with its batch
    ``read_steps - 1`` after its next (in a synchronous run, batch = tick)."""
    prefill, decode = PDEngine(case.prefill_kv_cache_config, case), PDEngine(case.decode_kv_cache_config, case)
    _require_pools(case, prefill, decode)
    model = ScriptedModel({r.request_id: r.output_token_ids for r in case.requests})
    prompts = {r.request_id: r.prompt_token_ids for r in case.requests}
    is_async = case.scheduler_config.async_scheduling
    pending = list(case.requests)
    next_arrival = 0
    ticks: list[dict] = []
    tick = done = 0

    def tick_over() -> None:
        nonlocal tick
        if on_step is not None:
            on_step(tick)
        tick += 1
        if tick >= max_ticks:
            raise ConfigError("requests", f"a case that ends within {max_ticks} ticks", source=case.source)

    while done < len(pending) or (is_async and (prefill.busy() or decode.busy())):
        while next_arrival < len(pending) and pending[next_arrival].arrival_step <= tick:
            spec = pending[next_arrival]
            prefill.connector.mark_remote_decode(spec.request_id)
            # The prefill side drops the connector's backoff (vLLM: on_new_request).
            prompt = truncated_prompt(TokenPrompt(spec.prompt_token_ids), prefill.connector.prefill_backoff_tokens)
            prefill.admit(Request(spec.request_id, prompt, 1), "prefill", case.source)
            next_arrival += 1
        prefill_line = prefill.step(model)
        for rid in prefill_line["finished"]:
            # What the prefill side computed: the prompt less the backoff, a prompt no longer than it whole.
            decode.connector.expect_remote_prefill(
                rid, remote_prefill_tokens(len(prompts[rid]), decode.connector.prefill_backoff_tokens))
            decode.admit(Request(rid, TokenPrompt(prompts[rid]), len(model.outputs[rid])), "decode", case.source)
        decode_line = decode.step(model)
        for rid, _ in decode_line["reads"]:
            prefill.transfers.send_done(rid, prefill.transfers.next_batch + case.read_steps - 1)
        done += len(decode_line["finished"])
        ticks.append({"tick": tick, "prefill": prefill_line, "decode": decode_line})
        tick_over()
    while not is_async and prefill.holds_requests():
        ticks.append({"tick": tick, "prefill": prefill.step(model), "decode": None})
        tick_over()
    return LockstepResult([], ticks, unit="tick")
