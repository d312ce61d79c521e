"""Calibration files: the cost model's factors, where they came from, and how far to trust them.

A calibration file is TOML. ``[cost_model]`` holds ``Efficiency`` fields; a file may
also carry

* ``[error]``: the fit's absolute relative error on a fold it was not fitted on, as
  fractions, per kind of answer: ``prefill_step``, ``decode_step``, ``ttft``, ``tpot``,
  ``e2e``. The replay and capacity commands turn these into the band around their answers
  (``kvtwin.sim.calibration.band``);
* ``[band]``: how far real servers' p99s lay from the replay's, held out: per kind of
  answer (``ttft``, ``tpot``, ``e2e``), ``[low, high]`` ratios of the measured p99 to the
  replay's (``low <= 1 <= high``). Where a kind has one, the band around that p99 is
  ``p99 x low .. p99 x high`` (docs/capacity.md#the-band) in place of ``[error]``'s
  symmetric one. The bundled files carry the band of the public serving runs
  (``bench/bench_fidelity_serving.py``);
* ``[[source]]``: each measurement set the fit used (repository, path, commit, licence,
  engine version);
* ``label``: one line naming the fit;
* ``warning``: why the measurements may not describe the GPU the file is for (``kvtwin
  calibrate --steps`` on steps timed on a CPU or another device).

kvtwin ships one file per GPU preset it has public measurements for, in
``sim/replay/data/calibration/<gpu>.toml`` (and ``<gpu>.<model>.toml`` where a model
needs its own). A scenario that names no calibration gets its GPU's bundled file; a
GPU/model pair without one runs on the default factors and says so.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.calibration.efficiency import Efficiency, efficiency_from_mapping

# The bundled files are package data of the replay's data folder, read as resources (no
# replay module is imported).
BUNDLED_PACKAGE = "kvtwin.sim.replay.data"
# The kinds of answer a fit's held-out error is given for, and what each bands.
ERROR_KINDS = ("prefill_step", "decode_step", "ttft", "tpot", "e2e")
# A summary latency figure -> the error kinds that bound it, most specific first.
BANDED_FIGURES = {"ttft_ms": ("ttft", "prefill_step"), "tpot_ms": ("tpot", "decode_step"),
                  "itl_ms": ("tpot", "decode_step"), "e2el_ms": ("e2e", "tpot", "decode_step")}
# The kinds a ``[band]`` of measured-to-replayed p99 ratios is given for.
BAND_KINDS = ("ttft", "tpot", "e2e")
_SOURCE_KEYS = ("repository", "path", "commit", "licence", "engine", "gpu", "notes")
# The label of a clock on the default factors.
UNCALIBRATED = "uncalibrated"


@dataclass(frozen=True)
class Calibration:
    """A cost-model calibration: the factors and, when known, their held-out error."""

    efficiency: Efficiency
    label: str  # "bundled h100 (aiconfigurator vLLM kernels, ...)", a path, or "uncalibrated"
    path: str | None = None
    errors: dict[str, float] = field(default_factory=dict)  # kind -> held-out |relative error|
    sources: tuple[dict[str, str], ...] = ()
    # Why an uncalibrated clock has no calibration, in words ("" when calibrated or not known):
    # every command that prints times says it (``kvtwin.sim.calibration.gpu``).
    note: str = ""
    # The file's own ``warning`` about its measurements ("" when none).
    warning: str = ""
    # kind -> (low, high): the held-out ratios of a measured p99 to the replay's.
    bands: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def calibrated(self) -> bool:
        return self.path is not None

    def band_ratios(self, figure: str) -> tuple[float, float] | None:
        """The factors a summary figure's p99 is multiplied by for the low and high edges
        of its band (docs/capacity.md#the-band): the ``[band]`` ratios of the first kind
        that has one, else ``1 -/+`` the ``[error]`` that ``error_for`` names (no lower than
        0), else None."""
        ratios = self.ratio_band(figure)
        if ratios is not None:
            return ratios
        error = self.error_for(figure)
        return None if error is None else (max(0.0, 1.0 - error), 1.0 + error)

    def band_error(self, figure: str) -> float | None:
        """The band's largest relative distance from the p99: the ``[error]`` itself where
        the band is symmetric, ``max(1 - low, high - 1)`` where it is a ``[band]``."""
        ratios = self.ratio_band(figure)
        return max(1.0 - ratios[0], ratios[1] - 1.0) if ratios is not None else self.error_for(figure)

    def ratio_band(self, figure: str) -> tuple[float, float] | None:
        """The ``[band]`` ratios that bound a figure, or None (its band, if any, is ``[error]``'s)."""
        for kind in BANDED_FIGURES.get(figure, ()):
            if kind in self.bands:
                return self.bands[kind]
        return None

    def error_for(self, figure: str) -> float | None:
        """The relative half-width of the band around a summary figure (``ttft_ms``...), or
        None when the calibration states no error for it."""
        for kind in BANDED_FIGURES.get(figure, ()):
            if kind in self.errors:
                return self.errors[kind]
        return None

    def with_overrides(self, entry: dict, *, where: str = "cost_model") -> Calibration:
        """The same calibration with a scenario's own ``[cost_model]`` keys on top."""
        if not entry:
            return self
        return dataclasses.replace(self, efficiency=efficiency_from_mapping(entry, where=where, base=self.efficiency))


def uncalibrated(efficiency: Efficiency = Efficiency(), note: str = "") -> Calibration:
    return Calibration(efficiency, UNCALIBRATED, note=note)


def read_calibration(path: Path | str, *, label: str | None = None, base: Efficiency = Efficiency()) -> Calibration:
    """A calibration file, checked; every error is one ``ConfigError`` naming the file.
    Factors the file does not set are ``base``'s."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("calibration", "an existing TOML file", str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("calibration", f"a readable TOML file ({err})", str(path)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("calibration", f"valid TOML ({err})", source=str(path)) from None
    try:
        return _calibration_from_data(data, path, label, base)
    except ConfigError as err:
        raise (err if err.source else err.with_source(str(path))) from None


def _calibration_from_data(data: dict, path: Path, label: str | None, base: Efficiency) -> Calibration:
    # Older files (kvtwin validate's) may hold the factors at the top level.
    entry = data["cost_model"] if "cost_model" in data else \
        {k: v for k, v in data.items() if k not in ("error", "band", "source", "label", "warning")}
    efficiency = efficiency_from_mapping(entry, base=base)
    errors = data.get("error", {})
    if not isinstance(errors, dict):
        raise ConfigError("error", "a table of held-out errors (fractions)", errors)
    for kind, value in errors.items():
        if kind not in ERROR_KINDS:
            raise ConfigError(f"error.{kind}", f"one of {', '.join(ERROR_KINDS)}", kind)
        # Above 1 is possible: a prediction twice the measurement is 100% off.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
            raise ConfigError(f"error.{kind}", "a non-negative relative error (0.1 is 10%)", value)
    bands = _bands(data.get("band", {}))
    sources = data.get("source", [])
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise ConfigError("source", "a list of [[source]] tables", sources)
    for i, source in enumerate(sources):
        for key, value in source.items():
            if key not in _SOURCE_KEYS or not isinstance(value, str):
                raise ConfigError(f"source[{i}].{key}", f"a string, one of {', '.join(_SOURCE_KEYS)}", value)
    file_label = data.get("label", "")
    if not isinstance(file_label, str):
        raise ConfigError("label", "a string", file_label)
    warning = data.get("warning", "")
    if not isinstance(warning, str):
        raise ConfigError("warning", "a string", warning)
    return Calibration(efficiency, label or file_label or str(path), str(path),
                       {k: float(v) for k, v in errors.items()}, tuple(dict(s) for s in sources), warning=warning,
                       bands=bands)


def _bands(table) -> dict[str, tuple[float, float]]:
    """A file's ``[band]``, checked: each kind a pair ``[low, high]`` with
    ``0 < low <= 1 <= high`` (a band that does not hold the replay's own figure is no band)."""
    if not isinstance(table, dict):
        raise ConfigError("band", "a table of [low, high] ratios of measured to replayed p99s", table)
    bands = {}
    for kind, pair in table.items():
        if kind not in BAND_KINDS:
            raise ConfigError(f"band.{kind}", f"one of {', '.join(BAND_KINDS)}", kind)
        numbers = isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
        if not numbers or not (0 < pair[0] <= 1 <= pair[1]):
            raise ConfigError(f"band.{kind}", "[low, high] with 0 < low <= 1 <= high (ratios of measured to "
                                              "replayed p99)", pair)
        bands[kind] = (float(pair[0]), float(pair[1]))
    return bands


def _bundled_dir():
    return resources.files(BUNDLED_PACKAGE).joinpath("calibration")


def bundled_calibration_path(gpu_name: str, model_name: str) -> Path | None:
    """The bundled file for this pair: ``<gpu>.<model>.toml`` before ``<gpu>.toml``."""
    folder = _bundled_dir()
    for name in (f"{gpu_name}.{model_name}.toml", f"{gpu_name}.toml"):
        candidate = folder.joinpath(name)
        if candidate.is_file():
            return Path(str(candidate))
    return None


def bundled_calibration(gpu_name: str, model_name: str) -> Calibration | None:
    path = bundled_calibration_path(gpu_name, model_name)
    return read_calibration(path) if path is not None else None


def bundled_gpus() -> tuple[str, ...]:
    """GPU presets with a bundled calibration."""
    return tuple(sorted(p.name.removesuffix(".toml") for p in _bundled_dir().iterdir()
                        if p.name.endswith(".toml") and p.name.count(".") == 1))
