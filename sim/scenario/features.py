"""The optional features of a run and which of them combine: one table, read once when a
scenario is resolved (docs/architecture.md#features-and-their-combinations).

``FEATURES`` names each optional feature once, with where a scenario or a flag turns it on;
``REFUSED`` names each set of features kvtwin does not run together, the reason, and what
the error line asks of each setting it may name. ``require_allowed`` checks a scenario
(``resolve_scenario`` with the command line's overrides on top; ``check_axes`` for each
swept value) and raises the one ``ConfigError``. The error names the setting a flag turned
on when there is one (the flag is what the user added last), else the refusal's first.

Every other combination runs. Some run, but take a slower path; these are not refusals:

* decode windows (``sim/core/decode_window.py``, docs/architecture.md#decode-windows) stay
  closed with synchronous scheduling, with an offload tier or a P/D connector (a pool the
  scheduler's passes do not change alone) and with speculative decoding: the run steps one
  batch at a time, with the same results;
* a scenario's ``[engine] replicas`` and ``router`` beside ``[disaggregation]`` are unused
  (the P/D table's replica counts and routers are the deployment); only the flags
  ``--replicas`` and ``--router`` are refused there, since they say the user meant them.

The core keeps its own checks of these pairs (``EngineCore``, ``Scheduler``,
``run_replay``) as assertions of what this table already guarantees, for direct library
use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.knobs import flag_for


class Overrides(Protocol):
    """The flags given, by section (``resolve.Overrides``; None in a mapping: not given)."""

    @property
    def offload(self) -> Mapping[str, object]: ...
    @property
    def speculative(self) -> Mapping[str, object]: ...
    @property
    def engine(self) -> Mapping[str, object]: ...
    @property
    def deployment(self) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class Setting:
    """Where a feature was turned on: the field (or flag) an error names, and its value."""

    field: str
    got: object
    by_flag: bool


def _given(overrides: Overrides | None, section: str, name: str) -> object:
    """A flag's value (None: not given, or no command line)."""
    if overrides is None:
        return None
    return getattr(overrides, section).get(name)


def _offload(scenario: Any, overrides: Overrides | None) -> Setting | None:
    if not scenario.offload.enabled:
        return None
    by_flag = _given(overrides, "offload", "cpu_bytes") is not None
    return Setting(flag_for("offload", "cpu_bytes") if by_flag else "offload.cpu_bytes", scenario.offload.cpu_bytes,
                   by_flag)


def _disaggregation(scenario: Any, overrides: Overrides | None) -> Setting | None:
    # Only a scenario's table (or a swept disaggregation.shape) disaggregates: no flag does.
    return Setting("disaggregation", None, False) if scenario.disaggregation is not None else None


def _speculative(scenario: Any, overrides: Overrides | None) -> Setting | None:
    if not scenario.speculative.enabled:
        return None
    by_flag = _given(overrides, "speculative", "method") is not None
    return Setting(flag_for("speculative", "method") if by_flag else "speculative.method",
                   scenario.speculative.method, by_flag)


def _replicas(scenario: Any, overrides: Overrides | None) -> Setting | None:
    given = {name: value for name, value in (overrides.deployment if overrides is not None else {}).items()
             if value is not None}
    if given:
        name = sorted(given)[0]
        return Setting(flag_for("engine", name), given[name], True)
    if scenario.deployment.replicas > 1:
        return Setting("engine.replicas", scenario.deployment.replicas, False)
    return None


def _mamba_without_prefix_caching(scenario: Any, overrides: Overrides | None) -> Setting | None:
    # vLLM 0.33 runs a Mamba hybrid's state in 'align' mode exactly when prefix caching is on
    # (EngineConfig.resolve refuses the other pairings), so prefix caching alone decides it.
    model = scenario.model
    if model is None or "mamba" not in model.layer_kinds or scenario.engine.enable_prefix_caching:
        return None
    by_flag = _given(overrides, "engine", "enable_prefix_caching") is not None
    return Setting(flag_for("engine", "enable_prefix_caching") if by_flag else "engine.enable_prefix_caching",
                   False, by_flag)


def _async_scheduling(scenario: Any, overrides: Overrides | None) -> Setting | None:
    if not scenario.engine.async_scheduling:
        return None
    by_flag = _given(overrides, "engine", "async_scheduling") is not None
    return Setting(flag_for("engine", "async_scheduling") if by_flag else "engine.async_scheduling", True, by_flag)


def _dp_lockstep(scenario: Any, overrides: Overrides | None) -> Setting | None:
    """Data-parallel ranks of a MoE model: vLLM steps them together (docs/semantics.md#data-parallel-lockstep)."""
    model = scenario.model
    if scenario.engine.data_parallel_size == 1 or model is None or not model.num_experts:
        return None
    by_flag = _given(overrides, "engine", "data_parallel_size") is not None
    return Setting(flag_for("engine", "data_parallel_size") if by_flag else "engine.data_parallel_size",
                   scenario.engine.data_parallel_size, by_flag)


def _engine_parallel(name: str, default: object) -> Callable[[Any, Overrides | None], Setting | None]:
    """A vLLM parallelism setting of ``[engine]`` away from its default."""
    def setting(scenario: Any, overrides: Overrides | None) -> Setting | None:
        value = getattr(scenario.engine, name)
        if value == default:
            return None
        by_flag = _given(overrides, "engine", name) is not None
        return Setting(flag_for("engine", name) if by_flag else f"engine.{name}", value, by_flag)
    return setting


@dataclass(frozen=True)
class Feature:
    """One optional feature: ``setting`` says whether a scenario (with the command line's
    overrides, if any) has it on, and where it was set (None: off)."""

    name: str
    summary: str
    turned_on_by: str
    setting: Callable[[Any, Overrides | None], Setting | None]


@dataclass(frozen=True)
class Refusal:
    """Features kvtwin does not run together. ``expected``: for each feature whose setting
    the error may name, what that setting must be instead (``{model}`` is the model's
    name). ``only_by_flag``: a feature whose setting refuses only when a flag gave it."""

    features: tuple[str, ...]
    reason: str
    expected: tuple[tuple[str, str], ...]
    only_by_flag: str | None = None

    def named(self, settings: Mapping[str, Setting]) -> str:
        """The feature whose setting the error names: the first a flag gave, else the first."""
        candidates = [name for name, _ in self.expected]
        return next((name for name in candidates if settings[name].by_flag), candidates[0])


FEATURES: tuple[Feature, ...] = (
    Feature("offload", "a KV offload tier: host memory (and disk) below the GPU's block pool",
            "[offload] cpu_bytes > 0; --offload-cpu-bytes", _offload),
    Feature("disaggregation", "disaggregated prefill/decode: prefill and decode replicas joined by a KV link",
            "[disaggregation]", _disaggregation),
    Feature("speculative", "speculative decoding: k drafts proposed and verified per decode",
            "[speculative] method; --speculative-method", _speculative),
    Feature("replicas", "data-parallel replicas of one engine behind a router",
            "[engine] replicas > 1; --replicas, --router", _replicas),
    Feature("mamba_without_prefix_caching", "a hybrid Mamba model with prefix caching off (its state in "
            "'none' mode)", "a [model] with Mamba layers and [engine] enable_prefix_caching = false; "
            "--no-prefix-caching", _mamba_without_prefix_caching),
    Feature("async_scheduling", "asynchronous scheduling: two batches in flight (vLLM's default)",
            "[engine] async_scheduling (on unless false); --async-scheduling", _async_scheduling),
    Feature("data_parallel", "vLLM data parallelism: DP ranks, each an engine with its own KV pool",
            "[engine] data_parallel_size > 1; --data-parallel-size", _engine_parallel("data_parallel_size", 1)),
    Feature("expert_parallel", "vLLM expert parallelism: the experts split over the DP x TP GPUs",
            "[engine] enable_expert_parallel; --enable-expert-parallel",
            _engine_parallel("enable_expert_parallel", False)),
    Feature("pipeline_parallel", "vLLM pipeline parallelism: the layers split into stages",
            "[engine] pipeline_parallel_size > 1; --pipeline-parallel-size",
            _engine_parallel("pipeline_parallel_size", 1)),
    Feature("dp_lockstep", "the DP ranks of a MoE model, which step together (dummy batches, waves)",
            "[engine] data_parallel_size > 1 with a MoE [model]; --data-parallel-size", _dp_lockstep),
    Feature("prefill_cadence", "prefill work held to every Nth step (vLLM's prefill_schedule_interval)",
            "[engine] prefill_schedule_interval > 1", _engine_parallel("prefill_schedule_interval", 1)),
)

REFUSED: tuple[Refusal, ...] = (
    Refusal(("disaggregation", "offload"), "P/D with an offload tier is not modelled",
            (("disaggregation", "no [offload] table beside it"),
             ("offload", "0 with a [disaggregation] table"))),
    Refusal(("disaggregation", "speculative"), "P/D with drafting is not modelled",
            (("disaggregation", "no [speculative] table beside it"),
             ("speculative", "no method with a [disaggregation] table"))),
    Refusal(("offload", "speculative"), "drafts with a KV offload tier are not modelled yet",
            (("offload", "0 with speculative decoding ([speculative] or --speculative-method)"),
             ("speculative", "no method with a KV offload tier ([offload] or --offload-cpu-bytes)"))),
    Refusal(("replicas", "disaggregation"), "its prefill_replicas, decode_replicas and routers are the "
            "deployment there", (("replicas", "no [disaggregation] table in the scenario"),),
            only_by_flag="replicas"),
    Refusal(("offload", "mamba_without_prefix_caching"), "vLLM 0.33 offloads a hybrid Mamba model only with "
            "prefix caching on", (("offload", "0 for {model} with prefix caching off"),
                                  ("mamba_without_prefix_caching", "prefix caching on for {model} with a KV "
                                   "offload tier"))),
    # The core's own refusals (``SchedulerConfig._check_pipeline``, ``make_scheduler``), named
    # here so the line names the setting (docs/semantics.md#pipeline-parallelism).
    Refusal(("pipeline_parallel", "speculative"), "drafting through pipeline stages is not modelled",
            (("speculative", "no method with pipeline_parallel_size > 1"),
             ("pipeline_parallel", "1 with speculative decoding"))),
    Refusal(("pipeline_parallel", "offload"), "a KV connector with pipeline stages is not modelled",
            (("offload", "0 with pipeline_parallel_size > 1"),
             ("pipeline_parallel", "1 with a KV offload tier"))),
    Refusal(("pipeline_parallel", "disaggregation"), "a KV connector with pipeline stages is not modelled",
            (("pipeline_parallel", "1 with a [disaggregation] table"),)),
    # Data parallelism (docs/semantics.md#data-parallel-lockstep): one DP engine, its ranks
    # the replay's replicas; with P/D each side names its own (docs/semantics.md#data-parallel-pd-sides).
    Refusal(("data_parallel", "replicas"), "the DP ranks are the deployment's engines; several DP engines are "
            "not modelled", (("replicas", "1 with data_parallel_size > 1"),
                             ("data_parallel", "1 with [engine] replicas > 1"))),
    Refusal(("data_parallel", "disaggregation"), "each P/D side names its own DP ranks: "
            "disaggregation.prefill_data_parallel_size and decode_data_parallel_size",
            (("data_parallel", "1 with a [disaggregation] table"),)),
    Refusal(("dp_lockstep", "pipeline_parallel"), "pipeline stages in a lockstep group are not modelled",
            (("pipeline_parallel", "1 with data_parallel_size > 1 on MoE {model}"),
             ("dp_lockstep", "1 with pipeline_parallel_size > 1 on MoE {model}"))),
    # The cadence with a connector: vLLM's asynchronous KV loads skip the interval's restart
    # (docs/semantics.md#local-prefill-cadence); no golden case pins it.
    Refusal(("prefill_cadence", "offload"), "a prefill cadence with a KV connector is not modelled",
            (("offload", "0 with prefill_schedule_interval > 1"), ("prefill_cadence", "1 with a KV offload tier"))),
    Refusal(("prefill_cadence", "disaggregation"), "a prefill cadence with a KV connector is not modelled",
            (("prefill_cadence", "1 with a [disaggregation] table"),)),
    Refusal(("prefill_cadence", "speculative"), "a prefill cadence with drafting is not modelled",
            (("speculative", "no method with prefill_schedule_interval > 1"),
             ("prefill_cadence", "1 with speculative decoding"))),
    Refusal(("prefill_cadence", "pipeline_parallel"), "a prefill cadence through pipeline stages is not modelled",
            (("prefill_cadence", "1 with pipeline_parallel_size > 1"),
             ("pipeline_parallel", "1 with prefill_schedule_interval > 1"))),
    Refusal(("dp_lockstep", "speculative"), "drafting in a lockstep group is not modelled",
            (("speculative", "no method with data_parallel_size > 1 on MoE {model}"),
             ("dp_lockstep", "1 with speculative decoding on MoE {model}"))),
)


def feature_settings(scenario: Any, overrides: Overrides | None = None) -> dict[str, Setting]:
    """The features ``scenario`` has on (with ``overrides`` on top), by name."""
    settings = {feature.name: feature.setting(scenario, overrides) for feature in FEATURES}
    return {name: setting for name, setting in settings.items() if setting is not None}


def require_allowed(scenario: Any, overrides: Overrides | None = None, where: str | None = None) -> None:
    """Refuse the first of ``REFUSED`` that ``scenario`` has all of, as one ``ConfigError``
    naming the setting (a flag's name without ``where``, a scenario field with it).
    ``scenario``: a parsed or resolved scenario (its ``offload``, ``disaggregation``,
    ``speculative``, ``deployment``, ``engine`` and ``model``, which may be None)."""
    settings = feature_settings(scenario, overrides)
    for refusal in REFUSED:
        if not all(name in settings for name in refusal.features):
            continue
        if refusal.only_by_flag is not None and not settings[refusal.only_by_flag].by_flag:
            continue
        named = refusal.named(settings)
        setting = settings[named]
        expected = dict(refusal.expected)[named]
        if "{model}" in expected:
            expected = expected.format(model=scenario.model.name)
        raise ConfigError(setting.field, f"{expected} ({refusal.reason})", setting.got,
                          source=None if setting.by_flag else where)


