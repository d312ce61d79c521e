"""How many bytes the KV cache gets on one GPU (docs/semantics.md#memory-budget).

vLLM measures it: ``ceil(total x gpu_memory_utilization)`` minus what a profiling forward
pass at ``max_num_batched_tokens`` consumed (weights, non-torch memory, the transient
activation peak) minus the CUDA graph estimate — unless ``kv_cache_memory_bytes`` is given,
which bypasses all of it. We cannot profile, so the terms are estimated here from the
model's shape; every estimate can be overridden from a scenario. The arithmetic after this
point (blocks, concurrency) is exact; this is the one approximate input.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.models import KV_HEAD_KINDS, ModelPreset
from kvtwin.sim.planner.parallel import ParallelLayout, stage_weights

MIB = 1 << 20
ACTIVATION_BYTES = 2  # bf16 activations
LOGITS_BYTES = 4  # the sampler works on fp32 logits
# Non-torch allocations the profiler counts (cuBLAS/cuDNN workspaces; with TP also NCCL
# and custom all-reduce buffers). Order-of-magnitude guesses, not measurements.
NON_TORCH_BYTES = 256 * MIB
NON_TORCH_TP_EXTRA_BYTES = 512 * MIB
# CUDA graphs: decode batches are captured up to this size; each graph keeps a little
# private memory besides the shared pool sized by the largest capture.
MAX_CUDA_GRAPH_CAPTURE_TOKENS = 512
CUDA_GRAPH_BYTES_PER_GRAPH = 2 * MIB


@dataclass(frozen=True)
class MemoryBudget:
    """Per-GPU memory breakdown in bytes. ``kv_cache_bytes`` <= 0 means nothing is left."""

    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    # "estimated" (from the model shape) or "kv_cache_memory_bytes" (given, as vLLM's option)
    kv_cache_source: str = "estimated"

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.activation_peak_bytes + self.cuda_graph_bytes + self.non_torch_bytes

    def to_dict(self) -> dict:
        return asdict(self)


def _cuda_graph_capture_sizes(max_size: int) -> list[int]:
    # vLLM's default ladder: 1, 2, 4, then steps of 8 to 256, then steps of 16.
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def activation_bytes_per_token(model: ModelPreset, *, tp: int) -> int:
    """Transient bytes one token needs inside a layer at its widest point.

    Residual + normed hidden state, the widest mixer (QKV and attention output, or the
    recurrent mixer's projections) and the widest MLP (gate/up + activation; for MoE each
    routed copy of the token plus the shared expert and router logits), TP-sharded.
    """
    kinds = set(model.layer_kinds)
    mixer = 0
    if kinds & KV_HEAD_KINDS:
        q = model.num_attention_heads * model.head_dim
        kv = 2 * model.num_kv_heads * model.head_dim
        mixer = max(mixer, (q + kv + model.num_attention_heads * model.head_dim_v) // tp)
    if "mla" in kinds:
        mixer = max(mixer, model.num_attention_heads * (model.head_dim + model.head_dim_v) // tp + model.mla_head_size)
    if "mamba" in kinds and model.state is not None:
        mixer = max(mixer, 3 * model.state.inner_width(model.hidden_size) // tp)
    mlp = 3 * model.intermediate_size // tp
    if model.num_experts:
        moe = (model.num_experts_per_token * 3 * model.moe_intermediate_size
               + 3 * model.shared_expert_intermediate_size) // tp + model.num_experts
        mlp = max(mlp, moe)
    return (2 * model.hidden_size + mixer + mlp) * ACTIVATION_BYTES


def weights_bytes_per_gpu(model: ModelPreset, *, tp: int) -> int:
    """Weights are split over the TP ranks, except KV heads when there are fewer than
    ranks: each rank then holds one whole KV head's projections."""
    sharded = math.ceil(model.weights_bytes / tp)
    if model.num_kv_heads < tp and not model.uses_mla:
        per_head = model.kv_projection_weight_bytes_per_kv_head()
        sharded += int(per_head * (1 - model.num_kv_heads / tp))
    return sharded


def estimate_memory(model: ModelPreset, gpu: GPUSpec, *, tp: int, gpu_memory_utilization: float,
                    max_num_batched_tokens: int, max_num_seqs: int,
                    activation_peak_bytes: int | None = None, cuda_graph_bytes: int | None = None,
                    non_torch_bytes: int | None = None, draft_weights_bytes: int = 0,
                    layout: ParallelLayout | None = None, stage: int = 0) -> MemoryBudget:
    """The KV cache budget of one GPU, from the model shape (overrides win); a draft head's
    weights (``draft_weights_bytes``, per GPU) are loaded before profiling, like the target's.
    With ``layout`` (data, expert or pipeline parallelism) the GPU is the most loaded one of
    pipeline stage ``stage`` (docs/semantics.md#parallel-layouts): its weights are that
    stage's, and only the last stage samples."""
    requested = math.ceil(gpu.memory_bytes * gpu_memory_utilization)
    parallel = layout is not None and not (layout.is_single_engine_tp and not layout.enable_expert_parallel)
    if parallel:
        assert layout is not None
        weights = stage_weights(model, layout, stage).total_bytes + draft_weights_bytes
    else:
        weights = weights_bytes_per_gpu(model, tp=tp) + draft_weights_bytes
    samples = layout is None or stage == layout.pipeline_parallel_size - 1
    per_token = activation_bytes_per_token(model, tp=tp)
    if activation_peak_bytes is None:
        forward = max_num_batched_tokens * per_token
        # The profiling run also samples max_num_seqs rows of fp32 logits (and their probs).
        sampler = 2 * max_num_seqs * model.vocab_size * LOGITS_BYTES if samples else 0
        activation_peak_bytes = max(forward, sampler)
    if cuda_graph_bytes is None:
        largest = min(MAX_CUDA_GRAPH_CAPTURE_TOKENS, max_num_seqs)
        cuda_graph_bytes = (largest * per_token
                            + len(_cuda_graph_capture_sizes(largest)) * CUDA_GRAPH_BYTES_PER_GRAPH)
    if non_torch_bytes is None:
        # Any process group (TP, PP or the DP/EP one) brings NCCL buffers.
        grouped = tp > 1 or (layout is not None and layout.num_gpus > 1)
        non_torch_bytes = NON_TORCH_BYTES + (NON_TORCH_TP_EXTRA_BYTES if grouped else 0)
    kv = requested - weights - activation_peak_bytes - cuda_graph_bytes - non_torch_bytes
    return MemoryBudget(total_bytes=gpu.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                        requested_bytes=requested, weights_bytes=weights,
                        activation_peak_bytes=activation_peak_bytes, cuda_graph_bytes=cuda_graph_bytes,
                        non_torch_bytes=non_torch_bytes, kv_cache_bytes=kv)


def explicit_memory(estimate: MemoryBudget, kv_cache_memory_bytes: int) -> MemoryBudget:
    """``kv_cache_memory_bytes`` given: the KV cache gets exactly that (the estimate's other
    terms are kept for reference only)."""
    return MemoryBudget(**{**estimate.to_dict(), "kv_cache_bytes": kv_cache_memory_bytes,
                           "kv_cache_source": "kv_cache_memory_bytes"})
