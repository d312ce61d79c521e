"""How a trace is to be read, apart from reading it: the formats, Mooncake's two arrival
modes and ``LoadOptions``.

Standard library only: a scenario file is parsed (``kvtwin plan``) and the command line's
help is built from these names without loading pyarrow or NumPy, which the readers
(``kvtwin.traces.load`` and the format modules) need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only; the generic reader loads pyarrow
    from kvtwin.traces.generic import ColumnMap

FORMATS = ("parquet", "mooncake", "bailian", "azure", "burstgpt", "generic")

# Mooncake's recorded timestamps fall in ~3 s buckets: spread each bucket's requests over
# it (seeded) or keep each bucket a burst (``kvtwin.traces.mooncake``).
SPREAD = "spread"
BURST = "burst"
DEFAULT_SPREAD_SEED = 0


@dataclass(frozen=True)
class LoadOptions:
    """How to read a trace. ``arrivals``/``seed`` apply to Mooncake, ``columns`` to generic;
    ``assume_session_history`` (a block size) derives identity from sessions where there is none."""

    format: str | None = None
    skip_bad: bool = False
    arrivals: str = SPREAD
    seed: int = DEFAULT_SPREAD_SEED
    columns: ColumnMap | None = None
    assume_session_history: int | None = None
