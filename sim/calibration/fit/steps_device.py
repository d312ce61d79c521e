"""Which device measured a `kvtwin validate` steps.parquet, and whether it is the GPU that a
calibration fitted on those steps is filed for.

A calibration's factors are the measuring device's: steps timed on a CPU (``kvtwin
validate``'s default, a scaled-down model) or on another GPU fitted to the scenario's GPU
give that GPU another device's clock. ``kvtwin validate`` records the device in the
file's schema metadata (``STEPS_DEVICE_KEY``); ``kvtwin calibrate --steps`` reads it and
warns (``device_warning``), on stderr and in the calibration file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pyarrow.parquet as pq

from kvtwin.sim.planner.hardware import GPUSpec

# Schema-metadata key of validate's steps.parquet: {"device": "cpu" | "cuda", "name": ...,
# "scaled_model": bool}.
STEPS_DEVICE_KEY = b"kvtwin.steps_device"


@dataclass(frozen=True)
class MeasuredOn:
    device: str  # "cpu" or "cuda"
    name: str  # "cpu", or the GPU's name as torch gives it ("NVIDIA H100 80GB HBM3")
    scaled_model: bool  # a scaled-down model (few narrow layers), not the preset's sizes

    def metadata(self) -> dict[bytes, bytes]:
        """The schema metadata a steps table carries (``read_measured_on`` reads it back)."""
        return {STEPS_DEVICE_KEY: json.dumps({"device": self.device, "name": self.name,
                                              "scaled_model": self.scaled_model}, sort_keys=True).encode()}


def read_measured_on(path) -> MeasuredOn | None:
    """The device a steps.parquet says it was measured on; None when it does not say (a file
    from before the record, or not `kvtwin validate`'s) or says it unreadably."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(STEPS_DEVICE_KEY)
        entry = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("device", "name")):
        return None
    return MeasuredOn(entry["device"], entry["name"], bool(entry.get("scaled_model", False)))


def device_warning(measured: MeasuredOn | None, gpu: GPUSpec) -> str | None:
    """Why steps measured on ``measured`` may not describe ``gpu`` (None when they do)."""
    filed_for = gpu.preset or gpu.name
    if measured is None:
        return (f"the steps file does not say which device measured it (kvtwin validate records it), so it may "
                f"not be a {filed_for}: the fitted factors are that device's")
    if measured.device != "cuda":
        model = ", a scaled-down model" if measured.scaled_model else ""
        return (f"the steps were measured on a CPU (kvtwin validate --device {measured.device}{model}), not on a "
                f"{filed_for}: the fitted factors describe that CPU, not the {filed_for} the calibration is for")
    if not is_same_gpu(measured.name, gpu):
        return (f"the steps were measured on {measured.name}, not on a {filed_for}: the fitted factors describe "
                f"that GPU, not the {filed_for} the calibration is for")
    if measured.scaled_model:
        return (f"the steps were measured on a scaled-down model on {measured.name}: the fitted factors describe "
                f"its small kernels, not the model's on a {filed_for}")
    return None


def is_same_gpu(device_name: str, gpu: GPUSpec) -> bool:
    """Whether a device name (``torch.cuda.get_device_name``) is this GPU: every part of the
    preset's name ("a100-80gb": a100 and 80gb) is a word of it ("NVIDIA A100-SXM4-80GB")."""
    words = set(_words(device_name))
    return all(part in words for part in _words(gpu.preset or gpu.name))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())
