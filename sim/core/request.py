"""A request as the scheduler and KV cache manager see it (vLLM ``v1/request.py``).

Prompt identity is a ``PromptSource`` (token ids or chained chunk hash ids), so a long
prompt costs one hash per block, never one object per token. Output tokens are kept:
a preempted request keeps what it produced and recomputes it on resumption.
"""

from __future__ import annotations

import enum

from kvtwin.sim.core.hashing import BlockHasher, HashIdBlockHashes, PromptSource
from kvtwin.sim.core.spec_decode_stats import RequestSpecDecodeMetrics


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Blocks allocated, KV being loaded from an offload tier (vLLM's WAITING_FOR_REMOTE_KVS).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED = "finished"
    REJECTED = "rejected"


class Request:
    __slots__ = ("request_id", "prompt", "max_tokens", "arrival_time", "priority", "output_token_ids",
                 "num_computed_tokens", "block_hashes", "status", "num_preemptions", "shared_prefix_boundary",
                 "_hasher", "num_prompt_tokens", "num_tokens", "_next_hash_tokens", "num_output_placeholders",
                 "num_in_flight_tokens", "last_sched_seq", "spec_token_ids", "is_prefill_chunk",
                 "spec_decode_metrics", "next_decode_eligible_step")

    def __init__(self, request_id: str, prompt: PromptSource, max_tokens: int, *, arrival_time: float = 0.0,
                 priority: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.num_prompt_tokens = prompt.num_tokens
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.priority = priority
        self.output_token_ids: list[int] = []
        # Prompt plus outputs; kept as a field because the scheduler reads it constantly.
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_hashes: list | HashIdBlockHashes = []
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Where a longer single-group prefix hit ends (0 if none): a Mamba prefill chunk
        # stops there so its state gets cached for siblings sharing that prefix.
        self.shared_prefix_boundary = 0
        self._hasher: BlockHasher | None = None
        # Token count at which the next block becomes full (and, with lookahead hashes, its
        # next tokens are known) and gets a hash.
        self._next_hash_tokens = 1 << 62
        # Asynchronous scheduling only (both stay 0 otherwise): tokens this request will
        # sample in batches still in flight (vLLM's output placeholders: they count as
        # tokens it has when the next batch is scheduled) ...
        self.num_output_placeholders = 0
        # ... and the tokens it has scheduled in batches still in flight: blocks they read
        # stay until they ran (a window slides by what was processed), and a preempted
        # request waits until output from before its preemption has been delivered.
        self.num_in_flight_tokens = 0
        # Asynchronous PP only (0 otherwise): the first schedule that may give it its next
        # decode (docs/semantics.md#asynchronous-pipeline-parallelism).
        self.next_decode_eligible_step = 0
        # With an offload connector and two batches in flight: the last non-empty batch that
        # holds this request (it is not preempted before that batch is applied).
        self.last_sched_seq = 0
        # Speculative decoding only (docs/semantics.md#speculative-decoding): the drafts to
        # verify at its next decode (asynchronous: placeholders), and whether its last
        # scheduled batch was a partial prefill chunk (set only when drafts are on).
        self.spec_token_ids: list[int] = []
        self.is_prefill_chunk = False
        # Its verify steps so far (None: none yet), as the scheduler counts them.
        self.spec_decode_metrics: RequestSpecDecodeMetrics | None = None

    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def attach_hasher(self, hasher: BlockHasher) -> None:
        self._hasher = hasher
        self.block_hashes = hasher.new_hashes(self.prompt)
        self._extend_block_hashes()

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids += token_ids
        self.num_tokens += len(token_ids)
        if self.num_tokens >= self._next_hash_tokens:
            self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        hasher = self._hasher
        if hasher is not None:
            hasher.extend(self.block_hashes, self.prompt, self.output_token_ids, self.num_tokens)
            self._next_hash_tokens = (len(self.block_hashes) + 1) * hasher.hash_block_size + hasher.lookahead

    def __hash__(self) -> int:
        # Identity, as for any object; spelled out because a compiled class that defines a
        # comparison loses the default.
        return id(self)

    def __lt__(self, other: "Request") -> bool:
        # The priority queue's order: lower priority value first, then earlier arrival.
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        return self.request_id < other.request_id

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens})")
