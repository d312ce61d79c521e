"""Where a model's weights and layers go under data, expert and pipeline parallelism, as
vLLM 0.33 lays them out (docs/semantics.md#parallel-layouts).

* Pipeline parallelism splits the decoder layers into ``pipeline_parallel_size`` stages
  (``pp_partition``, vLLM's default split); the first stage also holds the input
  embedding, the last the LM head (and, with tied embeddings, its own copy of the
  embedding matrix, which it reads as the head).
* Inside a stage, attention and dense weights are sharded over the TP ranks and replicated
  on every DP rank.
* The routed experts of the MoE layers are spread over all ``data_parallel_size x
  tensor_parallel_size`` GPUs of a stage either way: with expert parallelism each GPU
  holds ``ceil(experts / (DP x TP))`` whole experts (the most loaded one), without it every
  expert's intermediate dimension is split over the same DP x TP GPUs.
* With EPLB (expert parallelism only) the GPUs hold ``experts + num_redundant_experts``
  physical experts, ``ceil`` of that over DP x TP each, and every GPU also holds EPLB's
  state: a spare copy of one MoE layer's local experts (the buffer the rebalancing moves
  weights through), the per-step expert loads of its window and the expert maps
  (``distributed/eplb/eplb_state.py``). Its communicator's own staging buffers are not
  counted.

The planner sizes one GPU's KV cache from the most loaded GPU of each stage; every DP
rank is an engine with its own pool of ``num_blocks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtwin.sim.planner.models import KV_HEAD_KINDS, ModelPreset, mxfp4_bytes_per_param

# vLLM 0.33's EPLB (``distributed/eplb/eplb_state.py``, ``config/parallel.py`` ``EPLBConfig``):
# the most extra replicas of one logical expert, which also sizes the logical-to-physical map
# (one int64 slot per replica for every logical expert of every MoE layer), and the steps of
# expert loads its window keeps (int32 per physical expert and MoE layer).
MAX_EXPERT_REDUNDANCY = 1023
EPLB_WINDOW_STEPS = 1000
_INT64_BYTES, _INT32_BYTES = 8, 4


def pp_partition(num_layers: int, pipeline_parallel_size: int) -> tuple[int, ...]:
    """Decoder layers per stage: an even split, the remainder one each to the stages
    before the last, from the one before the last backwards (vLLM 0.33's default when
    ``VLLM_PP_LAYER_PARTITION`` is unset; docs/semantics.md#parallel-layouts)."""
    base, remainder = divmod(num_layers, pipeline_parallel_size)
    layers = [base] * pipeline_parallel_size
    for back in range(2, remainder + 2):
        layers[-back] += 1
    return tuple(layers)


def pp_layer_ranges(num_layers: int, pipeline_parallel_size: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each stage's layers, end exclusive."""
    out, start = [], 0
    for count in pp_partition(num_layers, pipeline_parallel_size):
        out.append((start, start + count))
        start += count
    return tuple(out)


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel sizes of one deployment (vLLM's option names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    num_redundant_experts: int = 0

    @property
    def num_gpus(self) -> int:
        """GPUs the deployment takes: TP x PP per engine, times the DP ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def moe_shard_size(self) -> int:
        """GPUs of one stage the routed experts are spread over (DP x TP, with or without EP)."""
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """vLLM's EP group size: DP x TP with expert parallelism, else 1."""
        return self.moe_shard_size if self.enable_expert_parallel and self.moe_shard_size > 1 else 1

    @property
    def is_single_engine_tp(self) -> bool:
        """Only tensor parallelism: the layout the planner has always sized."""
        return self.pipeline_parallel_size == 1 and self.data_parallel_size == 1

    def stage_ranges(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        return pp_layer_ranges(num_layers, self.pipeline_parallel_size)


@dataclass(frozen=True)
class StageWeights:
    """One GPU's weight bytes in one pipeline stage, by part."""

    stage: int
    layers: tuple[int, int]
    dense_bytes: int
    expert_bytes: int
    experts_per_gpu: int
    eplb_bytes: int = 0  # EPLB's state on the GPU, loaded before the memory profile like weights

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.eplb_bytes


def _bytes_per_param(model: ModelPreset) -> tuple[float, float]:
    """(dense, routed-expert) bytes per parameter of the checkpoint's format."""
    if model.weight_format == "fp8":
        return 1.0, 1.0
    if model.weight_format == "mxfp4_moe":
        return 2.0, mxfp4_bytes_per_param()
    return 2.0, 2.0


def stage_weights(model: ModelPreset, layout: ParallelLayout, stage: int) -> StageWeights:
    """The most loaded GPU's weights in ``stage`` (docs/semantics.md#parallel-layouts).

    The preset gives a total, not every matrix: the routed experts are counted from the
    shape, the embedding and the LM head from vocabulary x hidden, and the rest is spread
    evenly over the layers (a dense first layer weighs like the others)."""
    tp = layout.tensor_parallel_size
    start, end = layout.stage_ranges(model.num_layers)[stage]
    dense_bpp, expert_bpp = _bytes_per_param(model)
    moe_layers = [i for i in range(model.num_layers) if is_moe_layer(model, i)]
    routed_total = min(model.routed_expert_params, float(model.params_total))
    per_moe_layer = routed_total / len(moe_layers) if moe_layers else 0.0
    vocab = model.lm_head_params
    matrices = 1 if model.tie_word_embeddings else 2
    body = max(float(model.params_total) - routed_total - matrices * vocab, 0.0) / model.num_layers
    first, last = stage == 0, stage == layout.pipeline_parallel_size - 1
    # The last stage reads the LM head; tied, it holds the embedding matrix as its head.
    vocab_matrices = (1 if first else 0) + (1 if last and (matrices == 2 or not first) else 0)
    dense_params = body * (end - start) + vocab_matrices * vocab
    dense = math.ceil(dense_params * dense_bpp / tp)
    # KV heads fewer than the TP ranks: each rank holds one whole head's projections.
    if model.num_kv_heads < tp and not model.uses_mla:
        kv_layers = sum(1 for k in model.layer_kinds[start:end] if k in KV_HEAD_KINDS)
        all_kv_layers = sum(1 for k in model.layer_kinds if k in KV_HEAD_KINDS)
        if all_kv_layers:
            per_head = model.kv_projection_weight_bytes_per_kv_head() * kv_layers / all_kv_layers
            dense += int(per_head * (1 - model.num_kv_heads / tp))
    stage_moe_layers = sum(1 for i in moe_layers if start <= i < end)
    shards = layout.moe_shard_size
    physical = physical_experts(model, layout)
    experts_per_gpu = math.ceil(physical / shards) if model.num_experts else 0
    if layout.expert_parallel_size > 1:
        share = experts_per_gpu / model.num_experts
    else:
        share = 1 / shards
    expert = math.ceil(stage_moe_layers * per_moe_layer * expert_bpp * share)
    eplb = 0
    if layout.enable_eplb and stage_moe_layers:
        one_layer_experts = math.ceil(per_moe_layer * expert_bpp * experts_per_gpu / model.num_experts)
        eplb = one_layer_experts + eplb_state_bytes(model.num_experts, physical, stage_moe_layers)
    return StageWeights(stage=stage, layers=(start, end), dense_bytes=dense, expert_bytes=expert,
                        experts_per_gpu=experts_per_gpu if layout.expert_parallel_size > 1 else model.num_experts,
                        eplb_bytes=eplb)


def physical_experts(model: ModelPreset, layout: ParallelLayout) -> int:
    """Routed experts the GPUs of a MoE layer hold together: the model's, plus EPLB's
    redundant replicas (docs/semantics.md#parallel-layouts)."""
    return model.num_experts + (layout.num_redundant_experts if layout.enable_eplb else 0)


def eplb_state_bytes(logical_experts: int, physical: int, moe_layers: int) -> int:
    """EPLB's load and map tensors on one GPU for ``moe_layers`` MoE layers (vLLM 0.33's
    ``EplbState.add_model``): the load window (int32, ``EPLB_WINDOW_STEPS`` x layers x
    physical experts) and this pass's loads (int32), the logical-to-physical map
    (int64, ``MAX_EXPERT_REDUNDANCY + 1`` slots per logical expert), the physical-to-logical
    map, the replica counts and the last loads (int64)."""
    int32 = (EPLB_WINDOW_STEPS + 1) * moe_layers * physical * _INT32_BYTES
    int64 = moe_layers * (logical_experts * (MAX_EXPERT_REDUNDANCY + 1) + physical + 2 * logical_experts)
    return int32 + int64 * _INT64_BYTES


def is_moe_layer(model: ModelPreset, index: int) -> bool:
    """Whether decoder layer ``index`` has routed experts (the dense first layers have none)."""
    return (bool(model.num_experts) and index >= model.first_dense_layers
            and (index - model.moe_layer_offset) % model.moe_layer_period == 0)
