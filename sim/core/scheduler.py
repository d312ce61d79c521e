"""The v1 continuous-batching scheduler (vLLM ``v1/core/sched/scheduler.py``).

One ``schedule()`` call per engine step (docs/semantics.md#scheduler):

1. Running requests first, in running order, while token budget remains: each gets what
   it still lacks (the rest of its prefill, or one decode token), clipped by the budget,
   ``long_prefill_token_threshold``, ``max_model_len`` and, for Mamba "align" models, the
   block-aligned prefill split. If the pool is short, preempt (FCFS: the last running
   request; priority: the lowest-priority latest arrival) and retry. A request that had
   to preempt itself ends the running pass under FCFS; under priority the pass goes on
   with the next running request, which ranks higher and may fit in what it freed.
2. Waiting requests only if nobody was preempted this step, while budget remains and
   fewer than ``max_num_seqs`` run: look up the prefix hit, admit if the whole sequence
   fits; the first request that does not fit stops admission (head-of-line blocking).

``update_from_output`` appends sampled tokens, finishes requests that reached
``max_tokens`` or ``max_model_len`` and frees their blocks at once, in scheduled order.

The ``SchedulerOutput`` (``scheduler_output.py``) is everything an executor needs: block
ids of admitted requests, blocks appended and entries replaced for running ones, positions,
and who samples. A running request's table changes are taken from the KV cache manager
right after its allocation succeeds; a request preempted later in the same step (priority
policy) has them withdrawn, since its tables are dropped.

Asynchronous scheduling is the subclass ``AsyncScheduler`` (``async_scheduler.py``): how a
batch's computed counts advance and its update is applied. ``make_scheduler`` (``engine.py``)
picks the class. A KV connector, if any, is known here only through the ``KVConnector``
Protocol (``kv_connector.py``); the paths that use it are ``ConnectorScheduling``'s.
"""

from __future__ import annotations

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.connector_scheduling import ConnectorScheduling
from kvtwin.sim.core.drafting import (check_drafting, pad_admission, reserve_prefill_lookahead, schedule_spec_tokens,
                                      verify_drafts)
from kvtwin.sim.core.hashing import BlockHasher, get_hash_fn
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.kv_connector import KVConnector
from kvtwin.sim.core.kv_connector_state import KVConnectorState
from kvtwin.sim.core.mamba_chunks import MambaChunks
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.prefill_throttle import (defers_prefills, holds_prefills_locally, note_local_cadence,
                                               note_release)
from kvtwin.sim.core.request_queue import create_request_queue, remove_from_queue
from kvtwin.sim.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig
from kvtwin.sim.core.spec_decode_stats import SpecDecodingStats

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput"]


def _preemption_rank(request: Request) -> tuple[int, float]:
    """Under the priority policy the running request with the highest rank is preempted."""
    return (request.priority, request.arrival_time)


class Scheduler(ConnectorScheduling):
    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig(), connector: KVConnector | None = None):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, scheduler_config.max_model_len, scheduler_config.max_in_flight_tokens,
            enable_caching=cache_config.enable_prefix_caching, watermark=scheduler_config.watermark,
            num_prefill_lookahead=scheduler_config.num_prefill_lookahead_tokens,
            use_eagle_block_drop=scheduler_config.use_eagle_block_drop)
        # vLLM's engine hashes a request's blocks for the prefix cache and for a KV
        # connector alike: with caching off, an offload tier still stores and finds prefixes.
        # A draft head's lookahead hashes (docs/semantics.md#draft-heads-and-prefix-caching).
        self.hasher = (BlockHasher(get_hash_fn(cache_config.prefix_caching_hash_algo), kv_cache_config.hash_block_size,
                                   scheduler_config.num_hash_lookahead_tokens)
                       if cache_config.enable_prefix_caching or connector is not None else None)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished in the last update_from_output; reported in the next output.
        self.finished_req_ids: list[str] = []
        # Waiting-head prefix lookups skipped as certain to fail again (``KVCacheManager.still_blocked``).
        self.num_head_lookups_skipped = 0
        # Where an align-mode Mamba model's prefill chunks must end (block size 0: no rule).
        self.mamba_chunks = MambaChunks(kv_cache_config, scheduler_config)
        self.mamba_block_size = self.mamba_chunks.block_size
        # A KV connector (an offload tier), or None: then no connector path below runs.
        self.connector = connector
        # What the scheduler keeps for a connector; empty and off without one.
        self.connector_state = KVConnectorState(scheduler_config.scheduling_policy, connector is not None,
                                                scheduler_config.async_scheduling)
        if connector is not None:
            self.connector_state.listen_for_boundary_states(self.kv_cache_manager)
        # Speculative decoding (docs/semantics.md#speculative-decoding); 0: off, and no
        # path below looks at drafts.
        self.num_spec_tokens = scheduler_config.num_speculative_tokens
        self.num_lookahead_tokens = scheduler_config.num_lookahead_tokens
        # The drafts the last update verified, until the engine's stats take them.
        self.spec_decoding_stats: SpecDecodingStats | None = None
        # A connector with drafts is not modelled: a scenario with both is refused when it
        # is resolved (docs/architecture.md#features-and-their-combinations).
        assert not (self.num_spec_tokens and connector is not None), "drafts with a KV connector are not modelled"
        check_drafting(kv_cache_config, scheduler_config, cache_config)
        # Multi-module MTP: no prefill chunk ends within this many tokens of the prefill end
        # (0: the rule is off; vLLM's rule changes nothing for a lookahead of 1).
        self.num_prefill_lookahead = (scheduler_config.num_prefill_lookahead_tokens
                                      if scheduler_config.num_prefill_lookahead_tokens > 1 else 0)
        # This step's waiting pass may pad a one-token admission to 1 + k (set by schedule()).
        self._pad_admissions = False
        self._running_scheduled = False
        self.current_step = 0  # schedules so far, counted only with PP microbatching
        # Prefill throttling under DP (``prefill_throttle.py``, docs/semantics.md#data-parallel-lockstep).
        self.defer_prefills = False
        self.prefill_capacity_bound = False
        self.throttled = scheduler_config.prefill_schedule_interval > 1  # only then is the bound read
        # Its own cadence, a full interval back: the first step is never held (docs/semantics.md#local-prefill-cadence).
        self.local_prefill_interval = scheduler_config.local_prefill_interval
        self.last_prefill_step = -self.local_prefill_interval
        self.num_executed_steps = 0

    # -- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.hasher is not None:
            request.attach_hasher(self.hasher)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or len(self.connector_state.kv_holding_waiting) > 0

    # -- one step ------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        out = SchedulerOutput()
        self.defer_prefills = defer = defers_prefills(self, throttle_prefills)
        if self.local_prefill_interval > 1 and not defer:
            self.defer_prefills = defer = holds_prefills_locally(self)
        if self.finished_req_ids:
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        long_prefill = self.long_prefill_threshold()
        self.kv_cache_manager.new_step_starts()
        if self.num_spec_tokens:
            out.scheduled_spec_decode_tokens = {}
        token_budget = self._schedule_running(out, self.config.max_num_batched_tokens, long_prefill)
        if self.num_spec_tokens:
            self._note_padding_state(out)
        if self.connector is not None:
            if not out.preempted:
                self._schedule_waiting_with_connector(out, token_budget, long_prefill)
            return self._finish_schedule_with_connector(out)
        if not out.preempted:
            self.schedule_waiting(out, token_budget, long_prefill)
            if self.throttled:
                note_release(self, defer)
        if self.local_prefill_interval > 1:
            note_local_cadence(self, out)
        # Advance the computed counts optimistically (before the forward pass), noting for
        # the executor where each request starts and which ones sample.
        self.advance_computed(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, token_budget: int, long_prefill: int) -> int:
        """The running pass: schedule running requests in order into ``out`` (preempting
        if the pool is short); returns the budget left."""
        kv_cache_manager = self.kv_cache_manager
        scheduled = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        empty_blocks = kv_cache_manager.empty_blocks
        replaced_log = kv_cache_manager.replaced_block_ids
        is_priority = self.config.scheduling_policy == "priority"
        mamba_split = self.mamba_block_size > 0
        # Lookahead slots are past what the horizon knows of: always ask the manager.
        horizon = kv_cache_manager.noop_horizon if not self.num_lookahead_tokens else {}
        running = self.running
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            computed = request.num_computed_tokens
            num_new = request.num_tokens - computed
            spec_token_ids = request.spec_token_ids  # empty unless drafting
            if spec_token_ids:
                num_new += len(spec_token_ids)
            placeholders = request.num_output_placeholders  # 0 unless scheduling asynchronously
            if placeholders:
                if (computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
                        or self.current_step < request.next_decode_eligible_step):
                    # The batch in flight samples its last token, or PP microbatching holds
                    # its next decode (docs/semantics.md#asynchronous-pipeline-parallelism).
                    req_index += 1
                    continue
                # The tokens being sampled in flight count as tokens it has.
                num_new += placeholders
            num_new = self.clip_running_chunk(num_new, computed, token_budget, long_prefill)
            if mamba_split:
                num_new = self.mamba_block_aligned_split(request, num_new, 0)
            if self.num_prefill_lookahead:
                num_new = reserve_prefill_lookahead(request, computed, num_new, self.num_prefill_lookahead)
            if num_new <= 0 or (self.defer_prefills and request.is_prefill_chunk):
                req_index += 1
                continue
            request_id = request.request_id
            if computed + num_new <= horizon.get(request_id, -1):
                # Most decode steps: the KV cache manager already knows nothing changes.
                scheduled[request_id] = num_new
                token_budget -= num_new
                req_index += 1
                if spec_token_ids:
                    schedule_spec_tokens(out, request, num_new)
                continue
            new_blocks, req_index, token_budget = self._allocate_or_preempt(out, request, num_new, req_index,
                                                                            token_budget, is_priority)
            if new_blocks is None:
                if is_priority and request.status is RequestStatus.PREEMPTED:
                    # It was the lowest-priority running request and preempted itself.
                    # The ones after it rank higher and may fit in what it freed; it left
                    # ``self.running``, so ``req_index`` already points at the next one.
                    continue
                if replaced_log and request.status is RequestStatus.RUNNING:
                    # It waits, unscheduled, for a victim's blocks a batch in flight still
                    # holds; what its failed attempt released goes out now all the same.
                    replaced = kv_cache_manager.take_replaced_block_ids(request_id)
                    if replaced is not None:
                        cached.replaced_block_ids[request_id] = replaced
                break
            if new_blocks is not empty_blocks:
                cached.new_blocks[request_id] = new_blocks
            if replaced_log:
                # Also what an earlier failed attempt in this step changed (skipped blocks
                # are released before the capacity check). Taken, so the log empties.
                replaced = kv_cache_manager.take_replaced_block_ids(request_id)
                if replaced is not None:
                    cached.replaced_block_ids[request_id] = replaced
            scheduled[request_id] = num_new
            token_budget -= num_new
            req_index += 1
            if spec_token_ids:
                schedule_spec_tokens(out, request, num_new)
        return token_budget

    def _note_padding_state(self, out: SchedulerOutput) -> None:
        """After the running pass: whether a one-token admission may be padded to a full
        verify step (no running prefill chunk scheduled), and whether any running request
        was scheduled (vLLM pads a fresh request without a hit only then)."""
        requests = self.requests
        self._running_scheduled = bool(out.num_scheduled_tokens)
        self._pad_admissions = not any(requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens)

    def _allocate_or_preempt(self, out: SchedulerOutput, request: Request, num_new: int, req_index: int,
                             token_budget: int, is_priority: bool) -> tuple[KVCacheBlocks | None, int, int]:
        """Allocate ``num_new`` slots for the running request at ``req_index``, preempting
        until they fit. Returns the new blocks (None: the request preempted itself, or the
        victim's blocks would only come back after a batch in flight), and the running
        index and budget as the preemptions left them."""
        kv_cache_manager = self.kv_cache_manager
        lookahead = self.num_lookahead_tokens
        new_blocks = kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
        if new_blocks is not None:
            return new_blocks, req_index, token_budget
        running = self.running
        state = self.connector_state
        scheduled = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        while True:
            victim = max(running, key=_preemption_rank) if is_priority else running[-1]
            if state.defer_block_free and victim.last_sched_seq > state.processed_step_seq:
                return None, req_index, token_budget  # its blocks would not come back in time: wait
            if is_priority:
                victim_index = running.index(victim)
                del running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                if victim.request_id in scheduled:
                    token_budget += scheduled.pop(victim.request_id)
                    # Its tables are dropped: what changed in them is moot.
                    cached.new_blocks.pop(victim.request_id, None)
                    cached.replaced_block_ids.pop(victim.request_id, None)
                    if out.scheduled_spec_decode_tokens:
                        out.scheduled_spec_decode_tokens.pop(victim.request_id, None)
            else:
                running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return None, req_index, token_budget
            new_blocks = kv_cache_manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is not None:
                return new_blocks, req_index, token_budget

    def long_prefill_threshold(self) -> int:
        """This step's cap on one prefill chunk (0: none). It keeps one long prefill from
        starving others; alone, a request has nobody to starve and may use the whole budget."""
        cfg = self.config
        num_eligible = len(self.running) + len(self.waiting) + len(self.connector_state.kv_holding_waiting)
        long_prefill = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if long_prefill > 0 and cfg.adaptive_long_prefill_threshold:
            long_prefill = max(long_prefill, cfg.max_num_batched_tokens // num_eligible)
        return long_prefill

    def clip_running_chunk(self, num_new: int, computed: int, token_budget: int, long_prefill: int) -> int:
        """The running pass's clip of what a running request lacks (before any Mamba
        alignment): the long-prefill threshold, the budget left, ``max_model_len``."""
        if 0 < long_prefill < num_new:
            num_new = long_prefill
        if num_new > token_budget:
            num_new = token_budget
        max_model_len = self.config.max_model_len
        if num_new > max_model_len - computed - 1:
            num_new = max_model_len - computed - 1
        return num_new

    def advance_computed(self, out: SchedulerOutput) -> None:
        """Advance the computed counts of everything ``out`` schedules, before the forward
        pass (vLLM's ``_update_after_schedule``): each request's count moves past its
        tokens, its count before the step is appended to ``out.num_computed_tokens`` (in
        scheduled order) and a request whose tokens are then all computed samples
        (``out.num_output_tokens``); the rest are partial prefill chunks
        (``is_prefill_chunk``). Called once per scheduled batch, after everything in it was
        scheduled; ``AsyncScheduler`` adds the batch in flight through the hooks
        ``_start_batch`` and ``_update_request_after_schedule``."""
        requests = self.requests
        noted_computed = out.num_computed_tokens
        sampling = out.num_output_tokens
        self._start_batch(out)
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            request = requests[request_id]
            computed = request.num_computed_tokens
            noted_computed.append(computed)
            computed += num_tokens
            request.num_computed_tokens = computed
            # The outputs still being sampled in flight (asynchronous scheduling) count as
            # tokens it has; a partial prefill chunk (or part of a recompute) samples
            # nothing, and drafts are scheduled only past its known tokens.
            have = request.num_tokens + request.num_output_placeholders
            if computed >= have:
                sampling[request_id] = have - request.num_prompt_tokens
                request.is_prefill_chunk = False
            else:
                request.is_prefill_chunk = True
            self._update_request_after_schedule(request, num_tokens, out)

    def _start_batch(self, out: SchedulerOutput) -> None:
        """Hook: a batch is about to be advanced (nothing to note when synchronous)."""

    def _update_request_after_schedule(self, request: Request, num_tokens: int, out: SchedulerOutput) -> None:
        """Hook: ``request`` was advanced by ``num_tokens`` in ``out`` (a synchronous batch
        leaves nothing more to note: its update comes before the next schedule)."""

    def schedule_waiting(self, out: SchedulerOutput, token_budget: int, long_prefill: int) -> None:
        """The waiting pass without a connector: admit waiting requests into ``out`` while
        ``token_budget`` lasts and fewer than ``max_num_seqs`` run, each chunk clipped by
        ``long_prefill`` (``long_prefill_threshold()``); the first that does not fit stops
        it. A caller may rely on this: admitted requests are allocated, appended to
        ``running`` and to ``out.num_scheduled_tokens`` / ``out.scheduled_new_reqs``, and
        nothing is advanced (``advance_computed`` does that); nothing else in ``out``
        changes; no request is preempted; a request set aside keeps its place in the queue."""
        cfg = self.config
        kv_cache_manager = self.kv_cache_manager
        # Async: preempted requests whose output from before the preemption is still in
        # flight, set aside for this step (vLLM resumes them only once it is delivered).
        skipped: list[Request] = []
        # A head that failed the whole-sequence check may be known to fail it again without
        # a new prefix lookup (``KVCacheManager.still_blocked``; one full-attention group).
        remember_blocked = cfg.scheduler_reserve_full_isl and kv_cache_manager.remembers_blocked_head
        while len(self.waiting) and token_budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.num_in_flight_tokens:
                # Preempted while a batch with it was in flight (async; 0 when synchronous).
                skipped.append(self.waiting.pop())
                continue
            fresh = request.num_computed_tokens == 0
            if fresh and remember_blocked and kv_cache_manager.still_blocked(request, bool(self.running)):
                self.num_head_lookups_skipped += 1
                break  # the same failure as at its last try, without the lookup
            if fresh:
                hit_blocks, hit_tokens, request.shared_prefix_boundary = kv_cache_manager.get_computed_blocks(request)
            else:
                hit_blocks, hit_tokens = kv_cache_manager.empty_blocks, 0
            num_computed = request.num_computed_tokens + hit_tokens
            if self.defer_prefills and num_computed < request.num_tokens - 1:
                break  # a throttled step admits only what has no prompt left to compute
            num_new = self._first_chunk(request, num_computed, hit_tokens, token_budget, long_prefill)
            if not num_new:
                break
            if self.num_prefill_lookahead:
                num_new = reserve_prefill_lookahead(request, num_computed, num_new, self.num_prefill_lookahead)
                if not num_new:
                    skipped.append(self.waiting.pop())  # vLLM skips it for this step
                    continue
            new_blocks = kv_cache_manager.allocate_slots(request, num_new, hit_tokens, hit_blocks,
                                            num_lookahead_tokens=self.num_lookahead_tokens,
                                            full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                                            has_scheduled_reqs=bool(self.running))
            if new_blocks is None:
                if fresh and remember_blocked:
                    kv_cache_manager.remember_blocked(request, hit_tokens, bool(self.running))
                break
            self.waiting.pop()
            self._admit(out, request, num_computed, num_new, hit_tokens)
            token_budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)  # back in front, in their order

    def _first_chunk(self, request: Request, num_computed: int, num_new_computed: int, token_budget: int,
                     long_prefill: int) -> int:
        """Tokens a waiting request may schedule now, past its hit; 0 stops admission (no
        chunked prefill and the rest does not fit the budget, or no Mamba-aligned chunk)."""
        num_new = request.num_tokens - num_computed
        padded = 0
        if num_new == 1 and self.num_spec_tokens and self._pad_admissions and (
                self._running_scheduled or num_computed > 0):
            # One token left (a full hit, a resumed request): vLLM pads it to a uniform
            # verify step of 1 + k rows with placeholder drafts, when the sampled token
            # still fits max_model_len; if the padded step does not fit the budget
            # admission stops rather than schedule it unpadded.
            padded = 1 + self.num_spec_tokens
            if num_computed + padded + 1 <= self.config.max_model_len:
                if padded > token_budget:
                    return 0
                num_new = padded
            else:
                padded = 0
        if 0 < long_prefill < num_new:
            num_new = long_prefill
        if not self.config.enable_chunked_prefill and num_new > token_budget:
            return 0
        num_new = min(num_new, token_budget)
        if self.mamba_block_size:
            num_new = self.mamba_block_aligned_split(request, num_new, num_new_computed)
            if padded and num_new and num_new != padded:
                # A Mamba align-mode layout never keeps a shortened padded row (the
                # long-prefill threshold or the split cut it): the sampler needs all 1 + k
                # rows, so the padding is dropped and the one real token is scheduled
                # (docs/semantics.md#scheduling-drafts).
                num_new = 1
        return num_new

    def _admit(self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int,
               hit_tokens: int) -> None:
        """Move a request (taken from its queue) to running; its whole table goes out."""
        kv_cache_manager = self.kv_cache_manager
        self.running.append(request)
        request_id = request.request_id
        resumed = request.status is RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        kv_cache_manager.take_replaced_block_ids(request_id)  # the whole table goes out instead
        out.scheduled_new_reqs.append(NewRequestData(
            request_id, kv_cache_manager.get_blocks(request_id), num_computed, request.num_prompt_tokens,
            request.num_tokens, hit_tokens, resumed, request.prompt))
        out.num_scheduled_tokens[request_id] = num_new
        num_padding = num_new - (request.num_tokens - num_computed)
        if num_padding > 0:
            pad_admission(out, request_id, num_new, num_padding, self.num_spec_tokens,
                          self.config.long_prefill_token_threshold)

    def _preempt(self, request: Request) -> None:
        """Free everything (hashed blocks stay cached) and requeue at the front; keep outputs."""
        self.connector_state.inflight_prefills.discard(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.spec_token_ids:
            request.spec_token_ids = []
        # Async: output still in flight is stale; it is delivered but resolves nothing.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)

    def mamba_block_aligned_split(self, request: Request, num_new: int, num_new_computed: int) -> int:
        """Clip a prefill chunk so it ends where a Mamba state must be cached
        (``MambaChunks.aligned_split``)."""
        return self.mamba_chunks.aligned_split(request, num_new, num_new_computed)

    # -- after the forward pass -------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append sampled tokens; finish and free requests that are done. Returns the finished.

        ``sampled`` must list requests in scheduled order (a subset of the scheduled ones):
        it is the order finished requests are freed in, which decides the free queue's
        order. A request that verified drafts sampled one token plus the drafts accepted;
        the rejected ones leave ``num_computed_tokens`` (their slots stay allocated for
        the next verify step) (docs/semantics.md#speculative-decoding). Its tokens are
        appended up to a stop, then the blocks the accepted tokens completed are cached,
        then a finished request is freed. ``AsyncScheduler`` adds the batch in flight
        through the hooks ``_start_update``, ``_update_request_before_output`` and
        ``_cache_after_output``."""
        scheduled = output.num_scheduled_tokens
        if not scheduled:
            return []
        self._start_update()
        spec_scheduled = output.scheduled_spec_decode_tokens
        spec_stats = None
        if spec_scheduled is not None:
            spec_stats = self.spec_decoding_stats = SpecDecodingStats(self.num_spec_tokens)
        requests = self.requests
        preempted = RequestStatus.PREEMPTED
        running_status = RequestStatus.RUNNING
        finished: list[Request] = []
        for request_id, tokens in sampled.items():
            found = requests.get(request_id)
            if found is None:
                # Finished in an earlier update while this batch was in flight (drafts make
                # an asynchronous request's end uncertain, so it was scheduled again): vLLM
                # drops its output.
                continue
            request = found
            num_scheduled = scheduled[request_id]
            self._update_request_before_output(request, num_scheduled)
            if not tokens:
                continue
            # Output of a batch that was in flight when the request was preempted
            # (asynchronous scheduling): delivered, but the preemption already reset its counts.
            stale = request.status is preempted
            if spec_scheduled is not None and spec_stats is not None:
                drafts = spec_scheduled.get(request_id)
                if drafts:
                    verify_drafts(request, spec_stats, len(drafts), len(tokens) - 1, stale)
            running = request.status is running_status
            placeholders = request.num_output_placeholders
            stopped = self._update_request_with_output(request, tokens, stale)
            if running and (placeholders or spec_scheduled is not None):
                self._cache_after_output(request, num_scheduled)
            if stopped:
                if stale:
                    remove_from_queue(self.waiting, request)
                self._finish(request, finished)
        self._drop_finished(finished)
        return finished

    def take_spec_decoding_stats(self) -> SpecDecodingStats | None:
        """The drafts the last update verified (None: it had none to verify, or they were
        taken already): what the engine's stats of that batch carry."""
        stats = self.spec_decoding_stats
        self.spec_decoding_stats = None
        return stats

    def _start_update(self) -> None:
        """Hook: the update of a batch starts (a synchronous batch was the only one in flight)."""

    def _update_request_before_output(self, request: Request, num_tokens: int) -> None:
        """Hook: ``request``'s ``num_tokens`` in the batch being updated were processed
        (nothing to note when synchronous: no other batch holds it)."""

    def _cache_after_output(self, request: Request, num_tokens: int) -> None:
        """Cache the running ``request``'s blocks full within what was processed (computed
        less still in flight), after its sampled tokens were applied; called where they
        can complete blocks not cached at allocation (verified drafts, or outputs that were
        placeholders)."""
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)

    def _update_request_with_output(self, request: Request, tokens: list[int], stale: bool) -> bool:
        """Append a step's tokens up to a stop (``max_tokens``, ``max_model_len``); those
        past it (only a verify step samples several) are dropped, and unless the output is
        stale the computed count goes down by them too (vLLM's
        ``_update_request_with_output``). Resolves the request's placeholders. Returns
        whether the request stopped."""
        num_tokens = len(tokens)
        if num_tokens > 1:
            keep = min(num_tokens, request.max_tokens - len(request.output_token_ids),
                       self.config.max_model_len - request.num_tokens)
            if keep < num_tokens:
                tokens = tokens[:keep]
                if not stale:
                    request.num_computed_tokens -= num_tokens - keep
        request.append_output_token_ids(tokens)
        if not stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_tokens  # all returned tokens, trimmed ones too
        return len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.config.max_model_len

    def update_draft_token_ids(self, output: SchedulerOutput, draft_token_ids: dict[str, list[int]]) -> None:
        """A synchronous step's drafts (vLLM's ``update_draft_token_ids``, called by the
        engine after the update): each request still running that sampled in ``output``
        verifies them at its next decode; a partial prefill chunk's are dropped."""
        requests = self.requests
        sampling = output.num_output_tokens
        for request_id, spec_token_ids in draft_token_ids.items():
            request = requests.get(request_id)
            if request is None or request.status is RequestStatus.FINISHED:
                continue
            request.spec_token_ids = list(spec_token_ids) if request_id in sampling else []

    def _drop_finished(self, finished: list[Request]) -> None:
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                del self.requests[request.request_id]

    def _finish(self, request: Request, finished: list[Request]) -> None:
        """A request is done: the connector learns of it (its last chunks are stored with the
        next schedule), then its blocks are freed at once; it is reported next schedule."""
        request.status = RequestStatus.FINISHED
        if self.connector is None or not self._request_finished_with_connector(request):
            self.kv_cache_manager.free(request)
        finished.append(request)
        self.finished_req_ids.append(request.request_id)
