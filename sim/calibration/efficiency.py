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
        return interpolate_seconds(self.message_bytes, self.seconds, message_bytes)


def interpolate_seconds(sizes: tuple[float, ...], times: tuple[float, ...], size: float) -> float:
    """A measured curve's seconds at ``size``: linear between measured points, the
    smallest's time below them (the latency floor), the last segment's rate above them
    (one point: proportional above it)."""
    if size <= sizes[0] or len(sizes) == 1:
        return times[0] if size <= sizes[0] else times[0] * size / sizes[0]
    i = bisect.bisect_left(sizes, size)
    if i == len(sizes):
        i -= 1
    lo_b, hi_b, lo_t, hi_t = sizes[i - 1], sizes[i], times[i - 1], times[i]
    return lo_t + (hi_t - lo_t) * (size - lo_b) / (hi_b - lo_b)


def _check_points(where: str, size_name: str, sizes: object, times_by_name: dict[str, object]) -> None:
    for name, times in times_by_name.items():
        require(isinstance(sizes, tuple) and isinstance(times, tuple) and len(sizes) == len(times) >= 1,
                f"{where}.{size_name}", f"as many {size_name} as {name} (at least one)", sizes)
    for name, values in ((size_name, sizes), *times_by_name.items()):
        for value in values:  # type: ignore[union-attr]
            require(is_number(value) and value >= 0, f"{where}.{name}", "non-negative numbers", value)
    require(all(a < b for a, b in zip(sizes, sizes[1:])), f"{where}.{size_name}",  # type: ignore[arg-type]
            f"strictly increasing {size_name}", sizes)


# The measured NCCL collectives a calibration may carry besides the all-reduce
# (docs/clock.md#moe-under-data-parallelism): the Efficiency field of each.
COLLECTIVE_OPS = ("allgather", "reducescatter", "alltoall")


@dataclass(frozen=True)
class CollectiveCurve:
    """Measured seconds of one NCCL collective (``allgather``, ``reducescatter`` or
    ``alltoall``) over ``num_gpus`` GPUs of one node against its message size, in
    nccl-tests' meaning: the all-gather's gathered output, the reduce-scatter's input
    before the scatter, the all-to-all's send buffer of one GPU (all peers' parts together).
    Interpolated as ``AllReduceCurve``."""

    num_gpus: int
    message_bytes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        require(isinstance(self.num_gpus, int) and not isinstance(self.num_gpus, bool) and self.num_gpus >= 2,
                "cost_model.collective.num_gpus", "an integer number of GPUs of at least 2", self.num_gpus)
        _check_points("cost_model.collective", "message_bytes", self.message_bytes, {"seconds": self.seconds})

    def seconds_for(self, message_bytes: float) -> float:
        return interpolate_seconds(self.message_bytes, self.seconds, message_bytes)


# DeepEP's two kernels, as vLLM 0.33's ``--all2all-backend`` names them.
DEEPEP_MODES = ("low_latency", "high_throughput")


@dataclass(frozen=True)
class DeepEPTable:
    """Measured seconds of one DeepEP dispatch and one combine (``mode``: the
    low-latency or the high-throughput "normal" kernels) over ``nodes`` nodes of 8 GPUs,
    against the tokens each rank sends, for a model of ``hidden_size`` and ``top_k``
    experts a token (``MoEGroupCost`` scales other models' tokens by their bytes).
    Interpolated over tokens as ``AllReduceCurve`` over bytes."""

    mode: str
    nodes: int
    hidden_size: int
    top_k: int
    tokens_per_rank: tuple[float, ...]
    dispatch_s: tuple[float, ...]
    combine_s: tuple[float, ...]

    def __post_init__(self) -> None:
        require(self.mode in DEEPEP_MODES, "cost_model.deepep.mode", f"one of {', '.join(DEEPEP_MODES)}", self.mode)
        for name in ("nodes", "hidden_size", "top_k"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"cost_model.deepep.{name}", "a positive integer", value)
        _check_points("cost_model.deepep", "tokens_per_rank", self.tokens_per_rank,
                      {"dispatch_s": self.dispatch_s, "combine_s": self.combine_s})

    def seconds_for(self, tokens_per_rank: float) -> float:
        """One dispatch and one combine of ``tokens_per_rank`` tokens a rank."""
        return (interpolate_seconds(self.tokens_per_rank, self.dispatch_s, tokens_per_rank)
                + interpolate_seconds(self.tokens_per_rank, self.combine_s, tokens_per_rank))


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
    # Measured NCCL all-gather, reduce-scatter and all-to-all curves by GPU count, and
    # DeepEP dispatch/combine tables by mode and node count: what a DP group's MoE
    # collectives are priced from (docs/clock.md#moe-under-data-parallelism). None
    # measured: the all-reduce curve or the link's bandwidth prices them.
    allgather: tuple[CollectiveCurve, ...] = ()
    reducescatter: tuple[CollectiveCurve, ...] = ()
    alltoall: tuple[CollectiveCurve, ...] = ()
    deepep: tuple[DeepEPTable, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "allreduce":
                require(isinstance(value, tuple) and all(isinstance(c, AllReduceCurve) for c in value),
                        "cost_model.allreduce", "a list of all-reduce curves", value)
                degrees = [c.tensor_parallel_size for c in value]
                require(len(set(degrees)) == len(degrees), "cost_model.allreduce",
                        "one curve per tensor_parallel_size", degrees)
            elif f.name in COLLECTIVE_OPS:
                require(isinstance(value, tuple) and all(isinstance(c, CollectiveCurve) for c in value),
                        f"cost_model.{f.name}", "a list of collective curves", value)
                counts = [c.num_gpus for c in value]
                require(len(set(counts)) == len(counts), f"cost_model.{f.name}", "one curve per num_gpus", counts)
            elif f.name == "deepep":
                require(isinstance(value, tuple) and all(isinstance(c, DeepEPTable) for c in value),
                        "cost_model.deepep", "a list of DeepEP tables", value)
                keys = [(c.mode, c.nodes) for c in value]
                require(len(set(keys)) == len(keys), "cost_model.deepep", "one table per (mode, nodes)", keys)
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

    def collective_curve(self, op: str, num_gpus: int) -> CollectiveCurve | None:
        """The measured ``op`` (one of ``COLLECTIVE_OPS``) curve over ``num_gpus`` GPUs, or None."""
        for curve in getattr(self, op):
            if curve.num_gpus == num_gpus:
                return curve
        return None

    def deepep_table(self, mode: str, nodes: int) -> DeepEPTable | None:
        """The measured DeepEP table of ``mode`` over ``nodes`` nodes, or None."""
        for table in self.deepep:
            if table.mode == mode and table.nodes == nodes:
                return table
        return None


# The Efficiency fields that are plain numbers: what a scenario's [cost_model] table, a
# sweep axis and a flag may set one at a time.
TABLE_EFFICIENCY_FIELDS = ("allreduce", *COLLECTIVE_OPS, "deepep")
SCALAR_EFFICIENCY_FIELDS = tuple(f.name for f in fields(Efficiency) if f.name not in TABLE_EFFICIENCY_FIELDS)


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


def _tables(entry: object, where: str, keys: tuple[str, ...], lists: tuple[str, ...], build) -> tuple:
    """A list of TOML tables, each with exactly ``keys`` (``lists`` of them lists of
    numbers), built by ``build``; a ConfigError names the table's index."""
    expected = ", ".join(keys)
    if not isinstance(entry, list):
        raise ConfigError(where, f"a list of tables ({expected})", entry)
    built = []
    for i, table in enumerate(entry):
        field = f"{where}[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(field, f"a table ({expected})", table)
        reject_unknown_keys(table, set(keys), where=field, expected=expected)
        for key in keys:
            if key not in table:
                raise ConfigError(f"{field}.{key}", "present")
        for key in lists:
            if not isinstance(table[key], list):
                raise ConfigError(f"{field}.{key}", "a list of numbers", table[key])
        try:
            built.append(build(table))
        except ConfigError as err:
            prefix = "cost_model.deepep" if where.endswith("deepep") else "cost_model.collective"
            raise ConfigError(err.field.replace(prefix, field, 1), err.expected, err.got) from None
    return tuple(built)


def _collective_curves(entry: object, where: str) -> tuple[CollectiveCurve, ...]:
    return _tables(entry, where, ("num_gpus", "message_bytes", "seconds"), ("message_bytes", "seconds"),
                   lambda t: CollectiveCurve(t["num_gpus"], tuple(t["message_bytes"]), tuple(t["seconds"])))


_DEEPEP_KEYS = ("mode", "nodes", "hidden_size", "top_k", "tokens_per_rank", "dispatch_s", "combine_s")


def _deepep_tables(entry: object, where: str) -> tuple[DeepEPTable, ...]:
    return _tables(entry, where, _DEEPEP_KEYS, _DEEPEP_KEYS[4:],
                   lambda t: DeepEPTable(t["mode"], t["nodes"], t["hidden_size"], t["top_k"],
                                         *(tuple(t[k]) for k in _DEEPEP_KEYS[4:])))


def efficiency_from_mapping(entry: dict, *, where: str = "cost_model", base: Efficiency = Efficiency()) -> Efficiency:
    allowed = {f.name for f in fields(Efficiency)}
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table of efficiency factors", entry)
    reject_unknown_keys(entry, allowed, where=where, expected=f"one of {', '.join(sorted(allowed))}")
    entry = dict(entry)
    for key, value in entry.items():
        # Checked here, not only in __post_init__: the compiled dataclass turns a bool into
        # a float on its way into a float field.
        if key not in TABLE_EFFICIENCY_FIELDS and not is_number(value):
            raise ConfigError(f"{where}.{key}", "a finite number", value)
    if "allreduce" in entry:
        entry["allreduce"] = _allreduce_curves(entry["allreduce"], where)
    for op in COLLECTIVE_OPS:
        if op in entry:
            entry[op] = _collective_curves(entry[op], f"{where}.{op}")
    if "deepep" in entry:
        entry["deepep"] = _deepep_tables(entry["deepep"], f"{where}.deepep")
    try:
        return replace(base, **entry)
    except ConfigError as err:
        raise ConfigError(err.field.replace("cost_model", where, 1), err.expected, err.got) from None


