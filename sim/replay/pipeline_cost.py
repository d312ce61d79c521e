"""A step's seconds under pipeline parallelism: the whole model's step split over its stages.

docs/clock.md#pipeline-parallelism. Each stage is a tensor-parallel group of its own GPUs
holding its layers (``pp_partition``, vLLM's split). A batch runs stage after stage; each
stage's time is its share of the step ``CostModel`` prices for the whole model:

* the body's GEMMs, its element-wise traffic, its TP all-reduces and the fixed time per
  layer by the stage's share of the layers; the routed experts' weights by its MoE layers;
  attention and the KV read by its own layers of each kind (a stage of sliding-window
  layers reads less than one of full-attention layers);
* the LM head (its GEMM and its weights) and the fixed time per step (sampling, launch
  gaps) on the last stage; the embedding lookup reads nothing (``CostModel``), so the first
  stage has only its layers;
* where the whole step is bound by the weights or by the KV read (``max`` of a roofline),
  each stage takes that bound's share, so the stages' times add up to the whole step's;
* plus, after every stage but the last, the point-to-point send of the hidden states and
  the residual (vLLM sends both, each TP rank 1/TP of them, ``isend_tensor_dict``) over the
  inter-node link: the GPU preset's NIC (``nic_bytes_per_s``) where it has one, else its
  peer link (``interconnect_bytes_per_s``);
* and the CPU overhead once per batch, on the first stage: the batch is prepared before it
  enters the pipeline (synchronous scheduling adds it; asynchronous scheduling overlaps it
  with the first stage, as ``CostModel`` does with the whole step).

The result is a ``StepCost`` whose ``total_s`` is the batch's latency through an empty
pipeline (the sum of its stage times), with each stage's GPU time and send
(``stage_compute_s``, ``stage_send_s``; ``slowest_stage_s``: how long a full pipeline
holds each stage); the clock (``DeviceTimeline``) lets a batch into a stage only once the
previous one has left it.
"""

from __future__ import annotations

from kvtwin.sim.core.spec import KVCacheSpec
from kvtwin.sim.calibration.efficiency import Efficiency
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.models import ModelPreset
from kvtwin.sim.planner.parallel import is_moe_layer, pp_layer_ranges
from kvtwin.sim.replay.cost_model import CostModel, StepCost, gemm_fraction

# vLLM's models send two tensors between stages, the hidden states and the residual
# (``IntermediateTensors`` in model_executor/models/llama.py:444, deepseek_v2.py:1574).
PP_SEND_TENSORS = 2


def _share(whole: float, part: float, of: float) -> float:
    return whole * part / of if of else 0.0


def _gemm_term_s(cost_model: CostModel, flops: float, rows: int) -> float:
    """Seconds of GEMMs of ``flops`` over ``rows`` rows (one term of ``cost_model._gemm_s``)."""
    if not flops:
        return 0.0
    fraction = gemm_fraction(cost_model.matmul_flops_fraction, cost_model.matmul_half_tokens, rows)
    return flops / (cost_model.flops_per_s * fraction)


class PipelineCostModel(CostModel):
    """``CostModel`` of a ``pipeline_parallel_size``-stage engine: every price is a
    ``StepCost`` with its stages (``stage_compute_s``, ``stage_send_s``). Decode windows are
    not priced in closed form (``decode_key_shapes`` is None): a pipeline's batches are
    scheduled one by one."""

    def __init__(self, model: ModelPreset, gpu: GPUSpec, layer_specs: dict[str, KVCacheSpec],
                 layer_index: dict[str, int], *, pipeline_parallel_size: int, async_scheduling: bool,
                 tensor_parallel_size: int = 1, efficiency: Efficiency = Efficiency()):
        super().__init__(model, gpu, layer_specs, async_scheduling=async_scheduling,
                         tensor_parallel_size=tensor_parallel_size, efficiency=efficiency)
        tp = tensor_parallel_size
        ranges = pp_layer_ranges(model.num_layers, pipeline_parallel_size)
        self.num_stages = pipeline_parallel_size
        self.stage_layers = [end - start for start, end in ranges]
        # Each stage's attention, KV and decode-head terms come from its own layers.
        self.stage_models = [
            CostModel(model, gpu, {name: spec for name, spec in layer_specs.items()
                                   if start <= layer_index[name] < end},
                      async_scheduling=async_scheduling, tensor_parallel_size=tp, efficiency=efficiency)
            for start, end in ranges]
        self.stage_moe_layers = [sum(1 for i in range(start, end) if is_moe_layer(model, i)) for start, end in ranges]
        letters = model.layer_letters
        attention = [sum(1 for i in range(start, end) if letters[i] in "FSCA") for start, end in ranges]
        inner = model.intermediate_size or (model.num_experts_per_token * model.moe_intermediate_size
                                            + model.shared_expert_intermediate_size)
        per_layer = 2 * 4 * model.hidden_size + 3 * inner / tp
        rotary = 2 * (model.num_attention_heads + model.num_kv_heads) * model.head_dim / tp
        # The element-wise bytes per token of each stage (``_elementwise_bytes_per_token``'s terms).
        self.stage_elementwise_bytes_per_token = [2.0 * (layers * per_layer + att * rotary)
                                                  for layers, att in zip(self.stage_layers, attention)]
        self.head_bytes = model.lm_head_params * (1 if model.weight_format == "fp8" else 2) / tp
        link = gpu.nic_bytes_per_s if gpu.nic_bytes_per_s > 0 else gpu.interconnect_bytes_per_s
        self.pp_link_bytes_per_s = float(link)
        self.send_bytes_per_token = PP_SEND_TENSORS * self.activation_bytes_per_token / tp

    def decode_key_shapes(self) -> list[tuple[int, int]] | None:
        return None

    def send_s(self, num_tokens: int) -> float:
        """Seconds of one stage's send of ``num_tokens`` tokens' hidden states to the next."""
        link = self.pp_link_bytes_per_s
        return num_tokens * self.send_bytes_per_token / link if link else 0.0

    def split_step_cost(self, decode_ends: list[int], prefill_items: list[tuple[int, int]],
                        draft_ends: list[int] | None = None,
                        verify_items: list[tuple[int, int]] | None = None) -> StepCost:
        whole = super().split_step_cost(decode_ends, prefill_items, draft_ends, verify_items)
        parts = [stage.split_step_cost(decode_ends, prefill_items, draft_ends, verify_items)
                 for stage in self.stage_models]
        return self._pipeline(whole, parts, len(decode_ends) + (len(verify_items) if verify_items else 0))

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        whole = super().decode_step_cost(num_decodes, context_ends_sum, prefill_items)
        parts = [stage.decode_step_cost(num_decodes, context_ends_sum, prefill_items) for stage in self.stage_models]
        return self._pipeline(whole, parts, num_decodes)

    def decode_step_cost_by_keys(self, num_decodes: int, attended_keys: list[int],
                                 prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        raise NotImplementedError("a pipeline's decodes are priced batch by batch (decode_key_shapes is None)")

    def _pipeline(self, whole: StepCost, parts: list[StepCost], num_decodes: int) -> StepCost:
        """Split ``whole`` (the step of the whole model) over the stages; ``parts``: each
        stage's layers priced alone, for their attention and KV terms."""
        num_tokens, num_requests = whole.num_tokens, whole.num_requests
        body_s = _gemm_term_s(self, whole.body_flops, num_tokens)
        head_s = _gemm_term_s(self, whole.head_flops, num_requests)
        gemm_s = body_s + head_s
        weights = whole.weight_bytes
        # The routed experts' bytes the step reads (``_weight_bytes_read``'s touched experts).
        experts = 0.0
        if self.moe_layers:
            experts = weights - self.weight_bytes + self.expert_bytes * self.moe_layers * self.model.num_experts
        dense_body = weights - self.head_bytes - experts
        weights_s = weights / self.bytes_per_s
        attention_s = whole.attention_work / (self.flops_per_s * self.attention_flops_fraction)
        kv_s = whole.kv_bytes / self.bytes_per_s
        linear_s, attend_s = max(gemm_s, weights_s), max(attention_s, kv_s)
        layers = self.num_layers
        comm_s = whole.communication_s
        last = self.num_stages - 1
        compute: list[float] = []
        sends: list[float] = []
        for stage in range(self.num_stages):
            part = parts[stage]
            n_layers = self.stage_layers[stage]
            head = stage == last
            if gemm_s >= weights_s:
                linear = _share(linear_s, body_s * n_layers / layers + (head_s if head else 0.0), gemm_s)
            else:
                stage_bytes = (dense_body * n_layers / layers
                               + (experts * self.stage_moe_layers[stage] / self.moe_layers if self.moe_layers else 0.0)
                               + (self.head_bytes if head else 0.0))
                linear = _share(linear_s, stage_bytes, weights)
            if attention_s >= kv_s:
                attend = _share(attend_s, part.attention_work, whole.attention_work)
            else:
                attend = _share(attend_s, part.kv_bytes, whole.kv_bytes)
            fixed = n_layers * self.eff.layer_fixed_s + (self.eff.step_gpu_fixed_s if head else 0.0)
            if num_decodes:
                fixed += self.stage_models[stage].decode_head_s * num_decodes
            gpu_s = (linear + attend + num_tokens * self.stage_elementwise_bytes_per_token[stage] / self.bytes_per_s
                     + fixed + comm_s * n_layers / layers)
            if stage == 0:
                overhead_s = whole.overhead_s
                gpu_s = max(gpu_s, overhead_s) if self.async_scheduling else gpu_s + overhead_s
            compute.append(gpu_s)
            sends.append(0.0 if head else self.send_s(num_tokens))
        total_s = 0.0
        for gpu_s, send_s in zip(compute, sends):
            total_s += gpu_s + send_s
        return StepCost(total_s, whole.compute_s, whole.memory_s, whole.communication_s + sum(sends),
                        whole.overhead_s, whole.flops, whole.weight_bytes, whole.kv_bytes, whole.linear_flops,
                        whole.attention_flops, whole.num_requests, whole.num_tokens, whole.body_flops,
                        whole.head_flops, whole.elementwise_bytes, whole.extra_gpu_s, whole.attention_work,
                        whole.draft_s, compute, sends)
