"""The replay's recorder: one record per request and one row per engine step, kept as
the run goes and turned into the run directory's tables at the end.

docs/architecture.md#outputs; column meanings are in ``reports/SCHEMA.md``. Names follow
vLLM's metrics and ``vllm bench serve`` fields with units in the names. Times are seconds
since the trace start. Everything is collected in plain lists and turned into Arrow
tables at the end, so a run's outputs depend only on its inputs (no wall-clock values).
The recorder reads nothing of the engine but what each applied batch hands it: the
engine's record of the batch (``BatchRecord``), which carries the engine's figures after
it and each feature's own (the connector tier's counters, the drafts the scheduler
verified), and the requests it finished as snapshots.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
from mypy_extensions import mypyc_attr

from kvtwin.sim.core.engine import BatchRecord, Rejection, RequestSnapshot
from kvtwin.sim.core.engine_stats import EngineStats
from kvtwin.sim.core.offload.connector_metadata import OffloadingConnectorMetadata
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.replay.client_side import client_request_columns
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.replay.output_columns import (CLIENT_SIDE, DATA_PARALLEL, DISAGGREGATION, OFFLOAD,
                                              OFFLOAD_BYTES_STEP_COLUMNS, OFFLOAD_CPU_STEP_COLUMNS, OFFLOAD_DISK_STEP_COLUMNS,
                                              OFFLOAD_WAITING_COLUMN, SPECULATIVE, assemble)


class _RequestRecord:
    __slots__ = ("request_id", "index", "session_id", "arrival_s", "first_scheduled_s", "first_token_s",
                 "finish_s", "last_token_s", "hit_tokens", "hit_tokens_total", "queried_tokens", "scheduled_tokens",
                 "status", "reason", "reason_detail", "prompt_tokens", "max_tokens", "generated_tokens", "num_preemptions",
                 "replica", "draft_tokens", "accepted_draft_tokens", "verify_steps")

    def __init__(self, request: Request, index: int, session_id: str | None, arrival_s: float, replica: int = 0):
        # The request as it arrives (the front end's); what the engine made of it comes
        # back in snapshots (``RequestSnapshot``), so no live request is kept.
        self.request_id = request.request_id
        self.prompt_tokens = request.num_prompt_tokens
        self.max_tokens = request.max_tokens
        self.generated_tokens = 0
        self.num_preemptions = 0
        self.index = index
        self.session_id = session_id
        self.arrival_s = arrival_s
        self.first_scheduled_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.last_token_s = math.nan
        self.hit_tokens = 0
        self.hit_tokens_total = 0
        self.queried_tokens = 0
        self.scheduled_tokens = 0
        self.status = "waiting"
        self.reason = ""
        self.reason_detail = ""
        self.replica = replica
        # Speculative decoding only: drafts verified, how many accepted, in how many steps.
        self.draft_tokens = self.accepted_draft_tokens = self.verify_steps = 0



class _OffloadRecord:
    """One request's offload hits (at its first admission) and its first wait for KV in a
    tier: how long, how much of it before its load was issued, and the load's transfer."""

    __slots__ = ("admitted", "gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "load_wait_s",
                 "load_transfer_s", "load_defer_s", "pending_issue_s", "pending_gpu_hit_tokens", "wait_start_s")

    def __init__(self) -> None:
        self.admitted = False
        self.gpu_hit_tokens = self.cpu_hit_tokens = self.disk_hit_tokens = 0
        self.load_wait_s = math.nan
        self.load_transfer_s = math.nan
        self.load_defer_s = math.nan
        # A load issued and its request not yet scheduled: when, and the GPU hit then.
        self.pending_issue_s: float | None = None
        self.pending_gpu_hit_tokens = 0
        # When the request's current wait for KV in a tier began: the first lookup that
        # deferred it (a disk promotion, a store or another's load of its chunks still
        # running), else its load's issue; NaN while it does not wait.
        self.wait_start_s = math.nan


class _PDRecord:
    """A disaggregated request's prefill side and the read of its KV."""

    __slots__ = ("prefill_replica", "prefill", "prefill_finish_s", "transfer_bytes", "transfer_s", "decode_hit_tokens")

    def __init__(self, prefill_replica: int, prefill: _RequestRecord):
        self.prefill_replica = prefill_replica
        self.prefill = prefill  # the prefill-side request's record (not a row of its own)
        self.prefill_finish_s = math.nan
        self.transfer_bytes = 0
        self.transfer_s = math.nan
        # The decode side's own hit when its read loaded tokens (None: no load, and its
        # admission's hit is the one).
        self.decode_hit_tokens: int | None = None


_OFFLOAD_GAUGES = frozenset({"offload_cpu_used_chunks", "offload_disk_used_chunks"})


def offload_step_columns(has_disk: bool) -> tuple[str, ...]:
    """The tiers' step columns (their counters), without the recorder's own waiting gauge."""
    return (OFFLOAD_CPU_STEP_COLUMNS + (OFFLOAD_DISK_STEP_COLUMNS if has_disk else ())
            + OFFLOAD_BYTES_STEP_COLUMNS)


_BUFFER_BLOCK: Final = 1 << 16  # values a Float64Buffer collects before storing them


class Float64Buffer:
    """Doubles recorded one or a few at a time, 8 bytes each once stored. The newest wait
    in a list (the cheapest append there is) and move into a typed array a block at a
    time: a call of ``array("d").append`` costs three times a list's."""

    __slots__ = ("_stored", "_newest")

    def __init__(self) -> None:
        self._stored = array("d")
        self._newest: list[float] = []

    def __len__(self) -> int:
        return len(self._stored) + len(self._newest)

    def append(self, value: float) -> None:
        newest = self._newest
        newest.append(value)
        if len(newest) >= _BUFFER_BLOCK:
            self._store()

    def extend(self, values: Iterable[float]) -> None:
        newest = self._newest
        newest.extend(values)
        if len(newest) >= _BUFFER_BLOCK:
            self._store()

    def extend_repeated(self, value: float, count: int) -> None:
        """``count`` copies of ``value``, stored at once: a typed array repeats a double
        at the cost of a copy, where a list of them costs a conversion per value."""
        if self._newest:
            self._store()
        self._stored.extend(array("d", (value,)) * count)

    def _store(self) -> None:
        self._stored.fromlist(self._newest)
        self._newest.clear()

    def to_array(self) -> array:
        """Everything recorded, in order (the buffer keeps recording after this)."""
        if self._newest:
            self._store()
        return self._stored


@dataclass
class BatchTimes:
    """When a batch was scheduled, when the device ran it, and when the batch applied
    before it on the same replica ended (its tokens' previous sampling instant)."""

    scheduled_s: float
    start_s: float
    end_s: float
    previous_end_s: float = 0.0


@mypyc_attr(allow_interpreted_subclasses=True)  # a test's recorder extends it
class MetricsRecorder:
    """Collects per-request and per-step records as the engine steps.

    One recorder serves every data-parallel replica of a run: a request and a step carry
    the replica they ran on (``replica``); inter-token latencies are kept per replica
    (``itl_by_replica``; ``itl_s`` is replica 0's, and all of them with one replica).
    """

    def __init__(self, num_groups: int, num_replicas: int = 1, offload=None, roles: list[str] | None = None,
                 num_speculative_tokens: int = 0, moe_group: bool = False):
        self.num_groups = num_groups
        # Disaggregated prefill/decode: each replica's role ("prefill" or "decode"), and per
        # client request its prefill side and read (None: not disaggregated).
        self.roles = roles
        self._pd: dict[str, _PDRecord] = {}
        # Speculative decoding (``num_speculative_tokens`` drafts a step at most): verify rows
        # count as decode tokens, each request's drafts and accepted drafts are counted
        # (``output_columns.SPECULATIVE``), and each step's accepted drafts by position.
        self.speculative = num_speculative_tokens > 0
        self.num_speculative_tokens = num_speculative_tokens
        self._none_accepted = [0] * num_speculative_tokens  # a step row that verified no drafts
        self.num_replicas = num_replicas
        self.records: dict[str, _RequestRecord] = {}
        self.order: list[_RequestRecord] = []
        self._itl = [Float64Buffer() for _ in range(num_replicas)]
        # The step table as doubles, a row of ``step_width`` values a step in
        # ``STEP_COLUMNS`` order (the step index aside; the per-group usage takes
        # ``num_groups`` values; then any offload columns, then any accepted drafts by
        # position): 8 bytes a value instead of a Python object. Counts are exact in a
        # double (below 2**53).
        self._step_values = Float64Buffer()
        self._steps: pa.Table | None = None  # ``steps_table``, once made
        self.step_width = len(STEP_COLUMNS) - 2 + num_groups + num_speculative_tokens
        self.step_replica = array("i")
        # A DP MoE group (docs/clock.md#moe-under-data-parallelism): each step's MoE
        # collectives, last in the row (``output_columns.DATA_PARALLEL``).
        self.moe_group = moe_group
        self.step_width += moe_group
        self._evictions_before = [0] * num_replicas
        # With offload tiers (a ``ResolvedOffload``): per request, what its admissions hit
        # in each tier and how long its load took; per step, the tiers' counters.
        self.offload = offload
        if offload is not None:
            self._offload_columns = offload_step_columns(offload.has_disk)
            self.step_width += len(self._offload_columns) + 1
            self._offload_before: list[dict[str, int]] = [dict.fromkeys(self._offload_columns, 0)
                                                          for _ in range(num_replicas)]
            self._loads: dict[str, _OffloadRecord] = {}
            # Per replica: requests waiting for KV in a tier (``wait_start_s`` set).
            self._waiting_for_kv = [0] * num_replicas

    @property
    def itl_by_replica(self) -> list[array]:
        """Each replica's inter-token latencies, in the order they were observed."""
        return [itl.to_array() for itl in self._itl]

    @property
    def itl_s(self) -> array:
        return self._itl[0].to_array()

    def all_itl_s(self) -> array:
        """Every replica's inter-token latencies (replica order)."""
        if self.num_replicas == 1:
            return self.itl_s
        out = array("d")
        for itl in self._itl:
            out.extend(itl.to_array())
        return out

    # -- requests --------------------------------------------------------------------------

    def arrived(self, request: Request, arrival_s: float, session_id: str | None = None, replica: int = 0) -> None:
        record = _RequestRecord(request, len(self.order), session_id, arrival_s, replica)
        self.records[request.request_id] = record
        self.order.append(record)

    def arrived_prefill(self, request: Request, client_request_id: str, arrival_s: float, replica: int) -> None:
        """The prefill side of a disaggregated request: recorded like a request (its
        batches find it), but not a row of the requests table."""
        record = _RequestRecord(request, -1, None, arrival_s, replica)
        self.records[request.request_id] = record
        self._pd[client_request_id] = _PDRecord(replica, record)

    def prefill_done(self, request_id: str, end_s: float) -> None:
        self._pd[request_id].prefill_finish_s = end_s

    def pd_transfer(self, request_id: str, num_bytes: int, seconds: float, hit_tokens: int | None = None) -> None:
        """The decode side's read of a request's KV: its bytes (every worker) and seconds,
        and the decode side's own prefix hit it starts after when it loads tokens (the
        request is admitted after the load, its tokens computed, with no hit of its own)."""
        pd = self._pd[request_id]
        pd.transfer_bytes = num_bytes
        pd.transfer_s = seconds
        pd.decode_hit_tokens = hit_tokens

    def rejected(self, request: Request, rejection: Rejection) -> None:
        record = self.records[request.request_id]
        record.status = "rejected"
        record.reason = rejection.code
        record.reason_detail = rejection.detail

    # -- steps ------------------------------------------------------------------------------

    def on_batch_applied(self, record: BatchRecord, times: BatchTimes, replica: int = 0,
                         synchronous: bool = False) -> bool:
        """Record a batch whose results were just applied: ``record`` ran on ``replica`` as
        ``times`` says, and left the engine as its ``stats`` say. An asynchronous batch that
        computed and preempted nothing (and no decode window's batch) leaves no step row (it
        may still have started loads); a synchronous step always does. Returns whether it
        wrote a step row."""
        output = record.output
        decodes_by_request = record.implicit_decodes_by_request
        if decodes_by_request is not None:
            self._implicit_decodes(decodes_by_request, times.previous_end_s)
        if record.implicit_decodes is not None or synchronous or output.num_scheduled_tokens or output.preempted:
            self._batch(record, times, replica)
            return True
        if self.offload is not None:  # a batch that only starts loads or waits
            self.loads_issued(output, times.scheduled_s, record.stats.load_seconds, replica)
        return False

    def _batch(self, record: BatchRecord, times: BatchTimes, replica: int) -> None:
        """A batch's records: admissions stamped when it was scheduled, tokens when it
        ended. A decode window's batch (``implicit_decodes``) also ran one decode of each of
        its members, all sampling at the batch's end and last at the previous batch's end;
        its finished members catch up on their window steps in ``_finished``, the others
        with the first batch after the window (``_implicit_decodes``)."""
        output = record.output
        stats = record.stats
        scheduled_s = times.scheduled_s
        if self.offload is not None:
            self.loads_issued(output, scheduled_s, stats.load_seconds, replica)
        self._admissions(output, scheduled_s)
        sampled = record.execution.sampled
        spec = output.scheduled_spec_decode_tokens if self.speculative else None
        if spec is not None:
            # A request that finished while this batch was in flight (drafts make its end
            # uncertain, so it was scheduled again) gets nothing from it: vLLM drops it.
            records = self.records
            sampled = {rid: tokens for rid, tokens in sampled.items() if records[rid].status != "finished"}
        prefill_tokens, decode_tokens = self._scheduled(output, spec)
        num_scheduled = len(output.num_scheduled_tokens)
        itl = self._itl[replica]
        implicit = record.implicit_decodes
        if implicit is not None:
            num_scheduled += implicit
            decode_tokens += implicit
            itl.extend_repeated(times.end_s - times.previous_end_s, implicit)
        self._sampled(sampled, times.end_s, itl)
        self._finished(record.finished, times.end_s)
        self._step_row(stats, times, num_scheduled, prefill_tokens, decode_tokens, len(output.scheduled_new_reqs),
                       len(output.preempted), len(record.finished), record.execution.cost, replica)

    def _admissions(self, output, scheduled_s: float) -> None:
        records = self.records
        loads = self._loads if self.offload is not None else None
        for admission in output.scheduled_new_reqs:
            record = records[admission.req_id]
            hit_tokens = admission.hit_tokens
            if loads is not None:
                hit_tokens = self._offload_admission(admission.req_id, hit_tokens, scheduled_s,
                                                     math.isnan(record.first_scheduled_s), record.replica)
            if math.isnan(record.first_scheduled_s):
                record.first_scheduled_s = scheduled_s
                record.hit_tokens = hit_tokens
            record.hit_tokens_total += hit_tokens
            # Its length when the lookup ran (vLLM's PrefixCacheStats: request.num_tokens at
            # get_computed_blocks), not now: the batch's own sampled token is applied already.
            record.queried_tokens += admission.num_tokens

    def _scheduled(self, output, spec: dict[str, list[int]] | None) -> tuple[int, int]:
        """Count the batch's tokens into its requests' records: (prefill, decode) tokens.
        A decode is a request past its prompt that schedules one token, or with drafts
        (``spec``, docs/semantics.md#speculative-decoding) ``1 + drafts`` tokens to verify
        them (the scheduler counts the drafts it verified: ``SpecDecodingStats``)."""
        records = self.records
        prefill_tokens = decode_tokens = 0
        for (request_id, num_new), computed in zip(output.num_scheduled_tokens.items(), output.num_computed_tokens):
            record = records[request_id]
            record.scheduled_tokens += num_new
            num_drafts = 0
            if spec is not None:
                drafts = spec.get(request_id)
                if drafts:
                    num_drafts = len(drafts)
            # ``computed`` is where the batch started: a longer recompute after a
            # preemption counts as prefill.
            if num_new == 1 + num_drafts and computed >= record.prompt_tokens:
                decode_tokens += num_new
            else:
                prefill_tokens += num_new
        return prefill_tokens, decode_tokens

    def _sampled(self, sampled: dict[str, list[int]], end_s: float, itl_s: Float64Buffer) -> None:
        records = self.records
        for request_id in sampled:
            record = records[request_id]
            if math.isnan(record.first_token_s):
                record.first_token_s = end_s
                record.status = "running"
            else:
                itl_s.append(end_s - record.last_token_s)
            record.last_token_s = end_s

    def _finished(self, finished: list[RequestSnapshot], end_s: float) -> None:
        records = self.records
        for snapshot in finished:
            record = records[snapshot.request_id]
            if snapshot.implicit_decodes:
                record.scheduled_tokens += snapshot.implicit_decodes
                record.last_token_s = end_s
            record.finish_s = end_s
            record.status = "finished"
            record.generated_tokens = snapshot.num_output_tokens
            record.num_preemptions = snapshot.num_preemptions
            record.verify_steps, record.draft_tokens, record.accepted_draft_tokens = snapshot.spec_decode

    def _implicit_decodes(self, decodes_by_request: list[tuple[str, int]], last_token_s: float) -> None:
        """Running requests' decodes that earlier records left implicit (request id, how
        many: a decode window's batches), the last of them sampled at ``last_token_s``."""
        records = self.records
        for request_id, num_decodes in decodes_by_request:
            record = records[request_id]
            record.scheduled_tokens += num_decodes
            record.last_token_s = last_token_s

    def _step_row(self, stats: EngineStats, times: BatchTimes, num_scheduled: int, prefill_tokens: int,
                  decode_tokens: int, num_new: int, num_preempted: int, num_finished: int, cost: object,
                  replica: int) -> None:
        """The step table's row for a batch, with the engine as it is after the batch's update."""
        row = self._step_values
        start_s = times.start_s
        # In STEP_COLUMNS order.
        row.extend((start_s, times.end_s - start_s, stats.num_running_reqs, stats.num_waiting_reqs,
                    num_scheduled, prefill_tokens, decode_tokens, num_new, num_preempted, num_finished,
                    stats.num_free_blocks, stats.num_cached_blocks, stats.kv_cache_usage))
        row.extend(stats.kv_cache_usage_by_group)
        evictions = stats.num_evictions - self._evictions_before[replica]
        self._evictions_before[replica] = stats.num_evictions
        if not isinstance(cost, StepCost):  # an executor without a breakdown
            row.extend((evictions, math.nan, math.nan, math.nan, math.nan))
        else:
            row.extend((evictions, cost.compute_s, cost.memory_s, cost.communication_s, cost.overhead_s))
        self.step_replica.append(replica)
        if self.offload is not None:
            before = self._offload_before[replica]
            counters = stats.offload_counters
            assert counters is not None
            for name in self._offload_columns:
                value = counters[name]
                row.append(value if name in _OFFLOAD_GAUGES else value - before[name])
                before[name] = value
            row.append(self._waiting_for_kv[replica])
        if self.speculative:
            verified = stats.spec_decoding_stats
            row.extend(verified.num_accepted_tokens_per_pos if verified is not None else self._none_accepted)
        if self.moe_group:
            row.append(cost.moe_communication_s if isinstance(cost, StepCost) else math.nan)

    # -- offload tiers ----------------------------------------------------------------------

    def loads_issued(self, output, start_s: float, load_seconds: dict[int, float] | None, replica: int = 0) -> None:
        """The waits for KV that a schedule at ``start_s`` began on ``replica`` (requests
        its lookups deferred), the loads it issued (its ``external_hits``), and how long the
        worker takes for them (``load_seconds`` by job; None on a step clock); also for a
        batch that computes nothing (no step row)."""
        meta = output.kv_connector_metadata
        deferred = meta.deferred_req_ids if isinstance(meta, OffloadingConnectorMetadata) else None
        hits = output.external_hits
        if deferred is None and not hits:
            return
        loads = self._loads
        waiting = self._waiting_for_kv
        for request_id in deferred or ():
            load = loads.get(request_id)
            if load is None:
                load = loads[request_id] = _OffloadRecord()
            if math.isnan(load.wait_start_s):
                load.wait_start_s = start_s
                waiting[replica] += 1
        if not hits:
            return
        jobs = meta.load_jobs if meta is not None else {}
        for request_id, gpu_hit_tokens, loaded_tokens, sources in hits:
            load = loads.get(request_id)
            if load is None:
                load = loads[request_id] = _OffloadRecord()
            if math.isnan(load.wait_start_s):
                load.wait_start_s = start_s
                waiting[replica] += 1
            if not load.admitted:
                # The first admission: its hits per tier. Tokens of the hit that no loaded
                # chunk covers (sliding-window history it skips) go with the slowest tier read.
                cpu, disk = sources.get("cpu", 0), sources.get("disk", 0)
                if disk:
                    disk = loaded_tokens - cpu
                else:
                    cpu = loaded_tokens
                load.admitted = True
                load.gpu_hit_tokens, load.cpu_hit_tokens, load.disk_hit_tokens = gpu_hit_tokens, cpu, disk
            load.pending_issue_s = start_s
            load.pending_gpu_hit_tokens = gpu_hit_tokens
        if load_seconds is None:
            return  # a step clock: no seconds
        for job_id, job in jobs.items():
            load = loads.get(job.req_id)
            # Only the load that ends the request's first wait (``load_wait_s``).
            if load is not None and math.isnan(load.load_wait_s) and math.isnan(load.load_transfer_s):
                load.load_transfer_s = load_seconds.get(job_id, math.nan)

    def _offload_admission(self, request_id: str, hit_tokens: int, scheduled_s: float, first: bool,
                           replica: int) -> int:
        """A request scheduled: its wait for KV ends. After a load its GPU hit is the one
        found when the load was issued (the admission now computes on from the loaded
        tokens), and its first load's wait counts from the start of its wait: the lookups
        that deferred it before the load was issued are part of it."""
        load = self._loads.get(request_id)
        if load is None:
            load = self._loads[request_id] = _OffloadRecord()
        wait_start_s = load.wait_start_s
        if not math.isnan(wait_start_s):
            load.wait_start_s = math.nan
            self._waiting_for_kv[replica] -= 1
            if math.isnan(load.load_wait_s):
                load.load_wait_s = scheduled_s - wait_start_s
                # A wait may end with no load at all: the hit turned up on the GPU (another
                # request loaded the chunks) or left the tier. It was all before a load.
                issued_s = load.pending_issue_s if load.pending_issue_s is not None else scheduled_s
                load.load_defer_s = issued_s - wait_start_s
        if load.pending_issue_s is not None:
            hit_tokens = load.pending_gpu_hit_tokens
            load.pending_issue_s = None
        elif first and not load.admitted:
            load.admitted = True
            load.gpu_hit_tokens = hit_tokens
        return hit_tokens

    # -- tables -----------------------------------------------------------------------------

    def finish_unfinished(self, held: Iterable[RequestSnapshot]) -> None:
        """Requests still queued or running when the run stopped keep that status, with the
        figures the engines ``held`` them at (``EngineCore.request_snapshots``); one no
        engine holds never got that far (waiting, nothing generated)."""
        by_id = {snapshot.request_id: snapshot for snapshot in held}
        for record in self.order:
            if record.status in ("waiting", "running"):
                snapshot = by_id.get(record.request_id)
                running = snapshot is not None and snapshot.status is RequestStatus.RUNNING
                record.status = "running" if running else "waiting"
                if snapshot is not None:
                    # Window steps no record reported (the run stopped before the batch
                    # after the window was applied).
                    record.scheduled_tokens += snapshot.implicit_decodes
                    record.generated_tokens = snapshot.num_output_tokens
                    record.num_preemptions = snapshot.num_preemptions
                    record.verify_steps, record.draft_tokens, record.accepted_draft_tokens = snapshot.spec_decode

    def requests_table(self, client_overhead_s: float = 0.0) -> pa.Table:
        """``requests.parquet``: the base columns, the client-side ones (``client_overhead_s``
        past the server's TTFT and E2E) and each recorded feature's (``output_columns``)."""
        rows = self.order
        first_token = np.array([r.first_token_s for r in rows], dtype=np.float64)
        finish = np.array([r.finish_s for r in rows], dtype=np.float64)
        arrival = np.array([r.arrival_s for r in rows], dtype=np.float64)
        generated = np.array([r.generated_tokens for r in rows], dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(generated > 1, (finish - first_token) / (generated - 1), np.nan)
        prompt = np.array([r.prompt_tokens for r in rows], dtype=np.int64)
        hit_first = np.array([r.hit_tokens for r in rows], dtype=np.int64)
        scheduled = np.array([r.scheduled_tokens for r in rows], dtype=np.int64)
        # Tokens computed beyond one pass over the prompt (less its first hit) and the outputs.
        recomputed = np.maximum(scheduled - (prompt - hit_first) - np.maximum(generated - 1, 0), 0)
        recomputed = np.where(scheduled > 0, recomputed, 0)
        base: dict[str, object] = {
            "request_id": pa.array([r.request_id for r in rows], pa.string()),
            "session_id": pa.array([r.session_id for r in rows], pa.string()),
            "status": pa.array([r.status for r in rows], pa.string()),
            # A handful of codes over thousands of rows: dictionary-encoded, read back as categorical.
            "reject_reason": pa.array([r.reason or None for r in rows], pa.string()).dictionary_encode(),
            "reject_detail": pa.array([r.reason_detail or None for r in rows], pa.string()),
            "arrival_time_s": arrival,
            "first_scheduled_time_s": np.array([r.first_scheduled_s for r in rows], dtype=np.float64),
            "first_token_time_s": first_token,
            "finish_time_s": finish,
            "prompt_tokens": prompt,
            "output_tokens": np.array([r.max_tokens for r in rows], dtype=np.int64),
            "generated_tokens": generated,
            "prefix_hit_tokens": hit_first,
            "prefix_cache_queries": np.array([r.queried_tokens for r in rows], dtype=np.int64),
            "prefix_cache_hits": np.array([r.hit_tokens_total for r in rows], dtype=np.int64),
            "num_preemptions": np.array([r.num_preemptions for r in rows], dtype=np.int64),
            "scheduled_tokens": scheduled,
            "recomputed_tokens": recomputed,
            "ttft_s": first_token - arrival,
            "tpot_s": tpot,
            "e2el_s": finish - arrival,
            "replica": pa.array(np.array([r.replica for r in rows], dtype=np.int32), pa.int32()),
        }
        features: dict[str, dict[str, object]] = {
            CLIENT_SIDE.feature: dict(client_request_columns(base["ttft_s"], base["e2el_s"], client_overhead_s))}
        if self.roles is not None:
            features[DISAGGREGATION.feature] = self._pd_columns(base, rows)
        if self.speculative:
            features[SPECULATIVE.feature] = {
                name: pa.array(np.array([getattr(r, name) for r in rows], dtype=np.int64))
                for name in SPECULATIVE.requests}
        if self.offload is not None:
            loads = self._loads
            empty = _OffloadRecord()
            per = [loads.get(r.request_id, empty) for r in rows]
            features[OFFLOAD.feature] = {
                name: pa.array(np.array([getattr(x, name) for x in per],
                                        dtype=np.float64 if name.endswith("_s") else np.int64))
                for name in OFFLOAD.requests}
        return pa.table(assemble("requests", base, features))

    def _pd_columns(self, base: dict[str, object], rows: list[_RequestRecord]) -> dict[str, object]:
        """A disaggregated run's request columns (``output_columns.DISAGGREGATION``). The
        base prefix-cache columns become the prefill side's (where the prompt is computed);
        the decode side's own first hit is ``decode_prefix_hit_tokens``."""
        pds = [self._pd.get(r.request_id) for r in rows]
        admission_hits = base["prefix_hit_tokens"]
        assert isinstance(admission_hits, np.ndarray)
        decode_hits = pa.array([p.decode_hit_tokens if p is not None and p.decode_hit_tokens is not None else int(hit)
                                for p, hit in zip(pds, admission_hits)], pa.int64())
        # The decode side's lookups: an admission after a read finds nothing of its own
        # (its hit came before the read, ``decode_hit_tokens``), so that hit is added.
        decode_queries = pa.array(base["prefix_cache_queries"], pa.int64())
        decode_hits_total = pa.array([r.hit_tokens_total + ((p.decode_hit_tokens or 0) if p is not None else 0)
                                      for r, p in zip(rows, pds)], pa.int64())
        for name, attr in (("prefix_hit_tokens", "hit_tokens"), ("prefix_cache_queries", "queried_tokens"),
                           ("prefix_cache_hits", "hit_tokens_total")):
            base[name] = pa.array([getattr(p.prefill, attr) if p else 0 for p in pds], pa.int64())
        return {
            "prefill_replica": pa.array([p.prefill_replica if p else -1 for p in pds], pa.int32()),
            "decode_replica": base["replica"],
            "decode_prefix_hit_tokens": decode_hits,
            "decode_prefix_cache_queries": decode_queries,
            "decode_prefix_cache_hits": decode_hits_total,
            "prefill_finish_time_s": pa.array([p.prefill_finish_s if p else math.nan for p in pds], pa.float64()),
            "transfer_bytes": pa.array([p.transfer_bytes if p else 0 for p in pds], pa.int64()),
            "transfer_s": pa.array([p.transfer_s if p else math.nan for p in pds], pa.float64()),
        }

    def steps_table(self) -> pa.Table:
        """``steps.parquet``, made once, when the run is over: the packed rows go as the
        table is made (over a long run they are the recorder's largest holding, as large as
        the table), and a second call returns the same table."""
        made = self._steps
        if made is not None:
            return made
        values = self._step_values.to_array()
        self._step_values = Float64Buffer()
        rows = (np.frombuffer(values, dtype=np.float64) if len(values) else np.zeros(0)).reshape(-1, self.step_width)
        columns = {"step": pa.array(np.arange(len(rows), dtype=np.int64), pa.int64())}
        at = 0
        for name, (numpy_type, kind) in STEP_COLUMNS.items():
            if name == "step":
                continue
            if name == "kv_cache_usage_by_group":
                groups = self.num_groups
                offsets = np.arange(0, len(rows) * groups + 1, groups, dtype=np.int32)
                columns[name] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                         pa.array(rows[:, at:at + groups].ravel(), pa.float64()))
                at += groups
                continue
            columns[name] = pa.array(np.ascontiguousarray(rows[:, at]).astype(numpy_type), type=kind)
            at += 1
        columns["replica"] = pa.array(np.frombuffer(self.step_replica, dtype=np.int32) if len(self.step_replica)
                                      else np.zeros(0, np.int32), pa.int32())
        features: dict[str, dict[str, pa.Array]] = {}
        if self.offload is not None:
            features[OFFLOAD.feature] = offload = {}
            for name in self._offload_columns + (OFFLOAD_WAITING_COLUMN,):
                offload[name] = pa.array(np.ascontiguousarray(rows[:, at]).astype(np.int64), pa.int64())
                at += 1
        if self.speculative:
            k = self.num_speculative_tokens
            offsets = np.arange(0, len(rows) * k + 1, k, dtype=np.int32)
            features[SPECULATIVE.feature] = {SPECULATIVE.steps[0]: pa.ListArray.from_arrays(
                pa.array(offsets, pa.int32()), pa.array(rows[:, at:at + k].ravel().astype(np.int64), pa.int64()))}
            at += k
        if self.roles is not None:
            roles = self.roles
            features[DISAGGREGATION.feature] = {
                "role": pa.array([roles[i] for i in self.step_replica], pa.string()).dictionary_encode()}
        if self.moe_group:
            features[DATA_PARALLEL.feature] = {"moe_communication_s": pa.array(np.ascontiguousarray(rows[:, at]),
                                                                                pa.float64())}
            at += 1
        made = self._steps = pa.table(assemble("steps", columns, features))
        return made


# Step column -> (its numpy type, its type in steps.parquet), in the order
# ``MetricsRecorder.step`` records a row.
STEP_COLUMNS: dict[str, tuple[type, pa.DataType]] = {
    "step": (np.int64, pa.int64()),
    "time_s": (np.float64, pa.float64()),
    "duration_s": (np.float64, pa.float64()),
    "num_running": (np.int32, pa.int32()),
    "num_waiting": (np.int32, pa.int32()),
    "num_scheduled_reqs": (np.int32, pa.int32()),
    "prefill_tokens": (np.int64, pa.int64()),
    "decode_tokens": (np.int64, pa.int64()),
    "num_admitted": (np.int32, pa.int32()),
    "num_preempted": (np.int32, pa.int32()),
    "num_finished": (np.int32, pa.int32()),
    "num_free_blocks": (np.int64, pa.int64()),
    "num_cached_blocks": (np.int64, pa.int64()),
    "kv_cache_usage": (np.float64, pa.float64()),
    "kv_cache_usage_by_group": (np.float64, pa.list_(pa.float64())),  # num_groups values a step
    "num_evictions": (np.int64, pa.int64()),
    "compute_s": (np.float64, pa.float64()),
    "memory_s": (np.float64, pa.float64()),
    "communication_s": (np.float64, pa.float64()),
    "overhead_s": (np.float64, pa.float64()),
}
