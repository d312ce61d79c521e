"""What the offloading connector (``connector.py``) keeps per KV cache group, per request and
per transfer job.

vLLM 0.33's ``GroupOffloadConfig``, ``RequestGroupState``, ``RequestOffloadState`` and
``TransferJobStatus`` (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``),
and ``sliding_window_size_in_chunks`` (its ``config.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtwin.sim.core.offload.base import OffloadKey, ReqContext
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.spec import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv


@dataclass(frozen=True)
class GroupOffloadConfig:
    """How one KV cache group is cut into offload chunks."""

    group_idx: int
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    # None: full attention (prefix lookup); otherwise the chunks a hit must end with.
    sliding_window_size_in_chunks: int | None
    spec: KVCacheSpec
    # A Mamba "align" group's state is handed over by the KV cache manager, not read from
    # the request's block table.
    requires_cow_source: bool

    def load_window_size_in_chunks(self, num_tokens: int) -> int | None:
        window = self.sliding_window_size_in_chunks
        if isinstance(self.spec, SlidingWindowSpec):
            # The lookup rounds its right edge up to a chunk; the allocation keeps the
            # window ending at the hit, which may reach one chunk further left.
            right_padding = -num_tokens % self.tokens_per_chunk
            assert window is not None  # a sliding-window group has one
            window = max(window, cdiv(self.spec.sliding_window - 1 + right_padding, self.tokens_per_chunk))
        return window


def sliding_window_size_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    if isinstance(spec, SlidingWindowSpec):
        return max(cdiv(spec.sliding_window, tokens_per_chunk), cdiv(spec.sliding_window - 1, tokens_per_chunk))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1  # one state carries everything before it
    return None


@dataclass
class RequestGroupState:
    offload_keys: list[OffloadKey] = field(default_factory=list)
    # The request's block table as the connector sees it: append-only, 0 for a skipped
    # position or an entry found stale (its block was handed out again).
    block_ids: list[int] = field(default_factory=list)
    next_stored_chunk_idx: int = 0


class RequestOffloadState:
    """What the connector keeps per request (vLLM's ``RequestOffloadState``). Typed
    throughout: the store pass reads it for every scheduled request every step, and a
    compiled build reads typed attributes natively."""

    __slots__ = ("req", "req_context", "group_states", "num_locally_computed_tokens", "transfer_jobs",
                 "finished_signaled", "load_key_ranges", "settled_tokens", "num_hashes_keyed", "deferred")

    def __init__(self, request: Request, num_groups: int):
        self.req = request
        self.req_context = ReqContext(request.request_id)
        self.group_states = tuple(RequestGroupState() for _ in range(num_groups))
        self.num_locally_computed_tokens = 0
        # In flight: one load, or any number of stores.
        self.transfer_jobs: set[int] = set()
        self.finished_signaled = False
        # (first token, end token, key) of the last load, for hits per tier.
        self.load_key_ranges: list[tuple[int, int, OffloadKey]] = []
        # Offloadable tokens up to which every group's chunks were offered (all stored or
        # skipped): a store pass at this count is a no-op (-1: not settled).
        self.settled_tokens = -1
        # Block hashes already turned into offload keys: a decode step usually adds none,
        # so refreshing the keys then costs one comparison.
        self.num_hashes_keyed = 0
        # Its last lookup asked it to wait: reported once per wait (``deferred_req_ids``).
        self.deferred = False


@dataclass
class TransferJobStatus:
    req_id: str
    keys: frozenset
    is_store: bool
    # Store source blocks watched from the moment the request finishes ...
    deferred_fence_block_ids: list[int] | None = None
    # ... and those watched from the start (windowed blocks may be freed any step).
    fenced_block_ids: list[int] | None = None
