"""Loader for BurstGPT CSVs (``BurstGPT_1`` and the ``BurstGPT_3`` layout with sessions).

Columns are read by name, because later releases insert ``Session ID`` and ``Elapsed time``
in the middle: ``Timestamp`` (s), ``Request tokens``, ``Response tokens`` and, when present,
``Session ID`` (empty for API calls). ``Model``, ``Log Type`` and ``Elapsed time`` are not
kept. Rows with 0 response tokens are failed requests in the source: they are counted,
dropped and reported in the trace's notes. Arrival times become seconds since the first row.

Turns are numbered 1, 2, ... per session in arrival order. The trace has no content identity;
``sessions.assume_session_history`` can derive one under an explicit assumption.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvtwin.traces import schema as s
from kvtwin.traces.fields import FLOAT, INT, STR, Field, RowCheck
from kvtwin.traces.readers import read_csv
from kvtwin.traces.sessions import number_turns

FIELDS = (
    Field("Timestamp", FLOAT, minimum=0),
    Field("Request tokens", INT, minimum=0),
    Field("Response tokens", INT, minimum=0),
    Field("Session ID", STR, required=False),
)


def _empty_prompt_with_response(columns: dict[str, pa.Array]) -> np.ndarray:
    request = columns["Request tokens"].to_numpy(zero_copy_only=False)
    response = columns["Response tokens"].to_numpy(zero_copy_only=False)
    return (request == 0) & (response > 0)


CHECKS = (RowCheck("Request tokens", "an integer >= 1 when Response tokens > 0", _empty_prompt_with_response),)


def load_burstgpt(path: str | os.PathLike, *, skip_bad: bool = False) -> pa.Table:
    """Load a BurstGPT CSV into the trace schema (failed rows dropped and counted)."""
    columns = read_csv(path, FIELDS, skip_bad=skip_bad, row_checks=CHECKS)
    values = columns.values
    row_ids = np.arange(columns.num_rows)
    failed = values["Response tokens"].to_numpy(zero_copy_only=False) == 0
    times_s = values["Timestamp"].to_numpy(zero_copy_only=False)
    origin_s = float(times_s.min()) if len(times_s) else 0.0
    meta = columns.bad.stamp(s.TraceMeta(source_format="burstgpt", source_file=Path(path).name,
                                         content_identity=s.IDENTITY_NONE, time_origin=f"{origin_s:.15g} s"))
    if failed.any():
        meta = meta.with_note(f"dropped {int(failed.sum())} failed request(s) (0 response tokens) "
                              f"of {columns.num_rows} rows")
        keep = pa.array(~failed)
        values = {name: column.filter(keep) for name, column in values.items()}
        row_ids = row_ids[~failed]
        times_s = times_s[~failed]
    sessions = values["Session ID"]
    return s.build_table({
        # Ids are the 0-based data row in the file, so a request can be found in the source.
        s.REQUEST_ID: pa.array(row_ids.astype(str)),
        s.ARRIVAL_TIME_S: times_s - origin_s,
        s.PROMPT_TOKENS: values["Request tokens"],
        s.OUTPUT_TOKENS: values["Response tokens"],
        s.SESSION_ID: sessions,
        s.TURN: number_turns(sessions, times_s),
    }, meta)
