"""Refit the cost model's factors from measured steps: `kvtwin validate`'s steps.parquet.

Each row is a batch the executor ran, with its measured seconds and the cost model's raw
terms of that batch (``step_model.STEP_TERM_COLUMNS``). ``step_model.fit_efficiency``
fits the factors on every other step and the rest is held out: the error per batch kind
is measured on steps the fit never saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.calibration.fit.step_model import (STEP_TERM_COLUMNS, Fit, StepSample, ape_by_kind, batch_kind,
                                           fit_efficiency, step_cost_from_terms)
from kvtwin.sim.calibration.efficiency import Efficiency

_REQUIRED = ("decode_tokens", "prefill_tokens", "measured_s", *STEP_TERM_COLUMNS.values())


def read_steps(path: Path | str) -> list[StepSample]:
    """The measured steps of a `kvtwin validate` steps.parquet (rows without a prediction
    or a positive time are skipped: a pass that ran nothing)."""
    source = str(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise ConfigError("steps", "an existing steps.parquet written by `kvtwin validate`", source) from None
    except (OSError, pa.ArrowInvalid) as err:
        raise ConfigError("steps", f"a parquet file ({err})", source) from None
    missing = [name for name in _REQUIRED if name not in table.column_names]
    if missing:
        raise ConfigError(missing[0], "a column of `kvtwin validate`'s steps.parquet (this one is older or "
                          "another file)", "absent", source=source)
    columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in _REQUIRED}
    samples = []
    for i in range(table.num_rows):
        row = {name: columns[name][i] for name in _REQUIRED}
        measured = float(row["measured_s"])
        if not (math.isfinite(measured) and measured > 0) or any(
                not math.isfinite(float(row[c])) for c in STEP_TERM_COLUMNS.values()):
            continue
        decode, prefill = int(row["decode_tokens"]), int(row["prefill_tokens"])
        if decode < 0 or prefill < 0 or decode + prefill == 0:
            raise ConfigError(f"row {i}: decode_tokens, prefill_tokens", "non-negative counts, not both 0",
                              (decode, prefill), source=source)
        samples.append(StepSample(step_cost_from_terms(row), measured, batch_kind(decode, prefill)))
    if len(samples) < 4:
        raise ConfigError("steps", "at least 4 measured steps (half are held out)", len(samples), source=source)
    return samples


@dataclass(frozen=True)
class StepsFit:
    fit: Fit
    held_out: list[dict]  # ape_by_kind rows over the held-out steps
    fold: str

    @property
    def efficiency(self) -> Efficiency:
        return self.fit.efficiency

    def p90_errors(self) -> dict[str, float]:
        """The [error] table: decode_step from decode-only steps, prefill_step from steps
        with prefill (the larger of mixed and prefill-heavy)."""
        by_kind = {row["kind"]: row["p90_ape"] for row in self.held_out if row["count"]}
        out = {}
        if "decode-only" in by_kind:
            out["decode_step"] = by_kind["decode-only"]
        prefill = [by_kind[k] for k in ("mixed", "prefill-heavy") if k in by_kind]
        if prefill:
            out["prefill_step"] = max(prefill)
        return out


def fit_steps(samples: list[StepSample], *, flops_per_s: float, bytes_per_s: float, async_scheduling: bool,
              base: Efficiency) -> StepsFit:
    held = np.arange(len(samples)) % 2 == 1
    train = [s for s, h in zip(samples, held) if not h]
    test = [s for s, h in zip(samples, held) if h]
    fit = fit_efficiency(train, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s,
                         async_scheduling=async_scheduling, base=base)
    rows = ape_by_kind([fit.predict_s(s.cost) for s in test], [s.measured_s for s in test], [s.kind for s in test])
    return StepsFit(fit, rows, f"every other step ({len(test)}), fitted on the other {len(train)}")
