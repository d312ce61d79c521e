"""The scheduler side of vLLM 0.33's native offloading connector (``OffloadingConnector``).

vLLM ``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``. The
connector sits between the scheduler and an offloading manager (the CPU tier, or the CPU
tier over a disk tier). It answers four questions the scheduler asks, in the same order
and with the same effects as vLLM's:

* ``get_num_new_matched_tokens`` — how many tokens past the GPU prefix hit the tier holds.
  Full-attention groups are looked up left to right, windowed groups (sliding window,
  chunked local, and Mamba, whose "window" is one chunk) right to left, repeating until the
  hit length agrees; a chunk still being stored or loaded defers the request a step.
* ``update_state_after_alloc`` — once the scheduler allocated the blocks, which chunks to
  load into which fresh blocks: one load job per request, pinning its keys in the tier.
* ``build_connector_meta`` — at the end of every ``schedule()``: the store jobs for prompt
  chunks the step computes (or that a request finished with), a Mamba group's states as
  the KV cache manager hands them over at block boundaries, and the jobs to flush because
  a block they read was handed out again (or their request was preempted).
* ``update_connector_output`` — the worker reports finished jobs: stores become readable,
  loads release their pins, and a request waiting for its load may run.

Blocks are freed as soon as a request finishes (``request_finished`` returns nothing to
delay); a store still reading a freed block is flushed if the block is reused, which the
worker does before that step's forward pass.

Left out, as vLLM's defaults leave them off or our layouts never reach them: partial-tail
(sub-chunk) hits and stores, synchronous loads within a step, EAGLE drafter groups,
``max_load_tokens`` / ``max_offload_tokens``, decode context parallelism, cache resets and KV
events. Only prompt tokens are offloaded
(vLLM's ``offload_prompt_only`` default).

Beside it: ``connector_lookup.py`` (the lookups and the hit split by tier),
``connector_state.py`` (what it keeps per group, request and job) and
``connector_metadata.py`` (the jobs it hands the worker, ``transfers.py``).
"""

from __future__ import annotations

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.hashing import hashes_in_range
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.kv_connector import KVConnectorOutput
from kvtwin.sim.core.managers import manager_class_for
from kvtwin.sim.core.offload.base import OffloadKey, make_offload_key
from kvtwin.sim.core.offload.connector_lookup import ConnectorLookup
from kvtwin.sim.core.offload.connector_metadata import OffloadingConnectorMetadata, TransferJob
from kvtwin.sim.core.offload.connector_state import (GroupOffloadConfig, RequestGroupState, RequestOffloadState,
                                                     TransferJobStatus, sliding_window_size_in_chunks)
from kvtwin.sim.core.offload.manager import OffloadingManager
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.retention import reachable_boundaries, thins_caching
from kvtwin.sim.core.scheduler_output import SchedulerOutput
from kvtwin.sim.core.spec import KVCacheConfig, MambaSpec, SlidingWindowSpec, cdiv


class OffloadingConnector:
    # The tier stores no Mamba state beside the blocks it loads (vLLM's offloading
    # connector): a hybrid hit must be one every group agrees on.
    supports_divergent_local_hybrid_hits: bool = False

    def __init__(self, kv_cache_config: KVCacheConfig, manager: OffloadingManager, enable_prefix_caching: bool = True,
                 blocks_per_chunk: int = 1, retention_interval: int | None = 0):
        self.manager = manager
        self.blocks_per_chunk = blocks_per_chunk
        tokens_per_hash = kv_cache_config.hash_block_size
        self.tokens_per_hash = tokens_per_hash
        configs = []
        for gid, group in enumerate(kv_cache_config.groups):
            spec = group.spec
            tokens_per_chunk = spec.block_size * blocks_per_chunk
            configs.append(GroupOffloadConfig(
                gid, spec.block_size, tokens_per_chunk, tokens_per_chunk // tokens_per_hash,
                sliding_window_size_in_chunks(spec, tokens_per_chunk), spec,
                isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"))
        self.group_configs: tuple[GroupOffloadConfig, ...] = tuple(configs)
        # Hits are aligned to the full-attention chunk; with no full-attention group, to the
        # largest chunk (vLLM's alignment_tokens).
        full_chunks = {c.tokens_per_chunk for c in configs if c.sliding_window_size_in_chunks is None}
        if len(full_chunks) == 1:
            self.alignment_tokens: int | None = full_chunks.pop()
        elif not full_chunks:
            self.alignment_tokens = max(c.tokens_per_chunk for c in configs)
        else:
            self.alignment_tokens = None
        # Which chunks a store offers (docs/semantics.md#prefix-cache-retention): the
        # engine's ``CacheConfig`` setting, whatever the GPU cache runs. A Mamba group's
        # states come from the KV cache manager, already thinned by its own retention.
        self.retention_interval = retention_interval
        if retention_interval is not None:
            for c in configs:
                require(not isinstance(c.spec, SlidingWindowSpec) or retention_interval % c.tokens_per_chunk == 0,
                        "prefix_cache_retention_interval",
                        f"a multiple of the offload chunk ({c.tokens_per_chunk} tokens)", retention_interval)
        alignment = self.alignment_tokens
        self._thinned_groups = tuple(
            alignment is not None and not c.requires_cow_source
            and thins_caching(c.spec, alignment, retention_interval) for c in configs)

        self._req_status: dict[str, RequestOffloadState] = {}
        self._jobs: dict[int, TransferJobStatus] = {}
        self._job_counter = 0
        # block id -> store jobs still reading it (see TransferJobStatus's fences).
        self._block_id_to_pending_jobs: dict[int, set[int]] = {}
        self._current_batch_load_jobs: dict[int, TransferJob] = {}
        self._current_batch_jobs_to_flush: set[int] = set()
        self._current_batch_allocated_block_ids: set[int] = set()
        self._current_batch_deferred: list[str] = []
        # With GPU prefix caching a chunk being loaded for one request is not loaded again
        # for another: that one waits and then hits on the GPU.
        self._chunks_being_loaded: set | None = set() if enable_prefix_caching else None
        self._lookup = ConnectorLookup(manager, self.group_configs, self._chunks_being_loaded)
        # Windowed groups, widest window first (the lookup's order).
        self._sliding_window_groups = self._lookup.sliding_window_groups

    # -- requests ------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        state = RequestOffloadState(request, len(self.group_configs))
        self.manager.on_new_request(state.req_context)
        self._req_status[request.request_id] = state

    def _update_offload_keys(self, state: RequestOffloadState) -> None:
        hashes = state.req.block_hashes
        num_hashes = len(hashes)
        if num_hashes == state.num_hashes_keyed:
            return
        state.num_hashes_keyed = num_hashes
        ctx = state.req_context
        for config, group_state in zip(self.group_configs, state.group_states):
            per_chunk = config.hashes_per_chunk
            keys = group_state.offload_keys
            # A chunk's key is the hash of its last block: the hashes come in one run (the
            # request's memo, which the pool fills too), every ``per_chunk``-th a key.
            first_idx = per_chunk * (len(keys) + 1) - 1
            if first_idx >= num_hashes:
                continue
            group_idx = config.group_idx
            tokens_per_chunk = config.tokens_per_chunk
            end_token = len(keys) * tokens_per_chunk
            new_hashes = hashes_in_range(hashes, first_idx, num_hashes)
            if per_chunk != 1:
                new_hashes = new_hashes[::per_chunk]
            for block_hash in new_hashes:
                key = make_offload_key(block_hash, group_idx)
                keys.append(key)
                end_token += tokens_per_chunk
                ctx.set_offload_key_position(key, end_token)

    @staticmethod
    def _num_offloadable_tokens(request: Request, num_computed_tokens: int) -> int:
        """Computed prompt tokens (only the prompt is offloaded: vLLM's
        ``offload_prompt_only``). Plain comparisons: a compiled build runs them natively,
        where a three-argument ``min`` is a generic call."""
        num_tokens = request.num_tokens
        n = num_computed_tokens if num_computed_tokens < num_tokens else num_tokens
        num_prompt_tokens = request.num_prompt_tokens
        return n if n < num_prompt_tokens else num_prompt_tokens

    def _storable_chunks(self, config: GroupOffloadConfig, group_state: RequestGroupState,
                         num_offloadable_tokens: int) -> int:
        """Chunks of a group that are computed, in the block table and keyed."""
        n = num_offloadable_tokens // config.tokens_per_chunk
        in_table = len(group_state.block_ids) // self.blocks_per_chunk
        if in_table < n:
            n = in_table
        num_keys = len(group_state.offload_keys)
        return n if n < num_keys else num_keys

    def _advance_stored_idx(self, state: RequestOffloadState, num_offloadable_tokens: int) -> None:
        for config, group_state in zip(self.group_configs, state.group_states):
            group_state.next_stored_chunk_idx = max(
                group_state.next_stored_chunk_idx,
                self._storable_chunks(config, group_state, num_offloadable_tokens))

    # -- lookup (connector_lookup.py) ----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the tier can add past ``num_computed_tokens`` or None to ask again next
        step, whether they load asynchronously)."""
        state = self._req_status[request.request_id]
        for group_state in state.group_states:
            group_state.block_ids.clear()
            group_state.next_stored_chunk_idx = 0  # starting over: offer every chunk again
        state.settled_tokens = -1
        num_hit_tokens: int | None = None
        if not state.transfer_jobs:
            self._update_offload_keys(state)
            state.num_locally_computed_tokens = num_computed_tokens
            num_hit_tokens = self._lookup.num_hit_tokens(state)
        if num_hit_tokens is None:
            if not state.deferred:
                state.deferred = True
                self._current_batch_deferred.append(request.request_id)
            return None, False
        state.deferred = False
        return num_hit_tokens, bool(num_hit_tokens)

    # -- loads ---------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        allocated = self._current_batch_allocated_block_ids
        for group_blocks in blocks.blocks:
            allocated.update(b.block_id for b in group_blocks if b.block_id != 0)
        if num_external_tokens == 0:
            return
        state = self._req_status[request.request_id]
        num_local = state.num_locally_computed_tokens
        num_cached_tokens = num_local + num_external_tokens
        keys_to_load: list = []
        dst_block_ids: list[int] = []
        state.load_key_ranges.clear()
        for config, group_state in zip(self.group_configs, state.group_states):
            group_blocks = blocks.blocks[config.group_idx]
            per_block = config.tokens_per_block
            per_chunk = config.tokens_per_chunk
            num_gpu_blocks = cdiv(num_cached_tokens, per_block)
            # The load fills the fresh (unhashed, real) blocks after the local hit; windowed
            # and Mamba groups hold nulls and older real blocks below it.
            load_start = num_gpu_blocks
            for i in range(cdiv(num_local, per_block), num_gpu_blocks):
                block = group_blocks[i]
                if not block.is_null and block.block_hash is None:
                    load_start = i
                    break
            num_chunks = cdiv(num_cached_tokens, per_chunk)
            if num_gpu_blocks > load_start:
                start_chunk = load_start // self.blocks_per_chunk
                group_keys = group_state.offload_keys[start_chunk:num_chunks]
                keys_to_load.extend(group_keys)
                if isinstance(config.spec, MambaSpec):
                    state.load_key_ranges.extend((num_local, num_cached_tokens, k) for k in group_keys)
                else:
                    for chunk_idx, key in enumerate(group_keys, start_chunk):
                        state.load_key_ranges.append((max(load_start * per_block, chunk_idx * per_chunk),
                                                      min(num_cached_tokens, (chunk_idx + 1) * per_chunk), key))
            dst_block_ids.extend(b.block_id for b in group_blocks[load_start:num_gpu_blocks])
            # Chunks hit on the GPU or loaded are in the tier already: never store them.
            group_state.next_stored_chunk_idx = num_chunks
        self.manager.prepare_load(keys_to_load, state.req_context)
        job_id = self._new_job_id()
        self._current_batch_load_jobs[job_id] = TransferJob(job_id, request.request_id, False, keys_to_load,
                                                            dst_block_ids)
        assert not state.transfer_jobs  # a load is only issued with nothing else in flight
        state.transfer_jobs.add(job_id)
        self._jobs[job_id] = TransferJobStatus(request.request_id, frozenset(keys_to_load), False)
        if self._chunks_being_loaded is not None:
            self._chunks_being_loaded.update(keys_to_load)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The external hit split by the tier each loaded key came from (tokens no key
        covers, such as sliding-window history that was not loaded, are "unspecified");
        where keys of two tiers cover a token, the outer (slower) tier counts."""
        if not num_external_tokens:
            return {}
        return self._lookup.hit_sources(self._req_status[request.request_id], num_external_tokens)


    # -- stores, at the end of every schedule() ----------------------------------------

    def _new_job_id(self) -> int:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    def _update_req_states(self, output: SchedulerOutput) -> None:
        """Append the step's new blocks to the connector's tables and key new block hashes
        (vLLM's per-request state update in ``build_connector_meta``). A running request
        with no new blocks costs a key check and a dict lookup."""
        windowed = self._sliding_window_groups
        # request id -> per windowed group, the table length before this step's appends.
        old_ends: dict[str, tuple[int, ...]] | None = {} if windowed else None
        req_status = self._req_status
        for new in output.scheduled_new_reqs:
            state = req_status[new.req_id]
            self._update_offload_keys(state)
            for group_state in state.group_states:
                group_state.block_ids.clear()  # the whole table comes with it
            self._extend_block_ids(state, new.block_ids, old_ends)
        new_block_ids = output.scheduled_cached_reqs.new_block_ids
        for req_id in output.cached_req_ids:
            state = req_status[req_id]
            self._update_offload_keys(state)
            ids = new_block_ids.get(req_id)
            if ids is not None:
                self._extend_block_ids(state, ids, old_ends)
        if old_ends is not None and self._current_batch_allocated_block_ids:
            self._clear_stale_windowed_blocks(old_ends)

    def _extend_block_ids(self, state: RequestOffloadState, block_id_groups: tuple[list[int], ...],
                          old_ends: dict[str, tuple[int, ...]] | None) -> None:
        """Append one request's new block ids, per group, and note the real ones as
        handed out this step (a store still reading one must be flushed)."""
        if old_ends is not None:
            old_ends[state.req.request_id] = tuple(len(state.group_states[g].block_ids)
                                                   for g in self._sliding_window_groups)
        allocated = self._current_batch_allocated_block_ids
        for config, group_state in zip(self.group_configs, state.group_states):
            ids = block_id_groups[config.group_idx]
            group_state.block_ids.extend(ids)
            for block_id in ids:
                if block_id != 0:
                    allocated.add(block_id)

    def _clear_stale_windowed_blocks(self, old_ends: dict[str, tuple[int, ...]]) -> None:
        """A windowed block freed early and handed out again this step is stale in every
        table that still lists it at a position not yet stored."""
        allocated = self._current_batch_allocated_block_ids
        per_chunk = self.blocks_per_chunk
        for req_id, state in self._req_status.items():
            ends = old_ends.get(req_id)
            for i, gid in enumerate(self._sliding_window_groups):
                group_state = state.group_states[gid]
                block_ids = group_state.block_ids
                end = ends[i] if ends is not None else len(block_ids)
                for j in range(group_state.next_stored_chunk_idx * per_chunk, end):
                    if block_ids[j] in allocated:
                        block_ids[j] = 0

    def _start_store(self, state: RequestOffloadState, keys: list[OffloadKey], block_ids: list[int],
                     fenced: list[int] | None, deferred: list[int] | None,
                     key_set: frozenset[OffloadKey] | None = None) -> TransferJob:
        """Register a store job of ``keys`` (``key_set``: their frozenset, if the caller
        made one already; built from the same keys in the same order, it iterates alike)."""
        job_id = self._new_job_id()
        state.transfer_jobs.add(job_id)
        self._jobs[job_id] = TransferJobStatus(state.req.request_id, frozenset(keys) if key_set is None else key_set,
                                               True, deferred, fenced)
        return TransferJob(job_id, state.req.request_id, True, keys, block_ids)

    def _build_boundary_store_jobs(self, handoffs: dict[str, list[tuple[int, int, int]]]) -> dict[int, TransferJob]:
        """Mamba states at block boundaries, as the KV cache manager handed them over."""
        jobs: dict[int, TransferJob] = {}
        hashes_per_token = self.tokens_per_hash
        for req_id, entries in handoffs.items():
            state = self._req_status.get(req_id)
            if state is None:
                continue
            req = state.req
            max_boundary = self._num_offloadable_tokens(req, req.num_tokens)
            for group_idx, block_id, boundary in entries:
                config = self.group_configs[group_idx]
                if block_id == 0 or boundary > max_boundary or boundary % config.tokens_per_chunk:
                    continue
                key = make_offload_key(req.block_hashes[boundary // hashes_per_token - 1], group_idx)
                state.req_context.set_offload_key_position(key, boundary)
                stored = self.manager.prepare_store([key], state.req_context)
                if stored is None or not stored.keys_to_store:
                    continue
                job = self._start_store(state, [key], [block_id], [block_id], None)
                self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job.job_id)
                jobs[job.job_id] = job
        return jobs

    def _reachable_block_mask(self, config: GroupOffloadConfig, start_chunk: int, end_chunk: int,
                              req: Request) -> list[bool] | None:
        """Which blocks of chunks ``[start, end)`` a later hit can reach (None: all), as the
        group's manager decides it for the GPU cache, on the connector's hit grid
        (docs/semantics.md#prefix-cache-retention). Dense retention keeps the tail of the
        prompt's last, partial segment (the store horizon: only prompt tokens are stored);
        sparse retention keeps the semantic checkpoints instead."""
        if not self._thinned_groups[config.group_idx]:
            return None
        alignment = self.alignment_tokens
        assert alignment is not None  # a thinned group has a grid
        per_chunk = self.blocks_per_chunk
        interval = self.retention_interval
        boundaries: tuple[int, ...] = ()
        horizon: int | None = None
        if interval is None:
            horizon = req.num_prompt_tokens // config.tokens_per_chunk * per_chunk
        else:
            boundaries = reachable_boundaries(req.num_prompt_tokens, req.shared_prefix_boundary)
        return manager_class_for(config.spec).reachable_block_mask(
            start_chunk * per_chunk, end_chunk * per_chunk, alignment, config.spec, interval, boundaries, horizon)

    def _build_store_jobs(self, output: SchedulerOutput) -> dict[int, TransferJob]:
        """The store jobs for the prompt chunks this step computes, or that a request
        finished with (vLLM's ``_get_reqs_to_store``), scheduled requests first."""
        jobs: dict[int, TransferJob] = {}
        req_status = self._req_status
        for req_id, num_scheduled in output.num_scheduled_tokens.items():
            state = req_status.get(req_id)
            if state is not None:
                self._offer_new_chunks(state, num_scheduled, jobs)
        for req_id in output.finished_req_ids:
            state = req_status.get(req_id)
            if state is not None:
                self._offer_new_chunks(state, 0, jobs)
        return jobs

    def _offer_new_chunks(self, state: RequestOffloadState, num_scheduled: int, jobs: dict[int, TransferJob]) -> None:
        """Offer one request's chunks computed by the end of this step; a request whose
        offloadable count has not moved since it settled (a decode step, mostly) costs a
        few comparisons."""
        req = state.req
        finished = req.is_finished()
        if finished:
            # The last sampled token's slot is never committed to the prefix cache.
            num_tokens_after = req.num_tokens - 1
            if num_tokens_after < req.num_prompt_tokens:
                num_tokens_after = req.num_prompt_tokens
        else:
            num_tokens_after = req.num_computed_tokens + num_scheduled
        num_offloadable = self._num_offloadable_tokens(req, num_tokens_after)
        if num_offloadable == state.settled_tokens:
            return  # nothing new to offer
        job = self._store_job(state, num_offloadable, finished)
        if job is not None:
            jobs[job.job_id] = job

    def _store_job(self, state: RequestOffloadState, num_offloadable: int, finished: bool) -> TransferJob | None:
        """Offer the chunks up to ``num_offloadable`` tokens not offered yet; the job that
        stores those the tier took (None: none, or the tier is full of pinned chunks)."""
        req = state.req
        new_keys: list[OffloadKey] = []
        # Per group, the chunks offered: [start, end).
        ranges: list[tuple[int, int]] = []
        for config, group_state in zip(self.group_configs, state.group_states):
            num_chunks = self._storable_chunks(config, group_state, num_offloadable)
            start_chunk = group_state.next_stored_chunk_idx
            ranges.append((start_chunk, num_chunks))
            if not config.requires_cow_source and num_chunks > start_chunk:
                new_keys += self._chunks_to_offer(config, group_state, start_chunk, num_chunks, req)
        stored = self.manager.prepare_store(new_keys, state.req_context) if new_keys else None
        if new_keys and stored is None:
            return None  # the tier is full of pinned chunks: try again next step
        if stored is None or not stored.keys_to_store:
            # Nothing new: everything offered is in the tier or cannot be used.
            self._advance_stored_idx(state, num_offloadable)
            self._note_settled(state, num_offloadable)
            return None
        keys_to_store = list(stored.keys_to_store)
        # One set of the stored keys: the job's record (the tier completes them in its
        # order) and the membership test for the source blocks.
        key_set = frozenset(keys_to_store)
        src_ids, fenced, deferred = self._store_sources(state, ranges, key_set)
        self._note_settled(state, num_offloadable)
        job = self._start_store(state, keys_to_store, src_ids, fenced or None, deferred, key_set)
        pending = self._block_id_to_pending_jobs
        for block_id in fenced:
            pending.setdefault(block_id, set()).add(job.job_id)
        if finished:
            for block_id in deferred:
                pending.setdefault(block_id, set()).add(job.job_id)
                if block_id in self._current_batch_allocated_block_ids:
                    self._current_batch_jobs_to_flush.add(job.job_id)
        return job

    def _store_sources(self, state: RequestOffloadState, ranges: list[tuple[int, int]],
                       to_store: frozenset[OffloadKey]) -> tuple[list[int], list[int], list[int]]:
        """The source blocks of the chunks the tier took, and which of them to watch from
        the start (windowed: freed any step) or from the request's end; marks the offered
        chunks stored."""
        per_chunk = self.blocks_per_chunk
        src_ids: list[int] = []
        fenced: list[int] = []
        deferred: list[int] = []
        for config, group_state, (start_chunk, num_chunks) in zip(self.group_configs, state.group_states, ranges):
            watch = fenced if config.sliding_window_size_in_chunks is not None else deferred
            block_ids = group_state.block_ids
            keys = group_state.offload_keys
            for chunk_idx in range(start_chunk, num_chunks):
                if keys[chunk_idx] not in to_store:
                    continue
                if per_chunk == 1:  # the usual layout: no slice per chunk
                    block_id = block_ids[chunk_idx]
                    if block_id != 0:
                        src_ids.append(block_id)
                        watch.append(block_id)
                    continue
                first_block = chunk_idx * per_chunk
                for block_id in block_ids[first_block:first_block + per_chunk]:
                    if block_id != 0:
                        src_ids.append(block_id)
                        watch.append(block_id)
            if group_state.next_stored_chunk_idx < num_chunks:
                group_state.next_stored_chunk_idx = num_chunks
        return src_ids, fenced, deferred

    def _chunks_to_offer(self, config: GroupOffloadConfig, group_state: RequestGroupState, start_chunk: int,
                         end_chunk: int, req: Request) -> list[OffloadKey]:
        """The keys of chunks ``[start, end)`` worth storing: every block a later hit can
        reach is real (0 is a skipped or stale entry), and so is the chunk's last block,
        its source."""
        per_chunk = self.blocks_per_chunk
        mask = self._reachable_block_mask(config, start_chunk, end_chunk, req)
        if mask is None and per_chunk == 1:
            # Every block reachable, one per chunk: a chunk is worth storing iff it is real.
            block_ids = group_state.block_ids
            offload_keys = group_state.offload_keys
            return [offload_keys[idx] for idx in range(start_chunk, end_chunk) if block_ids[idx] != 0]
        keys: list[OffloadKey] = []
        for idx, key in enumerate(group_state.offload_keys[start_chunk:end_chunk]):
            first = (start_chunk + idx) * per_chunk
            blocks = group_state.block_ids[first:first + per_chunk]
            reachable = mask[idx * per_chunk:(idx + 1) * per_chunk] if mask is not None else [True] * per_chunk
            if blocks[-1] == 0 or not any(reachable):
                continue
            if any(block_id == 0 and reach for block_id, reach in zip(blocks, reachable)):
                continue  # a reachable null would leave part of the chunk unwritten
            keys.append(key)
        return keys

    def _note_settled(self, state: RequestOffloadState, num_offloadable: int) -> None:
        """Every group offered its chunks up to ``num_offloadable`` tokens: a store pass at
        that count has nothing to do."""
        for config, group_state in zip(self.group_configs, state.group_states):
            if group_state.next_stored_chunk_idx < num_offloadable // config.tokens_per_chunk:
                return
        state.settled_tokens = num_offloadable

    def build_connector_meta(self, output: SchedulerOutput,
                             boundary_offloads: dict[str, list[tuple[int, int, int]]] | None = None
                             ) -> OffloadingConnectorMetadata:
        self._update_req_states(output)
        for req_id in output.preempted:
            state = self._req_status.get(req_id)
            if state is not None:
                self._current_batch_jobs_to_flush.update(state.transfer_jobs - self._current_batch_load_jobs.keys())
        pending = self._block_id_to_pending_jobs
        if pending and not pending.keys().isdisjoint(self._current_batch_allocated_block_ids):
            self._current_batch_jobs_to_flush.update(
                job_id for block_id in self._current_batch_allocated_block_ids if block_id in pending
                for job_id in pending[block_id])
        store_jobs = self._build_boundary_store_jobs(boundary_offloads) if boundary_offloads else {}
        store_jobs.update(self._build_store_jobs(output))
        deferred: list[str] | None = None
        if self._current_batch_deferred:
            deferred = self._current_batch_deferred
            self._current_batch_deferred = []
        meta = OffloadingConnectorMetadata(self._current_batch_load_jobs, store_jobs, self._current_batch_jobs_to_flush,
                                           deferred)
        for req_id in output.finished_req_ids:
            state = self._req_status.get(req_id)
            if state is None:
                continue
            state.finished_signaled = True
            self.manager.on_request_finished(state.req_context)
            if not state.transfer_jobs:
                del self._req_status[req_id]
        self._current_batch_load_jobs = {}
        self._current_batch_jobs_to_flush = set()
        self._current_batch_allocated_block_ids = set()
        self.manager.on_schedule_end()
        return meta

    # -- the worker's report -------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for job_id in connector_output.completed_jobs:
            job = self._jobs.pop(job_id)
            state = self._req_status[job.req_id]
            if job.is_store:
                self.manager.complete_store(job.keys, state.req_context)
            else:
                self.manager.complete_load(job.keys, state.req_context)
                if self._chunks_being_loaded:
                    self._chunks_being_loaded.difference_update(job.keys)
            if self._block_id_to_pending_jobs:
                self._remove_pending_job(job_id, job.fenced_block_ids)
                if state.req.is_finished():
                    self._remove_pending_job(job_id, job.deferred_fence_block_ids)
            state.transfer_jobs.remove(job_id)
            if state.finished_signaled and not state.transfer_jobs:
                del self._req_status[job.req_id]

    def _remove_pending_job(self, job_id: int, block_ids: list[int] | None) -> None:
        pending = self._block_id_to_pending_jobs
        for block_id in block_ids or ():
            jobs = pending[block_id]
            jobs.remove(job_id)
            if not jobs:
                del pending[block_id]

    def request_finished(self, request: Request) -> bool:
        """Called before a finished request's blocks are freed (they are freed at once)."""
        state = self._req_status.get(request.request_id)
        if state is None:
            return False
        # The final block hash: the next step may store the chunk it completes.
        self._update_offload_keys(state)
        # Its blocks may be handed out again from now on: watch them for flushes.
        for job_id in state.transfer_jobs:
            for block_id in self._jobs[job_id].deferred_fence_block_ids or ():
                self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)
        return False

    def has_pending_jobs(self) -> bool:
        """Transfers still in flight, the tier's own (disk promotions) included: vLLM keeps
        stepping the engine until they finish."""
        return bool(self._jobs) or self.manager.has_pending_work()
