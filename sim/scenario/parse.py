"""Scenario files: one TOML describing model, hardware, engine, workload, SLO, cost model,
offload tiers and speculative decoding.

Format: ``scenarios/README.md``. ``resolve.py`` merges a scenario with command-line
overrides. Every table and key is checked: an unknown one is an
error naming the file, the key and the allowed ones, never silently ignored. Paths in a
scenario (a trace, a calibration file, an HF config) are relative to the scenario file;
``bundled:NAME`` names a trace shipped with kvtwin.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kvtwin.sim.core.errors import ConfigError, config_from_table, reject_unknown_keys
from kvtwin.sim.planner.engine_config import ENGINE_KEYS, EngineConfig, engine_config_from_mapping
from kvtwin.sim.planner.hardware import GPUSpec, gpu_from_mapping
from kvtwin.sim.planner.hf_config import load_hf_config
from kvtwin.sim.planner.models import ModelPreset, get_model, model_from_mapping
from kvtwin.sim.planner.offload import OffloadConfig, offload_config_from_mapping
from kvtwin.sim.calibration.file import Calibration, read_calibration
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.disaggregation import Disaggregation, disaggregation_from_mapping
from kvtwin.sim.calibration.efficiency import Efficiency, efficiency_from_mapping
from kvtwin.sim.scenario.knobs import DEPLOYMENT_FIELDS, TRANSFORM_KEYS, knob, section_knobs
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.scenario.speculative import SPECULATIVE_KEYS, SpeculativeConfig
from kvtwin.sim.scenario.trace_source import trace_options
from kvtwin.sim.scenario.validators import check_keys, fields_under, table_of
from kvtwin.traces.bundled import resolve
from kvtwin.traces.errors import TraceError
from kvtwin.traces.options import OPTIONS, SCENARIO, LoadOptions
from kvtwin.traces.synth_spec import parse_spec

if TYPE_CHECKING:  # a type only: reading a scenario (kvtwin plan) loads no trace, nor pyarrow
    import pyarrow as pa

SECTIONS = ("description", "model", "hardware", "engine", "workload", "slo", "cost_model", "run", "offload",
            "disaggregation", "speculative")
TRACE_KEYS = ("trace",) + tuple(OPTIONS)  # the trace, and how to read it (traces/options.py)
SLO_KEYS = tuple(section_knobs("slo"))
RUN_KEYS = tuple(section_knobs("run"))


@dataclass(frozen=True)
class Workload:
    """Where the requests come from (a trace file, or a synthetic spec) and how to cut it."""

    trace: Path | None = None
    synth: dict | None = None
    load_options: LoadOptions = LoadOptions()
    transforms: dict = field(default_factory=dict)
    base_dir: Path = Path(".")

    def load(self) -> pa.Table:
        return self.cut(self.load_source())

    def check_source(self) -> None:
        """Refuse a trace that cannot be read as asked (its format, a generic file's column
        map) without reading its requests: before a run of many replays, not in each."""
        if self.trace is not None:
            from kvtwin.traces.load import check_source

            check_source(self.trace, self.load_options)

    def load_source(self) -> pa.Table:
        """The requests before any cut (a caller replaying many cuts of one source loads it
        once). A source without a single request is bad input: nothing could be replayed."""
        # The reader or the generator (pyarrow, NumPy) loads here, when there are requests to make.
        if self.trace is not None:
            from kvtwin.traces.load import load_trace, require_requests

            return require_requests(load_trace(self.trace, self.load_options), self.trace)
        from kvtwin.traces.synth import synthesize

        return synthesize(parse_spec(self.synth, "workload"), self.base_dir, "scenario workload", where="workload")

    def cut(self, table: pa.Table) -> pa.Table:
        """This workload's cuts, in their order, applied to ``table``; a cut that leaves no
        request is refused, naming it."""
        from kvtwin.traces import transforms  # NumPy and pyarrow, only when there is a table to cut

        try:
            return transforms.apply_cuts(table, self.transforms)
        except transforms.CutError as err:
            raise ConfigError(" and ".join(f"workload.{k}" for k in err.keys), err.expected, err.got) from None


@dataclass(frozen=True)
class Scenario:
    path: Path | None = None
    description: str = ""
    model: ModelPreset | None = None
    gpu: GPUSpec | None = None
    engine: EngineConfig = EngineConfig()
    deployment: Deployment = Deployment()
    workload: Workload | None = None
    slo: SLO = SLO()
    efficiency: Efficiency = Efficiency()
    # The file [cost_model] calibration names (None: the GPU's bundled one, chosen when
    # the GPU is known), and the scenario's own [cost_model] keys that go on top of it.
    calibration: Calibration | None = None
    cost_overrides: Mapping[str, object] = field(default_factory=dict)
    time_limit_s: float | None = None
    offload: OffloadConfig = OffloadConfig()
    # Disaggregated prefill/decode (None: every replica does both).
    disaggregation: Disaggregation | None = None
    speculative: SpeculativeConfig = SpeculativeConfig()


def check_transform(key: str, value: object, where: str) -> None:
    knob(f"workload.{key}").check(value, where)


def check_time_limit(value: object, where: str) -> None:
    knob("run.time_limit_s").check(value, where)


def model_from_table(table: dict[str, Any], base_dir: Path) -> ModelPreset:
    """``[model]``: ``preset = NAME`` or ``hf_config = PATH`` (either with field
    overrides), or a whole inline description."""
    if not isinstance(table, dict):
        raise ConfigError("model", "a table", table)
    fields = dict(table)
    preset = fields.pop("preset", None)
    hf_config = fields.pop("hf_config", None)
    if preset is not None and hf_config is not None:
        raise ConfigError("model", "either preset or hf_config, not both")
    if hf_config is not None:
        path = Path(hf_config)
        return load_hf_config(path if path.is_absolute() else base_dir / path, name=fields.pop("name", None),
                              overrides=fields)
    if preset is not None:
        base = get_model(preset, field="model.preset")
        if not fields:
            return base
        merged = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        if "state" in fields or base.state is None:
            merged.pop("state")
        else:
            merged["state"] = {"kind": base.state.kind, **dataclasses.asdict(base.state)}
        merged.update(fields)
        return model_from_mapping(merged)
    return model_from_mapping(fields)


def _workload(table: dict, base_dir: Path) -> Workload | None:
    if not table:
        return None
    transform = {k: table[k] for k in TRANSFORM_KEYS if k in table}
    for key, value in transform.items():
        check_transform(key, value, f"workload.{key}")
    if "end_s" in transform and transform["end_s"] <= transform.get("start_s", 0.0):
        raise ConfigError("workload.end_s", f"a time after workload.start_s ({transform.get('start_s', 0.0):g} s)",
                          transform["end_s"])
    if "trace" in table:
        check_keys(table, TRACE_KEYS + TRANSFORM_KEYS, "workload")
        options = trace_options({k: table[k] for k in OPTIONS if k in table}, SCENARIO)
        try:
            trace = resolve(table["trace"], base_dir)
        except TraceError as err:
            raise ConfigError("workload.trace", err.expected, table["trace"]) from None
        return Workload(trace=trace, load_options=options, transforms=transform, base_dir=base_dir)
    if "kind" in table:
        synth = {k: v for k, v in table.items() if k not in TRANSFORM_KEYS}
        parse_spec(synth, "workload")  # check now, so errors name the scenario file
        return Workload(synth=synth, transforms=transform, base_dir=base_dir)
    raise ConfigError("workload", "trace = PATH (a trace file, or bundled:NAME) or kind = requests|chat|agent "
                      "(a synthetic workload)")


def engine_and_deployment(table: dict) -> tuple[EngineConfig, Deployment]:
    """``[engine]``: the engine's knobs and, beside them, the deployment's (replicas, router)."""
    allowed = ENGINE_KEYS + DEPLOYMENT_FIELDS
    reject_unknown_keys(table, allowed, where="engine", expected=f"an engine setting ({', '.join(sorted(allowed))})")
    engine = engine_config_from_mapping({k: v for k, v in table.items() if k not in DEPLOYMENT_FIELDS})
    with fields_under("engine"):
        deployment = Deployment(**{k: v for k, v in table.items() if k in DEPLOYMENT_FIELDS})
    return engine, deployment


def parse_scenario(data: dict, base_dir: Path) -> Scenario:
    """Each table checked alone; which features combine is checked once they are all known,
    flags included (``resolve_scenario``, docs/architecture.md#features-and-their-combinations)."""
    check_keys(data, SECTIONS, "scenario")
    engine, deployment = engine_and_deployment(table_of(data, "engine"))
    offload = offload_config_from_mapping(table_of(data, "offload"))
    disaggregation = disaggregation_from_mapping(table_of(data, "disaggregation"))
    speculative = config_from_table(SpeculativeConfig, table_of(data, "speculative"), where="speculative",
                                    table_is="a table of speculative-decoding settings", known=SPECULATIVE_KEYS,
                                    expected=f"one of {', '.join(SPECULATIVE_KEYS)}")
    slo_table = table_of(data, "slo")
    check_keys(slo_table, SLO_KEYS, "slo")
    for key, value in slo_table.items():
        knob(f"slo.{key}").check(value, f"slo.{key}")
    cost_table = dict(table_of(data, "cost_model"))
    calibration = cost_table.pop("calibration", None)
    named = None
    if calibration is not None:
        if not isinstance(calibration, str):
            raise ConfigError("cost_model.calibration", "a path to a calibration file", calibration)
        path = Path(calibration)
        named = read_calibration(path if path.is_absolute() else base_dir / path)
    # Checked now, so that a bad key names the scenario file.
    efficiency = efficiency_from_mapping(cost_table, base=named.efficiency if named else Efficiency())
    run_table = table_of(data, "run")
    check_keys(run_table, RUN_KEYS, "run")
    time_limit = run_table.get("time_limit_s")
    if time_limit is not None:
        check_time_limit(time_limit, "run.time_limit_s")
    return Scenario(
        description=str(data.get("description", "")),
        model=model_from_table(data["model"], base_dir) if "model" in data else None,
        gpu=gpu_from_mapping(data["hardware"]) if "hardware" in data else None,
        engine=engine, deployment=deployment, workload=_workload(table_of(data, "workload"), base_dir),
        slo=SLO(**slo_table), efficiency=efficiency, time_limit_s=time_limit, offload=offload,
        calibration=named, cost_overrides=cost_table, disaggregation=disaggregation, speculative=speculative)


def load_scenario_data(path: Path) -> dict:
    """A scenario file's TOML mapping, unchecked (``scenario_from_data`` checks it)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("scenario", "an existing scenario file", str(path)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("scenario", f"valid TOML ({err})", source=str(path)) from None


def load_scenario(path: Path) -> Scenario:
    return scenario_from_data(load_scenario_data(path), path)


def scenario_from_data(data: dict, path: Path) -> Scenario:
    """A scenario from its TOML mapping (e.g. a file's, edited), checked as if read from ``path``."""
    path = Path(path)
    try:
        scenario = parse_scenario(data, path.parent)
    except ConfigError as err:
        raise err if err.source else err.with_source(str(path)) from None
    return dataclasses.replace(scenario, path=path)
