"""Tables in a report: label/value tables and data frames, with the numbers formatted the
way the report shows every number (thousands separators, four significant digits,
"-" for a missing value)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from kvtwin.reports.html_page import escape


def fmt_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return "-"
        if float(value).is_integer() and abs(value) < 1e15:
            return f"{int(value):,}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return str(value)


def kv_table(rows: Sequence[tuple[str, object]], cls: str = "meta") -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def frame_table(frame: pd.DataFrame) -> str:
    shown = frame.copy()
    for column in shown.columns:
        shown[column] = [fmt_cell(v) for v in shown[column].tolist()]
    # to_html escapes every cell and header (escape=True).
    return '<div class="wide">' + shown.to_html(index=False, escape=True, border=0, na_rep="-") + "</div>"
