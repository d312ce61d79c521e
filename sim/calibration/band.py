"""The band a calibration's held-out error puts around a replay's answers, and the
pessimistic clock a capacity search also runs on.

The calibration file itself (its factors, held-out errors and sources) is read by
``kvtwin.sim.calibration.file``; this module turns its ``[error]`` table into
the ``p99_*_low``/``_high`` summary columns and the lines a command prints, and slows a
clock by the step error for the pessimistic edge of a capacity answer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvtwin.sim.calibration.file import BANDED_FIGURES, UNCALIBRATED, Calibration
from kvtwin.sim.calibration.efficiency import COLLECTIVE_OPS, AllReduceCurve, Efficiency


def uncalibrated_line(note: str, *, slow_edge: bool = False) -> str:
    """The one line an uncalibrated clock gets in every command: why (``Calibration.note``),
    and what it costs (``slow_edge``: a capacity search also loses its pessimistic edge)."""
    why = note or "no calibration named or bundled"
    band = "no error band and no slow edge" if slow_edge else "no error band"
    return (f"uncalibrated: {why}; times use the default cost-model factors and carry {band}. "
            f"Fit one with `kvtwin calibrate`.")


def band_columns(row: dict, calibration: Calibration) -> dict:
    """Summary columns: the calibration's name and, for p99 TTFT, TPOT, ITL and E2E, the
    band its held-out error implies (docs/capacity.md#the-band; NaN when it states none),
    and the band's largest relative distance from the p99 (``error_*``)."""
    out: dict = {"calibration": calibration.label, "calibration_note": calibration.note}
    for figure in BANDED_FIGURES:
        ratios = calibration.band_ratios(figure)
        value = row.get(f"p99_{figure}", math.nan)
        if ratios is None or value is None or (isinstance(value, float) and math.isnan(value)):
            low = high = error = math.nan
        else:
            low, high = value * ratios[0], value * ratios[1]
            error = calibration.band_error(figure)
        out[f"p99_{figure}_low"] = low
        out[f"p99_{figure}_high"] = high
        out[f"error_{figure.removesuffix('_ms')}"] = error
    return out


def _span_ms(low_ms: float, high_ms: float) -> str:
    if high_ms >= 1000:
        return f"{low_ms / 1000:,.2f}-{high_ms / 1000:,.2f} s"
    return f"{low_ms:,.1f}-{high_ms:,.1f} ms"


def band_lines(row: dict, calibration: Calibration) -> list[str]:
    """What a command prints about its clock: the band on each p99, or the uncalibrated line."""
    if not calibration.calibrated:
        return [uncalibrated_line(calibration.note)]
    parts = []
    for name, figure in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2el_ms")):
        low, high = row.get(f"p99_{figure}_low", math.nan), row.get(f"p99_{figure}_high", math.nan)
        if not math.isnan(low):
            ratios = calibration.ratio_band(figure)
            spread = f"x{ratios[0]:.2f}-x{ratios[1]:.2f}" if ratios else f"±{calibration.error_for(figure):.0%}"
            parts.append(f"{name} {_span_ms(low, high)} ({spread})")
    # The band is on the server's figures (the client's add a constant: docs/capacity.md#client-side-latency).
    band_text = ("p99 within the held-out error (server-side): " + ", ".join(parts) if parts
                 else "no held-out error stated")
    return [f"clock: {calibration.label}; {band_text}"]


# A capacity point's clock (``capacity.parquet``): the calibration's label and its note
# (null where a point failed before its clock was chosen).
CLOCK_COLUMNS = ("calibration", "calibration_note")


def points_clocks(rows: Sequence[dict], *, slow_edge: bool = False) -> list[tuple[bool, str]]:
    """What a sweep says about its clocks (``capacity.parquet`` rows: ``point`` and the
    ``CLOCK_COLUMNS``): (calibrated, line) per distinct calibration, the line naming its
    points when not every point shares it."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        if row.get("calibration") is not None:
            groups.setdefault((row["calibration"], row.get("calibration_note") or ""), []).append(row["point"])
    out = []
    for (label, note), points in groups.items():
        where = "" if len(points) == len(rows) else f"point{'s' if len(points) > 1 else ''} " \
                                                     f"{', '.join(str(p) for p in points)}: "
        if note or label == UNCALIBRATED:
            out.append((False, where + uncalibrated_line(note, slow_edge=slow_edge)))
        else:
            out.append((True, f"{where}clock: {label}"))
    return out


def step_error(calibration: Calibration) -> float | None:
    """The largest held-out step error the calibration states (prefill or decode), or
    None: what the pessimistic edge of a capacity answer slows every step by."""
    errors = [calibration.errors[k] for k in ("prefill_step", "decode_step") if k in calibration.errors]
    return max(errors) if errors and calibration.calibrated else None


def pessimistic(efficiency: Efficiency, error: float) -> Efficiency:
    """``efficiency`` with every step ``1 + error`` times as long: each rate divided, each
    time multiplied (CPU overheads and all-reduce curves too, so the async max keeps its
    branch); sizes (``*_tokens``), the MoE load factors (``*_imbalance``, no rate) and the
    client's overhead, outside the step, stay."""
    factor = 1.0 + error
    scaled = {}
    for f in dataclasses.fields(Efficiency):
        value = getattr(efficiency, f.name)
        if f.name == "allreduce":
            scaled[f.name] = tuple(AllReduceCurve(c.tensor_parallel_size, c.message_bytes,
                                                  tuple(t * factor for t in c.seconds)) for c in value)
        elif f.name in COLLECTIVE_OPS:
            scaled[f.name] = tuple(dataclasses.replace(c, seconds=tuple(factor * t for t in c.seconds))
                                   for c in value)
        elif f.name == "deepep":
            scaled[f.name] = tuple(dataclasses.replace(c, dispatch_s=tuple(t * factor for t in c.dispatch_s),
                                                       combine_s=tuple(t * factor for t in c.combine_s))
                                   for c in value)
        elif f.name.endswith("_fraction"):
            scaled[f.name] = value / factor
        elif not f.name.endswith(("_tokens", "_imbalance")) and f.name != "client_overhead_s":
            scaled[f.name] = value * factor
    return dataclasses.replace(efficiency, **scaled)
