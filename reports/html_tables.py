"""Tables in a report: label/value tables and data frames, with the numbers formatted the
way the report shows every number (thousands separators, four significant digits,
"-" for a missing value)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtwin.reports.html_page import escape

if TYPE_CHECKING:  # pandas only for the capacity report's frames: a replay report never imports it
    import pandas as pd


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


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A table with a header row, every cell formatted by ``fmt_cell`` and escaped."""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(fmt_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def frame_table(frame: pd.DataFrame) -> str:
    shown = frame.copy()
    for column in shown.columns:
        shown[column] = [fmt_cell(v) for v in shown[column].tolist()]
    # to_html escapes every cell and header (escape=True).
    return '<div class="wide">' + shown.to_html(index=False, escape=True, border=0, na_rep="-") + "</div>"
