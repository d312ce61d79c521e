"""``capacity.parquet`` read as sweep points: which columns are sweep keys, which of them
vary, how a point's settings read ("replicas=2, kv_cache=4 GiB"), and one line per
combination of the other keys."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvtwin.reports.html_tables import fmt_cell
from kvtwin.reports.summary_text import missing

RATE_KEY = "workload.rate_scale"
KV_KEY = "engine.kv_cache_memory_bytes"
ROUTER_KEY = "engine.router"
OFFLOAD_KEY = "offload.cpu_bytes"


def sweep_keys(frame: pd.DataFrame) -> list[str]:
    """Sweep keys are the dotted columns (``engine.replicas``); summary columns have no dot."""
    return [c for c in frame.columns if "." in c]


def varying(frame: pd.DataFrame, keys: Sequence[str]) -> list[str]:
    return [k for k in keys if frame[k].astype(str).nunique() > 1]


def key_value(key: str, value) -> str:
    """A sweep value as people read it: byte sizes in GiB."""
    if key.endswith("_bytes") and isinstance(value, (int, float, np.integer, np.floating)) and not missing(value):
        return f"{float(value) / 2**30:,.4g} GiB"
    return fmt_cell(value)


def combo_label(row: pd.Series, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.split('.')[-1].removesuffix('_memory_bytes')}={key_value(k, row[k])}" for k in keys)


def finite(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    values = pd.to_numeric(frame[column], errors="coerce")
    return frame[np.isfinite(values.to_numpy(dtype=float))]


def lines_by_combo(ok: pd.DataFrame, x: str, y: str, others: Sequence[str]):
    """(label, xs, ys) per combination of the ``others`` keys, sorted along ``x``."""
    data = finite(ok, y)
    if others:
        grouped = data.groupby([data[k].astype(str) for k in others], sort=True)
        parts = [g for _, g in grouped]
    else:
        parts = [data] if len(data) else []
    series = []
    for part in parts:
        part = part.sort_values(x)
        label = combo_label(part.iloc[0], others) if others else ""
        series.append((label, part[x].to_numpy(dtype=float), part[y].to_numpy(dtype=float)))
    return series
