"""GPU presets and custom hardware: memory, bandwidth, FLOP/s, interconnect, host link.

The planner (docs/semantics.md#memory-budget) starts from a GPU's memory; the cost model uses its
bandwidth and FLOP rates, the KV offload tiers its PCIe host link (per direction), and a
P/D scenario's RDMA link its scale-out NIC. The
figures live in ``sim/planner/data/gpus.toml`` with the vendor datasheets they come from. A scenario can name a preset, override some of its fields, or
describe a whole GPU inline.

The GPU also decides a few block-size constraints vLLM takes from the attention and
recurrent-state kernels it picks for that device (``attention_kernel_block_alignment_tokens``
and ``gdn_prefill_checkpoint_alignment_tokens``): the planner asks the preset rather than
hard-coding them.

A preset's bundled calibration (``sim/replay/data/calibration``) was fitted on that chip's
kernels, as fractions of its peaks: it holds while the ``STEP_TIME_FIELDS`` keep the
preset's values, whatever else a scenario overrides (``step_time_changes``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvtwin.sim.core.config import BYTE_FORMS, byte_count, byte_rate, is_number
from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys, require

GIB = 1 << 30
BANDWIDTH_FIELDS = ("hbm_bandwidth_bytes_per_s", "interconnect_bytes_per_s", "pcie_h2d_bytes_per_s",
                    "pcie_d2h_bytes_per_s", "nic_bytes_per_s")
FLOPS_FIELDS = ("bf16_flops", "fp8_flops")
# A preset leaves these 0 for "none" (no FP8 tensor cores, no published NIC); a table that
# gives any other rate as 0 has made a mistake the cost model would divide by, or silently
# price as free.
ZERO_MEANS_NONE = ("fp8_flops", "nic_bytes_per_s")


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator. FLOP rates are dense; ``fp8_flops == 0`` means no FP8 tensor cores."""

    name: str
    description: str = ""
    vendor: str = "nvidia"
    # "9.0" style for NVIDIA (SM major.minor), a gfx name for AMD, "" when unknown.
    compute_capability: str = ""
    memory_bytes: int
    memory_datasheet: str = ""
    hbm_bandwidth_bytes_per_s: float = 0.0
    bf16_flops: float = 0.0
    fp8_flops: float = 0.0
    interconnect_bytes_per_s: float = 0.0
    # Host link, per direction (host-to-device loads, device-to-host stores of offloaded KV):
    # what one GPU achieves with pinned host memory, not the raw link rate.
    pcie_h2d_bytes_per_s: float = 0.0
    pcie_d2h_bytes_per_s: float = 0.0
    # Scale-out NIC per GPU, one direction (the vendor's reference system); 0: none
    # published. A P/D scenario's RDMA link defaults to it.
    nic_bytes_per_s: float = 0.0
    # USD per GPU-hour, for cost figures (``kvtwin capacity``); presets leave it unset.
    price_per_hour: float | None = None
    # The preset this GPU is (or was overridden from); "" for a GPU described inline. Not
    # a [hardware] key: ``gpu = NAME`` sets it.
    preset: str = ""

    def __post_init__(self) -> None:
        if self.price_per_hour is not None:
            require(is_number(self.price_per_hour) and self.price_per_hour >= 0, "price_per_hour",
                    "a non-negative price in USD per GPU-hour", self.price_per_hour)
        object.__setattr__(self, "memory_bytes", byte_count(
            self.memory_bytes, "memory_bytes", f"a positive number of bytes ({BYTE_FORMS})", minimum=1))
        for name in BANDWIDTH_FIELDS:
            object.__setattr__(self, name, byte_rate(getattr(self, name), name, "a non-negative number of bytes per "
                                                     "second (3.35e12, or with a unit: 3.35TB/s)"))
        for name in FLOPS_FIELDS:
            value = getattr(self, name)
            require(is_number(value) and value >= 0, name, "a non-negative number of FLOP/s", value)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def step_time_changes(self) -> tuple[str, ...]:
        """The ``STEP_TIME_FIELDS`` whose values differ from this GPU's preset (none for an
        inline GPU, which has no preset to differ from)."""
        base = GPU_PRESETS.get(self.preset)
        if base is None:
            return ()
        return tuple(name for name in STEP_TIME_FIELDS if getattr(self, name) != getattr(base, name))

    def _sm_major(self) -> int | None:
        if self.vendor != "nvidia" or not self.compute_capability:
            return None
        try:
            return int(self.compute_capability.split(".")[0])
        except ValueError:
            return None

    @property
    def is_hopper(self) -> bool:
        return self.vendor == "nvidia" and self.compute_capability == "9.0"

    @property
    def is_blackwell_datacenter(self) -> bool:
        return self._sm_major() == 10

    def attention_kernel_block_alignment_tokens(self, *, head_size: int, use_mla: bool) -> int:
        """The block size must be a multiple of this for the attention kernel vLLM picks here.

        vLLM picks the first backend of its per-device priority list and, unless the user
        set a block size, uses that backend's smallest kernel block size. FlashAttention
        (and its MLA variant, first for MLA on Hopper) takes any multiple of 16. On
        Blackwell MLA goes to CUTLASS MLA, which needs 128; and the default backend for
        head size 256 is FlashInfer, which does not support block 16 there, so vLLM
        aligns to 32 (``HybridAttentionMambaModelConfig``, citing flashinfer issue 1993).
        """
        if use_mla:
            return 128 if self.is_blackwell_datacenter else 16
        if self.is_blackwell_datacenter and head_size == 256:
            return 32
        return 16

    @property
    def gdn_prefill_checkpoint_alignment_tokens(self) -> int | None:
        """Token alignment of gated-DeltaNet prefill checkpoints, or None if unconstrained.

        On Hopper vLLM runs GDN prefill with FlashInfer's chunked kernel (chosen for SM90
        with no further condition), which can only leave a state at a 64-token chunk
        boundary; with align-mode prefix caching every block boundary is a checkpoint, so
        the block size must be a multiple of 64. Elsewhere the Triton/FLA path can cut a
        prefill at any token.
        """
        return 64 if self.is_hopper else None


# What a step's time depends on, so what a calibration fitted on the preset's kernels holds
# for: the two peaks the cost model's factors are fractions of, the peer link the
# all-reduce runs over (its measured curves came from that link), and the chip's kind
# (which kernels vLLM picks, and so which kernels were timed).
STEP_TIME_FIELDS = ("bf16_flops", "hbm_bandwidth_bytes_per_s", "interconnect_bytes_per_s", "vendor",
                    "compute_capability")
# What no step's time depends on, so a calibration survives a change of it: names, the
# price; the memory (it moves the plan, not a step's speed); fp8_flops (the cost model
# prices every GEMM at bf16_flops; FP8 weights only halve the bytes read); the host link and
# the NIC (the offload tiers' and the P/D link's transfers, priced from the figure itself,
# outside the step and outside any fit).
CALIBRATION_NEUTRAL_FIELDS = ("name", "description", "memory_bytes", "memory_datasheet", "fp8_flops",
                              "pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s", "nic_bytes_per_s", "price_per_hour",
                              "preset")


def _load_presets() -> dict[str, GPUSpec]:
    raw = tomllib.loads(resources.files("kvtwin.sim.planner.data").joinpath("gpus.toml").read_text())
    presets: dict[str, GPUSpec] = {}
    for name, entry in raw.items():
        fields = {k: v for k, v in entry.items() if k != "aliases"}
        presets[name] = GPUSpec(name=name, preset=name, **fields)
    return presets


GPU_PRESETS: dict[str, GPUSpec] = _load_presets()
_ALIASES: dict[str, str] = {
    alias: name
    for name, entry in tomllib.loads(resources.files("kvtwin.sim.planner.data").joinpath("gpus.toml").read_text()).items()
    for alias in entry.get("aliases", [])
}


def gpu_names() -> list[str]:
    return sorted(GPU_PRESETS)


def get_gpu(name: str, *, field: str = "--gpu") -> GPUSpec:
    """A preset by name (case-insensitive, a few aliases); unknown names list the valid ones."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        raise ConfigError(field, f"one of {', '.join(gpu_names())}", name)
    return GPU_PRESETS[key]


# What a [hardware] table may set (``preset`` comes from ``gpu = NAME``).
_GPU_FIELDS = {f.name for f in dataclasses.fields(GPUSpec)} - {"preset"}


def _require_positive_rate(value: object, field: str) -> None:
    if field.endswith("_flops"):
        require(is_number(value) and value > 0, field, "a positive number of FLOP/s", value)
    else:
        byte_rate(value, field, "a positive number of bytes per second (3.35e12, or with a unit: 3.35TB/s)",
                  positive=True)


def require_cost_model_inputs(gpu: GPUSpec) -> None:
    """Refuse a GPU the cost model cannot price a step on (an inline ``[hardware]`` table
    that plans without them but gives no bandwidth or FLOP/s), naming the field."""
    for name, unit in (("hbm_bandwidth_bytes_per_s", "bytes per second"), ("bf16_flops", "FLOP/s")):
        value = getattr(gpu, name)
        require(value > 0, f"hardware.{name}", f"a positive number of {unit}: the cost model prices every step "
                f"with it, and {gpu.name} has none (an inline [hardware] table must give it)", value)


def gpu_from_mapping(entry: dict[str, Any], *, where: str = "hardware") -> GPUSpec:
    """A GPU from a scenario's ``[hardware]`` table.

    Either ``gpu = "h100"`` (a preset, optionally with field overrides) or a full inline
    description with at least ``name`` and ``memory_bytes`` (or ``memory_gib``).
    ``tensor_parallel_size`` may also sit here; the caller takes it out first.
    """
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table", entry)
    params = dict(entry)
    preset_name = params.pop("gpu", None)
    if "memory_gib" in params:
        gib = params.pop("memory_gib")
        require(is_number(gib) and gib > 0 and is_number(gib * GIB), f"{where}.memory_gib", "a positive number",
                gib)
        params["memory_bytes"] = int(gib * GIB)
    reject_unknown_keys(params, _GPU_FIELDS, where=where,
                        expected=f"a hardware field ({', '.join(sorted(_GPU_FIELDS | {'gpu', 'memory_gib'}))})")
    for name in BANDWIDTH_FIELDS + FLOPS_FIELDS:
        if name in params and name not in ZERO_MEANS_NONE:
            _require_positive_rate(params[name], f"{where}.{name}")
    try:
        if preset_name is not None:
            base = get_gpu(preset_name, field=f"{where}.gpu")
            return dataclasses.replace(base, **params) if params else base
        if "memory_bytes" not in params:
            raise ConfigError(f"{where}.memory_bytes", "the GPU memory (memory_bytes or memory_gib), or gpu = a preset")
        params.setdefault("name", "custom")
        return GPUSpec(**params)
    except ConfigError as err:
        if err.field.startswith(where):
            raise
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None
    except TypeError as err:
        raise ConfigError(where, "valid hardware fields", str(err)) from None
