"""Step duration from the batch: a roofline per GPU, term by term, per layer type.

DESIGN.md "cost model". One engine step runs every scheduled request's new tokens
through the model once. Per GPU of the tensor-parallel group it

* reads the weights once (MoE: only the experts the step's tokens are routed to, in
  expectation for uniform routing),
* reads each sequence's KV once per layer: full attention and MLA their whole context,
  sliding-window layers at most the window, chunked-local layers the current chunk,
  recurrent layers their state (read and written), and writes the new tokens' KV,
* does 2 FLOPs per active parameter per token, plus QK^T and PV over what each query
  token attends (closed forms for causal, windowed and chunked masks),
* all-reduces the activations twice per layer when TP > 1,
* and pays a CPU overhead per step and per scheduled request.

GPU time is ``max(compute, memory) + communication``. With synchronous scheduling the CPU
overhead adds to it; with asynchronous scheduling (vLLM's default) the next step is
prepared while this one runs, so the step takes the longer of the two. Efficiency
factors scale the datasheet peaks; a calibration file (fitted from kvtwin.executor
measurements) overrides them.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys, require
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.memory_budget import weights_bytes_per_gpu
from kvtwin.sim.planner.models import ModelPreset
from kvtwin.sim.core.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec

_MXFP4_BYTES_PER_PARAM = 4.25 / 8


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a real step achieves, and fixed CPU costs.

    The defaults are a starting point for a vLLM-like engine with CUDA graphs; fit them
    from measurements (``kvtwin validate``) for predictions you can trust.
    """

    matmul_flops_fraction: float = 0.6
    attention_flops_fraction: float = 0.45
    hbm_bandwidth_fraction: float = 0.8
    interconnect_fraction: float = 0.7
    allreduce_latency_s: float = 8e-6
    step_overhead_s: float = 1.5e-3
    per_request_overhead_s: float = 15e-6

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_fraction"):
                require(isinstance(value, (int, float)) and 0 < value <= 1, f"cost_model.{f.name}",
                        "a fraction in (0, 1]", value)
            else:
                require(isinstance(value, (int, float)) and value >= 0, f"cost_model.{f.name}",
                        "a non-negative number of seconds", value)


def efficiency_from_mapping(entry: dict, *, where: str = "cost_model", base: Efficiency = Efficiency()) -> Efficiency:
    allowed = {f.name for f in fields(Efficiency)}
    if not isinstance(entry, dict):
        raise ConfigError(where, "a table of efficiency factors", entry)
    reject_unknown_keys(entry, allowed, where=where, expected=f"one of {', '.join(sorted(allowed))}")
    try:
        return replace(base, **entry)
    except ConfigError as err:
        raise ConfigError(err.field.replace("cost_model", where, 1), err.expected, err.got) from None


def load_calibration(path: Path, base: Efficiency = Efficiency()) -> Efficiency:
    """A calibration TOML: efficiency keys at the top level or under ``[cost_model]``."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("calibration", "an existing TOML file", str(path)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("calibration", f"valid TOML ({err})", source=str(path)) from None
    entry = data.get("cost_model", data)
    try:
        return efficiency_from_mapping(entry, base=base)
    except ConfigError as err:
        raise err.with_source(str(path)) from None


@dataclass(frozen=True)
class LayerClass:
    """Layers with one spec, as one GPU of the TP group holds them. What a step reads in
    them (keys attended, KV tokens read, a recurrent state) is the spec's to say."""

    spec: KVCacheSpec
    num_layers: int
    attention_width: int = 0  # q heads per GPU x (d_k + d_v): FLOPs per attended key / 2
    kv_bytes_per_token: float = 0.0  # per layer
    state_bytes: int = 0  # per layer per request (recurrent)


@dataclass  # not frozen: one is made every step, and a compiled frozen dataclass sets each field through object.__setattr__
class StepCost:
    total_s: float
    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float
    flops: float  # linear_flops + attention_flops
    weight_bytes: float
    kv_bytes: float
    # The raw terms a calibration refits the efficiency factors from (calibration.py).
    linear_flops: float
    attention_flops: float
    num_requests: int  # decodes + prefill items: what the per-request overhead multiplies

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python.
    def __init__(self, total_s: float, compute_s: float, memory_s: float, communication_s: float,
                 overhead_s: float, flops: float, weight_bytes: float, kv_bytes: float, linear_flops: float,
                 attention_flops: float, num_requests: int):
        self.total_s = total_s
        self.compute_s = compute_s
        self.memory_s = memory_s
        self.communication_s = communication_s
        self.overhead_s = overhead_s
        self.flops = flops
        self.weight_bytes = weight_bytes
        self.kv_bytes = kv_bytes
        self.linear_flops = linear_flops
        self.attention_flops = attention_flops
        self.num_requests = num_requests


def _add_decodes(lc: LayerClass, attended: int, num_decodes: int, kv_bytes: float,
                 attention_flops: float) -> tuple[float, float]:
    """``kv_bytes`` and ``attention_flops`` plus what ``num_decodes`` decodes attending
    ``attended`` keys in all cost in the layers of ``lc`` (they read those keys, write their
    token, and read and write a recurrent state once each)."""
    kv_bytes += ((attended + num_decodes) * lc.kv_bytes_per_token + 2 * lc.state_bytes * num_decodes) * lc.num_layers
    attention_flops += 2.0 * lc.attention_width * lc.num_layers * attended
    return kv_bytes, attention_flops


class CostModel:
    """Predicts the seconds one engine step takes on one TP group of ``gpu``."""

    def __init__(self, model: ModelPreset, gpu: GPUSpec, layer_specs: dict[str, KVCacheSpec], *,
                 tensor_parallel_size: int = 1, async_scheduling: bool = True,
                 efficiency: Efficiency = Efficiency()):
        require(gpu.hbm_bandwidth_bytes_per_s > 0 and gpu.bf16_flops > 0, f"hardware {gpu.name}",
                "hbm_bandwidth_bytes_per_s and bf16_flops for the cost model", gpu.name)
        self.model = model
        self.gpu = gpu
        self.tp = tensor_parallel_size
        self.async_scheduling = async_scheduling
        self.eff = efficiency
        self.layer_classes = self._layer_classes(model, layer_specs, tensor_parallel_size)
        self.weight_bytes = float(weights_bytes_per_gpu(model, tp=tensor_parallel_size))
        self.expert_bytes, self.moe_layers = self._experts(model, tensor_parallel_size)
        self.linear_flops_per_token = 2.0 * float(model.params_active) / tensor_parallel_size
        self.activation_bytes_per_token = model.hidden_size * 2
        self.num_layers = model.num_layers
        self.flops_per_s = gpu.bf16_flops
        self.bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * efficiency.hbm_bandwidth_fraction

    @staticmethod
    def _layer_classes(model: ModelPreset, specs: dict[str, KVCacheSpec], tp: int) -> tuple[LayerClass, ...]:
        q_heads = max(1, model.num_attention_heads // tp)
        counts: dict[KVCacheSpec, int] = {}
        for spec in specs.values():
            # Padding a page to a unified size changes no byte a step reads.
            key = (dataclasses.replace(spec, page_size_padded=None) if isinstance(spec, (AttentionSpec, MambaSpec))
                   else spec)
            counts[key] = counts.get(key, 0) + 1
        return tuple(LayerClass(spec, n, q_heads * spec.attention_width_per_head, spec.kv_bytes_per_token,
                                spec.state_bytes) for spec, n in counts.items())

    @staticmethod
    def _experts(model: ModelPreset, tp: int) -> tuple[float, int]:
        """Bytes of one routed expert in one layer on one GPU, and the number of MoE layers."""
        if not model.num_experts:
            return 0.0, 0
        per_param = _MXFP4_BYTES_PER_PARAM if model.weight_format == "mxfp4_moe" else \
            (1 if model.weight_format == "fp8" else 2)
        params = 3 * model.hidden_size * model.moe_intermediate_size
        return params * per_param / tp, model.num_layers - model.first_dense_layers

    def _weight_bytes_read(self, num_tokens: int) -> float:
        if not self.moe_layers:
            return self.weight_bytes
        model = self.model
        experts, top_k = model.num_experts, model.num_experts_per_token
        all_experts = experts * self.expert_bytes * self.moe_layers
        # Expected distinct experts hit by num_tokens tokens each routed to top_k of them.
        touched = experts * (1.0 - (1.0 - top_k / experts) ** num_tokens)
        return self.weight_bytes - all_experts + touched * self.expert_bytes * self.moe_layers

    def split_step_cost(self, decode_ends: list[int], prefill_items: list[tuple[int, int]]) -> StepCost:
        """Seconds of one step: decodes (one new token each) given by the context length
        after the step, prefill chunks as (new tokens, tokens computed before). Decodes are
        most requests of most steps, so their terms are sums over contexts."""
        num_tokens, kv_bytes, attention_flops = self._prefill_terms(prefill_items)
        num_decodes = len(decode_ends)
        if num_decodes:
            for lc in self.layer_classes:
                kv_bytes, attention_flops = _add_decodes(lc, lc.spec.decode_attended_keys(decode_ends), num_decodes,
                                                         kv_bytes, attention_flops)
        return self._step_cost(num_tokens + num_decodes, kv_bytes, attention_flops, num_decodes + len(prefill_items))

    def _prefill_terms(self, prefill_items: list[tuple[int, int]]) -> tuple[int, float, float]:
        """(tokens, KV bytes, attention FLOPs) of a step's prefill chunks."""
        num_tokens = 0
        kv_bytes = 0.0
        attention_flops = 0.0
        layer_classes = self.layer_classes
        for new, before in prefill_items:
            num_tokens += new
            end = before + new
            for lc in layer_classes:
                spec = lc.spec
                # A chunk reads what its queries attend and writes its new tokens; a
                # recurrent layer reads and writes its state once.
                kv_bytes += ((spec.kv_tokens_read(before, new) + new) * lc.kv_bytes_per_token
                             + 2 * lc.state_bytes) * lc.num_layers
                attention_flops += 2.0 * lc.attention_width * lc.num_layers * spec.attended_keys(before, end)
        return num_tokens, kv_bytes, attention_flops

    @property
    def decodes_cost_by_context_sum(self) -> bool:
        """Whether a step's decodes cost depends on their contexts only through their sum
        (every layer attends its whole context): ``decode_step_cost`` then applies."""
        return all(type(lc.spec).decode_attended_keys is FullAttentionSpec.decode_attended_keys
                   and isinstance(lc.spec, FullAttentionSpec)
                   and lc.spec.sliding_window is None and lc.spec.attention_chunk_size is None
                   for lc in self.layer_classes)

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        """``split_step_cost`` of ``num_decodes`` decodes whose context ends sum to
        ``context_ends_sum`` (and ``prefill_items``), without the list of ends: decode
        windows (``sim/core/decode_window.py``). Only where ``decodes_cost_by_context_sum``;
        the same float operations in the same order, so the same seconds to the last bit."""
        num_tokens, kv_bytes, attention_flops = self._prefill_terms(prefill_items or [])
        if num_decodes:
            for lc in self.layer_classes:
                kv_bytes, attention_flops = _add_decodes(lc, context_ends_sum, num_decodes, kv_bytes, attention_flops)
        return self._step_cost(num_tokens + num_decodes, kv_bytes, attention_flops,
                               num_decodes + (len(prefill_items) if prefill_items else 0))

    def _step_cost(self, num_tokens: int, kv_bytes: float, attention_flops: float, num_requests: int) -> StepCost:
        eff = self.eff
        linear_flops = self.linear_flops_per_token * num_tokens
        compute_s = (linear_flops / (self.flops_per_s * eff.matmul_flops_fraction)
                     + attention_flops / (self.flops_per_s * eff.attention_flops_fraction))
        weight_bytes = self._weight_bytes_read(num_tokens)
        memory_s = (weight_bytes + kv_bytes) / self.bytes_per_s
        communication_s = 0.0
        if self.tp > 1:
            allreduce_bytes = num_tokens * self.activation_bytes_per_token * 2 * (self.tp - 1) / self.tp
            bandwidth = self.gpu.interconnect_bytes_per_s * eff.interconnect_fraction
            per_layer = (allreduce_bytes / bandwidth if bandwidth else 0.0) + eff.allreduce_latency_s
            communication_s = 2 * self.num_layers * per_layer
        overhead_s = eff.step_overhead_s + eff.per_request_overhead_s * num_requests
        gpu_s = max(compute_s, memory_s) + communication_s
        total_s = max(gpu_s, overhead_s) if self.async_scheduling else gpu_s + overhead_s
        return StepCost(total_s, compute_s, memory_s, communication_s, overhead_s,
                        linear_flops + attention_flops, weight_bytes, kv_bytes,
                        linear_flops, attention_flops, num_requests)
