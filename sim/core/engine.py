"""The engine step: schedule → execute → update, the one function every clock drives.

docs/architecture.md#one-core-three-clocks. The lockstep runner (one step per tick, a scripted
model), the SimPy replay (a cost model predicts each step's seconds) and the GPU executor
(kernels run and are timed) all call ``EngineCore.step`` with their own ``ModelExecutor``;
nothing here knows which clock is running. An executor sees only the ``SchedulerOutput``
(see ``scheduler_output.py`` for what it carries and how to keep block tables from it).

Asynchronous scheduling (``SchedulerConfig.async_scheduling``, vLLM's default) keeps two
batches in flight (pipeline parallelism: one per stage, plus one if asynchronous): ``step_async`` is one call of vLLM's ``step_with_batch_queue``. It
schedules a batch (handing it to the executor at once, as vLLM launches it) and returns
if the queue has room and there is more to do; otherwise it applies the oldest batch's
results. Its two halves, ``schedule_batch`` and ``update_batch``, let a clock put time
between launching a batch and applying it (the SimPy replay waits for the batch's end).
The synchronous ``step`` is unchanged and stays the only step for synchronous configs.

A connector tier (``connector_tier.py``: an offload tier, ``sim/core/offload/build.py``, or
a P/D engine's connector, ``pd_connector.py``) reaches the engine built, in its one slot:
its connector goes to the scheduler, its worker is the engine's. Without one the worker is
the bare ``KVTransferWorker``, which does nothing, so a step takes the same path either
way. Clocks and stats ask the engine (``next_transfer_event_s``, ``waits_for_transfers``,
``make_stats``), never the tier.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from kvtwin.sim.core.async_scheduler import AsyncScheduler
from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.connector_tier import ConnectorTier
from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.engine_stats import EngineStats, pool_stats
from kvtwin.sim.core.block_pool import KVCacheBlock
from kvtwin.sim.core.errors import require
from kvtwin.sim.core.hashing import BlockHasher
from kvtwin.sim.core.kv_connector import KVConnector, KVConnectorOutput, KVTransferWorker
from kvtwin.sim.core.pipeline_scheduler import PipelineAsyncScheduler, PipelineScheduler
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.scheduler import Scheduler
from kvtwin.sim.core.spec import KVCacheConfig
from kvtwin.sim.core.spec_decode_stats import SpecDecodingStats


@dataclass
class Execution:
    """What running one batch produced: the tokens sampled per request, and how long it took
    (predicted by a cost model, measured on a device, or one tick on the step clock)."""

    sampled: dict[str, list[int]]
    duration_s: float = 0.0
    cost: object | None = None  # the executor's breakdown of duration_s, if it has one
    # Speculative decoding, synchronous engine: the drafter's proposals per request (vLLM's
    # ``take_draft_token_ids``), verified at each one's next decode. None: no drafter.
    # A request that verified drafts samples ``1 + accepted`` tokens in ``sampled``.
    draft_token_ids: dict[str, list[int]] | None = None

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python.
    def __init__(self, sampled: dict[str, list[int]], duration_s: float = 0.0, cost: object | None = None,
                 draft_token_ids: dict[str, list[int]] | None = None):
        self.sampled = sampled
        self.duration_s = duration_s
        self.cost = cost
        self.draft_token_ids = draft_token_ids


class ModelExecutor(Protocol):
    """Runs one scheduled batch from the scheduler output alone.

    It samples one token for each request in ``output.num_output_tokens``. It is also
    called for an output that schedules no tokens but preempts or reports finished
    requests, so it can drop their tables (vLLM's model runner, too, updates its state
    before it checks for an empty batch); that call's ``Execution`` is ignored: such a
    step samples nothing and takes no time. With asynchronous scheduling it is called when
    a batch is scheduled, in schedule order, before the previous batch's tokens are applied;
    its ``Execution`` is applied at that batch's update."""

    def execute(self, output: SchedulerOutput) -> Execution:
        ...


@dataclass(frozen=True)
class Rejection:
    """A request ``add_request`` refused because it can never run.

    ``code`` is one of ``prompt_too_long`` (the prompt leaves no room for output within
    max_model_len), ``bad_max_tokens`` (max_tokens <= 0), ``exceeds_max_model_len``
    (prompt + output > max_model_len), ``exceeds_kv_pool`` (more blocks than the pool
    holds); ``detail`` says it with the numbers."""

    request: Request
    code: str
    detail: str


_NO_DRAFTS = (0, 0, 0)


class RequestSnapshot:
    """One request's figures at a moment, as the engine reports them (a front end keeps no
    live ``Request``): a finished one's when its batch was applied, an unfinished one's when
    a run stopped (``EngineCore.request_snapshots``). ``implicit_decodes``: its decode steps
    that a decode window ran and no ``SchedulerOutput`` listed (0 outside a window).
    ``spec_decode``: its verify steps, drafts and accepted drafts so far (zeros without)."""

    __slots__ = ("request_id", "status", "num_prompt_tokens", "max_tokens", "num_computed_tokens",
                 "num_output_tokens", "num_preemptions", "implicit_decodes", "spec_decode")

    def __init__(self, request: Request, implicit_decodes: int = 0):
        self.request_id = request.request_id
        self.status = request.status
        self.num_prompt_tokens = request.num_prompt_tokens
        self.max_tokens = request.max_tokens
        self.num_computed_tokens = request.num_computed_tokens
        self.num_output_tokens = request.num_output_tokens
        self.num_preemptions = request.num_preemptions
        self.implicit_decodes = implicit_decodes
        metrics = request.spec_decode_metrics
        self.spec_decode: tuple[int, int, int] = (
            _NO_DRAFTS if metrics is None
            else (metrics.num_verify_steps, metrics.num_draft_tokens, metrics.num_accepted_tokens))


def snapshots(requests: list[Request]) -> list[RequestSnapshot]:
    return [RequestSnapshot(request) for request in requests]


@dataclass
class BatchRecord:
    """What one step reports, as vLLM's engine core hands its front end ``EngineCoreOutputs``
    rather than its requests (docs/architecture.md#the-scheduler-output-contract): clocks,
    routers and the recorder read this, never the scheduler.

    ``output`` is the step's schedule (an empty one for an async step that scheduled
    nothing), ``finished`` the requests its update finished. ``execution`` belongs to the
    batch whose results the step applied: ``output`` itself in the synchronous step; in
    ``step_async`` the batch ``updated`` (None: nothing applied). ``stats``: the engine
    just after (vLLM's ``SchedulerStats``), with the features' own figures: the connector
    tier's counters, the drafts the update verified. ``connector_output``: what
    the connector's worker reported finished (None: no connector). ``implicit_decodes``: a
    decode window's batch (``decode_window.py``), the one-token decodes of its members that
    ``output`` leaves implicit (``output`` then holds only the batch's scheduled part, or
    nothing); None for a batch the scheduler scheduled whole. ``implicit_decodes_by_request``:
    the first batch after a window, each running member's decodes that the window's batches
    before it left implicit (request id, how many), the last of them sampled when the batch
    applied before this one ended; None for any other batch."""

    output: SchedulerOutput
    finished: list[RequestSnapshot]
    execution: Execution
    stats: EngineStats
    updated: SchedulerOutput | None = None
    connector_output: KVConnectorOutput | None = None
    implicit_decodes: int | None = None
    implicit_decodes_by_request: list[tuple[str, int]] | None = None

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python.
    def __init__(self, output: SchedulerOutput, finished: list[RequestSnapshot], execution: Execution,
                 stats: EngineStats, updated: SchedulerOutput | None = None,
                 connector_output: KVConnectorOutput | None = None, implicit_decodes: int | None = None,
                 implicit_decodes_by_request: list[tuple[str, int]] | None = None):
        self.output = output
        self.finished = finished
        self.execution = execution
        self.stats = stats
        self.updated = updated
        self.connector_output = connector_output
        self.implicit_decodes = implicit_decodes
        self.implicit_decodes_by_request = implicit_decodes_by_request


@dataclass
class Batch:
    """A scheduled batch in flight (async): its output and what the executor made of it."""

    output: SchedulerOutput
    execution: Execution

    def __init__(self, output: SchedulerOutput, execution: Execution):
        self.output = output
        self.execution = execution

    @property
    def executed(self) -> bool:
        """Whether it computes anything (vLLM's ``model_executed``)."""
        return bool(self.output.num_scheduled_tokens)


_IDLE = Execution({}, 0.0)


def make_scheduler(kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                   cache_config: CacheConfig = CacheConfig(), connector: KVConnector | None = None) -> Scheduler:
    """The scheduler ``scheduler_config`` asks for: ``AsyncScheduler`` with asynchronous
    scheduling, ``PipelineScheduler`` with several pipeline stages
    (docs/semantics.md#pipeline-parallelism), ``PipelineAsyncScheduler`` with both
    (docs/semantics.md#asynchronous-pipeline-parallelism), else ``Scheduler``."""
    pipelined = scheduler_config.pipeline_parallel_size > 1
    if pipelined:
        require(connector is None, "pipeline_parallel_size",
                "1 with a KV connector (several batches in flight with a connector are not modelled)",
                scheduler_config.pipeline_parallel_size)
    if scheduler_config.async_scheduling:
        if pipelined:
            return PipelineAsyncScheduler(kv_cache_config, scheduler_config, cache_config, connector)
        return AsyncScheduler(kv_cache_config, scheduler_config, cache_config, connector)
    if pipelined:
        return PipelineScheduler(kv_cache_config, scheduler_config, cache_config, connector)
    return Scheduler(kv_cache_config, scheduler_config, cache_config, connector)


def _stuck(request: Request, where: str) -> str:
    return (f"request {request.request_id} {where} with {request.num_computed_tokens} of its {request.num_tokens} "
            "tokens computed and is never scheduled again")


class EngineCore:
    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig(), connector: ConnectorTier | None = None):
        """``connector``: the engine's one connector tier (None: none). Which features may
        share an engine is the table of features' to say (sim/scenario/features.py;
        docs/architecture.md#features-and-their-combinations), so one slot is all it has."""
        self._tier = connector
        kv_connector: KVConnector | None = connector.connector if connector is not None else None
        self.scheduler = make_scheduler(kv_cache_config, scheduler_config, cache_config, kv_connector)
        # The worker side of the connector: submits each batch's jobs, reports what finished.
        # Held apart from the tier: every step calls it, and a compiled attribute of the
        # worker's own class is a direct call where the Protocol's would be a lookup.
        self._worker: KVTransferWorker = connector.transfers if connector is not None else KVTransferWorker()
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.rejected: list[Rejection] = []
        # Async or PP: batches scheduled and not yet updated, oldest first.
        self.batch_queue: deque[Batch] = deque()
        self.batch_queue_size = scheduler_config.max_concurrent_batches

    def add_request(self, request: Request) -> bool:
        """Queue a request, or reject it (counted, with a code) if it can never run."""
        max_model_len = self.scheduler.config.max_model_len
        if request.num_prompt_tokens >= max_model_len:
            return self._reject(request, "prompt_too_long",
                                f"prompt of {request.num_prompt_tokens} tokens leaves no room for output within "
                                f"max_model_len {max_model_len}")
        if request.max_tokens <= 0:
            return self._reject(request, "bad_max_tokens", f"max_tokens must be positive, got {request.max_tokens}")
        total_tokens = request.num_prompt_tokens + request.max_tokens
        if total_tokens > max_model_len:
            return self._reject(request, "exceeds_max_model_len",
                                f"prompt + output = {total_tokens} tokens exceeds max_model_len {max_model_len}")
        # vLLM would keep such a request at the head of the queue forever.
        needed = self.blocks_to_hold(total_tokens, request.request_id)
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        if needed > usable:
            return self._reject(request, "exceeds_kv_pool", f"needs {needed} KV blocks, more than the pool's {usable}")
        self.scheduler.add_request(request)
        return True

    def blocks_to_hold(self, num_tokens: int, request_id: str = "") -> int:
        """Blocks a new request of ``num_tokens`` tokens (prompt and output), nothing of it
        cached, takes from the pool at most: the whole sequence under the sliding-window
        and chunked admission caps, as admission checks it (docs/semantics.md#allocate-slots)."""
        kv_cache_manager = self.kv_cache_manager
        return kv_cache_manager.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens, kv_cache_manager.empty_blocks, 0, num_tokens, apply_admission_cap=True)

    def require_pool_holds(self, num_tokens: int, field: str) -> None:
        """Refuse with a ``ConfigError`` on ``field`` a pool that cannot hold one request of
        ``num_tokens`` tokens besides the null block: every such request would be rejected
        (in vLLM, wait forever), so the configuration is refused before anything runs, as
        vLLM refuses to start without room for one request of ``max_model_len``
        (docs/semantics.md#room-for-one-request)."""
        needed = self.blocks_to_hold(num_tokens)
        usable = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
        require(needed <= usable, field,
                f"a KV pool that holds one request of {num_tokens} tokens ({needed} blocks besides the null block)",
                usable)

    def _reject(self, request: Request, code: str, detail: str) -> bool:
        request.status = RequestStatus.REJECTED
        self.rejected.append(Rejection(request, code, detail))
        return False

    @staticmethod
    def _execute(executor: ModelExecutor, output: SchedulerOutput) -> Execution:
        """Run a batch; an empty one is still shown to the executor when it has tables to
        drop, but samples nothing and takes no time."""
        if output.num_scheduled_tokens:
            return executor.execute(output)
        if output.preempted or output.finished_req_ids:
            executor.execute(output)
        return _IDLE

    def step(self, executor: ModelExecutor, throttle_prefills: bool = False) -> BatchRecord:
        """One synchronous step. The worker gets the step's transfer jobs before the
        forward pass and reports the finished ones with its output; an empty step still
        reports them. ``throttle_prefills``: a DP group's off-cadence step
        (docs/semantics.md#data-parallel-lockstep)."""
        output = self.scheduler.schedule(throttle_prefills)
        transfers = self._worker
        transfers.submit(output.kv_connector_metadata)
        execution = self._execute(executor, output)
        finished: list[Request] = (self.scheduler.update_from_output(output, execution.sampled)
                                   if output.num_scheduled_tokens else [])
        if execution.draft_token_ids is not None and output.num_scheduled_tokens:
            # vLLM's post_step: the drafts reach the scheduler after the update.
            self.scheduler.update_draft_token_ids(output, execution.draft_token_ids)
        reported = transfers.finish_step(execution.duration_s)
        self.scheduler.update_connector_output(reported)
        return BatchRecord(output, snapshots(finished), execution, self._record_stats(), connector_output=reported)

    @property
    def has_connector(self) -> bool:
        """Whether a KV connector moves this engine's KV (an offload tier, or P/D's)."""
        return self.scheduler.connector is not None

    def has_pending_transfers(self) -> bool:
        """Transfer jobs still running (the engine keeps stepping until they finish)."""
        connector = self.scheduler.connector
        return connector is not None and connector.has_pending_jobs()

    def waits_for_transfers(self) -> bool:
        """Whether requests wait for transfers, so a clock with nothing to run waits for the
        next one (``next_transfer_event_s``) rather than stopping: unfinished requests (a load
        may let them go on), or finished ones whose jobs the tier says keep the engine
        stepping (a P/D prefill side's blocks still to be read). False without a connector."""
        tier = self._tier
        return tier is not None and (self.scheduler.has_unfinished_requests() or tier.keeps_engine_waiting())

    def next_transfer_event_s(self) -> float | None:
        """When the connector's next job in flight finishes on a timed clock: a P/D read, an
        offload tier's GPU↔CPU job, or a CPU↔disk job of its disk tier (None: nothing in
        flight, a step clock, or no connector)."""
        tier = self._tier
        return tier.next_event_s() if tier is not None else None

    # -- what a clock or a router may ask (they read no member of the engine's parts) ------

    @property
    def async_scheduling(self) -> bool:
        """Whether batches are scheduled while others run (``step_async``: asynchronous
        scheduling, or pipeline parallelism's batch queue), or one by one."""
        return self.batch_queue_size > 1

    def holds_blocks_for_reads(self) -> bool:
        """Whether finished requests keep their blocks until another engine reads them (a
        P/D prefill side's ``delayed_free``; False without a P/D connector)."""
        return bool(self.scheduler.connector_state.delayed_free)

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        return self.kv_cache_manager.coordinator.kv_cache_config

    @property
    def block_hasher(self) -> BlockHasher | None:
        """How a request's prompt becomes block hashes (None without prefix caching)."""
        return self.scheduler.hasher

    def cached_blocks_by_hash(self, group_id: int) -> dict[object, KVCacheBlock | dict[int, KVCacheBlock]]:
        """The prefix cache's index of one KV cache group: block hash to its cached blocks,
        the live map (what a KV-event subscriber such as a prefix-aware router mirrors; a
        reader must not change it)."""
        return self.kv_cache_manager.block_pool.cached_block_hash_to_block[group_id]

    def request_counts(self) -> tuple[int, int]:
        """(waiting, running): what the engine reports to vLLM's DP coordinator as
        ``SchedulerStats.num_waiting_reqs`` and ``num_running_reqs``; the waiting count
        includes the requests whose KV is still being loaded, as vLLM's
        ``Scheduler.get_request_counts`` counts them (docs/semantics.md#data-parallel-load-balancing)."""
        scheduler = self.scheduler
        waiting = len(scheduler.waiting) + len(scheduler.connector_state.kv_holding_waiting)
        return waiting, len(scheduler.running)

    def kv_cache_usage(self) -> float:
        """The used fraction of the block pool, the null block left out (vLLM's
        ``Scheduler.get_kv_cache_usage``, sent to the DP coordinator with the counts)."""
        return self.kv_cache_manager.usage

    # -- asynchronous scheduling: two batches in flight --------------------------------

    def has_requests(self) -> bool:
        """Something to schedule, or finished requests still to report (vLLM's ``has_requests``)."""
        scheduler = self.scheduler
        # Finished requests whose blocks wait for another engine's read keep it stepping,
        # as vLLM's has_finished_requests does (empty without a P/D connector).
        return (scheduler.has_unfinished_requests() or bool(scheduler.finished_req_ids)
                or bool(scheduler.connector_state.delayed_free))

    def schedule_batch(self, executor: ModelExecutor, throttle_prefills: bool = False) -> Batch:
        """Schedule one batch, hand it to the executor (it runs while the next is scheduled)
        and queue it. An output with no tokens is queued too (vLLM updates it as well).
        The worker gets the batch's transfer jobs with it. ``throttle_prefills``: a DP
        group's off-cadence step (docs/semantics.md#data-parallel-lockstep)."""
        output = self.scheduler.schedule(throttle_prefills)
        self._worker.submit(output.kv_connector_metadata)
        batch = Batch(output, self._execute(executor, output))
        self.batch_queue.append(batch)
        return batch

    def update_batch(self, implicit_decodes_by_request: list[tuple[str, int]] | None = None) -> BatchRecord:
        """Apply the oldest batch's sampled tokens (it has finished running), and the
        transfers the worker reports finished with it. ``implicit_decodes_by_request``: the
        decodes a decode window left implicit before this batch, for its record."""
        batch = self.batch_queue.popleft()
        finished = self.scheduler.update_from_output(batch.output, batch.execution.sampled)
        reported = self._worker.finish_step(batch.execution.duration_s)
        self.scheduler.update_connector_output(reported)
        return BatchRecord(batch.output, snapshots(finished), batch.execution, self._record_stats(), batch.output,
                           connector_output=reported, implicit_decodes_by_request=implicit_decodes_by_request)

    # -- what a decode window asks (``decode_window.WindowEngine``) ----------------------

    def window_scheduler(self) -> AsyncScheduler | None:
        """The scheduler, if its batches may ever be windowed (asynchronous, two batches in
        flight, no connector, no drafts: ``AsyncScheduler.windows_allowed``); else None."""
        scheduler = self.scheduler
        if isinstance(scheduler, AsyncScheduler) and scheduler.windows_allowed():
            return scheduler
        return None

    def num_batches_in_flight(self) -> int:
        return len(self.batch_queue)

    def oldest_batch(self) -> Batch:
        return self.batch_queue[0]

    def newest_batch(self) -> Batch:
        """The batch scheduled last and still in flight (a pipeline's clock times its pass
        through the stages from its cost)."""
        return self.batch_queue[-1]

    @property
    def pipeline_parallel_size(self) -> int:
        """The pipeline stages its batches pass through (docs/semantics.md#pipeline-parallelism)."""
        return self.scheduler.config.pipeline_parallel_size

    def any_batch_executed(self) -> bool:
        """Whether a batch in flight computes something."""
        return any(batch.executed for batch in self.batch_queue)

    def enqueue_batch(self, batch: Batch) -> None:
        """Queue a batch scheduled by other means than ``schedule_batch`` (a decode
        window's, made real): it is updated in its turn by ``update_batch``."""
        self.batch_queue.append(batch)

    def step_async(self, executor: ModelExecutor) -> BatchRecord:
        """One engine step with a batch queue (vLLM ``EngineCore.step_with_batch_queue``).

        If there are requests, schedule a batch; if the queue then has room and (the batch
        computes something or requests remain), that is the step. Otherwise apply the
        oldest batch in flight (none: an idle step). The result's ``output`` is this step's
        schedule, ``finished``, ``execution`` and ``updated`` those of the batch applied."""
        scheduled = None
        if self.has_requests():
            scheduled = self.schedule_batch(executor)
            if len(self.batch_queue) < self.batch_queue_size and (scheduled.executed or self.has_requests()):
                return BatchRecord(scheduled.output, [], _IDLE, self._record_stats())
        elif not self.batch_queue:
            return BatchRecord(SchedulerOutput(), [], _IDLE, self._record_stats())
        updated = self.update_batch()
        updated.output = scheduled.output if scheduled is not None else SchedulerOutput()
        return updated

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def request_snapshots(self, implicit_decodes: dict[str, int] | None = None) -> list[RequestSnapshot]:
        """The requests this engine holds unfinished, as they are now: what a clock that
        stops early reports of them (``MetricsRecorder.finish_unfinished``).
        ``implicit_decodes``: decodes a decode window ran that no record reported, by request."""
        held = [r for r in self.scheduler.requests.values() if not r.is_finished()]
        if implicit_decodes is None:
            return [RequestSnapshot(r) for r in held]
        return [RequestSnapshot(r, implicit_decodes.get(r.request_id, 0)) for r in held]

    def no_progress_error(self, workload_field: str) -> ConfigError:
        """The error a clock raises when nothing can be scheduled again and requests are
        unfinished: no arrival, transfer or batch in flight is left to change the state, so
        stepping on would loop for ever (docs/semantics.md#no-progress). It names a stuck
        request, and the setting when the cause is known: multi-module MTP with a
        long-prefill threshold below its prefill lookahead, where vLLM 0.33 livelocks too.
        Otherwise the workload (``workload_field``: what the clock calls it) is blamed."""
        scheduler = self.scheduler
        stuck: list[tuple[Request, str]] = [(r, "is running") for r in scheduler.running]
        stuck.extend((r, "waits") for r in scheduler.waiting)
        stuck.extend((r, "waits for its KV") for r in scheduler.connector_state.kv_holding_waiting)
        if not stuck:
            return ConfigError(workload_field, "a workload that can make progress (nothing is left to schedule, yet "
                               "the engine reports unfinished requests)")
        lookahead = scheduler.num_prefill_lookahead
        threshold = scheduler.long_prefill_threshold()
        if lookahead and 0 < threshold < lookahead:
            for request, where in stuck:
                if threshold < request.num_tokens - request.num_computed_tokens <= lookahead:
                    # No chunk may end within `lookahead` tokens of the prefill end, none may
                    # exceed `threshold`: the last `lookahead` prefill tokens never fit.
                    return ConfigError(
                        "long_prefill_token_threshold",
                        f"0 or at least num_prefill_lookahead_tokens = {lookahead} (multi-module MTP): a prefill chunk "
                        f"may neither end within {lookahead} tokens of the prefill end nor be longer than the "
                        f"threshold, so {_stuck(request, where)}; vLLM 0.33 livelocks too", threshold)
        request, where = stuck[0]
        return ConfigError(workload_field, f"a workload that can make progress: {_stuck(request, where)}")

    def make_stats(self) -> EngineStats:
        """The queues and the pool as they are now, and the connector tier's counters (vLLM's
        ``Scheduler.make_stats``), without reading the scheduler. The drafts a batch's update
        verified come only with that batch's record (``_record_stats``)."""
        return self._stats(None)

    def _record_stats(self) -> EngineStats:
        """``make_stats`` for the record of the batch just applied: with the drafts its
        update verified, taken from the scheduler so that no other record carries them."""
        return self._stats(self.scheduler.take_spec_decoding_stats())

    def _stats(self, spec_decoding_stats: SpecDecodingStats | None) -> EngineStats:
        scheduler = self.scheduler
        tier = self._tier
        counters = None
        load_seconds = None
        if tier is not None:
            counters = tier.step_counters()
            load_seconds = tier.job_load_seconds()
        return pool_stats(self.kv_cache_manager.block_pool, len(scheduler.running), len(scheduler.waiting), counters,
                          load_seconds, spec_decoding_stats)
