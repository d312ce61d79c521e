"""What a validation run finds: one verdict per check and rows of ``validation.parquet``.

Its own module so that the checks (``validate``, ``memory``) both write into it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

VALIDATION_COLUMNS: dict[str, pa.DataType] = {
    "check": pa.string(),
    "item": pa.string(),  # a request id, a batch kind, a memory term, or "all"
    "metric": pa.string(),
    "expected": pa.float64(),  # the prediction (or the reference run)
    "observed": pa.float64(),  # the device's value
    "error": pa.float64(),  # observed - expected, or the relative error where the metric says so
    "passed": pa.bool_(),  # null: informational
    "detail": pa.string(),
}

CHECKS = ("prefix_hits_are_real", "predicted_hits_are_executed", "memory", "step_latency")


@dataclass
class Verdict:
    check: str
    status: str  # "pass", "fail", "skipped", "info"
    line: str

    @property
    def failed(self) -> bool:
        return self.status == "fail"


@dataclass
class Validation:
    verdicts: list[Verdict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    calibration_toml: str | None = None
    executor_steps: pa.Table | None = None

    @property
    def failed(self) -> bool:
        return any(v.failed for v in self.verdicts)

    def row(self, check: str, item: str, metric: str, expected=None, observed=None, error=None, passed=None,
            detail: str = "") -> None:
        self.rows.append(dict(check=check, item=item, metric=metric, expected=_num(expected),
                              observed=_num(observed), error=_num(error), passed=passed, detail=detail))

    def table(self) -> pa.Table:
        return pa.table({name: pa.array([r[name] for r in self.rows], type=kind)
                         for name, kind in VALIDATION_COLUMNS.items()})


def _num(value) -> float | None:
    return None if value is None else float(value)
