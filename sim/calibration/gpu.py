"""Which bundled calibration a GPU gets and, when it gets none, why.

A preset's bundled calibration was fitted on that chip's kernels as fractions of its peaks,
so it holds while the fields a step's time depends on (``hardware.STEP_TIME_FIELDS``)
keep the preset's values: a price, a name or a memory size beside ``gpu = "h100"`` keeps
it. A changed one (a slower HBM, another compute capability) would make its factors
describe another device: the clock then runs on the default factors, and the
``Calibration.note`` names the field, so that every command that prints times says so.
"""

from __future__ import annotations

from kvtwin.sim.planner.hardware import GPU_PRESETS, GPUSpec
from kvtwin.sim.calibration.file import Calibration, bundled_calibration, bundled_gpus, uncalibrated
from kvtwin.sim.calibration.efficiency import Efficiency


def bundled_for(gpu: GPUSpec, model_name: str, efficiency: Efficiency) -> Calibration:
    """The bundled calibration of ``gpu``'s preset for this model; else ``efficiency``
    (the default factors with the scenario's own keys), uncalibrated, with the reason."""
    have = ", ".join(bundled_gpus()) or "none"
    if not gpu.preset:
        return uncalibrated(efficiency, f"{gpu.name} is a GPU described inline, not a preset, so no bundled "
                                        f"calibration applies (bundled: {have})")
    bundled = bundled_calibration(gpu.preset, model_name)
    if bundled is None:
        return uncalibrated(efficiency, f"no bundled calibration for {model_name} on {gpu.preset} (bundled: {have})")
    changed = gpu.step_time_changes()
    if changed:
        preset = GPU_PRESETS[gpu.preset]
        sets = ", ".join(f"{name} = {_shown(getattr(gpu, name))} (the preset's: {_shown(getattr(preset, name))})"
                         for name in changed)
        return uncalibrated(efficiency, f"the bundled {gpu.preset} calibration no longer applies: [hardware] sets "
                                        f"{sets}, which step times depend on")
    return bundled


def _shown(value: object) -> str:
    # Rates read as whole numbers (a byte rate in a sweep) or floats print alike.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return repr(value)
