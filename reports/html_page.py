"""The page every report is: one self-contained HTML file with inline CSS, the plots
embedded as base64 PNG data URIs and no external URL.

Every string that comes from data (scenario text, request ids, errors, sweep values) goes
through ``escape``. A small inline script marks each image with ``data-loaded="1"`` once
the browser has decoded it (used by the browser test).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.wide{overflow-x:auto}.meta td{text-align:left}
figure{margin:1.2em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:.85em;color:#555;margin-top:.3em}
pre{background:#f7f7f7;padding:.6em;font-size:.8em;overflow-x:auto}
.note{color:#555;font-size:.9em}.warning{color:#8a3b00;font-weight:600}
"""

LOADED_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img"), ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    var good = imgs[i].complete && imgs[i].naturalWidth > 0;
    imgs[i].setAttribute("data-loaded", good ? "1" : "0");
    if (good) { ok++; }
  }
  document.body.setAttribute("data-plots-rendered", ok + "/" + imgs.length);
});
"""


def escape(value) -> str:
    return html.escape(str(value), quote=True)


def figure(png: bytes, caption: str, alt: str) -> str:
    """A plot (``reports.plots``' PNG bytes) inlined as a data URI, with its caption."""
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{escape(alt)}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def page(title: str, sections: Sequence[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(sections)
            + f"\n<script>{LOADED_SCRIPT}</script>\n</body></html>\n"
            # Pure ASCII whatever the locale writes files in: other characters as references.
            ).encode("ascii", "xmlcharrefreplace").decode("ascii")
