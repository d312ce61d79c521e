"""What the scheduler knows of a KV connector: the calls it makes, the worker's report.

The scheduler talks to an external KV store (today the CPU/disk offload tier in
``sim/core/offload``) only through ``KVConnector``, the scheduler side of vLLM's v1
connector API, and reads the worker's side only as a ``KVConnectorOutput``. It never
imports a connector's implementation: an engine builds one and hands it in. The
engine's side of the same seam is ``KVTransferWorker``, which runs the jobs a step's
metadata describes and reports which finished; the base class itself stands in for it
when the engine has no connector, so an engine step needs no branch on offloading.

The order and effects of the calls are those of docs/semantics.md#kv-offloading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.scheduler_output import KVConnectorMetadata, SchedulerOutput


@dataclass
class KVConnectorOutput:
    """What the worker reports after a step: finished jobs, the requests whose load
    finished (vLLM's ``finished_recving``), and finished requests whose blocks another
    engine has read, so they may be freed (``finished_sending``, P/D only)."""

    completed_jobs: list[int] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)


class KVConnector(Protocol):
    """The scheduler side of a KV connector, called by the scheduler alone."""

    # Whether the connector brings a hybrid model's Mamba state with its load, so the
    # scheduler may take the full-attention group's local hit where the Mamba group's
    # lags (vLLM's ``supports_divergent_local_hybrid_hits``: NIXL yes, offloading no).
    supports_divergent_local_hybrid_hits: bool

    def on_new_request(self, request: Request) -> None:
        """A request was added to the scheduler (before any lookup for it)."""
        ...

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past the GPU's ``num_computed_tokens`` hit that the store can provide,
        and whether they arrive asynchronously; ``(None, False)``: ask again next step."""
        ...

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The scheduler allocated ``request``'s blocks; the last ``num_external_tokens``
        of its hit are to be loaded into them."""
        ...

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """Of the loaded tokens, how many come from each tier (for metrics)."""
        ...

    def build_connector_meta(self, output: SchedulerOutput,
                             boundary_offloads: dict[str, list[tuple[int, int, int]]] | None
                             ) -> KVConnectorMetadata:
        """The end of a ``schedule()``: the step's jobs for the worker. It reads the
        computed counts from before the step (they have not been advanced yet)."""
        ...

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker's report of finished jobs."""
        ...

    def request_finished(self, request: Request) -> bool:
        """A request finished; its blocks are freed right after this call, unless it
        returns True (vLLM's ``delay_free_blocks``): then they are freed when the worker
        reports the request in ``finished_sending``."""
        ...

    def has_pending_jobs(self) -> bool:
        """Whether jobs are still running (the engine keeps stepping until they finish)."""
        ...


class KVTransferWorker:
    """The worker side of a connector, as an engine drives it: each batch's metadata
    before its forward pass, and the report of what finished once the batch has run.

    This base class runs nothing and reports nothing (``finish_step`` returns None, which
    the scheduler's ``update_connector_output`` and a step's result read as "no
    connector"): it is the worker of an engine without one. The offload tier's clocks
    subclass it (``sim/core/offload/transfers.py``), so an engine calls either natively."""

    def submit(self, meta: KVConnectorMetadata | None) -> None:
        pass

    def finish_step(self, duration_s: float) -> KVConnectorOutput | None:
        return None

    def job_load_seconds(self) -> dict[int, float] | None:
        """Each load job's seconds on the link, by job id (None: a clock without seconds)."""
        return None

    def next_completion_s(self) -> float | None:
        """When the next job in flight finishes, on a timed clock (None: none in flight, or
        a clock that counts steps)."""
        return None

    def moved_bytes(self) -> tuple[int, int]:
        """Bytes loaded and stored so far, (loads, stores): a clock that counts steps, not
        bytes on a link, reports none."""
        return 0, 0
