"""Disaggregated prefill/decode: the scheduler half of vLLM 0.33's NIXL connector (pull
mode), and a timed worker for it.

docs/semantics.md#disaggregated-prefill-and-decode. One ``PDConnector`` sits in each
engine of a P/D deployment, behind the ``KVConnector`` Protocol, and plays either side
per request, as vLLM's ``kv_both`` instances do:

* a request marked ``mark_remote_decode`` (vLLM's ``do_remote_decode``) is a prefill-side
  request: it prefills as usual (the clock gives it ``max_tokens = 1`` and drops the
  trailing ``prefill_backoff_tokens``), and when it finishes ``request_finished`` asks the
  scheduler to keep its blocks; they are freed when the worker reports the request in
  ``finished_sending`` (the decode side has read them);
* a request announced with ``expect_remote_prefill`` (vLLM's ``do_remote_prefill``) is a
  decode-side request: every prompt token past its local prefix hit is external and
  loads asynchronously (``WAITING_FOR_REMOTE_KVS``); allocation queues one read of the
  fresh blocks (one read per request, even of zero blocks: it tells the prefill side to
  free), which ``build_connector_meta`` hands to the worker. The read brings a hybrid
  model's Mamba state whatever the local hit, so the connector declares
  ``supports_divergent_local_hybrid_hits``: the scheduler may then take the
  full-attention group's local hit where the Mamba group's lags
  (docs/semantics.md#disaggregated-prefill-and-decode).

``StepPDTransfers`` is the worker on the step clock (the golden cases' stand-in): a read
issued with batch ``k`` lands with batch ``k + read_steps``; the prefill side is told by
batch number. ``PDTransfers`` is the worker of either side on a timed clock: a read moves the blocks'
bytes of every KV cache group over the decode replica's inbound link (first in, first
out, at the link's bandwidth, plus its latency); the decode side is told with
``finished_recving`` and the prefill side, through ``send_done``, with
``finished_sending``, each at the end of its first step that ends after the read.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from kvtwin.sim.core.hashing import HashIdPrompt, PromptSource, TokenPrompt
from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.kv_connector import KVConnectorOutput, KVTransferWorker
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import KVConnectorMetadata, SchedulerOutput
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec, cdiv


class RemoteRead:
    """One read the decode side runs: ``num_tokens`` prompt tokens of ``req_id`` from its
    prefill replica, past the ``hit_tokens`` of its own prefix cache, ``num_blocks``
    blocks per KV cache group, ``num_bytes`` in all."""

    __slots__ = ("req_id", "num_tokens", "num_blocks", "num_bytes", "hit_tokens")

    def __init__(self, req_id: str, num_tokens: int, num_blocks: tuple[int, ...], num_bytes: int,
                 hit_tokens: int = 0):
        self.req_id = req_id
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.hit_tokens = hit_tokens


class PDConnectorMetadata(KVConnectorMetadata):
    """A step's reads, for the worker."""

    def __init__(self, reads: list[RemoteRead]):
        self.reads = reads


def prefill_backoff_tokens(kv_cache_config: KVCacheConfig) -> int:
    """Trailing prompt tokens the prefill side leaves to the decode side: one with a Mamba
    group (the decode side derives the last state from the one before), else none
    (vLLM ``_prefill_backoff`` without multi-token prediction)."""
    return 1 if any(isinstance(g.spec, MambaSpec) for g in kv_cache_config.groups) else 0


def remote_prefill_tokens(num_prompt_tokens: int, backoff_tokens: int) -> int:
    """Prompt tokens the decode side loads from the prefill side: all but the trailing
    ``backoff_tokens``, or the whole prompt when it is no longer than the backoff (the
    prefill side then keeps it whole too; vLLM ``_get_remote_prefill_token_count``,
    docs/semantics.md#disaggregated-prefill-and-decode)."""
    if backoff_tokens > 0 and num_prompt_tokens > backoff_tokens:
        return num_prompt_tokens - backoff_tokens
    return num_prompt_tokens


def truncated_prompt(prompt: PromptSource, backoff_tokens: int) -> PromptSource:
    """``prompt`` less its last ``backoff_tokens`` tokens (none if that would empty it): what the
    prefill side runs (vLLM drops the backoff in ``on_new_request``)."""
    if backoff_tokens <= 0 or prompt.num_tokens <= backoff_tokens:
        return prompt
    if isinstance(prompt, TokenPrompt):
        return TokenPrompt(prompt.token_ids[:-backoff_tokens])
    assert isinstance(prompt, HashIdPrompt)
    return HashIdPrompt(prompt.hash_ids, prompt.hash_block_tokens, prompt.num_tokens - backoff_tokens,
                        prompt.unique_id)


def read_blocks_by_group(kv_cache_config: KVCacheConfig, blocks: KVCacheBlocks,
                         num_external_tokens: int) -> tuple[int, ...]:
    """Blocks of each group the decode side reads for a request whose admission just
    loaded ``num_external_tokens`` tokens, ``blocks`` being its whole block table then
    (docs/semantics.md#disaggregated-prefill-and-decode, "D side, read size").

    The read is what the admission took from the pool: the table's blocks that are
    neither null nor cached (the local hit is cached; the positions a sliding-window or
    chunked-local group skipped are null, so a long prompt costs such a group only its
    window or its current chunk), clipped as vLLM's ``get_exchange_clipped_blocks`` clips
    them once any group is not full attention (a sliding-window group to its window plus
    one block, a Mamba group to its state block). Nothing is read without external
    tokens."""
    groups = kv_cache_config.groups
    if num_external_tokens <= 0:
        return (0,) * len(groups)
    clips = any(not isinstance(g.spec, FullAttentionSpec) for g in groups)
    counts = []
    for group, table in zip(groups, blocks.blocks):
        fresh = 0
        for block in table:
            if not block.is_null and block.block_hash is None:
                fresh += 1
        spec = group.spec
        if clips and isinstance(spec, SlidingWindowSpec):
            fresh = min(fresh, cdiv(spec.sliding_window, spec.block_size) + 1)
        elif clips and isinstance(spec, MambaSpec):
            fresh = min(fresh, 1)
        counts.append(fresh)
    return tuple(counts)


def group_block_bytes(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """Bytes one block of each group holds on one worker (every layer of the group; a
    Mamba group's state page included)."""
    return tuple(g.spec.real_page_size_bytes * len(g.layer_names) for g in kv_cache_config.groups)


class PDConnector:
    """The scheduler half of a P/D connector (module docstring)."""

    # The transfer carries the Mamba state whatever the local hit (vLLM's NIXL connector).
    supports_divergent_local_hybrid_hits: bool = True

    def __init__(self, kv_cache_config: KVCacheConfig):
        self.kv_cache_config = kv_cache_config
        self.prefill_backoff_tokens = prefill_backoff_tokens(kv_cache_config)
        self._block_bytes = group_block_bytes(kv_cache_config)
        # Decode side: request id -> prompt tokens its prefill side computed (to be read).
        self._remote_prefill: dict[str, int] = {}
        # Decode side: the local hit each remote request was last looked up with (the
        # read's metrics; the admission that follows reports none, its tokens computed).
        self._local_hit: dict[str, int] = {}
        # Prefill side: requests whose blocks a decode side will read.
        self._remote_decode: set[str] = set()
        # Reads queued since the last step's metadata.
        self._reads: list[RemoteRead] = []
        # Prefill side: finished requests holding their blocks until their read is done.
        self.sending: set[str] = set()
        # Decode side: reads issued, not yet reported.
        self.receiving: set[str] = set()

    # -- what the clock tells it ----------------------------------------------------------

    def expect_remote_prefill(self, request_id: str, num_tokens: int) -> None:
        """``request_id`` arrives at this (decode) engine with ``num_tokens`` prompt tokens
        computed by a prefill engine."""
        self._remote_prefill[request_id] = num_tokens

    def mark_remote_decode(self, request_id: str) -> None:
        """``request_id`` is prefilled here for a decode engine to read."""
        self._remote_decode.add(request_id)

    # -- the KVConnector Protocol ---------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._remote_prefill.get(request.request_id)
        if remote is None:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        count = remote - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        request_id = request.request_id
        remote = self._remote_prefill.pop(request_id, None)
        if remote is None:
            return
        # One read per request (vLLM clears do_remote_prefill here); a full local hit
        # still reads nothing, which tells the prefill side to free its blocks.
        counts = read_blocks_by_group(self.kv_cache_config, blocks, num_external_tokens)
        num_bytes = sum(n * b for n, b in zip(counts, self._block_bytes))
        self._reads.append(RemoteRead(request_id, num_external_tokens, counts, num_bytes,
                                      self._local_hit.pop(request_id, 0)))
        if num_external_tokens:
            self.receiving.add(request_id)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        return {"remote": num_external_tokens}

    def build_connector_meta(self, output: SchedulerOutput,
                             boundary_offloads: dict[str, list[tuple[int, int, int]]] | None) -> KVConnectorMetadata:
        reads = self._reads
        self._reads = []
        return PDConnectorMetadata(reads)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_recving:
            self.receiving.discard(request_id)
        for request_id in connector_output.finished_sending:
            self.sending.discard(request_id)

    def request_finished(self, request: Request) -> bool:
        """A prefill-side request finished: keep its blocks for the decode side to read
        (vLLM's ``delay_free_blocks``, when it holds any block)."""
        request_id = request.request_id
        if request_id not in self._remote_decode:
            self._remote_prefill.pop(request_id, None)
            self._local_hit.pop(request_id, None)
            return False
        self._remote_decode.discard(request_id)
        if request.num_computed_tokens <= 0:
            return False
        self.sending.add(request_id)
        return True

    def has_pending_jobs(self) -> bool:
        return bool(self.sending or self.receiving or self._reads)


class StepPDTransfers(KVTransferWorker):
    """The step clock's worker (module docstring). Batches are numbered as they are
    submitted; ``last_reads`` are the reads of the newest batch."""

    def __init__(self, read_steps: int = 1):
        if read_steps < 1:
            raise ValueError("a read lands one batch after it is issued at the earliest")
        self.read_steps = read_steps
        self.next_batch = 0
        self.last_reads: list[RemoteRead] = []
        self._recv: dict[int, list[str]] = {}
        self._send: dict[int, list[str]] = {}
        self._in_flight: deque[int] = deque()

    def send_done(self, request_id: str, batch: int) -> None:
        """Prefill side: the decode side's read of ``request_id`` lands with ``batch``."""
        self._send.setdefault(batch, []).append(request_id)

    def submit(self, meta: KVConnectorMetadata | None) -> None:
        batch = self.next_batch
        self.next_batch += 1
        self.last_reads = meta.reads if isinstance(meta, PDConnectorMetadata) else []
        for read in self.last_reads:
            if read.num_tokens:
                self._recv.setdefault(batch + self.read_steps, []).append(read.req_id)
        self._in_flight.append(batch)

    def finish_step(self, duration_s: float = 0.0) -> KVConnectorOutput:
        """The oldest batch's report: what is due by it, each list sorted (the order the
        scheduler frees finished_sending requests in)."""
        batch = self._in_flight.popleft()
        out = KVConnectorOutput()
        for due in sorted(b for b in self._recv if b <= batch):
            out.finished_recving.extend(self._recv.pop(due))
        for due in sorted(b for b in self._send if b <= batch):
            out.finished_sending.extend(self._send.pop(due))
        out.finished_recving.sort()
        out.finished_sending.sort()
        return out


class PDLink:
    """One replica's inbound KV link: reads queue first in, first out, each taking its
    bytes over ``bandwidth_bytes_per_s`` and arriving ``latency_s`` after it leaves."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float):
        if not bandwidth_bytes_per_s > 0 or latency_s < 0:
            raise ValueError("a P/D link needs a positive bandwidth and a latency >= 0")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._free_s = 0.0

    def transfer(self, now_s: float, num_bytes: int) -> float:
        """When a read of ``num_bytes`` issued at ``now_s`` has landed."""
        start = max(now_s, self._free_s)
        self._free_s = done = start + num_bytes / self.bandwidth_bytes_per_s
        return done + self.latency_s


class PDTransfers(KVTransferWorker):
    """The timed worker of a P/D engine (module docstring). ``on_read(read, issued_s,
    done_s)`` tells the clock of each read issued (it tells the prefill side's worker)."""

    def __init__(self, clock_s: Callable[[], float], link: PDLink,
                 on_read: Callable[[RemoteRead, float, float], None] | None = None):
        self.clock_s = clock_s
        self.link = link
        self.on_read = on_read
        # (due, sequence, request id, whether a send) of what is still to be reported.
        self._heap: list[tuple[float, int, str, bool]] = []
        self._seq = 0
        self._in_flight: list[float] = []  # when each batch in flight was scheduled
        self._head = 0

    def _add(self, due_s: float, request_id: str, is_send: bool) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (due_s, self._seq, request_id, is_send))

    def send_done(self, request_id: str, at_s: float) -> None:
        """Prefill side: the decode side's read of ``request_id`` is done at ``at_s``."""
        self._add(at_s, request_id, True)

    def submit(self, meta: KVConnectorMetadata | None) -> None:
        now = self.clock_s()
        if isinstance(meta, PDConnectorMetadata):
            for read in meta.reads:
                done = self.link.transfer(now, read.num_bytes) if read.num_tokens else now
                if read.num_tokens:
                    self._add(done, read.req_id, False)
                if self.on_read is not None:
                    self.on_read(read, now, done)
        self._in_flight.append(now)

    def finish_step(self, duration_s: float) -> KVConnectorOutput:
        start_s = self._in_flight[self._head]
        self._head += 1
        if self._head > 64:
            del self._in_flight[:self._head]
            self._head = 0
        until = max(self.clock_s(), start_s + duration_s)
        out = KVConnectorOutput()
        heap = self._heap
        while heap and heap[0][0] <= until:
            _, _, request_id, is_send = heapq.heappop(heap)
            (out.finished_sending if is_send else out.finished_recving).append(request_id)
        return out

    def next_completion_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None


class PDTier:
    """A P/D engine's connector tier (``connector_tier.ConnectorTier``): its connector and
    worker. It has no step columns (the P/D columns are per request) and its reads are the
    jobs a clock waits for; a prefill side's blocks still to be read keep the engine
    stepping after its requests finished."""

    def __init__(self, connector: PDConnector, transfers: PDTransfers | StepPDTransfers):
        self.connector = connector
        self.transfers = transfers

    def step_counters(self) -> dict[str, int] | None:
        return None

    def job_load_seconds(self) -> dict[int, float] | None:
        return None

    def next_event_s(self) -> float | None:
        return self.transfers.next_completion_s()

    def keeps_engine_waiting(self) -> bool:
        return self.connector.has_pending_jobs()
