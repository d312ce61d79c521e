"""Tables in a report: label/value tables and data frames, with the numbers formatted the
way the report shows every number (thousands separators, four significant digits,
"-" for a missing value)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A table with a header row, every cell formatted by ``fmt_cell`` and escaped."""
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{escape(fmt_cell(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def frame_table(names: Sequence[str], columns: Sequence[Sequence[object]]) -> str:
    """A table of ``columns`` (one list of values per name), each cell formatted by
    ``fmt_cell``, in the layout pandas' ``DataFrame.to_html(index=False, border=0)`` wrote
    (the capacity report's bytes are kept)."""
    head = "".join(f"      <th>{_pandas_html_text(name)}</th>\n" for name in names)
    cells = [[_pandas_html_text(_shown_escapes(fmt_cell(v))) for v in values] for values in columns]
    body = "".join("    <tr>\n" + "".join(f"      <td>{cell}</td>\n" for cell in row) + "    </tr>\n"
                   for row in zip(*cells))
    return ('<div class="wide"><table class="dataframe">\n  <thead>\n    <tr style="text-align: right;">\n'
            f"{head}    </tr>\n  </thead>\n  <tbody>\n{body}  </tbody>\n</table></div>")


def _shown_escapes(text: str) -> str:
    """A cell's tab, carriage return and newline shown as ``\\t``, ``\\r``, ``\\n`` (as pandas
    printed a cell's text)."""
    return text.replace("\t", "\\t").replace("\r", "\\r").replace("\n", "\\n")


def _pandas_html_text(text: str) -> str:
    """A cell or header as pandas' HTML writer put it: ``&``, ``<``, ``>`` escaped (quotes
    not), the ends stripped of white space, each run of two spaces as two ``&nbsp;``."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.strip().replace("  ", "&nbsp;&nbsp;")
