"""The cost model's knobs, as a scenario's ``[cost_model]`` table and a calibration file set
them: ``Efficiency`` (fractions of datasheet peaks, fixed GPU and CPU costs) and the measured
all-reduce curves it may carry.

The step-time model that reads them is ``kvtwin.sim.replay.cost_model``; this module only
declares and checks the settings, so a scenario is checked without loading the replay.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace

from kvtwin.sim.core.config import is_number
from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys, require


@dataclass(frozen=True)
class AllReduceCurve:
    """Measured seconds of one all-reduce against its message size, for one TP degree.

    Between two measured sizes the time is interpolated linearly; below the smallest it
    is the smallest's time (the latency floor), above the largest it grows at the last
    segment's rate (the bandwidth the largest messages reach).
    """

    tensor_parallel_size: int
    message_bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        require(isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
                and self.tensor_parallel_size >= 2, "cost_model.allreduce.tensor_parallel_size",
                "an integer TP degree of at least 2", self.tensor_parallel_size)
        sizes, times = self.message_bytes, self.seconds
        require(isinstance(sizes, tuple) and isinstance(times, tuple) and len(sizes) == len(times) >= 1,
                "cost_model.allreduce.message_bytes", "as many message sizes as seconds (at least one)", sizes)
        for name, values in (("message_bytes", sizes), ("seconds", times)):
            for value in values:
                require(is_number(value) and value >= 0,
                        f"cost_model.allreduce.{name}", "non-negative numbers", value)
        require(all(a < b for a, b in zip(sizes, sizes[1:])), "cost_model.allreduce.message_bytes",
                "strictly increasing message sizes", sizes)

    def seconds_for(self, message_bytes: float) -> float:
        sizes, times = self.message_bytes, self.seconds
        if message_bytes <= sizes[0] or len(sizes) == 1:
            return times[0] if message_bytes <= sizes[0] else times[0] * message_bytes / sizes[0]
        i = bisect.bisect_left(sizes, message_bytes)
        if i == len(sizes):
            i -= 1
        lo_b, hi_b, lo_t, hi_t = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return lo_t + (hi_t - lo_t) * (message_bytes - lo_b) / (hi_b - lo_b)


# The fitted MoE fractions, 0 where no fit set them.
MOE_FIT_FRACTIONS = ("moe_flops_fraction", "moe_hbm_bandwidth_fraction")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a real step achieves, fixed GPU and CPU costs, and
    the all-reduce curves.

    The defaults are a starting point for a vLLM-like engine with CUDA graphs; the
    bundled calibration of a GPU (``sim/replay/data/calibration``) or one fitted from
    your own server (``kvtwin calibrate``) replaces them.
    """

    matmul_flops_fraction: float = 0.6  # of bf16 peak, for GEMMs of many rows
    # Rows (tokens in the step) at which a GEMM reaches half of matmul_flops_fraction; 0:
    # the fraction holds at every size.
    matmul_half_tokens: float = 0.0
    attention_flops_fraction: float = 0.45
    # Query tokens of a prefill chunk at which its attention reaches half of
    # attention_flops_fraction; 0: every chunk at the full fraction.
    attention_half_query_tokens: float = 0.0
    hbm_bandwidth_fraction: float = 0.8
    interconnect_fraction: float = 0.7
    allreduce_latency_s: float = 8e-6
    layer_fixed_s: float = 0.0  # GPU time per layer per step: launch gaps, small kernels
    # GPU time of one decode's attention per query head and layer, beyond its KV read (the
    # paged kernel's per-sequence work: it dominates large batches of short contexts).
    decode_attention_s_per_head: float = 0.0
    step_gpu_fixed_s: float = 0.0  # GPU time per step outside the layers: embedding, sampling
    step_overhead_s: float = 1.5e-3  # CPU
    per_request_overhead_s: float = 15e-6  # CPU
    # Between the server and a client that measures (HTTP, detokenising, streaming): added
    # to the client-side TTFT and E2E columns, which the SLO judges; the server-side ones
    # are vLLM's own. 0 here; 8 ms in every bundled calibration (docs/capacity.md#client-side-latency).
    client_overhead_s: float = 0.0
    # The routed experts of a DP group's MoE layer (docs/clock.md#moe-under-data-parallelism),
    # fitted on measured fused-MoE layers (sim/calibration/fit/moe_kernels.py). 0 (the
    # default): not fitted, the experts are priced as the dense GEMMs (matmul_flops_fraction
    # at the group's tokens, hbm_bandwidth_fraction), with no floor nor per-token time.
    moe_flops_fraction: float = 0.0  # of bf16 peak, for experts of many rows each
    # Rows (tokens) per expert at which the experts' grouped GEMM reaches half of
    # moe_flops_fraction; 0: the fraction holds at every size.
    moe_expert_half_tokens: float = 0.0
    moe_hbm_bandwidth_fraction: float = 0.0  # the experts' weight reads; 0: hbm_bandwidth_fraction
    moe_floor_s: float = 0.0  # GPU time per MoE layer per step
    # Time per hidden value of each token entering a GPU's MoE layer (quantizing, permuting
    # and combining its routed copies), whatever experts it picks.
    moe_s_per_token_value: float = 0.0
    # Load factors (at least 1) on the busiest GPU's expert compute under skewed routing,
    # with expert parallelism and without; 1: uniform routing's expected load.
    moe_ep_imbalance: float = 1.0
    moe_tp_imbalance: float = 1.0
    # Measured all-reduce curves by TP degree; a TP degree without one uses
    # interconnect_fraction and allreduce_latency_s.
    allreduce: tuple[AllReduceCurve, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "allreduce":
                require(isinstance(value, tuple) and all(isinstance(c, AllReduceCurve) for c in value),
                        "cost_model.allreduce", "a list of all-reduce curves", value)
                degrees = [c.tensor_parallel_size for c in value]
                require(len(set(degrees)) == len(degrees), "cost_model.allreduce",
                        "one curve per tensor_parallel_size", degrees)
            elif not is_number(value):
                raise ConfigError(f"cost_model.{f.name}", "a finite number", value)
            elif f.name in MOE_FIT_FRACTIONS:
                require(0 <= value <= 1, f"cost_model.{f.name}", "a fraction in (0, 1], or 0 (not fitted)", value)
            elif f.name.endswith("_fraction"):
                require(0 < value <= 1, f"cost_model.{f.name}", "a fraction in (0, 1]", value)
            elif f.name.endswith("_imbalance"):
                require(value >= 1, f"cost_model.{f.name}", "a load factor of at least 1", value)
            elif f.name.endswith("_tokens"):
                require(value >= 0, f"cost_model.{f.name}", "a non-negative number of tokens", value)
            else:
                require(value >= 0, f"cost_model.{f.name}", "a non-negative number of seconds", value)

    @property
    def moe_fitted(self) -> bool:
        """Whether the routed experts have a fit of their own (``moe_*``) rather than the
        dense GEMMs' factors."""
        return self.moe_flops_fraction > 0

    def allreduce_curve(self, tensor_parallel_size: int) -> AllReduceCurve | None:
        for curve in self.allreduce:
            if curve.tensor_parallel_size == tensor_parallel_size:
                return curve
        return None


# The Efficiency fields that are plain numbers: what a scenario's [cost_model] table, a
# sweep axis and a flag may set one at a time.
SCALAR_EFFICIENCY_FIELDS = tuple(f.name for f in fields(Efficiency) if f.name != "allreduce")


def _allreduce_curves(entry: object, where: str) -> tuple[AllReduceCurve, ...]:
    if not isinstance(entry, list):
        raise ConfigError(f"{where}.allreduce", "a list of tables (tensor_parallel_size, message_bytes, seconds)",
                          entry)
    curves = []
    for i, table in enumerate(entry):
        field = f"{where}.allreduce[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(field, "a table (tensor_parallel_size, message_bytes, seconds)", table)
        reject_unknown_keys(table, {"tensor_parallel_size", "message_bytes", "seconds"}, where=field,
                            expected="tensor_parallel_size, message_bytes, seconds")
        for key in ("tensor_parallel_size", "message_bytes", "seconds"):
            if key not in table:
                raise ConfigError(f"{field}.{key}", "present")
        for key in ("message_bytes", "seconds"):
            if not isinstance(table[key], list):
                raise ConfigError(f"{field}.{key}", "a list of numbers", table[key])
        try:
            curves.append(AllReduceCurve(table["tensor_parallel_size"], tuple(table["message_bytes"]),
                                         tuple(table["seconds"])))
        except ConfigError as err:
            raise ConfigError(err.field.replace("cost_model.allreduce", field, 1), err.expected, err.got) from None
    return tuple(curves)


def efficiency_from_mapping(entry: dict, *, where: str = "cost_model", base: Efficiency = Efficiency()) -> Efficiency:
    allowed = {f.name for f in fields(Efficiency)}
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table of efficiency factors", entry)
    reject_unknown_keys(entry, allowed, where=where, expected=f"one of {', '.join(sorted(allowed))}")
    entry = dict(entry)
    for key, value in entry.items():
        # Checked here, not only in __post_init__: the compiled dataclass turns a bool into
        # a float on its way into a float field.
        if key != "allreduce" and not is_number(value):
            raise ConfigError(f"{where}.{key}", "a finite number", value)
    if "allreduce" in entry:
        entry["allreduce"] = _allreduce_curves(entry["allreduce"], where)
    try:
        return replace(base, **entry)
    except ConfigError as err:
        raise ConfigError(err.field.replace("cost_model", where, 1), err.expected, err.got) from None


