"""The v1 continuous-batching scheduler (vLLM ``v1/core/sched/scheduler.py``, synchronous).

Semantics section 6. One ``schedule()`` call per engine step:

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
"""

from __future__ import annotations

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.hashing import BlockHasher, get_hash_fn
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.core.request_queue import create_request_queue
from kvtwin.sim.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig, MambaSpec

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(self, kv_cache_config: KVCacheConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig = CacheConfig()):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, scheduler_config.max_model_len, scheduler_config.max_in_flight_tokens,
            enable_caching=cache_config.enable_prefix_caching, watermark=scheduler_config.watermark)
        self.hasher = (BlockHasher(get_hash_fn(cache_config.prefix_caching_hash_algo), kv_cache_config.hash_block_size)
                       if cache_config.enable_prefix_caching else None)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished in the last update_from_output; reported in the next output.
        self.finished_req_ids: list[str] = []
        mamba_align = [g.spec for g in kv_cache_config.groups
                       if isinstance(g.spec, MambaSpec) and g.spec.mamba_cache_mode == "align"]
        # Align mode caches a Mamba state only where a prefill chunk ends, so chunks must
        # end on block boundaries.
        self.mamba_block_size = mamba_align[0].block_size if mamba_align and cache_config.enable_prefix_caching \
            else 0

    # -- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.hasher is not None:
            request.attach_hasher(self.hasher)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kvm = self.kv_cache_manager
        out = SchedulerOutput()
        if self.finished_req_ids:
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        scheduled = out.num_scheduled_tokens
        cached = out.scheduled_cached_reqs
        empty_blocks = kvm.empty_blocks
        replaced_log = kvm.replaced_block_ids
        token_budget = cfg.max_num_batched_tokens
        # The threshold keeps one long prefill from starving others; alone, it has nobody
        # to starve and may use the whole budget.
        num_eligible = len(self.running) + len(self.waiting)
        long_prefill = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if long_prefill > 0 and cfg.adaptive_long_prefill_threshold:
            long_prefill = max(long_prefill, token_budget // num_eligible)
        is_priority = cfg.scheduling_policy == "priority"
        max_model_len = cfg.max_model_len
        mamba_split = self.mamba_block_size > 0
        horizon = kvm.noop_horizon
        kvm.new_step_starts()

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            computed = request.num_computed_tokens
            num_new = request.num_tokens - computed
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            if num_new > token_budget:
                num_new = token_budget
            if num_new > max_model_len - computed - 1:
                num_new = max_model_len - computed - 1
            if mamba_split:
                num_new = self._mamba_block_aligned_split(request, num_new, 0)
            if num_new <= 0:
                req_index += 1
                continue
            if computed + num_new <= horizon.get(request.request_id, -1):
                # Most decode steps: the KV cache manager already knows nothing changes.
                scheduled[request.request_id] = num_new
                token_budget -= num_new
                req_index += 1
                continue
            while True:
                new_blocks = kvm.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                if is_priority:
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    victim_index = self.running.index(victim)
                    del self.running[victim_index]
                    if victim_index < req_index:
                        req_index -= 1
                    if victim.request_id in scheduled:
                        token_budget += scheduled.pop(victim.request_id)
                        # Its tables are dropped: what changed in them is moot.
                        cached.new_blocks.pop(victim.request_id, None)
                        cached.replaced_block_ids.pop(victim.request_id, None)
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                if is_priority and request.status is RequestStatus.PREEMPTED:
                    # It was the lowest-priority running request and preempted itself.
                    # The ones after it rank higher and may fit in what it freed; it left
                    # ``self.running``, so ``req_index`` already points at the next one.
                    continue
                break
            request_id = request.request_id
            if new_blocks is not empty_blocks:
                cached.new_blocks[request_id] = new_blocks
            if replaced_log:
                # Also what an earlier failed attempt in this step changed (skipped blocks
                # are released before the capacity check). Taken, so the log empties.
                replaced = replaced_log.pop(request_id, None)
                if replaced is not None:
                    cached.replaced_block_ids[request_id] = replaced
            scheduled[request_id] = num_new
            token_budget -= num_new
            req_index += 1

        if not out.preempted:
            self._schedule_waiting(out, token_budget, long_prefill)

        # Advance the computed counts optimistically (before the forward pass), noting for
        # the executor where each request starts and which ones sample.
        requests = self.requests
        note_computed = out.num_computed_tokens.append
        sampling = out.num_output_tokens
        for request_id, num_tokens in scheduled.items():
            request = requests[request_id]
            computed = request.num_computed_tokens
            note_computed(computed)
            computed += num_tokens
            request.num_computed_tokens = computed
            # A partial prefill chunk (or part of a recompute) samples nothing.
            if computed >= request.num_tokens:
                sampling[request_id] = request.num_tokens - request.num_prompt_tokens
        return out

    def _schedule_waiting(self, out: SchedulerOutput, token_budget: int, long_prefill: int) -> None:
        cfg = self.config
        kvm = self.kv_cache_manager
        while len(self.waiting) and token_budget > 0:
            if len(self.running) >= cfg.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.num_computed_tokens == 0:
                hit_blocks, hit_tokens, request.shared_prefix_boundary = kvm.get_computed_blocks(request)
            else:
                hit_blocks, hit_tokens = kvm.empty_blocks, 0
            num_computed = request.num_computed_tokens + hit_tokens
            num_new = request.num_tokens - num_computed
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            if not cfg.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            if self.mamba_block_size:
                num_new = self._mamba_block_aligned_split(request, num_new, hit_tokens)
                if num_new == 0:
                    break
            new_blocks = kvm.allocate_slots(request, num_new, hit_tokens, hit_blocks,
                                            full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                                            has_scheduled_reqs=bool(self.running))
            if new_blocks is None:
                break
            self.waiting.pop()
            self.running.append(request)
            request_id = request.request_id
            resumed = request.status is RequestStatus.PREEMPTED
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if kvm.replaced_block_ids:
                kvm.replaced_block_ids.pop(request_id, None)  # the whole table goes out instead
            out.scheduled_new_reqs.append(NewRequestData(
                request_id, kvm.get_blocks(request_id), num_computed, request.num_prompt_tokens,
                request.num_tokens, hit_tokens, resumed))
            out.num_scheduled_tokens[request_id] = num_new
            token_budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Free everything (hashed blocks stay cached) and requeue at the front; keep outputs."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)

    def _mamba_block_aligned_split(self, request: Request, num_new: int, num_new_local_computed: int) -> int:
        """Clip a prefill chunk so it ends where a Mamba state must be cached.

        States are written only at chunk ends, so an unfinished prefill chunk must end on a
        block boundary; it also stops at the last cacheable boundary of the sequence and at
        a shared-prefix junction, so siblings sharing that prefix can reuse its state.
        """
        block_size = self.mamba_block_size
        start = request.num_computed_tokens + num_new_local_computed
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new
        # The last boundary a later request can hit (hits stop at num_tokens - 1).
        last_cache_position = (request.num_tokens - 1) // block_size * block_size
        end = start + num_new
        if end < prefill_end:
            max_prefill_tokens = self.config.max_num_batched_tokens
            if self.config.long_prefill_token_threshold > 0:
                max_prefill_tokens = min(max_prefill_tokens, self.config.long_prefill_token_threshold)
            aligned_end = end // block_size * block_size
            if aligned_end > start or block_size <= max_prefill_tokens:
                end = aligned_end
        boundary = request.shared_prefix_boundary
        stops = (
            (start // block_size + 1) * block_size if start % block_size else 0,
            last_cache_position,
            start + (boundary - start) // block_size * block_size if start < boundary < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    # -- after the forward pass -------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append sampled tokens; finish and free requests that are done. Returns the finished.

        ``sampled`` must list requests in scheduled order (a subset of the scheduled ones)."""
        finished: list[Request] = []
        max_model_len = self.config.max_model_len
        requests = self.requests
        # ``sampled`` follows the scheduled order, which is the order finished requests are
        # freed in (it decides the free queue's order).
        for request_id, tokens in sampled.items():
            if not tokens:
                continue
            request = requests[request_id]
            request.append_output_token_ids(tokens)
            if len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= max_model_len:
                request.status = RequestStatus.FINISHED
                self.kv_cache_manager.free(request)
                finished.append(request)
                self.finished_req_ids.append(request_id)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                del self.requests[request.request_id]
        return finished
