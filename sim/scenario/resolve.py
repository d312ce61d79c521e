"""A scenario file merged with command-line overrides: the one set of rules every command
that plans or runs the engine shares (plan, replay, capacity, validate, calibrate).

Precedence, field by field: a flag wins over the scenario, which wins over vLLM's defaults.

* model: ``--model PRESET`` or ``--hf-config PATH`` (not both), else the scenario's ``[model]``;
* GPU: ``--gpu PRESET``, else ``[hardware]``;
* engine: the scenario's ``[engine]`` table, then each engine flag given; the deployment's
  ``--replicas`` and ``--router`` likewise (as flags, refused beside a ``[disaggregation]`` table,
  whose prefill and decode replicas are the deployment);
* workload: ``--trace`` replaces the scenario's source but keeps its cuts (``limit``,
  ``rate_scale``, ...); ``--limit`` and ``--rate-scale`` replace those cuts; the reading
  flags (``--format``, ``--map``, ``--time-unit``, ``--arrivals``, ...) say how to read
  ``--trace``, or, without it, override the scenario's ``[workload]`` keys of those names;
* ``--time-limit-s`` wins over ``[run] time_limit_s``;
* offload: the scenario's ``[offload]`` table, then each ``--offload-*`` flag given
  (``--offload-cpu-bytes``, ``--offload-policy``, ``--offload-disk-bytes``,
  ``--offload-disk-bandwidth``);
* speculative decoding: the scenario's ``[speculative]`` table, then each of
  ``--speculative-method``, ``--num-speculative-tokens``, ``--spec-acceptance`` given; the
  plan's scheduler gets its k drafts and lookahead slots (``ResolvedScenario.plan``);
* cost model: the file ``[cost_model] calibration`` names, else the GPU preset's bundled
  calibration (while no field a step's time depends on differs from the preset), else the
  defaults (uncalibrated, and why); the table's other keys go on top.

Every flag is checked here, before any trace is read or any step simulated, and refused with
the flag's name; then, once every feature is known, which features combine is checked
against the one table of them (``features.py``, docs/architecture.md#features-and-their-combinations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.engine_config import EngineConfig, kv_cache_memory_limit
from kvtwin.sim.planner.hardware import GPUSpec, get_gpu, require_cost_model_inputs
from kvtwin.sim.planner.hf_config import load_hf_config
from kvtwin.sim.planner.host_memory import HostMemoryEstimate, require_host_memory
from kvtwin.sim.planner.models import ModelPreset, get_model
from kvtwin.sim.planner.offload import OffloadConfig, ResolvedOffload
from kvtwin.sim.planner.plan import Plan, plan
from kvtwin.sim.calibration.file import Calibration
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.disaggregation import Disaggregation, require_sides_plannable
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.scenario.features import require_allowed
from kvtwin.sim.calibration.gpu import bundled_for
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.scenario.speculative import SpeculativeConfig
from kvtwin.sim.scenario.knobs import DEPLOYMENT_FIELDS, flag_for, knob
from kvtwin.sim.scenario.parse import Scenario, Workload, load_scenario, scenario_from_data
from kvtwin.sim.scenario.trace_source import trace_options
from kvtwin.traces.bundled import resolve as resolve_trace
from kvtwin.traces.options import FLAGS, OPTIONS

@dataclass(frozen=True)
class Overrides:
    """What the command line said; None (or absent) means "not given"."""

    model: str | None = None
    hf_config: Path | None = None
    gpu: str | None = None
    trace: str | None = None
    engine: Mapping[str, object] = field(default_factory=dict)  # EngineConfig field -> value
    rate_scale: float | None = None
    limit: int | None = None
    time_limit_s: float | None = None
    offload: Mapping[str, object] = field(default_factory=dict)  # OffloadConfig field -> value
    speculative: Mapping[str, object] = field(default_factory=dict)  # SpeculativeConfig field -> value
    # How to read the trace (``kvtwin.traces.options.OPTIONS`` name -> value).
    trace_options: Mapping[str, object] = field(default_factory=dict)
    deployment: Mapping[str, object] = field(default_factory=dict)  # Deployment field -> value

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, object], **sources: object) -> Overrides:
        """The overrides of a command's knob flags (``section.name`` -> value, None: not
        given) beside its source flags (``model``, ``gpu``, ``trace``, ...)."""
        engine = {k.removeprefix("engine."): v for k, v in knobs.items() if k.startswith("engine.")}
        # ``[engine] replicas`` and ``router`` sit in the engine's table but configure the deployment.
        deployment = {name: engine.pop(name) for name in DEPLOYMENT_FIELDS if name in engine}
        offload = {k.removeprefix("offload."): v for k, v in knobs.items() if k.startswith("offload.")}
        speculative = {k.removeprefix("speculative."): v for k, v in knobs.items()
                       if k.startswith("speculative.") and v is not None}
        return cls(**sources, engine=engine, offload={k: v for k, v in offload.items() if v is not None},
                   speculative=speculative, deployment=deployment,
                   rate_scale=knobs.get("workload.rate_scale"), limit=knobs.get("workload.limit"),
                   time_limit_s=knobs.get("run.time_limit_s"))

    def check(self) -> None:
        """Refuse a bad flag value by the flag's name (nothing has been read yet)."""
        if self.model is not None and self.hf_config is not None:
            raise ConfigError("--model", "either --model or --hf-config, not both")
        for key, value in (("workload.rate_scale", self.rate_scale), ("workload.limit", self.limit),
                           ("run.time_limit_s", self.time_limit_s)):
            if value is not None:
                knob(key).check(value, knob(key).flag or key)
        trace_options(self.trace_options, FLAGS)

    def given(self) -> dict:
        """The flags that were given, for a run's metadata."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("engine", "offload", "speculative", "trace_options", "deployment")}
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in out.items() if v is not None}
        out.update({k: v for k, v in self.engine.items() if v is not None})
        out.update({k: v for k, v in self.deployment.items() if v is not None})
        out.update({f"offload_{k}": v for k, v in self.offload.items() if v is not None})
        out.update({f"speculative_{k}": v for k, v in self.speculative.items() if v is not None})
        out.update({f"trace_{k}": v for k, v in self.trace_options.items()})
        return out


@dataclass(frozen=True)
class ResolvedScenario:
    """Everything a command needs to plan or run, with every choice made."""

    source: Path | None
    description: str
    model: ModelPreset
    gpu: GPUSpec
    engine: EngineConfig
    deployment: Deployment
    workload: Workload | None
    slo: SLO
    efficiency: Efficiency
    time_limit_s: float | None
    overrides: Overrides
    offload: OffloadConfig = OffloadConfig()
    # Where ``efficiency`` came from and its held-out error (the band on every answer).
    calibration: Calibration | None = None
    # Disaggregated prefill/decode (None: every replica does both).
    disaggregation: Disaggregation | None = None
    speculative: SpeculativeConfig = SpeculativeConfig()

    @property
    def where(self) -> str | None:
        return str(self.source) if self.source is not None else None

    def plan(self) -> Plan:
        # Drafting sizes a Mamba layer's speculative state blocks (its pool worst case too);
        # a draft head's layers and weights take their share of the GPU.
        drafts = self.speculative.num_speculative_tokens if self.speculative.enabled else 0
        engine = self.engine
        pd = self.disaggregation
        if pd is not None and pd.has_data_parallel_sides:
            # Wide-EP P/D: the run's plan is its prefill side's, the one its first engines
            # run (a model too big for one GPU fits only with its side's experts spread:
            # docs/semantics.md#data-parallel-pd-sides); the decode side plans its own.
            engine = dataclasses.replace(engine, data_parallel_size=pd.prefill_data_parallel_size)
        planned = plan(self.model, self.gpu, engine, num_speculative_tokens=drafts,
                       draft_head=self.speculative.draft_head,
                       num_prefill_lookahead_tokens=self.speculative.num_prefill_lookahead_tokens)
        return with_speculative(planned, self.speculative, self.where, self.overrides)

    def offload_for(self, planned: Plan) -> ResolvedOffload | None:
        """The offload tiers sized for ``planned`` (None: no offloading); errors name the file."""
        try:
            return self.offload.resolve(planned)
        except ConfigError as err:
            name = err.field.removeprefix("offload.")
            if self.overrides.offload.get(name) is not None:
                raise ConfigError(flag_for("offload", name), err.expected, err.got) from None
            raise err if err.source or self.where is None else err.with_source(self.where) from None

    def describe(self) -> dict:
        """What runs, every choice made (flags over file over defaults), in JSON types: the
        run directory records it (``reports/SCHEMA.md``, metadata ``resolved``) so that a
        report's headline and ``kvtwin diff`` say what ran, not what the file described.
        Engine sizes are the plan's (``plan.json``); these are the rest."""
        workload = self.workload
        source = None
        if workload is not None:
            # The file's name only: an absolute path would differ between two checkouts of one run.
            source = workload.trace.name if workload.trace is not None else f"synthetic {workload.synth.get('kind')}"
        pd = self.disaggregation
        described = {
            "model": self.model.name,
            "gpu": self.gpu.name,
            "tensor_parallel_size": self.engine.tensor_parallel_size,
            "replicas": None if pd is not None else self.deployment.replicas,
            "router": None if pd is not None else self.deployment.router,
            "disaggregation": None if pd is None else {
                "prefill_replicas": pd.prefill_replicas, "decode_replicas": pd.decode_replicas, "link": pd.link,
                "prefill_router": pd.prefill_router, "decode_router": pd.decode_router,
                # Only where set: a P/D run of plain engines records what it always did.
                **({"prefill_data_parallel_size": pd.prefill_data_parallel_size,
                    "decode_data_parallel_size": pd.decode_data_parallel_size}
                   if pd.has_data_parallel_sides else {})},
            "offload": None if not self.offload.enabled else {
                "cpu_bytes": self.offload.cpu_bytes, "disk_bytes": self.offload.disk_bytes,
                "policy": self.offload.policy},
            "speculative": None if not self.speculative.enabled else {
                "method": self.speculative.method,
                "num_speculative_tokens": self.speculative.num_speculative_tokens},
            "workload": source,
            "workload_cuts": dict(sorted(workload.transforms.items())) if workload is not None else {},
            "slo_ttft_s": self.slo.ttft_s,
            "slo_tpot_s": self.slo.tpot_s,
            "calibration": self.calibration.label if self.calibration is not None else None,
            "time_limit_s": self.time_limit_s,
        }
        eng = self.engine
        if eng.pipeline_parallel_size > 1 or eng.data_parallel_size > 1 or eng.enable_expert_parallel:
            # Only where set: a run of one engine on one TP group records what it always did.
            described["parallel"] = {
                "pipeline_parallel_size": eng.pipeline_parallel_size,
                "data_parallel_size": eng.data_parallel_size,
                "enable_expert_parallel": eng.enable_expert_parallel,
                "dp_router": self.deployment.dp_router if eng.data_parallel_size > 1 else None,
                "dp_lockstep": eng.data_parallel_size > 1 and self.model.num_experts > 0}
        return described

    def require_workload(self) -> Workload:
        """The workload to replay; and since a replay prices its steps, a GPU the cost model
        can price them on (an inline one may plan without a bandwidth, not replay)."""
        if self.workload is None:
            raise ConfigError("workload", "a [workload] table in the scenario or --trace", source=self.where)
        try:
            require_cost_model_inputs(self.gpu)
        except ConfigError as err:
            raise err.with_source(self.where) if self.where else err from None
        return self.workload

    @property
    def num_replicas(self) -> int:
        """Engines the replay builds: the prefill and decode replicas when disaggregated."""
        if self.disaggregation is not None:
            return self.disaggregation.num_replicas
        return self.deployment.replicas

    def require_host_memory(self, planned: Plan, available_bytes: int | None = None) -> HostMemoryEstimate:
        """Refuse, before any pool is built, a run whose block pools would not fit in this
        machine's memory (``sim/planner/host_memory.py``), naming the setting to change: the
        replicas when there are several, else what sized the KV cache."""
        where: str | None = self.where
        if self.disaggregation is not None:
            field = "disaggregation.prefill_replicas + decode_replicas"
            got: object = self.disaggregation.num_replicas
        elif self.deployment.replicas > 1:
            field, got = "engine.replicas", self.deployment.replicas
            if self.overrides.deployment.get("replicas") is not None:
                field, where = flag_for("engine", "replicas"), None
        elif self.engine.kv_cache_memory_bytes is not None:
            field, got = "engine.kv_cache_memory_bytes", self.engine.kv_cache_memory_bytes
            if self.overrides.engine.get("kv_cache_memory_bytes") is not None:
                field, where = flag_for("engine", "kv_cache_memory_bytes"), None
        else:
            field, got = "hardware.memory_bytes", self.gpu.memory_bytes
            if self.overrides.gpu is not None:
                field, got, where = "--gpu", self.overrides.gpu, None
        return require_host_memory(planned.num_blocks, self.num_replicas, field=field, got=got, source=where,
                                   available_bytes=available_bytes)


def resolve_scenario(path: Path | None, overrides: Overrides = Overrides(), *,
                     data: dict | None = None) -> ResolvedScenario:
    """Load ``path`` (if given) and apply ``overrides``; every error is one ``ConfigError``.
    ``data``, if given, is the scenario's TOML mapping to use instead of the file's (an
    edited copy, as ``kvtwin capacity`` makes per point); paths in it stay relative to ``path``."""
    overrides.check()
    if data is not None:
        scenario = scenario_from_data(data, path if path is not None else Path("scenario"))
    else:
        scenario = load_scenario(path) if path is not None else Scenario()
    where = str(path) if path is not None else None

    if overrides.model is not None:
        model = get_model(overrides.model, field="--model")
    elif overrides.hf_config is not None:
        model = load_hf_config(overrides.hf_config)
    elif scenario.model is not None:
        model = scenario.model
    else:
        raise ConfigError("model", "--model PRESET, --hf-config PATH or a scenario with a [model] table",
                          source=where)
    if overrides.gpu is not None:
        gpu = get_gpu(overrides.gpu, field="--gpu")
    elif scenario.gpu is not None:
        gpu = scenario.gpu
    else:
        raise ConfigError("hardware", "--gpu PRESET or a scenario with a [hardware] table", source=where)

    engine = scenario.engine
    for name, value in overrides.engine.items():
        if value is None:
            continue
        try:
            engine = dataclasses.replace(engine, **{name: value})
        except ConfigError as err:
            raise ConfigError(flag_for("engine", name), err.expected, err.got) from None

    _check_kv_cache_memory(engine, gpu, overrides, where)

    workload = scenario.workload
    if overrides.trace is not None:
        workload = Workload(trace=resolve_trace(overrides.trace), load_options=trace_options(overrides.trace_options,
                                                                                              FLAGS),
                            transforms=dict(workload.transforms) if workload is not None else {})
    elif overrides.trace_options:
        if workload is None or workload.trace is None:
            flag = OPTIONS[next(iter(overrides.trace_options))].flag
            raise ConfigError(flag, "a trace to read (--trace, or a scenario whose [workload] names a trace)",
                              source=where)
        workload = dataclasses.replace(workload, load_options=trace_options(overrides.trace_options, FLAGS,
                                                                            workload.load_options))
    if workload is not None and (overrides.rate_scale is not None or overrides.limit is not None):
        cuts = dict(workload.transforms)
        if overrides.rate_scale is not None:
            cuts["rate_scale"] = overrides.rate_scale
        if overrides.limit is not None:
            cuts["limit"] = overrides.limit
        workload = dataclasses.replace(workload, transforms=cuts)

    offload = _offload(scenario, overrides)
    deployment = _deployment(scenario, overrides)
    speculative = _speculative(scenario.speculative, overrides)
    time_limit_s = overrides.time_limit_s if overrides.time_limit_s is not None else scenario.time_limit_s
    calibration = choose_calibration(scenario, model, gpu, where)
    resolved = ResolvedScenario(source=path, description=scenario.description, model=model, gpu=gpu, engine=engine,
                            deployment=deployment, workload=workload, slo=scenario.slo,
                            efficiency=calibration.efficiency,
                            time_limit_s=time_limit_s, overrides=overrides, offload=offload, calibration=calibration,
                            disaggregation=scenario.disaggregation, speculative=speculative)
    # Every feature is known now, flags included: the one check of which combine.
    require_allowed(resolved, overrides, where)
    require_sides_plannable(scenario.disaggregation, model, gpu, engine, where)
    return resolved


def _offload(scenario: Scenario, overrides: Overrides) -> OffloadConfig:
    """The scenario's offload tiers with the offload flags on top; errors name the flag."""
    given = {name: value for name, value in overrides.offload.items() if value is not None}
    if not given:
        return scenario.offload
    # All at once: a disk tier's size and bandwidth are checked together.
    try:
        return dataclasses.replace(scenario.offload, **given)
    except ConfigError as err:
        if err.field in given:
            raise ConfigError(flag_for("offload", err.field), err.expected, err.got) from None
        # A scenario value (or default) the flags made inconsistent: both ways to set it.
        raise ConfigError(f"{flag_for('offload', err.field)} or [offload] {err.field}", err.expected,
                          err.got) from None


def _deployment(scenario: Scenario, overrides: Overrides) -> Deployment:
    """The scenario's replicas and router with ``--replicas`` and ``--router`` on top; errors
    name the flag."""
    given = {name: value for name, value in overrides.deployment.items() if value is not None}
    if not given:
        return scenario.deployment
    try:
        return dataclasses.replace(scenario.deployment, **given)
    except ConfigError as err:
        raise ConfigError(flag_for("engine", err.field), err.expected, err.got) from None


def _check_kv_cache_memory(engine: EngineConfig, gpu: GPUSpec, overrides: Overrides, where: str | None) -> None:
    """A KV cache larger than the GPU is refused here, named where it was set, before the
    planner would make a pool of that many blocks."""
    kv = engine.kv_cache_memory_bytes
    if kv is None or kv <= gpu.memory_bytes:
        return
    if overrides.engine.get("kv_cache_memory_bytes") is not None:
        raise ConfigError(flag_for("engine", "kv_cache_memory_bytes"), kv_cache_memory_limit(gpu), kv)
    raise ConfigError("engine.kv_cache_memory_bytes", kv_cache_memory_limit(gpu), kv, source=where)


def _speculative(config: SpeculativeConfig, overrides: Overrides) -> SpeculativeConfig:
    """The scenario's ``[speculative]`` with the flags given on top (all at once: a method
    and its k are checked together); errors name the flag, or both ways to set the field."""
    given = {name: value for name, value in overrides.speculative.items() if value is not None}
    if not given:
        return config
    try:
        return dataclasses.replace(config, **given)
    except ConfigError as err:
        if err.field in given:
            raise ConfigError(flag_for("speculative", err.field), err.expected, err.got) from None
        raise ConfigError(f"{flag_for('speculative', err.field)} or [speculative] {err.field}", err.expected,
                          err.got) from None


def with_speculative(planned: Plan, speculative: SpeculativeConfig, where: str | None,
                     overrides: Overrides = Overrides()) -> Plan:
    """``planned`` with its scheduler drafting as ``speculative`` says (unchanged when off).
    A k the step budget cannot verify is refused here, naming the setting. A draft head
    (EAGLE, EAGLE-3, single-module MTP) with prefix caching on hashes each block with the
    token after it, as vLLM 0.33 does by default (docs/semantics.md#draft-heads-and-prefix-caching)."""
    if not speculative.enabled:
        return planned
    name = "num_speculative_tokens"
    from_flag = name in overrides.speculative
    setting = flag_for("speculative", name) if from_flag else f"speculative.{name}"
    scheduler = planned.engine.scheduler
    hash_lookahead = speculative.num_hash_lookahead_tokens(planned.engine.cache.enable_prefix_caching)
    try:
        scheduler = dataclasses.replace(scheduler, num_speculative_tokens=speculative.num_speculative_tokens,
                                        num_lookahead_tokens=speculative.num_lookahead_tokens,
                                        num_hash_lookahead_tokens=hash_lookahead,
                                        num_prefill_lookahead_tokens=speculative.num_prefill_lookahead_tokens)
    except ConfigError as err:
        raise ConfigError(setting, err.expected, err.got, source=None if from_flag else where) from None
    return dataclasses.replace(planned, engine=dataclasses.replace(planned.engine, scheduler=scheduler))


def choose_calibration(scenario: Scenario, model: ModelPreset, gpu: GPUSpec, where: str | None) -> Calibration:
    """The file the scenario names; else the bundled one of the GPU's preset while no field
    a step's time depends on is changed; else the default factors, marked uncalibrated with
    the reason (``kvtwin.sim.calibration.gpu``). The scenario's [cost_model] keys go on top."""
    if scenario.calibration is not None:
        return scenario.calibration.with_overrides(dict(scenario.cost_overrides))
    chosen = bundled_for(gpu, model.name, scenario.efficiency)
    if not chosen.calibrated:
        return chosen
    try:
        return chosen.with_overrides(dict(scenario.cost_overrides))
    except ConfigError as err:
        raise (err if err.source or where is None else err.with_source(where)) from None
