"""Every user-facing setting, declared once: its scenario table, name, type, command-line
flag and help.

The config types (``EngineConfig``, ``Deployment``, ``OffloadConfig``, ``SLO``,
``Efficiency``, ``SpeculativeConfig``) hold the fields and their defaults; this table adds what the user sees: the
flag that sets a field from the command line, its help, and the words an error about it
uses. The commands' options (``kvtwin.knob_options``), the ``Overrides`` a command
packs, the keys a sweep may vary (``sweep_keys``) and the flag named in an error all read
it, so a new setting is one field on its config type plus, for a flag, one line in
``FLAGS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.offload import OffloadConfig
from kvtwin.sim.scenario.deployment import Deployment
from kvtwin.sim.scenario.disaggregation import Disaggregation
from kvtwin.sim.calibration.efficiency import SCALAR_EFFICIENCY_FIELDS
from kvtwin.sim.scenario import validators
from kvtwin.sim.scenario.slo import SLO
from kvtwin.sim.scenario.speculative import SpeculativeConfig
from kvtwin.sim.scenario.validators import Rule



@dataclass(frozen=True)
class Knob:
    """One setting: ``[section] name`` in a scenario, ``section.name`` in a sweep."""

    section: str
    name: str
    kind: str  # int, float, bool, str
    optional: bool = False  # None allowed: vLLM's (or kvtwin's) default
    flags: tuple[str, ...] = ()  # command-line spellings, the first the one errors name
    help: str = ""
    rule: Rule | None = None  # checked where the config type does not check it itself
    # "bytes" (a size: 500GB, 1e9) or "bytes_per_s" (a rate: 2GB/s), read by
    # ``validators.parse_text``; named by the field's suffix, as every unit is.
    unit: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None

    @property
    def param(self) -> str:
        """The command's parameter name for the flag (``--max-model-len`` → ``max_model_len``)."""
        return self.flag.removeprefix("--").replace("-", "_") if self.flag else self.name

    def check(self, value: object, where: str) -> None:
        if self.rule is not None:
            validators.check(self.rule, value, where)


# The cuts of a workload, in the order they apply: plain values the scenario layer checks itself.
_CUT_RULES: dict[str, tuple[str, Rule]] = {
    "start_s": ("float", validators.NON_NEGATIVE_SECONDS),
    "end_s": ("float", validators.POSITIVE_SECONDS),
    "limit": ("int", validators.POSITIVE_REQUESTS),
    "rate_scale": ("float", validators.POSITIVE_FACTOR),
    "sample_sessions": ("float", validators.FRACTION_OF_SESSIONS),
    "sample_seed": ("int", validators.INTEGER_SEED),
}

# key -> (flags, help): the settings a command line may set.
FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "engine.tensor_parallel_size": (("--tp", "--tensor-parallel-size"), "Tensor-parallel GPUs."),
    "engine.data_parallel_size": (("--dp", "--data-parallel-size"), "vLLM data-parallel ranks, each an engine with "
                                  "its own KV pool (a MoE model's step together)."),
    "engine.enable_expert_parallel": (("--enable-expert-parallel",), "Whole experts split over the DP x TP "
                                      "GPUs."),
    "engine.all2all_backend": (("--all2all-backend",), "How a DP group's MoE layers move tokens (vLLM's "
                               "--all2all-backend): allgather_reducescatter (default), deepep_low_latency, ...; "
                               "used only with DP > 1 on a MoE model."),
    "engine.enable_eplb": (("--enable-eplb",), "vLLM's expert-parallel load balancer (needs "
                           "--enable-expert-parallel)."),
    "engine.num_redundant_experts": (("--num-redundant-experts",), "Extra expert replicas EPLB places (vLLM's "
                                     "eplb_config.num_redundant_experts; default 0)."),
    "engine.pipeline_parallel_size": (("--pp", "--pipeline-parallel-size"), "Pipeline stages, each its share "
                                      "of the layers."),
    "engine.max_model_len": (("--max-model-len",), "Longest request (tokens)."),
    "engine.max_num_batched_tokens": (("--max-num-batched-tokens",), "Token budget per step."),
    "engine.max_num_seqs": (("--max-num-seqs",), "Most running requests."),
    "engine.block_size": (("--block-size",), "Tokens per block (default 16)."),
    "engine.kv_cache_dtype": (("--kv-cache-dtype",), "auto, bfloat16, fp8, ..."),
    "engine.gpu_memory_utilization": (("--gpu-memory-utilization",), "Fraction of GPU memory vLLM may use (0.92)."),
    "engine.kv_cache_memory_bytes": (("--kv-cache-memory-bytes",),
                                     "KV cache bytes per GPU; skips the memory estimate."),
    "engine.hybrid_kv_cache": (("--hybrid-kv-cache",), "Hybrid KV cache manager (default: vLLM's per model)."),
    "engine.async_scheduling": (("--async-scheduling",), "Two batches in flight (vLLM default on)."),
    "engine.enable_prefix_caching": (("--enable-prefix-caching", "--prefix-caching"), "Prefix caching (default on)."),
    "engine.prefix_cache_retention_interval": (("--prefix-cache-retention-interval",),
                                               "Sliding-window/Mamba prefix-cache checkpoints: 0 (vLLM default: "
                                               "semantic only), N (also every N tokens) or dense."),
    "engine.replicas": (("--replicas",), "Data-parallel replicas of the engine, each its --tp GPUs."),
    "engine.router": (("--router",), "What routes requests between replicas: round_robin, least_loaded, "
                                     "session_affinity, prefix_aware or dp_lb."),
    "engine.mamba_cache_mode": (("--mamba-cache-mode",), "none or align."),
    "engine.mamba_cache_dtype": (("--mamba-cache-dtype",), "Conv state dtype."),
    "engine.mamba_ssm_cache_dtype": (("--mamba-ssm-cache-dtype",), "SSM state dtype."),
    "workload.rate_scale": (("--rate-scale",), "Multiply the arrival rate (2 = twice as fast)."),
    "workload.limit": (("--limit",), "Replay only the first N requests."),
    "run.time_limit_s": (("--time-limit-s",), "Stop at this simulated time."),
    "offload.cpu_bytes": (("--offload-cpu-bytes",), "Host memory for the CPU KV offload tier, bytes (0 = off)."),
    "offload.policy": (("--offload-policy",), "CPU/disk tier policy: lru or arc."),
    "offload.disk_bytes": (("--offload-disk-bytes",), "Disk tier below the CPU tier, bytes (0 = none)."),
    "offload.disk_bandwidth_bytes_per_s": (("--offload-disk-bandwidth",), "Disk tier bandwidth, bytes/s."),
    "offload.disk_latency_s": (("--offload-disk-latency",), "Disk tier latency per job, seconds (default 0.0001)."),
    "speculative.method": (("--speculative-method",), "Speculative decoding drafter: ngram, eagle, eagle3 or mtp."),
    "speculative.num_speculative_tokens": (("--num-speculative-tokens",), "Drafts verified per decode (k)."),
    "speculative.acceptance": (("--spec-acceptance",), "Draft acceptance rate in [0, 1], every position "
                                                       "(default: the method's published table)."),
}


def _kind_of(annotation: object) -> tuple[str, bool]:
    text = str(annotation)
    optional = "None" in text
    if "str" in text and ("int" in text or "float" in text):
        return "str", optional  # a number or a word: its config type reads the text
    for kind in ("bool", "int", "float", "str"):
        if kind in text:
            return kind, optional
    return "str", optional


def _unit_of(name: str) -> str:
    if name.endswith("_bytes"):
        return "bytes"
    return "bytes_per_s" if name.endswith("_bytes_per_s") else ""


def _fields(section: str, cls, skip: tuple[str, ...] = ()) -> list[Knob]:
    return [Knob(section, f.name, *_kind_of(f.type), unit=_unit_of(f.name)) for f in dataclasses.fields(cls)
            if f.name not in skip]


def _declared() -> list[Knob]:
    knobs = _fields("engine", EngineConfig) + _fields("engine", Deployment) + _fields("offload", OffloadConfig)
    knobs += _fields("speculative", SpeculativeConfig)
    knobs += [Knob("slo", f.name, "float", rule=validators.POSITIVE_SECONDS) for f in dataclasses.fields(SLO)]
    knobs += [Knob("cost_model", name, "float") for name in SCALAR_EFFICIENCY_FIELDS]
    knobs += [Knob("workload", name, kind, rule=rule) for name, (kind, rule) in _CUT_RULES.items()]
    knobs.append(Knob("run", "time_limit_s", "float", rule=validators.POSITIVE_SIMULATED_SECONDS))
    knobs += _fields("hardware", GPUSpec, skip=("name", "preset")) + [Knob("hardware", "gpu", "str"),
                                                                        Knob("model", "preset", "str")]
    # Disaggregated prefill/decode; ``shape`` (xPyD, or none: aggregated) is a sweep's only.
    knobs += _fields("disaggregation", Disaggregation) + [Knob("disaggregation", "shape", "str", optional=True)]
    out = {}
    for k in knobs:
        flags, text = FLAGS.get(k.key, ((), ""))
        out[k.key] = dataclasses.replace(k, flags=flags, help=text)
    return list(out.values())


KNOBS: dict[str, Knob] = {k.key: k for k in _declared()}
assert set(FLAGS) <= set(KNOBS), set(FLAGS) - set(KNOBS)

DEPLOYMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Deployment))
TRANSFORM_KEYS = tuple(_CUT_RULES)


def knob(key: str) -> Knob:
    return KNOBS[key]


def section_knobs(section: str) -> dict[str, Knob]:
    """The knobs of one scenario table, by name."""
    return {k.name: k for k in KNOBS.values() if k.section == section}


def flag_for(section: str, name: str) -> str:
    """The flag an error about a command-line value names (``--`` + the name where the
    setting has no flag of its own)."""
    found = KNOBS.get(f"{section}.{name}")
    return found.flag if found is not None and found.flag else "--" + name.replace("_", "-")
