"""The cyclic garbage collector's pace while a simulation runs.

A replay allocates small, long-lived objects at a high rate: requests, block lists and,
with an offload tier, a key, a chunk record and eviction entries for every offloaded
block (some 750 per Mooncake request). CPython starts a young-generation collection
every 700 net allocations of tracked objects, and each one walks every young object
that is still alive. Almost everything a replay allocates is still alive, and its
reference cycles are few, so those walks find next to nothing: timed with
``gc.callbacks``, the bundled offload scenario's first 1,000 requests spent 2.4 s of
16 s in 4,228 collections.

``relaxed_collection`` raises the young generation's threshold for the length of a run
(the older generations keep their own thresholds, counted in young collections, so
they come round as rarely). Cycles are still collected, in larger batches. Nothing the
simulation can reach is ever freed, so no result depends on the collector's pace.
"""

from __future__ import annotations

import gc
from types import TracebackType

# Net allocations between young-generation collections during a run (CPython: 700).
RUN_YOUNG_THRESHOLD = 100_000


class relaxed_collection:
    """``with relaxed_collection():`` the run's young-generation threshold, restored on
    exit. A run inside a run (or a caller that set a larger one) keeps the larger."""

    def __init__(self) -> None:
        self._saved: tuple[int, int, int] | None = None

    def __enter__(self) -> relaxed_collection:
        young, middle, old = gc.get_threshold()
        if 0 < young < RUN_YOUNG_THRESHOLD:
            self._saved = (young, middle, old)
            gc.set_threshold(RUN_YOUNG_THRESHOLD, middle, old)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None
