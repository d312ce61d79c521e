"""The offloading manager interface: what the connector and the step columns ask of a tier.

vLLM's scheduler-side connector talks to its store through ``OffloadingManager``
(``vllm/v1/kv_offload/base.py``): lookups, load and store preparation and completion, the
request and step hooks. This Protocol names exactly the calls ``OffloadingConnector``
makes, plus what the engine's stats and clocks read (``counters``, ``next_finish_s``), so
the CPU tier (``CPUOffloadingManager``) and the CPU tier over a disk tier
(``TieredOffloadingManager``) stand behind one type; a tier's own counters come through
``counters`` rather than a type test (docs/semantics.md#kv-offloading).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from kvtwin.sim.core.offload.base import (LookupResult, OffloadKey, PrepareStoreOutput, ReqContext,
                                          RequestOffloadingContext)


class OffloadingManager(Protocol):
    """The scheduler side of an offload store (vLLM's ``OffloadingManager``)."""

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request is first seen; how its chunks are to be offered for storing."""
        ...

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether one key is stored and ready (HIT), being made ready, absent or to ask later."""
        ...

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> str:
        """The tier a HIT came from (``cpu``, ``disk``), for the hit-source metrics."""
        ...

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> list[int]:
        """Pin stored keys for a load (no eviction until ``complete_load``); their chunk ids."""
        ...

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """A load finished: its keys may be evicted again."""
        ...

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Chunks for the keys not stored yet, evicting to make room; None: no room."""
        ...

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """A store finished: its keys become loadable (or are dropped, without ``success``)."""
        ...

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more loads or stores will be prepared for the request."""
        ...

    def on_schedule_end(self, context: object = None) -> None:
        """The last manager call of a schedule: flush work deferred during it."""
        ...

    def has_pending_work(self) -> bool:
        """Whether the manager needs the engine to keep stepping (jobs of its own in flight)."""
        ...

    def counters(self) -> dict[str, int]:
        """Cumulative counters and gauges by step column (reports/SCHEMA.md), the tier's
        own included: a disk tier adds its columns."""
        ...

    def next_finish_s(self) -> float | None:
        """When the next job of the manager's own finishes on a timed clock (None: none)."""
        ...
