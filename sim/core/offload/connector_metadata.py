"""What the offloading connector (``connector.py``) hands its worker (``transfers.py``) each
step: vLLM 0.33's ``TransferJob`` and ``OffloadingConnectorMetadata``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtwin.sim.core.scheduler_output import KVConnectorMetadata


@dataclass
class TransferJob:
    """One transfer the worker runs: ``keys`` between the tier and these GPU blocks."""

    job_id: int
    req_id: str
    is_store: bool
    keys: list
    block_ids: list[int]


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """What one step hands the worker (the connector part of the scheduler output)."""

    load_jobs: dict[int, TransferJob] = field(default_factory=dict)
    store_jobs: dict[int, TransferJob] = field(default_factory=dict)
    jobs_to_flush: set[int] = field(default_factory=set)
    # Requests whose lookup this step began a wait: their hit is in the tier but not yet
    # loadable (a disk promotion, a store, or another request's load of its chunks still
    # runs). Only the step that began the wait names them; None when none did. For
    # metrics: nothing in the step depends on it.
    deferred_req_ids: list[str] | None = None

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python
    # (one is made every step).
    def __init__(self, load_jobs: dict[int, TransferJob] | None = None,
                 store_jobs: dict[int, TransferJob] | None = None, jobs_to_flush: set[int] | None = None,
                 deferred_req_ids: list[str] | None = None):
        self.load_jobs = load_jobs if load_jobs is not None else {}
        self.store_jobs = store_jobs if store_jobs is not None else {}
        self.jobs_to_flush = jobs_to_flush if jobs_to_flush is not None else set()
        self.deferred_req_ids = deferred_req_ids
