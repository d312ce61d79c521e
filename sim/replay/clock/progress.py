"""Where a simulated run is, for a progress display."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplayClock:
    now_s: float = 0.0
    steps: int = 0
    arrived: int = 0
    finished: int = 0
    # Refused at arrival: done as far as progress goes (finished + rejected of the total).
    rejected: int = 0
    # Of ``steps``, those recorded inside decode windows (``sim/core/decode_window.py``).
    decode_window_steps: int = 0
