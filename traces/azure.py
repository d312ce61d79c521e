"""Loader for the Azure LLM inference trace CSVs (2023 format, Splitwise).

Header ``TIMESTAMP,ContextTokens,GeneratedTokens``: an absolute wall-clock time with 7-digit
fractional seconds, the input and the output token counts. Arrival times become seconds
since the first request (kept to the nanosecond before the subtraction); the first
timestamp is kept as the trace's ``time_origin``.

The trace has no sessions and no content identity: ``trace info`` reports no prefix-reuse
bound for it, and nothing here invents one.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtwin.traces import schema as s
from kvtwin.traces.fields import DATETIME, INT, Field
from kvtwin.traces.readers import read_csv

FIELDS = (
    Field("TIMESTAMP", DATETIME),
    Field("ContextTokens", INT, minimum=1),
    Field("GeneratedTokens", INT, minimum=1),
)


def load_azure(path: str | os.PathLike, *, skip_bad: bool = False) -> pa.Table:
    """Load an Azure LLM inference 2023 CSV into the trace schema."""
    columns = read_csv(path, FIELDS, skip_bad=skip_bad)
    nanos = columns.values["TIMESTAMP"].to_numpy(zero_copy_only=False)
    origin_ns = int(nanos.min()) if len(nanos) else 0
    meta = s.TraceMeta(source_format="azure", source_file=Path(path).name, content_identity=s.IDENTITY_NONE,
                       time_origin=format_utc_ns(origin_ns))
    return s.build_table({
        s.REQUEST_ID: pa.array(np.arange(columns.num_rows).astype(str)),
        s.ARRIVAL_TIME_S: (nanos - origin_ns) / 1e9,
        s.PROMPT_TOKENS: columns.values["ContextTokens"],
        s.OUTPUT_TOKENS: columns.values["GeneratedTokens"],
    }, columns.bad.stamp(meta))


def format_utc_ns(nanos: int) -> str:
    """``YYYY-MM-DD HH:MM:SS.fffffffff`` for nanoseconds since 1970 (read as UTC)."""
    seconds, fraction = divmod(nanos, 1_000_000_000)
    stamp = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp}.{fraction:09d}"
