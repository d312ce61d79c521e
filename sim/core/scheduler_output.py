"""What one scheduler step decided: the contract between the scheduler and a model executor.

vLLM ``v1/core/sched/output.py``. An executor runs the step from this object alone, with no
access to the scheduler's requests: it keeps an exact copy of every running request's
block table per KV cache group, as vLLM's GPU model runner does from its own output, and
learns each scheduled request's positions and whether it samples.

With asynchronous scheduling (two batches in flight) outputs still reach the executor in
schedule order and the rules below are unchanged; a request's sequence length then counts
the tokens being sampled in flight (its placeholders), and ``finished_req_ids`` lists what
finished in the updates since the previous schedule.

Keeping the tables, in this order, once per output:

1. drop the tables of ``finished_req_ids`` (requests that finished at the end of the
   previous step: the scheduler frees them in ``update_from_output``, after this step's
   output was made, so they are reported with the next one, as vLLM does; the caller of
   ``EngineCore.step`` also sees them at once in ``BatchRecord.finished``) and of
   ``preempted`` (a preempted request is never also scheduled in that step);
2. every ``scheduled_new_reqs`` entry (a new request, or a preempted one resumed) sets the
   request's tables to its ``block_ids``: the whole table after allocation, the null block
   as id 0 where a position is skipped, so positions line up with token positions;
3. every request in ``scheduled_cached_reqs`` (already running) first applies its
   ``replaced_block_ids``, ``(group id, position, new block id)`` triples in the order made
   (positions changed in place: windowed blocks that slid out, Mamba state blocks moved or
   released, all of them the null block today; every such position exists before this
   step's appends), then appends its ``new_block_ids``. A request absent from both dicts
   kept its tables. A running request may have replacements without being scheduled (below).

``EngineCore.step`` hands the executor every output that has something in it, also one
that computes nothing but drops tables. In-place changes made by an allocation that failed
(skipped blocks are released before the capacity check) are reported with the request's
successful allocation later in the same step, or moot because it was preempted, or, when it
stays running unscheduled because the blocks a preemption would free are still read by a
batch in flight (a KV connector's deferred free), reported in this output without a
schedule: every change reaches the executor in the step that made it.

Block ids are made when first read, from the blocks the scheduler kept (a snapshot of a
new request's table, the lists an allocation returned; a block's id never changes), so a
consumer that never reads them, such as the cost model, pays nothing for them.

Positions: request ``num_scheduled_tokens`` keys, in order (running requests in running
order, then admissions), with ``num_computed_tokens`` at the same index giving the tokens
already computed when the step starts; the step computes positions ``[computed, computed +
scheduled)``. Requests in ``num_output_tokens`` sample one token at the end of the step;
the value is how many output tokens they have so far, those still being sampled in flight
included (the index of the one they sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from kvtwin.sim.core.hashing import PromptSource
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks


class KVConnectorMetadata:
    """What a KV connector hands the worker with one step (vLLM's base class of the same
    name); each connector's metadata subclasses it."""


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request taken from the waiting queue into the running queue in this step."""

    req_id: str
    blocks: KVCacheBlocks  # a snapshot of the whole table per group after allocation
    num_computed_tokens: int  # where computing starts: the prefix hit
    num_prompt_tokens: int
    num_tokens: int  # prompt plus the outputs it kept from before a preemption
    hit_tokens: int  # the local prefix-cache hit (metrics; equals num_computed_tokens today)
    resumed: bool  # re-admitted after a preemption
    # The prompt's identity (token ids or a trace's chained hash ids; a reference, nothing
    # is copied): an executor derives the token ids it feeds the model from it.
    prompt: PromptSource | None = None

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        """The table's block ids per group (made afresh on every read)."""
        return self.blocks.get_block_ids()


@dataclass(slots=True)
class CachedRequestData:
    """Table changes of already-running requests scheduled this step; only those whose
    tables changed appear (the usual decode step adds nothing here)."""

    # request id -> blocks appended per group (see new_block_ids)
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    # request id -> (group id, position, new block id) changed in place; apply before appending
    replaced_block_ids: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    _new_block_ids: dict[str, tuple[list[int], ...]] | None = None

    # Spelled out (one is made every step): a compiled dataclass keeps the generated
    # __init__, which runs as Python. None stands for a fresh empty container.
    def __init__(self, new_blocks: dict[str, KVCacheBlocks] | None = None,
                 replaced_block_ids: dict[str, list[tuple[int, int, int]]] | None = None,
                 _new_block_ids: dict[str, tuple[list[int], ...]] | None = None):
        self.new_blocks = {} if new_blocks is None else new_blocks
        self.replaced_block_ids = {} if replaced_block_ids is None else replaced_block_ids
        self._new_block_ids = _new_block_ids

    @property
    def new_block_ids(self) -> dict[str, tuple[list[int], ...]]:
        """Request id -> block ids appended per group (made on first read)."""
        if self._new_block_ids is None:
            self._new_block_ids = {rid: blocks.get_block_ids() for rid, blocks in self.new_blocks.items()}
        return self._new_block_ids


@dataclass(slots=True)
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # running order, then admissions
    # Parallel to num_scheduled_tokens: tokens computed when the step starts.
    num_computed_tokens: list[int] = field(default_factory=list)
    # Requests that sample at the end of the step -> their output tokens so far.
    num_output_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    preempted: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # finished at the end of the previous step
    # With a KV connector: the step's jobs for the worker; None without one.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # With an offload tier, for metrics (the executor ignores it): per admission that loads
    # from the tier, (request id, GPU hit tokens, loaded tokens, loaded tokens per tier).
    external_hits: list | None = None
    # Speculative decoding: request id -> the draft tokens this step verifies (they are the
    # last ``len`` of its scheduled tokens; -1 ids are placeholders). None when drafts are off.
    scheduled_spec_decode_tokens: dict[str, list[int]] | None = None

    # Spelled out, as CachedRequestData's; None stands for a fresh empty container.
    def __init__(self, num_scheduled_tokens: dict[str, int] | None = None, num_computed_tokens: list[int] | None = None,
                 num_output_tokens: dict[str, int] | None = None,
                 scheduled_new_reqs: list[NewRequestData] | None = None,
                 scheduled_cached_reqs: CachedRequestData | None = None, preempted: list[str] | None = None,
                 finished_req_ids: list[str] | None = None,
                 kv_connector_metadata: KVConnectorMetadata | None = None, external_hits: list | None = None,
                 scheduled_spec_decode_tokens: dict[str, list[int]] | None = None):
        self.num_scheduled_tokens = {} if num_scheduled_tokens is None else num_scheduled_tokens
        self.num_computed_tokens = [] if num_computed_tokens is None else num_computed_tokens
        self.num_output_tokens = {} if num_output_tokens is None else num_output_tokens
        self.scheduled_new_reqs = [] if scheduled_new_reqs is None else scheduled_new_reqs
        self.scheduled_cached_reqs = CachedRequestData() if scheduled_cached_reqs is None else scheduled_cached_reqs
        self.preempted = [] if preempted is None else preempted
        self.finished_req_ids = [] if finished_req_ids is None else finished_req_ids
        self.kv_connector_metadata = kv_connector_metadata
        self.external_hits = external_hits
        self.scheduled_spec_decode_tokens = scheduled_spec_decode_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def cached_req_ids(self) -> list[str]:
        """The running requests scheduled this step (admissions come last in the dict)."""
        scheduled = self.num_scheduled_tokens
        return list(islice(scheduled, len(scheduled) - len(self.scheduled_new_reqs)))
