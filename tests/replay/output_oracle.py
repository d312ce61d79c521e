"""A second, independent computation of a replay's output tables, for the oracle tests.

``replay`` runs a handful of requests on tiny engines (blocks of 4 tokens, a pool of a few
dozen blocks) through the real clock (``run_simulation``) with an executor whose step
times and tokens are known, and logs what the recorder is handed (each applied batch: its
times, its scheduler output, its sampled tokens, the engine's pool after it) and, at
schedule time, each admitted request's length. ``OracleRun`` then recomputes every column
of requests.parquet, steps.parquet and summary.parquet from that log and the trace alone,
following ``reports/SCHEMA.md``'s definitions with NumPy — never from the recorder's own
tables — so a test compares the two value by value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.hashing import TokenPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.arrivals import Arrival
from kvtwin.sim.replay.clock.cluster import run_simulation
from kvtwin.sim.replay.clock.replica import Replica
from kvtwin.sim.replay.cost_model import StepCost
from kvtwin.sim.replay.recorder import MetricsRecorder
from kvtwin.sim.replay.router import make_router
from kvtwin.sim.replay.run_tables import RunSettings, run_tables
from kvtwin.sim.scenario.slo import SLO
from kvtwin.traces.schema import TRACE_SCHEMA
from tests.sim.builders import full, kv_config

BLOCK_TOKENS = 4


@dataclass
class TraceRequest:
    """One request of an in-test trace: its arrival, prompt token ids and ``max_tokens``."""

    request_id: str
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Batch:
    """What one ``on_batch_applied`` call was handed, copied at once."""

    replica: int
    scheduled_s: float
    start_s: float
    end_s: float
    synchronous: bool
    num_scheduled: dict[str, int]
    num_computed: list[int]
    admitted: list[tuple[str, int]]  # (request id, hit tokens)
    preempted: list[str]
    sampled: dict[str, list[int]]
    finished: list[str]
    spec: dict[str, list[int]] | None
    free_blocks: int
    cached_blocks: int
    running: int
    waiting: int
    evictions_total: int
    cost: StepCost | None


class KnownExecutor:
    """Step time 10 ms + 1 ms per token + 0.5 ms per request (so steps differ and a
    per-step mean differs from a time-weighted one), a ``StepCost`` whose parts are fixed
    shares of it, tokens unique per request and position. With drafts, a verify of ``d``
    drafts accepts ``accept(n) % (d + 1)`` of them, ``n`` counting its verify steps."""

    def __init__(self, admitted_lengths: dict[str, list[int]], requests: dict[str, Request],
                 synchronous_drafts: int = 0):
        self.admitted_lengths = admitted_lengths
        self.requests = requests
        self.synchronous_drafts = synchronous_drafts
        self.verifies: dict[str, int] = {}

    @staticmethod
    def duration_s(num_tokens: int, num_requests: int) -> float:
        return 0.010 + 0.001 * num_tokens + 0.0005 * num_requests

    def execute(self, output):
        # Called when the batch is scheduled, right after its admissions' prefix lookups:
        # the request's length now is what a lookup queried (vLLM's request.num_tokens).
        for new in output.scheduled_new_reqs:
            self.admitted_lengths.setdefault(new.req_id, []).append(self.requests[new.req_id].num_tokens)
        if not output.num_scheduled_tokens:
            return Execution({}, 0.0)
        spec = output.scheduled_spec_decode_tokens or {}
        admitted = {new.req_id for new in output.scheduled_new_reqs}
        sampled = {}
        for request_id, index in output.num_output_tokens.items():
            base = (int(request_id.strip("rq")) + 1) * 100_000 + index
            drafts = spec.get(request_id)
            accepted = 0
            if drafts and request_id not in admitted:
                n = self.verifies[request_id] = self.verifies.get(request_id, 0) + 1
                accepted = n % (len(drafts) + 1)
            sampled[request_id] = [base + i for i in range(1 + accepted)]
        tokens = sum(output.num_scheduled_tokens.values())
        total = self.duration_s(tokens, len(output.num_scheduled_tokens))
        cost = StepCost(total, 0.5 * total, 0.25 * total, 0.125 * total, 0.125 * total, 0.0, 0.0, 0.0, 0.0, 0.0,
                        len(output.num_scheduled_tokens))
        drafts_out = None
        if self.synchronous_drafts:
            drafts_out = {rid: [-1] * self.synchronous_drafts for rid in output.num_output_tokens}
        return Execution(sampled, total, cost, drafts_out)


@dataclass
class Replay:
    """A replay's recorder tables and summaries, and the log the oracle recomputes them from."""

    trace: list[TraceRequest]
    requests: pa.Table
    steps: pa.Table
    summary: pa.Table
    replicas: pa.Table
    end_s: float
    batches: list[Batch]
    admitted_lengths: dict[str, list[int]]
    generated: dict[str, int]
    rejected: set[str]
    replica_of: dict[str, int]
    num_blocks: int
    num_replicas: int
    num_speculative_tokens: int
    slo: SLO
    max_model_len: int
    itl_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    client_overhead_s: float = 0.0


def trace_table(trace: list[TraceRequest]) -> pa.Table:
    """The trace as a trace table whose identity is chained hashes of ``BLOCK_TOKENS``-token
    blocks (the last one partial): one id per distinct prompt prefix ending at a block end."""
    ids: dict[tuple[int, ...], int] = {}
    rows = []
    for t in trace:
        ends = [min(end, len(t.prompt)) for end in range(BLOCK_TOKENS, len(t.prompt) + BLOCK_TOKENS, BLOCK_TOKENS)]
        hashes = [ids.setdefault(tuple(t.prompt[:end]), len(ids) + 1) for end in ends]
        rows.append({"request_id": t.request_id, "arrival_time_s": t.arrival_s, "prompt_tokens": len(t.prompt),
                     "output_tokens": t.max_tokens, "session_id": None, "turn": None, "priority": None,
                     "block_hashes": hashes, "hash_block_tokens": BLOCK_TOKENS, "prompt_token_ids": None})
    return pa.Table.from_pylist(rows, schema=TRACE_SCHEMA)


def replay(trace: list[TraceRequest], *, num_blocks: int = 40, async_scheduling: bool = True,
           max_num_batched_tokens: int = 64, num_replicas: int = 1, slo: SLO = SLO(ttft_s=0.08, tpot_s=0.025),
           num_speculative_tokens: int = 0, max_model_len: int = 96, time_limit_s: float | None = None,
           caching: bool = True, client_overhead_s: float = 0.0) -> Replay:
    """Run ``trace`` on ``num_replicas`` tiny engines (round robin) and log every batch;
    ``client_overhead_s`` is the calibration's time outside the engine."""
    scheduler = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                async_scheduling=async_scheduling, num_speculative_tokens=num_speculative_tokens)
    engines = [EngineCore(kv_config(full(BLOCK_TOKENS), num_blocks=num_blocks), scheduler,
                          CacheConfig(enable_prefix_caching=caching)) for _ in range(num_replicas)]
    requests = {t.request_id: Request(t.request_id, TokenPrompt(list(t.prompt)), t.max_tokens,
                                      arrival_time=t.arrival_s) for t in trace}
    admitted_lengths: dict[str, list[int]] = {}
    sync_drafts = num_speculative_tokens if not async_scheduling else 0
    executors = [KnownExecutor(admitted_lengths, requests, sync_drafts) for _ in engines]
    batches: list[Batch] = []
    replica_of: dict[str, int] = {}

    class LoggingRecorder(MetricsRecorder):
        def arrived(self, request, arrival_s, session_id=None, replica=0):
            replica_of[request.request_id] = replica
            super().arrived(request, arrival_s, session_id, replica)

        def on_batch_applied(self, result, times, replica=0, synchronous=False):
            out = result.output
            pool = engines[replica].kv_cache_manager.block_pool
            batches.append(Batch(
                replica, times.scheduled_s, times.start_s, times.end_s, synchronous,
                dict(out.num_scheduled_tokens), list(out.num_computed_tokens),
                [(new.req_id, new.hit_tokens) for new in out.scheduled_new_reqs], list(out.preempted),
                {rid: list(tokens) for rid, tokens in result.execution.sampled.items()},
                [r.request_id for r in result.finished],
                {rid: list(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
                if out.scheduled_spec_decode_tokens is not None else None,
                pool.get_num_free_blocks(), pool.num_cached_blocks(),
                len(engines[replica].scheduler.running), len(engines[replica].scheduler.waiting),
                result.stats.num_evictions, result.execution.cost))
            return super().on_batch_applied(result, times, replica, synchronous)

    metrics = LoggingRecorder(1, num_replicas, num_speculative_tokens=num_speculative_tokens)
    arrivals = [Arrival(t.arrival_s, requests[t.request_id]) for t in trace]
    router = make_router("round_robin", engines) if num_replicas > 1 else None
    end_s = run_simulation([Replica(e, x) for e, x in zip(engines, executors)], arrivals, metrics, router=router,
                           time_limit_s=time_limit_s)
    tables = run_tables(metrics, end_s, RunSettings(slo, trace_table(trace), "round_robin", "0", client_overhead_s))
    requests_table, steps_table, summary, replicas = tables.requests, tables.steps, tables.summary, tables.replicas
    rejected = {rid for e in engines for rid in (r.request.request_id for r in e.rejected)}
    return Replay(trace, requests_table, steps_table, summary, replicas, end_s, batches, admitted_lengths,
                  {rid: r.num_output_tokens for rid, r in requests.items()}, rejected, replica_of, num_blocks,
                  num_replicas, num_speculative_tokens, slo, max_model_len, np.frombuffer(metrics.all_itl_s(), dtype=np.float64),
                  client_overhead_s)


# -- the oracle -----------------------------------------------------------------------------


def _nan_stats(values: np.ndarray, prefix: str) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds, as vllm bench serve reports them."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return {f"{s}_{prefix}": math.nan for s in ("mean", "median", "p90", "p99")}
    # Percentiles by linear interpolation between order statistics (NumPy's default and
    # vllm bench serve's), written out rather than asked of the code under test.
    ordered = np.sort(values)

    def percentile(q: float) -> float:
        rank = q / 100 * (ordered.size - 1)
        low = int(math.floor(rank))
        high = min(low + 1, ordered.size - 1)
        return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))

    return {f"mean_{prefix}": float(values.sum() / values.size) * 1000, f"median_{prefix}": percentile(50) * 1000,
            f"p90_{prefix}": percentile(90) * 1000, f"p99_{prefix}": percentile(99) * 1000}


class OracleRun:
    """Every column recomputed from a ``Replay``'s log (optionally only ``replica``'s share)."""

    def __init__(self, run: Replay, replica: int | None = None):
        self.run = run
        self.replica = replica
        # A time limit may stop the run before the last requests arrive: they are no rows.
        arrived = [t for t in run.trace if t.request_id in run.replica_of]
        trace = arrived if replica is None else [t for t in arrived if run.replica_of[t.request_id] == replica]
        self.trace = trace
        self.request_rows = [self._request(t) for t in trace]
        self.step_rows = self._steps()

    # A request's life from the batches it was in.
    def _request(self, t: TraceRequest) -> dict:
        rid = t.request_id
        first_scheduled = first_token = finish = last_token = math.nan
        hits: list[int] = []
        scheduled = preemptions = 0
        token_times: list[float] = []
        done = running = False
        for b in self.run.batches:
            for admitted, hit in b.admitted:
                if admitted == rid:
                    hits.append(hit)
                    running = True
                    if math.isnan(first_scheduled):
                        first_scheduled = b.scheduled_s
            scheduled += b.num_scheduled.get(rid, 0)
            preemptions += b.preempted.count(rid)
            running = running and rid not in b.preempted
            # A token applied after the request finished (a batch in flight with drafts) is dropped.
            if b.sampled.get(rid) and not done:
                token_times.append(b.end_s)
            if rid in b.finished:
                done = True
                finish = b.end_s
        rejected = rid in self.run.rejected
        reason = None
        if rejected:  # SCHEMA's codes: no room for output at all, or not room for all of it
            reason = ("prompt_too_long" if len(t.prompt) >= self.run.max_model_len
                      else "exceeds_max_model_len")
        generated = self.run.generated[rid]
        if token_times:
            first_token = token_times[0]
        # The engine's state when the run stopped: admitted (at schedule time, which a batch still
        # in flight at a time limit did) more often than preempted is running.
        running = running or len(self.run.admitted_lengths.get(rid, [])) > preemptions
        status = "rejected" if rejected else "finished" if done else "running" if running else "waiting"
        prompt = len(t.prompt)
        first_hit = hits[0] if hits else 0
        # SCHEMA: beyond one pass over the prompt (less its first hit) and its outputs
        # (the last output token is never fed back).
        recomputed = max(scheduled - (prompt - first_hit) - max(generated - 1, 0), 0) if scheduled else 0
        return {
            "request_id": rid, "session_id": None, "status": status,
            "reject_reason": reason,
            "arrival_time_s": t.arrival_s, "first_scheduled_time_s": first_scheduled,
            "first_token_time_s": first_token, "finish_time_s": finish, "prompt_tokens": prompt,
            "output_tokens": t.max_tokens, "generated_tokens": generated, "prefix_hit_tokens": first_hit,
            # vLLM's PrefixCacheStats: request.num_tokens at each lookup that admitted it.
            # (Only the admissions of batches applied before the run stopped.)
            "prefix_cache_queries": sum(self.run.admitted_lengths.get(rid, [])[:len(hits)]),
            "prefix_cache_hits": sum(hits), "num_preemptions": preemptions, "scheduled_tokens": scheduled,
            "recomputed_tokens": recomputed, "ttft_s": first_token - t.arrival_s,
            "tpot_s": (finish - first_token) / (generated - 1) if generated > 1 and done else math.nan,
            "e2el_s": finish - t.arrival_s, "replica": self.run.replica_of[rid],
            # A client waits for the time outside the engine too, before its first token
            # and so before its last (docs/capacity.md#client-side-latency).
            "ttft_client_s": first_token - t.arrival_s + self.run.client_overhead_s,
            "e2el_client_s": finish - t.arrival_s + self.run.client_overhead_s,
            "_token_times": token_times, **self._spec_of(rid),
        }

    def _spec_of(self, rid: str) -> dict:
        if not self.run.num_speculative_tokens:
            return {}
        drafts = accepted = verifies = 0
        done = False
        for b in self.run.batches:
            tokens = b.sampled.get(rid)
            d = len((b.spec or {}).get(rid) or [])
            if d and tokens and not done:
                drafts += d
                accepted += len(tokens) - 1
                verifies += 1
            done = done or rid in b.finished
        return {"draft_tokens": drafts, "accepted_draft_tokens": accepted, "verify_steps": verifies}

    def _steps(self) -> list[dict]:
        prompt = {t.request_id: len(t.prompt) for t in self.run.trace}
        rows = []
        evictions_before = [0] * self.run.num_replicas
        finished_before: set[str] = set()
        usable = self.run.num_blocks - 1  # the null block is never handed out
        for b in self.run.batches:
            # Synchronously every step is a row; asynchronously a batch that computed and
            # preempted nothing is none.
            wrote = b.synchronous or bool(b.num_scheduled) or bool(b.preempted)
            sampled_live = {rid for rid, tok in b.sampled.items() if tok and rid not in finished_before}
            finished_before.update(b.finished)
            if not wrote:
                continue
            # Evictions since the replica's previous row.
            evictions = b.evictions_total - evictions_before[b.replica]
            evictions_before[b.replica] = b.evictions_total
            if self.replica is not None and b.replica != self.replica:
                continue
            prefill = decode = 0
            by_position = [0] * self.run.num_speculative_tokens
            for (rid, n), computed in zip(b.num_scheduled.items(), b.num_computed):
                drafts = len((b.spec or {}).get(rid) or [])
                # A decode is a request past its prompt given 1 (+ its drafts) tokens; a
                # one-token chunk that ends a prompt or a recompute is prefill.
                if n == 1 + drafts and computed >= prompt[rid]:
                    decode += n
                else:
                    prefill += n
                if drafts and rid in sampled_live:
                    for position in range(len(b.sampled[rid]) - 1):
                        by_position[position] += 1
            cost = b.cost
            rows.append({
                "time_s": b.start_s, "duration_s": b.end_s - b.start_s, "num_running": b.running,
                "num_waiting": b.waiting, "num_scheduled_reqs": len(b.num_scheduled), "prefill_tokens": prefill,
                "decode_tokens": decode, "num_admitted": len(b.admitted), "num_preempted": len(b.preempted),
                "num_finished": len(b.finished), "num_free_blocks": b.free_blocks,
                "num_cached_blocks": b.cached_blocks, "kv_cache_usage": 1 - b.free_blocks / usable,
                "kv_cache_usage_by_group": [1 - b.free_blocks / usable], "num_evictions": evictions,
                "compute_s": cost.compute_s if cost else math.nan, "memory_s": cost.memory_s if cost else math.nan,
                "communication_s": cost.communication_s if cost else math.nan,
                "overhead_s": cost.overhead_s if cost else math.nan, "replica": b.replica,
                "_by_position": by_position,
            })
        for i, row in enumerate(rows):
            row["step"] = i
        return rows

    def reuse_upper_bound(self) -> float:
        """An infinite cache's share of the arrived prompts' tokens: each prompt's leading
        blocks (the last one partial) whose content some earlier request's blocks had."""
        seen: set[tuple[int, ...]] = set()
        reused = total = 0
        for t in self.trace:
            blocks = [tuple(t.prompt[:end]) for end in range(BLOCK_TOKENS, len(t.prompt) + BLOCK_TOKENS, BLOCK_TOKENS)]
            run = 0
            while run < len(blocks) and blocks[run] in seen:
                run += 1
            reused += min(run * BLOCK_TOKENS, len(t.prompt))
            total += len(t.prompt)
            seen.update(blocks)
        return reused / total if total else 0.0

    def itl_s(self) -> np.ndarray:
        """Every gap between consecutive tokens (streamed chunks) of a request."""
        gaps = [np.diff(r["_token_times"]) for r in self.request_rows]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def summary(self) -> dict:
        """summary.parquet's row, recomputed from the request and step rows (SCHEMA.md)."""
        r = self.request_rows
        s = self.step_rows
        end = self.run.end_s
        done = [x for x in r if x["status"] == "finished"]

        def col(rows, name):
            return np.array([x[name] for x in rows], dtype=float)

        inp = int(sum(x["prompt_tokens"] for x in done))
        out = int(sum(x["generated_tokens"] for x in done))
        queries = sum(x["prefix_cache_queries"] for x in r)
        hits = sum(x["prefix_cache_hits"] for x in r)
        durations = col(s, "duration_s")
        usage = col(s, "kv_cache_usage")
        row = {
            "duration_s": end, "num_requests": len(r), "completed": len(done),
            "rejected": sum(x["status"] == "rejected" for x in r),
            "unfinished": sum(x["status"] in ("waiting", "running") for x in r),
            "total_input_tokens": inp, "total_output_tokens": out,
            "request_throughput": len(done) / end, "output_throughput": out / end,
            "total_token_throughput": (inp + out) / end,
            **_nan_stats(col(done, "ttft_s"), "ttft_ms"), **_nan_stats(col(done, "tpot_s"), "tpot_ms"),
            **_nan_stats(self.itl_s(), "itl_ms"), **_nan_stats(col(done, "e2el_s"), "e2el_ms"),
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else math.nan,
            "num_preemptions": sum(x["num_preemptions"] for x in r),
            "recomputed_tokens": sum(x["recomputed_tokens"] for x in r),
            "num_evictions": int(sum(x["num_evictions"] for x in s)), "num_steps": len(s),
            "prefill_tokens": int(sum(x["prefill_tokens"] for x in s)),
            "decode_tokens": int(sum(x["decode_tokens"] for x in s)),
            "busy_time_s": float(durations.sum()),
            "kv_cache_usage_peak": float(usage.max()) if usage.size else 0.0,
            # Each step's usage holds for its duration.
            "kv_cache_usage_mean": float(np.dot(usage, durations) / durations.sum()) if s else 0.0,
        }
        slo = self.run.slo
        met = 0
        for x in done:
            # TPOT is undefined for a single output token: only the TTFT bound applies.
            # The SLO is a client's: judged on the TTFT a client measures.
            ttft_ok = slo.ttft_s is None or x["ttft_client_s"] <= slo.ttft_s
            tpot_ok = slo.tpot_s is None or math.isnan(x["tpot_s"]) or x["tpot_s"] <= slo.tpot_s
            met += ttft_ok and tpot_ok
        arrived = len(r)
        queue = [(x["first_scheduled_time_s"] if not math.isnan(x["first_scheduled_time_s"]) else end)
                 - x["arrival_time_s"] for x in r if x["status"] != "rejected"]
        last_arrival = max((x["arrival_time_s"] for x in r), default=0.0)
        row.update({
            "slo_ttft_ms": slo.ttft_s * 1000 if slo.ttft_s is not None else math.nan,
            "slo_tpot_ms": slo.tpot_s * 1000 if slo.tpot_s is not None else math.nan,
            "slo_attainment": met / arrived, "rejected_share": row["rejected"] / arrived,
            "request_goodput": met / end, **_nan_stats(np.array(queue, dtype=float), "queue_delay_ms"),
            "last_arrival_s": last_arrival,
            # A replica's trace is the requests routed to it; the cluster's the whole trace.
            "num_trace_requests": len(self.run.trace) if self.replica is None else len(r),
            "not_arrived": len(self.run.trace) - len(r) if self.replica is None else 0,
            "prefix_reuse_upper_bound": self.reuse_upper_bound(),
        })
        reasons = []
        if (row["p90_queue_delay_ms"] if not math.isnan(row["p90_queue_delay_ms"]) else 0.0) > 60_000:
            reasons.append("queueing")
        admitted = arrived - row["rejected"]
        if (slo.ttft_s is not None or slo.tpot_s is not None) and admitted and met / admitted < 0.5:
            reasons.append("slo")
        if len(done) and end > 1.5 * max(last_arrival, 1.0) and end - last_arrival > 60:
            reasons.append("drain")
        sustained = sustained_columns(r, end)
        reasons += [x for x in sustained["sustained_reason"].split(",") if x and x != "short_window"]
        row.update(sustained)
        by_reason: dict[str, int] = {}
        for x in r:
            if x["reject_reason"]:
                by_reason[x["reject_reason"]] = by_reason.get(x["reject_reason"], 0) + 1
        routed = [sum(self.run.replica_of[x["request_id"]] == k for x in r) for k in range(self.run.num_replicas)]
        row.update({"rejected_by_reason": by_reason, "saturated": bool(reasons),
                    "saturation_reason": ",".join(reasons), "num_replicas": self.run.num_replicas,
                    "router": "round_robin",
                    "load_imbalance": max(routed) / (sum(routed) / len(routed)) if sum(routed) else math.nan})
        if self.run.num_speculative_tokens:
            drafts = sum(x["draft_tokens"] for x in r)
            accepted = sum(x["accepted_draft_tokens"] for x in r)
            verifies = sum(x["verify_steps"] for x in r)
            positions = np.sum([x["_by_position"] for x in s], axis=0)
            row.update({"spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
                        "spec_acceptance_rate": accepted / drafts if drafts else math.nan,
                        "mean_acceptance_length": 1 + accepted / verifies if verifies else math.nan,
                        "spec_acceptance_by_position": [p / verifies for p in positions]})
        # The client-side figures: the finished requests' client TTFT and E2E, and the
        # overhead itself.
        for name in ("ttft_client", "e2el_client"):
            row.update(_nan_stats(col(done, f"{name}_s"), f"{name}_ms"))
        row["client_overhead_ms"] = self.run.client_overhead_s * 1000
        return row


def assert_same(actual: dict, expected: dict, names, where: str = "") -> None:
    """Each name's value equal (floats to 1e-12 relative, NaN equal to NaN)."""
    for name in names:
        a, e = actual[name], expected[name]
        if isinstance(e, float) and math.isnan(e):
            assert a is None or (isinstance(a, float) and math.isnan(a)), f"{where}{name}: {a} != NaN"
        elif isinstance(e, float):
            assert a == pytest.approx(e, rel=1e-12, abs=1e-15), f"{where}{name}: {a} != {e}"
        elif isinstance(e, list) and e and isinstance(e[0], float):
            assert a == pytest.approx(e, rel=1e-12), f"{where}{name}: {a} != {e}"
        else:
            assert a == e, f"{where}{name}: {a!r} != {e!r}"


def sustained_columns(rows: list[dict], end: float) -> dict:
    """summary.parquet's sustained-load columns, from SCHEMA.md's words: over the requests
    not rejected, the window from 20% to 80% of the arrival span; each request in the system
    from its arrival to its finish (the run's end when unfinished)."""
    stays = [(x["arrival_time_s"], x["finish_time_s"] if x["status"] == "finished" else end,
              x["first_scheduled_time_s"], x["status"] == "finished") for x in rows if x["status"] != "rejected"]
    services = sorted(leave - scheduled for _, leave, scheduled, finished in stays if finished)
    n = len(services)
    median = (services[n // 2] if n % 2 else (services[n // 2 - 1] + services[n // 2]) / 2) if n else math.nan
    if not stays:
        return {"sustained": False, "sustained_reason": "short_window", "steady_window_s": 0.0,
                "steady_arrival_rate": math.nan, "steady_completion_rate": math.nan, "steady_queue_growth": math.nan,
                "drain_s": math.nan, "steady_median_service_s": median}
    first = min(a for a, _, _, _ in stays)
    last = max(a for a, _, _, _ in stays)
    lo, hi = first + 0.2 * (last - first), first + 0.8 * (last - first)
    width = hi - lo
    arrived = sum(lo < a <= hi for a, _, _, _ in stays)
    finished = sum(lo < leave <= hi for _, leave, _, f in stays if f)

    def occupancy(u: float, v: float) -> float:
        # Time in the system inside [u, v], summed over requests, over the interval's length.
        return sum(max(0.0, min(leave, v) - max(a, u)) for a, leave, _, _ in stays) / (v - u)

    growth = occupancy(hi - width / 4, hi) - occupancy(lo, lo + width / 4) if width > 0 else math.nan
    drain = max(end - last, 0.0)
    if arrived < 200 or width <= 0 or width < 5 * (median if not math.isnan(median) else 0.0):
        reasons = ["short_window"]
    else:
        reasons = [name for name, failed in (("falling_behind", finished < 0.9 * arrived),
                                              ("queue_growth", growth > 0.1 * arrived),
                                              ("long_drain", drain > 0.25 * (last - first))) if failed]
    return {"sustained": not reasons, "sustained_reason": ",".join(reasons), "steady_window_s": width,
            "steady_arrival_rate": arrived / width if width > 0 else math.nan,
            "steady_completion_rate": finished / width if width > 0 else math.nan,
            "steady_queue_growth": growth, "drain_s": drain, "steady_median_service_s": median}
