"""Drawing a report's figures, on two processes where the machine allows.

A report describes each figure first (``PendingFigure``: a call that draws its PNG, and
its caption and alt text) and draws them all with ``render_figures``. Once the modules are
imported, drawing is most of a report's time (matplotlib laying out and rasterising text,
mostly), and the figures do not depend on one another. So on Linux, with no other thread
running, a forked child draws every other figure while the parent draws the rest; the
child inherits everything imported and sends back only PNG bytes.

The PNGs are the same bytes whoever draws them, so the page is too. If the child fails in
any way (it raises, is killed, sends something unreadable), the parent draws its share
itself: forking only ever saves time.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtwin.reports.html_page import figure

__all__ = ["PendingFigure", "draw_all", "render_figures"]


@dataclass(frozen=True)
class PendingFigure:
    draw: Callable[[], bytes]  # e.g. functools.partial of a ``reports.plots`` function
    caption: str
    alt: str


def render_figures(pending: Sequence[PendingFigure]) -> list[str]:
    """The figures drawn (``draw_all``) and inlined with their captions, in order."""
    pngs = draw_all([p.draw for p in pending])
    return [figure(png, p.caption, p.alt) for png, p in zip(pngs, pending)]


def draw_all(draws: Sequence[Callable[[], bytes]], *, fork: bool | None = None) -> list[bytes]:
    """Each call's bytes, in order. ``fork`` None: fork where it is safe (``_can_fork``)."""
    if fork is None:
        fork = len(draws) > 1 and _can_fork()
    if not fork:
        return [draw() for draw in draws]
    child_share = list(range(0, len(draws), 2))
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # no process to spare (a limit, a sandbox): draw them all here
        os.close(read_end)
        os.close(write_end)
        return [draw() for draw in draws]
    if pid == 0:  # the child: draw its share, send it, and leave without any clean-up
        # No collections: one would walk (and so copy) the parent's every object, a whole
        # replay's after `kvtwin replay`; the child lives for a few figures.
        gc.disable()
        os.close(read_end)
        try:
            data = pickle.dumps([draws[i]() for i in child_share], protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            data = b""
        try:
            with os.fdopen(write_end, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write_end)
    pngs: list[bytes | None] = [None] * len(draws)
    try:
        for i in range(1, len(draws), 2):
            pngs[i] = draws[i]()
    finally:
        # Read before waiting: a child blocked on a full pipe would never exit.
        with os.fdopen(read_end, "rb") as source:
            data = source.read()
        os.waitpid(pid, 0)
    for i, png in zip(child_share, _child_pngs(data, len(child_share))):
        pngs[i] = png if png is not None else draws[i]()
    return pngs  # type: ignore[return-value]


def _child_pngs(data: bytes, count: int) -> list[bytes | None]:
    try:
        pngs = pickle.loads(data)
    except Exception:  # the child died or failed: nothing usable
        return [None] * count
    if not isinstance(pngs, list) or len(pngs) != count or not all(isinstance(p, bytes) for p in pngs):
        return [None] * count
    return pngs


def _can_fork() -> bool:
    # Linux only: macOS system libraries may not survive a fork. And never with another
    # thread alive, which may hold a lock the child would wait on forever.
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1
