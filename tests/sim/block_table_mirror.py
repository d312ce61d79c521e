"""A test-only model executor that rebuilds the block tables from the scheduler output alone.

BLOCK-TABLE-MIRROR (``docs/invariants.md``): what a device executor will do, kept as
simple as possible so that it can be trusted. Per output, in the order
``scheduler_output.py`` prescribes: drop finished (previous step) and preempted requests;
set a new or resumed request's tables to its ``block_ids``; for a running request apply
the in-place replacements, then the appended blocks. It also mirrors what an executor
needs for positions and sampling (computed tokens, sequence length) from the same stream.

``check(engine, result)`` after each step asserts that the mirror equals the KV cache
manager's tables (``get_block_ids``) for every running request, and holds nothing else but
the requests that finished since the last output (reported with the next output).

Asynchronous scheduling (``EngineCore.step_async``) needs no other rule: outputs reach
the executor in schedule order, and the mirror counts a token as the request's as soon as
a batch that samples it is handed over (vLLM's output placeholders), so its sequence
length is the scheduler's ``num_tokens + num_output_placeholders``. Finished requests
are reported with the next schedule, which may come several steps later (steps that only
update); a request preempted while a batch was in flight can finish from the waiting
queue when that batch's token arrives, and its table was already dropped.

Speculative decoding: a request's drafts (``scheduled_spec_decode_tokens``) are the last of
its scheduled tokens. It sampled ``1 + accepted`` tokens, so ``drafts - accepted`` of its
computed tokens are rolled back: at once when synchronous; asynchronously the batch's
drafts count as tokens in flight (like the scheduler's placeholders) until that batch is
applied (``BatchRecord.updated``), when both counts drop by the rejected drafts.

Pipeline stages with synchronous scheduling (``pipelined``: a batch queue without
placeholders, docs/semantics.md#pipeline-parallelism): a sampled token becomes the
request's when its batch is applied, as the scheduler counts it.
"""

from __future__ import annotations

from kvtwin.sim.core.engine import EngineCore, Execution, ModelExecutor, BatchRecord
from kvtwin.sim.core.scheduler_output import SchedulerOutput

NAME = "BLOCK-TABLE-MIRROR"


def _fail(message: str) -> None:
    raise AssertionError(f"{NAME}: {message}")


class BlockTableMirror:
    def __init__(self, model: ModelExecutor):
        self.model = model  # samples the tokens; the mirror only watches
        self.tables: dict[str, tuple[list[int], ...]] = {}
        self.num_computed_tokens: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.expected_finished: set[str] = set()
        self.dropped_preempted: set[str] = set()  # preempted, not resumed (tables dropped)
        self.num_replacements = 0
        self.num_appends = 0
        # Async with drafts: per batch in flight (its output's id), request -> rejected drafts.
        self.pending_rejections: dict[int, dict[str, int]] = {}
        self.num_rejected = 0
        # Pipelined: per batch in flight (its output's id), request -> tokens it sampled.
        self.pending_tokens: dict[int, dict[str, int]] = {}

    # -- the consumer --------------------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> Execution:
        self.apply(output)
        execution = self.model.execute(output)
        spec = output.scheduled_spec_decode_tokens or {}
        rejections: dict[str, int] = {}
        for rid, tokens in execution.sampled.items():
            drafts = len(spec.get(rid, ()))
            rejected = drafts - (len(tokens) - 1) if drafts else 0
            if self.asynchronous:
                self.num_tokens[rid] += 1 + drafts
                if rejected:
                    rejections[rid] = rejected
            elif self.pipelined:
                self.pending_tokens.setdefault(id(output), {})[rid] = len(tokens)
            else:
                self.num_tokens[rid] += len(tokens)
                self.num_computed_tokens[rid] -= rejected
            self.num_rejected += rejected
        if rejections:
            self.pending_rejections[id(output)] = rejections
        return execution

    asynchronous = False  # set by the driver for an asynchronous engine
    pipelined = False  # set by the driver for a synchronous engine with pipeline stages

    def _apply_sampled(self, result: BatchRecord) -> None:
        """Pipelined: the batch just applied hands its requests their sampled tokens (one
        preempted meanwhile, its table dropped, gets it while waiting)."""
        if result.updated is None:
            return
        for rid, n in self.pending_tokens.pop(id(result.updated), {}).items():
            if rid in self.tables and rid not in self.dropped_preempted:
                self.num_tokens[rid] += n

    def _apply_rejections(self, result: BatchRecord) -> None:
        """Async: the batch just applied rolls back its rejected drafts (a request whose
        table was dropped meanwhile, preempted or finished, has nothing to roll back)."""
        if result.updated is None:
            return
        for rid, rejected in self.pending_rejections.pop(id(result.updated), {}).items():
            if rid in self.tables and rid not in self.dropped_preempted:
                self.num_computed_tokens[rid] -= rejected
                self.num_tokens[rid] -= rejected

    def _drop(self, rid: str, why: str) -> None:
        if rid not in self.tables:
            _fail(f"{why} request {rid} has no table to drop")
        for state in (self.tables, self.num_computed_tokens, self.num_tokens, self.num_prompt_tokens):
            del state[rid]

    def apply(self, output: SchedulerOutput) -> None:
        if set(output.finished_req_ids) != self.expected_finished:
            _fail(f"finished_req_ids {output.finished_req_ids} != finished last step {sorted(self.expected_finished)}")
        self.expected_finished = set()
        for rid in output.finished_req_ids:
            if rid in self.dropped_preempted:  # finished by stale output while waiting (async)
                self.dropped_preempted.discard(rid)
                continue
            self._drop(rid, "finished")
        for rid in output.preempted:
            if rid in output.num_scheduled_tokens:
                _fail(f"preempted request {rid} is also scheduled")
            self._drop(rid, "preempted")
            self.dropped_preempted.add(rid)
        new_ids = set()
        for new in output.scheduled_new_reqs:
            rid = new.req_id
            if rid in self.tables:
                _fail(f"new request {rid} already has a table")
            self.tables[rid] = tuple(list(ids) for ids in new.block_ids)
            self.num_computed_tokens[rid] = new.num_computed_tokens
            self.num_tokens[rid] = new.num_tokens
            self.num_prompt_tokens[rid] = new.num_prompt_tokens
            self.dropped_preempted.discard(rid)
            new_ids.add(rid)
        cached_ids = set(output.cached_req_ids)
        if cached_ids & new_ids:
            _fail(f"requests both new and cached: {sorted(cached_ids & new_ids)}")
        cached = output.scheduled_cached_reqs
        for rid, changes in cached.replaced_block_ids.items():
            # A running request waiting unscheduled for a deferred free gets its changes too.
            if rid in new_ids or rid not in self.tables:
                _fail(f"replacements for {rid}, which is not a running request")
            tables = self.tables[rid]
            for gid, position, block_id in changes:
                if not 0 <= position < len(tables[gid]):
                    _fail(f"{rid} group {gid}: replacement at {position} outside its table of {len(tables[gid])}")
                tables[gid][position] = block_id
                self.num_replacements += 1
        for rid, per_group in cached.new_block_ids.items():
            if rid not in cached_ids:
                _fail(f"appended blocks for {rid}, which is not a scheduled running request")
            tables = self.tables[rid]
            for gid, ids in enumerate(per_group):
                tables[gid].extend(ids)
                self.num_appends += len(ids)
        # Positions and sampling, from the same stream.
        if len(output.num_computed_tokens) != len(output.num_scheduled_tokens):
            _fail("num_computed_tokens is not parallel to num_scheduled_tokens")
        for (rid, n), computed in zip(output.num_scheduled_tokens.items(), output.num_computed_tokens):
            if rid not in self.tables:
                _fail(f"scheduled request {rid} has no table")
            if computed != self.num_computed_tokens[rid]:
                _fail(f"{rid} starts at {computed}, the mirror says {self.num_computed_tokens[rid]}")
            computed += n
            self.num_computed_tokens[rid] = computed
            samples = computed >= self.num_tokens[rid]
            if samples != (rid in output.num_output_tokens):
                _fail(f"{rid} computes to {computed} of {self.num_tokens[rid]} tokens; sampling: "
                      f"{rid in output.num_output_tokens}")
            if samples and output.num_output_tokens[rid] != self.num_tokens[rid] - self.num_prompt_tokens[rid]:
                _fail(f"{rid} samples output {output.num_output_tokens[rid]}, the mirror says "
                      f"{self.num_tokens[rid] - self.num_prompt_tokens[rid]}")
        if set(output.num_output_tokens) - set(output.num_scheduled_tokens):
            _fail("a request samples without being scheduled")

    # -- the check -------------------------------------------------------------------------

    def check(self, engine: EngineCore, result: BatchRecord) -> None:
        self._apply_rejections(result)
        self._apply_sampled(result)
        kvm = engine.kv_cache_manager
        if kvm.replaced_block_ids:
            # A running request whose allocation failed is scheduled in the same step,
            # preempted, or waits with its changes delivered: none may wait past the step.
            _fail(f"in-place changes left undelivered: {kvm.replaced_block_ids}")
        running = {r.request_id: r for r in engine.scheduler.running}
        finished = {r.request_id for r in result.finished}
        if finished & running.keys():
            _fail(f"finished requests still running: {sorted(finished & running.keys())}")
        # Finished since the last output (several steps' worth under async scheduling).
        finished |= self.expected_finished
        if self.tables.keys() != running.keys() | (finished - self.dropped_preempted):
            _fail(f"mirror holds {sorted(self.tables)}, running {sorted(running)}, just finished {sorted(finished)}")
        for rid, request in running.items():
            actual = kvm.get_block_ids(rid)
            if tuple(self.tables[rid]) != actual:
                _fail(f"{rid}: mirror {self.tables[rid]} != manager {actual}")
            if self.num_computed_tokens[rid] != request.num_computed_tokens:
                _fail(f"{rid}: mirror computed {self.num_computed_tokens[rid]} != {request.num_computed_tokens}")
            # Async: tokens being sampled in flight count (0 placeholders when synchronous).
            if self.num_tokens[rid] != request.num_tokens + request.num_output_placeholders:
                _fail(f"{rid}: mirror num_tokens {self.num_tokens[rid]} != {request.num_tokens} + "
                      f"{request.num_output_placeholders} placeholders")
        self.expected_finished = finished
