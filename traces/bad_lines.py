"""What a loader does with a bad line: raise it, or (with skip_bad) count it and keep going."""

from __future__ import annotations

import dataclasses

from kvtwin.traces.errors import TraceError
from kvtwin.traces.schema import TraceMeta

REASONS_KEPT = 5


class BadLines:
    """Collects malformed lines of one file; raises the first one unless skipping is allowed."""

    def __init__(self, path: str, skip_bad: bool):
        self.path = path
        self.skip_bad = skip_bad
        self.count = 0
        self.reasons: list[str] = []

    def report(self, err: TraceError) -> None:
        """Raise ``err``, or count it when skipping (the first few reasons are kept)."""
        if not self.skip_bad:
            raise err
        self.count += 1
        if len(self.reasons) < REASONS_KEPT:
            self.reasons.append(str(err))

    def stamp(self, meta: TraceMeta) -> TraceMeta:
        """``meta`` with the skipped-line count and reasons recorded (and a note when any)."""
        if not self.count:
            return meta
        meta = dataclasses.replace(meta, skipped_bad_lines=meta.skipped_bad_lines + self.count,
                                   bad_line_reasons=meta.bad_line_reasons + tuple(self.reasons))
        return meta.with_note(f"skipped {self.count} bad line(s) of {self.path} (--skip-bad)")
