"""The engine's one connector slot: what a feature that moves KV outside the pool hands it.

vLLM's engine builds at most one KV connector (``KVConnectorFactory``), a scheduler half
and a worker half, and reads it back only through the connector API and the stats it
reports; the engine never asks which connector it is. ``ConnectorTier`` is that slot here
(docs/architecture.md#a-new-kv-connector): the offload tier (``offload/build.py``'s
``OffloadTier``) and a P/D engine's connector (``pd_connector.py``'s ``PDTier``) implement
it, and ``EngineCore`` takes one or none. Whoever built a tier keeps its own reference for
the feature's own calls (P/D's hand-overs, the lockstep runner's tier counters); clocks
ask the engine (``next_transfer_event_s``, ``waits_for_transfers``), never the tier.
"""

from __future__ import annotations

from typing import Protocol

from kvtwin.sim.core.kv_connector import KVConnector, KVTransferWorker


class ConnectorTier(Protocol):
    """A connector and its worker, with what the engine's stats and clocks need of them."""

    # Read-only members, which a plain attribute satisfies: a tier holds its own connector
    # and worker types, which a mutable Protocol attribute would refuse (it is invariant).
    @property
    def connector(self) -> KVConnector:
        """The scheduler half: the scheduler calls it and nothing else."""
        ...

    @property
    def transfers(self) -> KVTransferWorker:
        """The worker half: the engine submits each batch's jobs to it and applies its report."""
        ...

    def step_counters(self) -> dict[str, int] | None:
        """Cumulative counters and gauges by step column (``EngineStats.offload_counters``;
        reports/SCHEMA.md), or None where the feature has no step columns."""
        ...

    def job_load_seconds(self) -> dict[int, float] | None:
        """Each load job's seconds on a timed link, by job id (the worker's own table), or
        None (a step clock, or no loads to time)."""
        ...

    def next_event_s(self) -> float | None:
        """When the next job in flight finishes on a timed clock (None: none, or a step
        clock): the time a clock that waits for transfers sleeps until."""
        ...

    def keeps_engine_waiting(self) -> bool:
        """Whether jobs in flight keep the engine stepping once its requests are done:
        a P/D prefill side's blocks still to be read do (they are freed only when the read
        is reported), an offload tier's stores do not (no request waits for them)."""
        ...
