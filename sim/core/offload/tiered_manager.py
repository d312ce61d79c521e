"""A disk tier below the CPU tier: write-through on every CPU store, promotion disk→CPU
on a lookup that only the disk can answer.

What vLLM 0.33 does (``vllm/v1/kv_offload/tiering/``), in our words:

* ``manager.py:TieringOffloadingManager`` puts a CPU *primary* tier (the
  ``CPUOffloadingManager``) in front of secondary tiers that never touch GPU memory: every
  byte goes GPU↔CPU↔secondary.
* Write-through, not write-back. ``complete_store`` first completes the CPU store, then
  (if the store succeeded) *cascades* the same keys to every secondary tier:
  ``create_store_job`` pins the CPU chunks (``prepare_read``: a ref count, recorded as no
  request access) and ``submit_store`` starts the asynchronous write. The pin is released
  when the tier reports the write finished (``_process_finished_jobs`` →
  ``complete_read``), so a chunk cannot be evicted from the CPU while it is being written.
  A CPU eviction writes nothing: the disk already has the chunk, or never will. The only
  thing that drops a cascade is the opt-in back-pressure detector (``backpressure.py``,
  configured per tier; off by default).
* ``lookup`` polls finished jobs (at most once per step), asks the CPU tier first (HIT or
  HIT_PENDING is the answer), then each secondary tier in order. A secondary HIT starts a
  *promotion* (``_initiate_promotion``): a CPU chunk is allocated at once through the CPU
  tier's own ``prepare_store`` (which may evict idle CPU chunks, and counts as the
  request's insertion), so the key is HIT_PENDING in the CPU from then on and no second
  promotion starts; the lookup returns HIT_PENDING, or MISS when the CPU has no evictable
  room. The promotions of one request in one step are submitted as one batched
  ``submit_load`` at ``on_schedule_end`` (``_flush_pending_promotions``). When the tier
  reports the load done, ``_complete_promotion`` completes the CPU store (the chunk turns
  ready) and a later lookup returns HIT. RETRY means "a secondary tier is still deciding":
  the filesystem tier answers its first lookup of a key with RETRY while an existence
  probe runs in a background thread (``async_lookup.py``), and HIT or MISS on a later
  step; the connector keeps scanning past RETRY and HIT_PENDING and defers the request.
* The disk copy stays: the filesystem tier (``fs/manager.py``) never deletes a file, a
  load only reads it. vLLM's tiers are *inclusive*; the filesystem tier has no capacity
  and no eviction at all (its directory grows until the file system is full; failed
  writes then put the tier under pressure if a back-pressure detector is configured). ``reset_cache`` drains every tier's jobs
  (``drain_jobs``) and resets only the CPU tier: secondary tiers are persistent.
* ``get_load_source``: each request keeps the keys it promoted, with the tier they came
  from; those report that tier (DISK for the filesystem), everything else the CPU tier's
  answer (HOST). A request that finds a chunk another request promoted gets HOST.
* The filesystem tier's thread pool (``fs/thread_pool.py``) has a read (load) queue and a
  write (store) queue with read-priority and write-priority threads; writes overwrite an
  existing file rather than skip it.

This module reproduces that logic against the simulator's ``CPUOffloadingManager``, with
the same interface, so the connector drives either. With ``disk_num_chunks == 0`` it is
exactly the CPU manager: no cascade, no promotion, the same answers and counters.

The design, and every simplification against vLLM:

1. **One disk tier**, the filesystem tier's role; vLLM allows any number (fs, object
   store, p2p, ...).
2. **Capacity**: the disk (``disk_tier.py``) holds ``disk_num_chunks`` chunks under the
   same policy classes as the CPU tier (``policies.make_policy``); vLLM's filesystem tier
   is unbounded. A write that finds the disk full evicts idle disk chunks (the policy's
   choice, never a chunk being read by a promotion or written, never a key of the same
   write); what still does not fit is *dropped* (the tail of the batch first; counted in
   ``disk_dropped_keys``), as a back-pressure drop would. The disk policy sees a write
   batch as one insertion (LRU: batches in write order, and within a batch tails before
   heads, by the request's key positions, as the CPU orders one request) and a promotion
   as a use (``touch``); ``touch`` is forwarded to it as vLLM forwards it to every tier.
   It does not see the request-scoped access record (``on_request_access`` /
   ``on_request_finished``) that the CPU policy gets: the disk is not looked up per
   request, only read on a CPU miss. The disk policy gets a view of the ``ReqContext``
   with state slots of its own, so it never overwrites the CPU policy's.
3. **Inclusive**, as vLLM: a promoted chunk stays on disk, a CPU-resident chunk may be on
   disk too. A disk eviction does not touch the CPU copy (no back-invalidation), so a
   chunk can be in the CPU only. A write of a key already on disk is skipped (the
   ``SecondaryTierManager.submit_store`` contract asks tiers to filter present chunks;
   the filesystem tier rewrites the file instead, which costs disk bandwidth we do not
   charge).
4. **Lookups are synchronous**: the disk index is in memory, so a disk-only key starts its
   promotion on the first lookup (HIT_PENDING) instead of answering RETRY for one step
   while the filesystem tier probes for the file. The result RETRY is never returned.
5. **Time is ours**. vLLM has real threads and a monotonic clock; here every transfer
   between CPU and disk is a job on a ``PromotionClock`` (``promotion_clock.py``):
   ``StepPromotions(steps)`` finishes a job ``steps`` scheduler steps after it started,
   ``TimedPromotions`` runs one FIFO disk queue in simulated seconds, where writes and
   promotions share the bandwidth *and delay each other* (vLLM's pool lets reads overtake
   queued writes; ours is the pessimistic single queue). Jobs never fail (vLLM handles
   partial and failed promotions; here every job succeeds), there is no back-pressure
   detector, and no tier-poll thread: completions are seen at the manager's polls (the
   first lookup of a step, every ``prepare_store``, every ``on_schedule_end``), as vLLM
   polls.
6. **Batching as vLLM**: one write job per ``complete_store`` call, one promotion job per
   request per step, started at ``on_schedule_end``; all keys of a job finish together.
7. **Promotion admission**: when the CPU tier's admission filter (``store_threshold``)
   turns the promoted key away, the lookup is a MISS (vLLM would answer HIT_PENDING for a
   chunk that never arrives).
8. **reset_cache** completes every in-flight job at once (vLLM blocks until the tiers
   drain), keeps the disk, resets the CPU tier and forgets the requests' promoted keys.
   vLLM also holds new promotions until the workers confirm the reset
   (``on_reset_flushed``), against late DMA into freed CPU chunks; the simulator has no
   late DMA, so promotions resume at once.
9. Not modelled: KV events, Prometheus metrics, request-level offload policies, external
   (peer) requests served by a tier, the real file layout.

Counters. ``num_stored_keys``, ``num_loaded_keys``, ``num_evicted_keys`` and
``num_used_chunks`` mean what they mean on the CPU manager (GPU→CPU stores, CPU→GPU
loads, CPU evictions, CPU chunks in use): the manager's internal traffic (promotions
allocating CPU chunks, cascades pinning them) is taken out. Per tier (cumulative ints):
``cpu_hits`` / ``disk_hits`` (keys loaded to the GPU whose source was the CPU, or a
promotion for the loading request), ``disk_stored_keys`` (writes finished),
``disk_loaded_keys`` (promotions finished: disk→CPU reads), ``disk_evicted_keys``,
``disk_dropped_keys``, ``promotions`` (keys whose promotion started),
``promotion_failures`` (disk hits turned into a MISS: no CPU room). ``tier_counters()``
returns them all by tier.
"""

from __future__ import annotations

from collections.abc import Collection

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.offload.base import (
    LookupResult,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.disk_tier import DiskTier, DiskView
from kvtwin.sim.core.offload.promotion_clock import PromotionClock, StepPromotions


class _TieredRequestState:
    """What the tiered manager keeps in a request's ReqContext."""

    __slots__ = ("owner", "generation", "promoted")

    def __init__(self, owner: object, generation: int):
        self.owner = owner
        self.generation = generation
        # Keys this request promoted from the disk: their load source is "disk".
        self.promoted: set[OffloadKey] = set()


class _Job:
    __slots__ = ("write", "keys", "ctx")

    def __init__(self, write: bool, keys: list[OffloadKey], ctx: ReqContext):
        self.write = write
        self.keys = keys
        self.ctx = ctx


# --- the tiered manager ----------------------------------------------------------------


class TieredOffloadingManager:
    """A CPU tier (``cpu``) with a disk tier of ``disk_num_chunks`` chunks under
    ``policy`` below it; CPU↔disk transfers finish when ``promotion`` says. The interface
    is ``CPUOffloadingManager``'s. ``chunk_bytes`` sizes the jobs for a timed clock."""

    def __init__(self, cpu: CPUOffloadingManager, disk_num_chunks: int, policy: str = "lru",
                 promotion: PromotionClock | None = None, *, chunk_bytes: int = 0):
        require(isinstance(disk_num_chunks, int) and disk_num_chunks >= 0, "offload.disk.num_chunks",
                "an integer >= 0", disk_num_chunks)
        require(isinstance(chunk_bytes, int) and chunk_bytes >= 0, "offload.disk.chunk_bytes", "an integer >= 0",
                chunk_bytes)
        self.cpu = cpu
        self.disk_num_chunks = disk_num_chunks
        self.disk = DiskTier(disk_num_chunks, policy)
        self.promotion: PromotionClock = promotion if promotion is not None else StepPromotions(1)
        self.chunk_bytes = chunk_bytes
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        # Promotions asked for this step, started at on_schedule_end: req_id -> (ctx, keys).
        self._pending_promotions: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}
        self._polled_this_step = False
        self._generation = 0
        # Keys of CPU chunks pinned by writes in flight (a key is written once at a time).
        self._writing: set[OffloadKey] = set()
        self._promoting: set[OffloadKey] = set()
        # Internal CPU traffic, taken out of the CPU manager's counters.
        self._cascade_pins = 0
        # Per-tier counters.
        self.cpu_hits = 0
        self.disk_hits = 0
        self.disk_stored_keys = 0
        self.disk_loaded_keys = 0
        self.disk_evicted_keys = 0
        self.disk_dropped_keys = 0
        self.promotions = 0
        self.promotion_failures = 0

    # --- the CPU manager's counters, without the internal traffic --------------------

    @property
    def num_chunks(self) -> int:
        return self.cpu.num_chunks

    @property
    def policy_name(self) -> str:
        return self.cpu.policy_name

    @property
    def num_used_chunks(self) -> int:
        return self.cpu.num_used_chunks

    @property
    def num_free_chunks(self) -> int:
        return self.cpu.num_free_chunks

    @property
    def num_evictable_chunks(self) -> int:
        return self.cpu.num_evictable_chunks

    @property
    def num_write_pending_chunks(self) -> int:
        return self.cpu.num_write_pending_chunks

    @property
    def num_stored_keys(self) -> int:
        return self.cpu.num_stored_keys - self.promotions

    @property
    def num_store_failed_keys(self) -> int:
        return self.cpu.num_store_failed_keys

    @property
    def num_skipped_store_keys(self) -> int:
        return self.cpu.num_skipped_store_keys

    @property
    def num_loaded_keys(self) -> int:
        return self.cpu.num_loaded_keys - self._cascade_pins

    @property
    def num_evicted_keys(self) -> int:
        return self.cpu.num_evicted_keys

    @property
    def num_disk_used_chunks(self) -> int:
        return self.disk.num_used_chunks

    def counters(self) -> dict[str, int]:
        """The step columns (reports/SCHEMA.md): the CPU tier's, less the traffic of
        promotions and cascades, then the disk tier's when there is one."""
        out = {"offload_cpu_loaded_keys": self.num_loaded_keys, "offload_cpu_stored_keys": self.num_stored_keys,
               "offload_cpu_evicted_keys": self.num_evicted_keys, "offload_cpu_used_chunks": self.num_used_chunks}
        if self.disk_num_chunks:
            out["offload_disk_loaded_keys"] = self.disk_loaded_keys
            out["offload_disk_stored_keys"] = self.disk_stored_keys
            out["offload_disk_evicted_keys"] = self.disk_evicted_keys
            out["offload_disk_used_chunks"] = self.num_disk_used_chunks
        return out

    def tier_counters(self) -> dict[str, dict[str, int]]:
        return {
            "cpu": {"stored": self.num_stored_keys, "loaded": self.num_loaded_keys,
                    "evicted": self.num_evicted_keys, "hits": self.cpu_hits,
                    "promoted_in": self.disk_loaded_keys, "used_chunks": self.num_used_chunks},
            "disk": {"stored": self.disk_stored_keys, "loaded": self.disk_loaded_keys,
                     "evicted": self.disk_evicted_keys, "dropped": self.disk_dropped_keys,
                     "hits": self.disk_hits, "promotions": self.promotions,
                     "promotion_failures": self.promotion_failures, "used_chunks": self.num_disk_used_chunks},
        }

    # --- introspection (tests, diagnostics) ------------------------------------------

    def cpu_status(self, key: OffloadKey) -> str | None:
        """None, "pending" (store or promotion in flight), "ready" (idle) or "pinned"."""
        chunk = self.cpu.policy.get(key)
        if chunk is None:
            return None
        return "pending" if chunk.ref_cnt < 0 else "ready" if chunk.ref_cnt == 0 else "pinned"

    def disk_status(self, key: OffloadKey) -> str | None:
        """None, "writing", "ready" (idle) or "reading" (a promotion in flight)."""
        chunk = self.disk.get(key)
        if chunk is None:
            return None
        return "writing" if chunk.ref_cnt < 0 else "ready" if chunk.ref_cnt == 0 else "reading"

    def tier_of(self, key: OffloadKey) -> str:
        """"none", "cpu", "disk" or "cpu+disk": where the key has a chunk (in any state)."""
        where = [name for name, status in (("cpu", self.cpu_status(key)), ("disk", self.disk_status(key)))
                 if status is not None]
        return "+".join(where) or "none"

    def writing_keys(self) -> frozenset:
        return frozenset(self._writing)

    def promoting_keys(self) -> frozenset:
        return frozenset(self._promoting)

    # --- internals -------------------------------------------------------------------

    def _state(self, ctx: ReqContext) -> _TieredRequestState:
        state = ctx.get_state(_TieredRequestState)
        if state is None or state.owner is not self:
            state = _TieredRequestState(self, self._generation)
            ctx.set_state(state)
        elif state.generation != self._generation:
            state.generation = self._generation
            state.promoted = set()
        return state

    def _new_job(self, write: bool, keys: list[OffloadKey], ctx: ReqContext) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = _Job(write, keys, ctx)
        self.promotion.start(job_id, len(keys) * self.chunk_bytes, write=write)
        return job_id

    def _finish(self, job_id: int) -> None:
        job = self._jobs.pop(job_id)
        if job.write:
            self.disk.complete_write(job.keys)
            self.cpu.complete_load(job.keys, job.ctx)
            self._writing.difference_update(job.keys)
            self.disk_stored_keys += len(job.keys)
        else:
            for key in job.keys:
                self.disk.unpin(key)
            self.cpu.complete_store(job.keys, job.ctx, True)
            self._promoting.difference_update(job.keys)
            self.disk_loaded_keys += len(job.keys)

    def _process_finished_jobs(self) -> None:
        if not self._jobs:
            return
        for job_id in self.promotion.poll():
            self._finish(job_id)

    def _flush_pending_promotions(self) -> None:
        pending, self._pending_promotions = self._pending_promotions, {}
        for ctx, keys in pending.values():
            self._new_job(False, keys, ctx)

    def _initiate_promotion(self, key: OffloadKey, ctx: ReqContext) -> bool:
        out = self.cpu.prepare_store([key], ctx)
        if out is None or list(out.keys_to_store) != [key]:
            return False
        self.promotions += 1
        self.disk.pin(key)
        self.disk.policy.touch([key], DiskView(ctx))
        self._promoting.add(key)
        self._state(ctx).promoted.add(key)
        entry = self._pending_promotions.get(ctx.req_id)
        if entry is None:
            self._pending_promotions[ctx.req_id] = (ctx, [key])
        else:
            entry[1].append(key)
        return True

    def _cascade(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Write the keys that just turned ready in the CPU through to the disk."""
        absent = []
        for key in keys:
            if self.disk.get(key) is None:
                absent.append(key)
        if not absent:
            return
        written, evicted = self.disk.allocate(absent, set(keys), DiskView(ctx))
        self.disk_evicted_keys += len(evicted)
        self.disk_dropped_keys += len(absent) - len(written)
        if not written:
            return
        self.cpu.prepare_load(written, ctx)
        self._cascade_pins += len(written)
        self._writing.update(written)
        self._new_job(True, written, ctx)

    # --- the manager interface (CPUOffloadingManager's) -------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.cpu.on_new_request(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._polled_this_step:
            self._polled_this_step = True
            self._process_finished_jobs()
        result = self.cpu.lookup(key, req_context)
        if result is not LookupResult.MISS or self.disk_num_chunks == 0:
            return result
        chunk = self.disk.get(key)
        if chunk is None or not chunk.is_ready:
            return LookupResult.MISS
        if self._initiate_promotion(key, req_context):
            return LookupResult.HIT_PENDING
        self.promotion_failures += 1
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> str:
        state = req_context.get_state(_TieredRequestState)
        if (state is not None and state.owner is self and state.generation == self._generation
                and key in state.promoted):
            return "disk"
        return self.cpu.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        chunk_ids = self.cpu.prepare_load(keys, req_context)
        for key in keys:
            if self.get_load_source(key, req_context) == "disk":
                self.disk_hits += 1
            else:
                self.cpu_hits += 1
        return chunk_ids

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cpu.touch(keys, req_context)
        if self.disk_num_chunks:
            self.disk.policy.touch(keys, DiskView(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cpu.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        # Completions first, so chunks they release are evictable for this store.
        self._polled_this_step = True
        self._process_finished_jobs()
        return self.cpu.prepare_store(keys, req_context)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if not self.disk_num_chunks or not success:
            self.cpu.complete_store(keys, req_context, success)
            return
        keys = list(keys)
        in_flight = [key for key in keys if self.cpu_status(key) == "pending" and key not in self._promoting]
        self.cpu.complete_store(keys, req_context, success)
        # The chunks this call made ready (another store, a failure or a reset may have
        # finished or dropped the rest), once each.
        turned_ready = list(dict.fromkeys(key for key in in_flight if self.cpu_status(key) == "ready"))
        if turned_ready:
            self._cascade(turned_ready, req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.cpu.on_request_finished(req_context)

    def on_schedule_end(self, context: object = None) -> None:
        self._process_finished_jobs()
        self._polled_this_step = False
        self._flush_pending_promotions()
        self.promotion.on_schedule_end()
        self.cpu.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._pending_promotions) or self.cpu.has_pending_work()

    def next_finish_s(self) -> float | None:
        """When the next CPU↔disk job finishes on a timed promotion clock (None: none, or
        a step clock)."""
        next_finish = getattr(self.promotion, "next_finish_s", None)
        return next_finish() if next_finish is not None else None

    def reset_cache(self) -> None:
        """Finish every CPU↔disk transfer, keep the disk, reset the CPU tier."""
        self._flush_pending_promotions()
        for job_id in self.promotion.drain():
            self._finish(job_id)
        assert not self._jobs, "a CPU/disk job outlived the drain"
        self._generation += 1
        self._polled_this_step = False
        self.cpu.reset_cache()
