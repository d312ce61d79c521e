"""What a replay measured: one record per request, one per engine step, one summary.

DESIGN.md "Outputs"; column meanings are in ``reports/SCHEMA.md``. Names follow vLLM's
metrics and ``vllm bench serve`` fields (``ttft``, ``tpot``, ``itl``, ``e2el``,
``prefix_cache_queries``/``hits``, ``kv_cache_usage``, ``num_preemptions``) with units in
the names. Times are seconds since the trace start. Everything is collected in plain
lists and turned into Arrow tables at the end, so a run's outputs depend only on its
inputs (no wall-clock values).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from mypy_extensions import mypyc_attr

from kvtwin.sim.core.engine import Rejection, StepResult
from kvtwin.sim.core.request import Request, RequestStatus
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.scenario.slo import SLO
from kvtwin.traces.expand import table_block_ids
from kvtwin.traces.schema import hash_block_tokens_of
from kvtwin.traces.stats import DEFAULT_BLOCK_TOKENS, prefix_reuse


class _RequestRecord:
    __slots__ = ("request", "request_id", "index", "session_id", "arrival_s", "first_scheduled_s", "first_token_s",
                 "finish_s", "last_token_s", "hit_tokens", "hit_tokens_total", "queried_tokens", "scheduled_tokens",
                 "status", "reason", "reason_detail", "prompt_tokens", "max_tokens", "generated_tokens", "num_preemptions",
                 "replica")

    def __init__(self, request: Request, index: int, session_id: str | None, arrival_s: float, replica: int = 0):
        # The request is referenced only while it lives: a finished one is reduced to its
        # counts, so its block hashes can be freed during a long replay.
        self.request: Request | None = request
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

    def snapshot(self) -> None:
        request = self.request
        if request is not None:
            self.generated_tokens = request.num_output_tokens
            self.num_preemptions = request.num_preemptions
            self.request = None


class _OffloadRecord:
    """One request's offload hits (at its first admission) and its first load's times."""

    __slots__ = ("admitted", "gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens", "load_wait_s",
                 "load_transfer_s", "pending_issue_s", "pending_gpu_hit_tokens")

    def __init__(self) -> None:
        self.admitted = False
        self.gpu_hit_tokens = self.cpu_hit_tokens = self.disk_hit_tokens = 0
        self.load_wait_s = math.nan
        self.load_transfer_s = math.nan
        # A load issued and its request not yet scheduled: when, and the GPU hit then.
        self.pending_issue_s: float | None = None
        self.pending_gpu_hit_tokens = 0


# Per-step offload columns (``reports/SCHEMA.md``): counter deltas of the step, except the
# gauges (chunks in use after the step).
_OFFLOAD_CPU_STEP_COLUMNS = ("offload_cpu_loaded_keys", "offload_cpu_stored_keys", "offload_cpu_evicted_keys",
                             "offload_cpu_used_chunks")
_OFFLOAD_DISK_STEP_COLUMNS = ("offload_disk_loaded_keys", "offload_disk_stored_keys", "offload_disk_evicted_keys",
                              "offload_disk_used_chunks")
_OFFLOAD_BYTES_STEP_COLUMNS = ("offload_load_bytes", "offload_store_bytes")
_OFFLOAD_GAUGES = frozenset({"offload_cpu_used_chunks", "offload_disk_used_chunks"})


def offload_step_columns(has_disk: bool) -> tuple[str, ...]:
    return (_OFFLOAD_CPU_STEP_COLUMNS + (_OFFLOAD_DISK_STEP_COLUMNS if has_disk else ())
            + _OFFLOAD_BYTES_STEP_COLUMNS)


def offload_counters(tier) -> dict[str, int]:
    """An offload tier's cumulative counters (gauges as they are), by step column."""
    manager = tier.manager
    transfers = tier.transfers
    out = {"offload_cpu_loaded_keys": manager.num_loaded_keys, "offload_cpu_stored_keys": manager.num_stored_keys,
           "offload_cpu_evicted_keys": manager.num_evicted_keys, "offload_cpu_used_chunks": manager.num_used_chunks}
    if getattr(manager, "disk_num_chunks", 0):
        out.update({"offload_disk_loaded_keys": manager.disk_loaded_keys,
                    "offload_disk_stored_keys": manager.disk_stored_keys,
                    "offload_disk_evicted_keys": manager.disk_evicted_keys,
                    "offload_disk_used_chunks": manager.num_disk_used_chunks})
    out["offload_load_bytes"] = transfers.loaded_bytes
    out["offload_store_bytes"] = transfers.stored_bytes
    return out


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

    def _store(self) -> None:
        self._stored.fromlist(self._newest)
        self._newest.clear()

    def to_array(self) -> array:
        """Everything recorded, in order (the buffer keeps recording after this)."""
        if self._newest:
            self._store()
        return self._stored


@mypyc_attr(allow_interpreted_subclasses=True)  # a test's recorder extends it
class MetricsRecorder:
    """Collects per-request and per-step records as the engine steps.

    One recorder serves every data-parallel replica of a run: a request and a step carry
    the replica they ran on (``replica``); inter-token latencies are kept per replica
    (``itl_by_replica``; ``itl_s`` is replica 0's, and all of them with one replica).
    """

    def __init__(self, num_groups: int, num_replicas: int = 1, offload=None):
        self.num_groups = num_groups
        self.num_replicas = num_replicas
        self.records: dict[str, _RequestRecord] = {}
        self.order: list[_RequestRecord] = []
        self._itl = [Float64Buffer() for _ in range(num_replicas)]
        # The step table as doubles, a row of ``step_width`` values a step in
        # ``STEP_COLUMNS`` order (the step index aside; the per-group usage takes
        # ``num_groups`` values; then any offload columns): 8 bytes a value instead of a
        # Python object. Counts are exact in a double (below 2**53).
        self._step_values = Float64Buffer()
        self.step_width = len(STEP_COLUMNS) - 2 + num_groups
        self.step_replica = array("i")
        self._evictions_before = [0] * num_replicas
        # With offload tiers (a ``ResolvedOffload``): per request, what its admissions hit
        # in each tier and how long its load took; per step, the tiers' counters.
        self.offload = offload
        if offload is not None:
            self._offload_columns = offload_step_columns(offload.has_disk)
            self.step_width += len(self._offload_columns)
            self._offload_before: list[dict[str, int]] = [dict.fromkeys(self._offload_columns, 0)
                                                          for _ in range(num_replicas)]
            self._loads: dict[str, _OffloadRecord] = {}

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

    def rejected(self, request: Request, rejection: Rejection) -> None:
        record = self.records[request.request_id]
        record.status = "rejected"
        record.reason = rejection.code
        record.reason_detail = rejection.detail

    # -- steps ------------------------------------------------------------------------------

    def step(self, engine, result: StepResult, start_s: float, end_s: float,
             scheduled_s: float | None = None, replica: int = 0) -> None:
        """Record one executed batch: ``result.output`` ran from ``start_s`` to ``end_s`` on
        ``replica`` and its results were applied at ``end_s``. ``scheduled_s`` is when it
        was scheduled, if earlier (async scheduling: while the previous batch ran);
        admissions take it."""
        output = result.output
        if scheduled_s is None:
            scheduled_s = start_s
        if self.offload is not None:
            self.loads_issued(engine, output, scheduled_s)
        self._admissions(output, scheduled_s)
        prefill_tokens, decode_tokens = self._scheduled(output)
        self._sampled(result.execution.sampled, end_s, self._itl[replica])
        self._finished(result.finished, end_s)
        self._step_row(engine, start_s, end_s, len(output.num_scheduled_tokens), prefill_tokens, decode_tokens,
                       len(output.scheduled_new_reqs), len(output.preempted), len(result.finished),
                       result.execution.cost, replica)

    def _admissions(self, output, scheduled_s: float) -> None:
        records = self.records
        loads = self._loads if self.offload is not None else None
        for admission in output.scheduled_new_reqs:
            record = records[admission.req_id]
            hit_tokens = admission.hit_tokens
            if loads is not None:
                hit_tokens = self._offload_admission(admission.req_id, hit_tokens, scheduled_s,
                                                     math.isnan(record.first_scheduled_s))
            if math.isnan(record.first_scheduled_s):
                record.first_scheduled_s = scheduled_s
                record.hit_tokens = hit_tokens
            record.hit_tokens_total += hit_tokens
            assert record.request is not None  # held until the request is done
            record.queried_tokens += record.request.num_tokens

    def _scheduled(self, output) -> tuple[int, int]:
        """Count the batch's tokens into its requests' records: (prefill, decode) tokens."""
        records = self.records
        prefill_tokens = decode_tokens = 0
        for (request_id, num_new), computed in zip(output.num_scheduled_tokens.items(), output.num_computed_tokens):
            record = records[request_id]
            record.scheduled_tokens += num_new
            # A decode: one token for a request past its prompt (a longer recompute after a
            # preemption counts as prefill). ``computed`` is where the batch started.
            if num_new == 1 and computed >= record.prompt_tokens:
                decode_tokens += 1
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

    def _finished(self, finished: list[Request], end_s: float) -> None:
        records = self.records
        for request in finished:
            record = records[request.request_id]
            record.finish_s = end_s
            record.status = "finished"
            record.snapshot()

    def decode_window_step(self, engine, start_s: float, end_s: float, num_decodes: int, cost: StepCost,
                           itl_s: float, finished: list[Request], window_steps: dict[str, int],
                           join=None, join_sampled: dict[str, list[int]] | None = None,
                           scheduled_s: float = 0.0, replica: int = 0) -> None:
        """Record a batch of a decode window (``sim/core/decode_window.py``): ``num_decodes``
        members decoded one token each, all sampling at ``end_s`` and last at ``end_s -
        itl_s``; ``join`` (an output, scheduled at ``scheduled_s``) holds the batch's
        admissions, which sampled ``join_sampled``. ``finished`` sampled their last token,
        a member after ``window_steps`` window batches. Members' records catch up on the
        others in ``close_decode_window``."""
        itl = self._itl[replica]
        num_scheduled = decode_tokens = num_decodes
        prefill_tokens = num_new = 0
        if join is not None:
            self._admissions(join, scheduled_s)
            join_prefill, join_decode = self._scheduled(join)
            prefill_tokens += join_prefill
            decode_tokens += join_decode
            num_scheduled += len(join.num_scheduled_tokens)
            num_new = len(join.scheduled_new_reqs)
        itl.extend([itl_s] * num_decodes)
        if join_sampled is not None:
            self._sampled(join_sampled, end_s, itl)
        records = self.records
        for request in finished:
            steps = window_steps.get(request.request_id, 0)
            if steps:
                record = records[request.request_id]
                record.scheduled_tokens += steps
                record.last_token_s = end_s
        self._finished(finished, end_s)
        self._step_row(engine, start_s, end_s, num_scheduled, prefill_tokens, decode_tokens, num_new, 0, len(finished),
                       cost, replica)

    def close_decode_window(self, members: list[tuple[str, int]], last_token_s: float) -> None:
        """The records of a window's running members after their window batches (request
        id, how many) were recorded, the last of them at ``last_token_s``."""
        records = self.records
        for request_id, num_steps in members:
            record = records[request_id]
            record.scheduled_tokens += num_steps
            record.last_token_s = last_token_s

    def _step_row(self, engine, start_s: float, end_s: float, num_scheduled: int, prefill_tokens: int,
                  decode_tokens: int, num_new: int, num_preempted: int, num_finished: int, cost: object,
                  replica: int) -> None:
        """The step table's row for a batch, with the pool as it is after the batch's update."""
        pool = engine.kv_cache_manager.block_pool
        usable = pool.num_gpu_blocks - 1
        row = self._step_values
        # In STEP_COLUMNS order.
        row.extend((start_s, end_s - start_s, len(engine.scheduler.running), len(engine.scheduler.waiting),
                    num_scheduled, prefill_tokens, decode_tokens, num_new, num_preempted, num_finished,
                    pool.get_num_free_blocks(), pool.num_cached_blocks(), pool.get_usage()))
        row.extend([n / usable for n in pool.num_used_by_group])
        if not isinstance(cost, StepCost):  # an executor without a breakdown
            row.extend((pool.num_evictions - self._evictions_before[replica], math.nan, math.nan, math.nan, math.nan))
        else:
            row.extend((pool.num_evictions - self._evictions_before[replica], cost.compute_s, cost.memory_s,
                        cost.communication_s, cost.overhead_s))
        self._evictions_before[replica] = pool.num_evictions
        self.step_replica.append(replica)
        if self.offload is not None:
            before = self._offload_before[replica]
            counters = offload_counters(engine.offload)
            for name in self._offload_columns:
                value = counters[name]
                row.append(value if name in _OFFLOAD_GAUGES else value - before[name])
                before[name] = value

    # -- offload tiers ----------------------------------------------------------------------

    def loads_issued(self, engine, output, start_s: float) -> None:
        """The loads a schedule issued at ``start_s`` (its ``external_hits``), and how long
        the worker takes for them; also for a batch that computes nothing (no step row)."""
        hits = output.external_hits
        if not hits:
            return
        loads = self._loads
        meta = output.kv_connector_metadata
        jobs = meta.load_jobs if meta is not None else {}
        for request, gpu_hit_tokens, loaded_tokens, sources in hits:
            load = loads.get(request.request_id)
            if load is None:
                load = loads[request.request_id] = _OffloadRecord()
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
        seconds = getattr(engine.offload.transfers, "load_seconds", None)
        if seconds is None:
            return  # a step clock: no seconds
        for job_id, job in jobs.items():
            load = loads.get(job.req_id)
            if load is not None and math.isnan(load.load_transfer_s):
                load.load_transfer_s = seconds.get(job_id, math.nan)

    def _offload_admission(self, request_id: str, hit_tokens: int, scheduled_s: float, first: bool) -> int:
        """A request scheduled: after its load, its GPU hit is the one found when the load
        was issued (the admission now computes on from the loaded tokens)."""
        load = self._loads.get(request_id)
        if load is None:
            load = self._loads[request_id] = _OffloadRecord()
        if load.pending_issue_s is not None:
            hit_tokens = load.pending_gpu_hit_tokens
            if math.isnan(load.load_wait_s):
                load.load_wait_s = scheduled_s - load.pending_issue_s
            load.pending_issue_s = None
        elif first and not load.admitted:
            load.admitted = True
            load.gpu_hit_tokens = hit_tokens
        return hit_tokens

    # -- tables -----------------------------------------------------------------------------

    def finish_unfinished(self) -> None:
        """Requests still queued or running when the run stopped keep that status."""
        for record in self.order:
            if record.status in ("waiting", "running"):
                assert record.request is not None
                status = record.request.status
                record.status = "running" if status is RequestStatus.RUNNING else "waiting"
            record.snapshot()

    def requests_table(self) -> pa.Table:
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
        table = pa.table({
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
        })
        if self.offload is None:
            return table
        loads = self._loads
        empty = _OffloadRecord()
        per = [loads.get(r.request_id, empty) for r in rows]
        for name in ("gpu_hit_tokens", "cpu_hit_tokens", "disk_hit_tokens"):
            table = table.append_column(name, pa.array(np.array([getattr(x, name) for x in per], dtype=np.int64)))
        for name in ("load_wait_s", "load_transfer_s"):
            table = table.append_column(name, pa.array(np.array([getattr(x, name) for x in per], dtype=np.float64)))
        return table

    def steps_table(self) -> pa.Table:
        values = self._step_values.to_array()
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
        if self.offload is not None:
            for name in self._offload_columns:
                columns[name] = pa.array(np.ascontiguousarray(rows[:, at]).astype(np.int64), pa.int64())
                at += 1
        return pa.table(columns)


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


def _stats(values: np.ndarray, prefix: str, scale: float = 1000.0) -> dict[str, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {f"mean_{prefix}": math.nan, f"median_{prefix}": math.nan, f"p90_{prefix}": math.nan,
                f"p99_{prefix}": math.nan}
    return {
        f"mean_{prefix}": float(finite.mean() * scale),
        f"median_{prefix}": float(np.percentile(finite, 50) * scale),
        f"p90_{prefix}": float(np.percentile(finite, 90) * scale),
        f"p99_{prefix}": float(np.percentile(finite, 99) * scale),
    }


# When a run counts as saturated (summary columns ``saturated``, ``saturation_reason``).
# A minute in line before the first schedule is more than any interactive service hides.
SATURATION_QUEUE_P90_S = 60.0
# Fewer than half the requests within the SLO: the deployment does not hold it.
SATURATION_SLO_ATTAINMENT = 0.5
# The engine still busy long after the last arrival: requests queued faster than served.
SATURATION_DRAIN_FACTOR = 1.5
SATURATION_DRAIN_MIN_S = 60.0


def _reuse_upper_bound(trace: pa.Table) -> float:
    """The infinite-cache share of prompt tokens (``kvtwin trace info``), NaN without identity.

    Measured at the trace's own hash block size, which costs a few milliseconds on the
    Mooncake hour; finer blocks would cost seconds and move the bound by under 1%.
    """
    block_tokens = hash_block_tokens_of(trace) or DEFAULT_BLOCK_TOKENS
    ids = table_block_ids(trace, block_tokens)
    if ids is None:
        return math.nan
    return prefix_reuse(ids, trace.column("prompt_tokens").to_numpy(), block_tokens).token_fraction


def _saturation(queue_p90_s: float, attainment: float, has_slo: bool, completed: int, duration_s: float,
                last_arrival_s: float) -> list[str]:
    reasons = []
    if queue_p90_s > SATURATION_QUEUE_P90_S:
        reasons.append("queueing")
    if has_slo and attainment < SATURATION_SLO_ATTAINMENT:
        reasons.append("slo")
    if (completed and duration_s > SATURATION_DRAIN_FACTOR * max(last_arrival_s, 1.0)
            and duration_s - last_arrival_s > SATURATION_DRAIN_MIN_S):
        reasons.append("drain")
    return reasons


def summarize(requests: pa.Table, steps: pa.Table, itl_s: array, slo: SLO, end_time_s: float, *,
              trace: pa.Table | None = None, num_replicas: int = 1, router: str = "round_robin",
              offload: dict | None = None) -> pa.Table:
    """One row of run-level figures, named as ``vllm bench serve`` names them (times in ms).

    ``trace`` is the replayed trace: it gives the requests that never arrived (a time
    limit) and the prefix-reuse upper bound of those that did. ``num_replicas`` and
    ``router`` describe the cluster (figures are over all replicas); ``load_imbalance``
    is computed from the requests' ``replica`` column (``load_imbalance``). With offload
    tiers (the tables have their columns) the offload figures follow
    (``OFFLOAD_SUMMARY_COLUMNS``); ``offload`` is the tiers' settings
    (``ResolvedOffload.describe()``).
    """
    status = requests.column("status").to_numpy(zero_copy_only=False)
    done = status == "finished"
    ttft = requests.column("ttft_s").to_numpy()
    tpot = requests.column("tpot_s").to_numpy()
    e2el = requests.column("e2el_s").to_numpy()
    generated = requests.column("generated_tokens").to_numpy()
    prompt = requests.column("prompt_tokens").to_numpy()
    duration_s = end_time_s
    input_tokens = int(prompt[done].sum())
    output_tokens = int(generated[done].sum())
    met = np.array([slo.met(a, b) for a, b in zip(ttft[done], tpot[done])], dtype=bool)
    step_durations = steps.column("duration_s").to_numpy() if steps.num_rows else np.zeros(0)
    usage = steps.column("kv_cache_usage").to_numpy() if steps.num_rows else np.zeros(0)
    busy_s = float(step_durations.sum())
    queries = int(requests.column("prefix_cache_queries").to_numpy().sum())
    hits = int(requests.column("prefix_cache_hits").to_numpy().sum())
    row: dict[str, Any] = {
        "duration_s": duration_s,
        "num_requests": requests.num_rows,
        "completed": int(done.sum()),
        "rejected": int((status == "rejected").sum()),
        "unfinished": int(((status == "waiting") | (status == "running")).sum()),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": done.sum() / duration_s if duration_s > 0 else math.nan,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else math.nan,
    }
    row.update(_stats(ttft[done], "ttft_ms"))
    row.update(_stats(tpot[done], "tpot_ms"))
    row.update(_stats(np.frombuffer(itl_s, dtype=np.float64) if len(itl_s) else np.zeros(0), "itl_ms"))
    row.update(_stats(e2el[done], "e2el_ms"))
    row.update({
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else math.nan,
        "num_preemptions": int(requests.column("num_preemptions").to_numpy().sum()),
        "recomputed_tokens": int(requests.column("recomputed_tokens").to_numpy().sum()),
        "num_evictions": int(steps.column("num_evictions").to_numpy().sum()) if steps.num_rows else 0,
        "num_steps": steps.num_rows,
        "prefill_tokens": int(steps.column("prefill_tokens").to_numpy().sum()) if steps.num_rows else 0,
        "decode_tokens": int(steps.column("decode_tokens").to_numpy().sum()) if steps.num_rows else 0,
        "busy_time_s": busy_s,
        "kv_cache_usage_peak": float(usage.max()) if usage.size else 0.0,
        # Time-weighted: a step's usage holds for its duration.
        "kv_cache_usage_mean": float((usage * step_durations).sum() / busy_s) if busy_s > 0 else 0.0,
        "slo_ttft_ms": slo.ttft_s * 1000 if slo.ttft_s is not None else math.nan,
        "slo_tpot_ms": slo.tpot_s * 1000 if slo.tpot_s is not None else math.nan,
        "slo_attainment": float(met.mean()) if met.size else math.nan,
        "request_goodput": float(met.sum()) / duration_s if duration_s > 0 else math.nan,
    })
    arrival = requests.column("arrival_time_s").to_numpy()
    scheduled = requests.column("first_scheduled_time_s").to_numpy()
    # A request still waiting at the end has queued at least until then.
    queue_s = np.where(np.isnan(scheduled), end_time_s - arrival, scheduled - arrival)[status != "rejected"]
    row.update(_stats(queue_s, "queue_delay_ms"))
    last_arrival_s = float(arrival.max()) if arrival.size else 0.0
    trace_rows = trace.num_rows if trace is not None else requests.num_rows
    reasons = requests.column("reject_reason").drop_null()
    by_reason = pc.value_counts(reasons.cast(pa.string())).to_pylist() if len(reasons) else []
    has_slo = slo.ttft_s is not None or slo.tpot_s is not None
    queue_p90_s = row["p90_queue_delay_ms"] / 1000 if not math.isnan(row["p90_queue_delay_ms"]) else 0.0
    saturation = _saturation(queue_p90_s, row["slo_attainment"], has_slo, row["completed"], duration_s,
                             last_arrival_s)
    row.update({
        "last_arrival_s": last_arrival_s,
        "num_trace_requests": trace_rows,
        "not_arrived": max(trace_rows - requests.num_rows, 0),
        # Arrivals follow the trace's row order, so the rows that arrived are its first rows.
        "prefix_reuse_upper_bound": _reuse_upper_bound(trace.slice(0, requests.num_rows))
        if trace is not None else math.nan,
        "rejected_by_reason": json.dumps({d["values"]: d["counts"] for d in sorted(by_reason,
                                                                                  key=lambda d: d["values"])}),
        "saturated": bool(saturation),
        "saturation_reason": ",".join(saturation),
        "num_replicas": num_replicas,
        "router": router,
        "load_imbalance": load_imbalance(requests, num_replicas),
    })
    if "cpu_hit_tokens" in requests.column_names:
        row.update(offload_summary(requests, steps, offload))
    return pa.Table.from_pylist([row])


# The summary's offload columns (only in runs with offload tiers), in order.
OFFLOAD_SUMMARY_COLUMNS: dict[str, pa.DataType] = {
    "offload_policy": pa.string(),
    "offload_cpu_bytes": pa.int64(),
    "offload_cpu_chunks": pa.int64(),
    "offload_chunk_bytes": pa.int64(),
    "offload_disk_bytes": pa.int64(),
    "offload_disk_chunks": pa.int64(),
    "gpu_hit_tokens": pa.int64(),
    "cpu_hit_tokens": pa.int64(),
    "disk_hit_tokens": pa.int64(),
    "hit_rate_gpu": pa.float64(),
    "hit_rate_cpu": pa.float64(),
    "hit_rate_disk": pa.float64(),
    "hit_rate_total": pa.float64(),
    "num_loads": pa.int64(),
    "mean_load_wait_ms": pa.float64(),
    "median_load_wait_ms": pa.float64(),
    "p90_load_wait_ms": pa.float64(),
    "p99_load_wait_ms": pa.float64(),
    "mean_load_transfer_ms": pa.float64(),
    "median_load_transfer_ms": pa.float64(),
    "p90_load_transfer_ms": pa.float64(),
    "p99_load_transfer_ms": pa.float64(),
    "kv_offload_load_bytes": pa.int64(),
    "kv_offload_store_bytes": pa.int64(),
    "offload_cpu_loaded_keys": pa.int64(),
    "offload_cpu_stored_keys": pa.int64(),
    "offload_cpu_evicted_keys": pa.int64(),
    "offload_disk_loaded_keys": pa.int64(),
    "offload_disk_stored_keys": pa.int64(),
    "offload_disk_evicted_keys": pa.int64(),
}


def offload_summary(requests: pa.Table, steps: pa.Table, offload: dict | None = None) -> dict:
    """The offload figures of a run (``OFFLOAD_SUMMARY_COLUMNS``): hits per tier at first
    admission over the prompt tokens of the requests admitted, the loads' waits, the
    tiers' traffic (sums of the step columns; a disk column is 0 without a disk tier)."""
    row: dict[str, object] = {name: None for name in OFFLOAD_SUMMARY_COLUMNS}
    row.update(offload or {})
    status = requests.column("status").to_numpy(zero_copy_only=False)
    admitted = ~np.isnan(requests.column("first_scheduled_time_s").to_numpy()) & (status != "rejected")
    prompt = int(requests.column("prompt_tokens").to_numpy()[admitted].sum())
    total = 0
    for tier in ("gpu", "cpu", "disk"):
        hits = int(requests.column(f"{tier}_hit_tokens").to_numpy()[admitted].sum())
        total += hits
        row[f"{tier}_hit_tokens"] = hits
        row[f"hit_rate_{tier}"] = hits / prompt if prompt else math.nan
    row["hit_rate_total"] = total / prompt if prompt else math.nan
    wait = requests.column("load_wait_s").to_numpy()
    row["num_loads"] = int(np.isfinite(wait).sum())
    row.update(_stats(wait, "load_wait_ms"))
    row.update(_stats(requests.column("load_transfer_s").to_numpy(), "load_transfer_ms"))
    names = steps.column_names

    def total_of(column: str) -> int:
        return int(steps.column(column).to_numpy().sum()) if column in names and steps.num_rows else 0

    row["kv_offload_load_bytes"] = total_of("offload_load_bytes")
    row["kv_offload_store_bytes"] = total_of("offload_store_bytes")
    for tier in ("cpu", "disk"):
        for what in ("loaded", "stored", "evicted"):
            row[f"offload_{tier}_{what}_keys"] = total_of(f"offload_{tier}_{what}_keys")
    return row


def routed_counts(requests: pa.Table, num_replicas: int) -> np.ndarray:
    """Requests routed to each replica (every arrival, rejected ones included)."""
    if "replica" not in requests.column_names or requests.num_rows == 0:
        counts = np.zeros(num_replicas, dtype=np.int64)
        counts[0] = requests.num_rows
        return counts
    return np.bincount(requests.column("replica").to_numpy(), minlength=num_replicas)[:num_replicas]


def load_imbalance(requests: pa.Table, num_replicas: int) -> float:
    """Max over replicas of the requests routed there, over the mean (1.0 = even, N = all
    on one of N replicas); NaN when nothing arrived."""
    counts = routed_counts(requests, num_replicas)
    mean = counts.mean() if counts.size else 0.0
    return float(counts.max() / mean) if mean > 0 else math.nan


# Cluster-level columns of ``summarize`` that a per-replica row does not repeat.
_CLUSTER_ONLY = ("num_replicas", "router", "load_imbalance")


def summarize_replicas(requests: pa.Table, steps: pa.Table, itl_by_replica: list[array], slo: SLO,
                       end_time_s: float, *, trace: pa.Table | None = None,
                       cluster_summary: pa.Table | None = None, offload: dict | None = None) -> pa.Table:
    """One row per replica: ``replica``, then ``summarize``'s figures over that replica's
    requests, steps and inter-token latencies (the cluster-only ``num_replicas``,
    ``router`` and ``load_imbalance`` left out), then ``load_ratio`` (requests routed
    there over the mean). Durations and rates use the cluster's ``end_time_s``; a
    replica's trace is the rows routed to it (so ``prefix_reuse_upper_bound`` is the
    reuse available within its own stream, and ``not_arrived`` is 0). With one replica
    the row is ``cluster_summary``'s, if given (the same figures, not computed twice)."""
    num_replicas = len(itl_by_replica)
    if num_replicas == 1 and cluster_summary is not None:
        row = cluster_summary.to_pylist()[0]
        row["not_arrived"] = 0
        row["num_trace_requests"] = requests.num_rows
        for name in _CLUSTER_ONLY:
            del row[name]
        table = pa.Table.from_pylist([{"replica": 0, **row, "load_ratio": 1.0 if requests.num_rows else math.nan}])
        return table.set_column(0, "replica", table.column("replica").cast(pa.int32()))
    counts = routed_counts(requests, num_replicas)
    mean = counts.mean() if counts.size else 0.0
    replica_of_request = (requests.column("replica").to_numpy() if "replica" in requests.column_names
                          else np.zeros(requests.num_rows, np.int32))
    replica_of_step = (steps.column("replica").to_numpy() if "replica" in steps.column_names
                       else np.zeros(steps.num_rows, np.int32))
    arrived = trace.slice(0, requests.num_rows) if trace is not None else None
    rows = []
    for replica in range(num_replicas):
        mine = np.flatnonzero(replica_of_request == replica)
        sub_requests = requests.take(mine)
        sub_steps = steps.take(np.flatnonzero(replica_of_step == replica))
        sub_trace = arrived.take(mine) if arrived is not None else None
        row = summarize(sub_requests, sub_steps, itl_by_replica[replica], slo, end_time_s,
                        trace=sub_trace, offload=offload).to_pylist()[0]
        for name in _CLUSTER_ONLY:
            del row[name]
        rows.append({"replica": replica, **row,
                     "load_ratio": float(counts[replica] / mean) if mean > 0 else math.nan})
    table = pa.Table.from_pylist(rows)
    return table.set_column(0, "replica", table.column("replica").cast(pa.int32()))
