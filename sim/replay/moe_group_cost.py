"""The MoE layers of a data-parallel group's step, priced for the whole group
(docs/clock.md#moe-under-data-parallelism).

vLLM 0.33 does not run a DP rank's MoE layers on that rank's tokens alone. Whether or not
expert parallelism is on, the routed experts are spread over all ``DP x TP`` GPUs
(``FusedMoEParallelConfig.flatten_tp_across_dp_and_pcp``; the planner sizes memory the same
way, ``sim/planner/parallel.py``), and at every MoE layer the ranks' tokens are gathered,
run through the experts and sent back:

* **without EP** each expert's intermediate dimension is split over the ``DP x TP`` GPUs:
  every GPU runs every routed token through its slice of the experts those tokens pick;
* **with EP** each GPU holds ``ceil(experts / (DP x TP))`` whole experts and runs the
  routed tokens that picked them.

The collective: vLLM 0.33's default ``--all2all-backend`` is ``allgather_reducescatter``
(``ParallelConfig.all2all_backend``; the ``naive`` and ``pplx`` names fall back to it).
Dispatch all-gathers the hidden states of every rank onto every GPU of the group
(``AgRsAll2AllManager.dispatch``/``dispatch_router_logits``) and combine reduce-scatters the
expert outputs back (``combine``), with EP as without it (``all2all_utils``: the naive
DP/EP prepare-and-finalize). The group is the DP group, or with EP and TP > 1 the EP group
of ``DP x TP`` GPUs, each holding its ``1/TP`` of its rank's tokens (sequence-parallel MoE,
``ParallelConfig.use_sequence_parallel_moe``). Either way every GPU receives the hidden
states of all the group's tokens. With EP every other backend (DeepEP, MoRI, nixl-ep,
MoonEP, FlashInfer's) sends each token to the GPUs of its top-k experts and back, an
all-to-all (``ALL_TO_ALL``); ``[engine] all2all_backend`` picks the shape
(``collective_for``).

So a lockstep step holds, on every rank, its own attention, dense layers, shared experts
and LM head (``DPRankCostModel``: ``CostModel`` without the routed experts) and the group's
MoE part (``MoEGroupCost``), which is the same on every rank: each MoE layer's collective
waits for every GPU, so the ranks leave every MoE layer together at the pace of the most
loaded GPU. The step is the slowest rank's.

Assumptions, each documented in docs/clock.md#moe-under-data-parallelism:

* Tokens: a rank's scheduled tokens, a dummy batch one token; when CUDA graphs run the
  step every rank runs the group's largest batch (``dp_padding_tokens``): its GEMMs, its
  TP all-reduces and its share of the MoE collective and experts at that count, its
  attention, LM head and CPU work on its own requests. The further padding to a captured
  graph size is not priced, as the single-engine ``CostModel`` prices none.
* Compute: 2 FLOPs per routed parameter per (token, expert) pair; without EP a GPU does
  ``1/(DP x TP)`` of all the group's pairs, with EP the pairs of its experts, as the
  expected load of the most loaded GPU under uniform routing (the mean plus
  ``sqrt(2 ln GPUs)`` standard deviations of one GPU's load, the Gaussian bound on the
  expected maximum; a token picks ``top_k`` distinct experts, so a GPU's share of one token
  is hypergeometric). Without a MoE fit the GEMMs run at the cost model's efficiency for a
  GEMM of as many rows as the group's tokens (``gemm_fraction``), as ``CostModel`` prices
  its experts. With one (``Efficiency.moe_fitted``: ``sim/calibration/fit/moe_kernels.py``
  on aiconfigurator's measured fused-MoE layers) the grouped GEMM runs at
  ``moe_flops_fraction`` ramped by the rows each expert gets (``T x top_k / experts``), and
  the busiest GPU's load is the mean times the fitted load factor of skewed routing
  (``moe_ep_imbalance`` with EP, ``moe_tp_imbalance`` without), in place of the uniform
  bound; each MoE layer adds ``moe_floor_s`` and ``moe_s_per_token_value`` per hidden value
  of each token entering the GPU's layer (the group's tokens after the all-gather, its
  routed copies after an all-to-all). FP8 and MXFP4 experts compute at the bf16 rate and
  read their own bytes per parameter, as ``CostModel`` prices them.
* Weights: the expected distinct experts the group's tokens touch (``_weight_bytes_read``'s
  formula), on a GPU its share of them: a ``1/(DP x TP)`` slice of every touched expert
  without EP, its own touched experts whole with EP, at ``moe_hbm_bandwidth_fraction`` with a
  MoE fit, else ``hbm_bandwidth_fraction``. GPU time is the roofline ``max(GEMMs,
  weights)`` of the MoE kernels, plus the fit's fixed and per-token time, plus the
  collective: the MoE kernels are separate from the rank's other GEMMs, each on its own
  roofline.
* Collective messages: hidden states at 2 bytes a value; the routing tensors (router
  logits, or top-k ids and weights) and an FP8 dispatch are not counted (vLLM quantizes
  the dispatch of an FP8 block-quantized model on every backend, the all-gather's
  included, so it is no difference between backends). The all-gather plus reduce-scatter
  of ``N`` bytes moves the bytes of one ring all-reduce of ``N`` (``2 (n-1)/n N`` per
  GPU); the all-to-all of the busiest rank's ``t`` tokens moves ``2 (n-1)/n t top_k x
  hidden x 2`` per GPU, an all-reduce of ``N = t top_k x hidden x 2``.
* Pricing, from the calibration's measured tables where one fits the group (``pricing``
  says which): DeepEP's backends from the ``deepep`` table of their kernel and node count
  (``ceil(DP x TP / 8)``), one dispatch and one combine at the busiest rank's tokens
  counted as the table model's tokens of the same bytes; the other all-to-alls from the
  NCCL ``alltoall`` curve of ``n`` GPUs, two of a send buffer of ``N``; the gather from
  the ``allgather`` and ``reducescatter`` curves of ``n`` GPUs, one of each at ``N`` (the
  gathered output and the scattered input, nccl-tests' sizes). NCCL was measured within
  one node: past it, and where no table fits, each is priced as its all-reduce as before
  the tables: the measured all-reduce curve for ``n`` GPUs where there is one
  (``efficiency.allreduce_curve``), else those bytes over the link at
  ``interconnect_fraction`` plus ``allreduce_latency_s`` per collective.
* Link: NVLink (``interconnect_bytes_per_s``) while the group's ``DP x TP`` GPUs fit one
  node, else the GPU preset's NIC (``nic_bytes_per_s``, the peer link where it has none).
  GPU presets do not say how many GPUs a node has: ``GPUS_PER_NODE`` (8) is assumed.
* EPLB (``enable_eplb``): each GPU holds ``(experts + num_redundant_experts) / (DP x TP)``
  physical experts and reads its touched ones; the busiest GPU carries the mean load, as if
  EPLB's rebalancing (every 3000 steps, on the last 1000 steps' loads) had evened it out
  from the start: its first interval and its residual imbalance are not priced, nor the
  moves of expert weights between GPUs.
* Not modelled: the all-to-all kernels of backends other than DeepEP (priced as NCCL's)
  and, past the measured tables, the kernels' dedup of a token's copies bound for one GPU
  or node, skew beyond uniform routing without a MoE fit, and overlap of the collective
  with compute (dual-batch overlap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtwin.sim.calibration.efficiency import CollectiveCurve, DeepEPTable, Efficiency
from kvtwin.sim.core.spec import KVCacheSpec
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.models import ModelPreset
from kvtwin.sim.planner.plan import Plan
from kvtwin.sim.replay.cost_model import CostModel, StepCost, _gemm_s, gemm_fraction

# GPUs one node holds: GPU presets do not say; 8 is the HGX/DGX board every preset ships on.
GPUS_PER_NODE = 8
# The two collective shapes: vLLM 0.33's default ``--all2all-backend``, and the all-to-all
# of DeepEP-style ones.
ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
ALL_TO_ALL = "all_to_all"
# The shape each backend vLLM 0.33 runs moves a DP group's tokens with (aliases resolved by
# ``EngineConfig.resolve``): every dedicated kernel dispatches each token to the GPUs of its
# top-k experts and combines back (``fused_moe/all2all_utils.py:238-440``).
BACKEND_COLLECTIVES = {
    "allgather_reducescatter": ALLGATHER_REDUCESCATTER,
    "deepep_high_throughput": ALL_TO_ALL, "deepep_low_latency": ALL_TO_ALL, "deepep_v2": ALL_TO_ALL,
    "mori_high_throughput": ALL_TO_ALL, "mori_low_latency": ALL_TO_ALL, "moonep": ALL_TO_ALL,
    "nixl_ep": ALL_TO_ALL, "flashinfer_nvlink_two_sided": ALL_TO_ALL, "flashinfer_nvlink_one_sided": ALL_TO_ALL,
}
# Backends whose EP group splits a rank's tokens over its TP GPUs (sequence-parallel MoE,
# ``config/parallel.py:768-786``); the others dispatch every TP GPU's full copy.
SEQUENCE_PARALLEL_BACKENDS = frozenset(BACKEND_COLLECTIVES) - {"moonep", "flashinfer_nvlink_two_sided"}


# The DeepEP backends and the kernels of theirs the calibration's ``deepep`` tables measure.
DEEPEP_BACKEND_MODES = {"deepep_low_latency": "low_latency", "deepep_high_throughput": "high_throughput"}


def collective_for(backend: str, expert_parallel: bool) -> str:
    """The shape a DP group's MoE layers move tokens with under ``backend``: the backend's
    own with EP; without EP vLLM 0.33 runs no all-to-all kernel and falls back to the
    all-gather and reduce-scatter whatever the backend (``fused_moe/config.py:1035``
    ``use_all2all_kernels``, ``fused_moe/all2all_utils.py:203-226``)."""
    return BACKEND_COLLECTIVES[backend] if expert_parallel else ALLGATHER_REDUCESCATTER
_ACTIVATION_BYTES = 2  # bf16 hidden states
# vLLM 0.33's ceiling on the default largest CUDA graph (``VllmConfig._set_cudagraph_sizes``):
# 1024 tokens on a data-centre Blackwell GPU (compute capability 10.x), else 512.
_DEFAULT_MAX_GRAPH_TOKENS = 512
_BLACKWELL_MAX_GRAPH_TOKENS = 1024


def max_cudagraph_capture_tokens(max_num_seqs: int, max_num_batched_tokens: int, compute_capability: str) -> int:
    """The largest batch vLLM 0.33 captures a CUDA graph for by default, one decode token a
    request (``config/vllm.py:2447-2600``): ``min(2 max_num_seqs, 512 or 1024)``, then no
    more than ``max_num_batched_tokens``; the ladder 1, 2, 4, steps of 8 below 256 and of 16
    from there, plus ``max_num_batched_tokens`` and ``max_num_seqs`` where they fit, tops
    out at its largest entry (docs/clock.md#moe-under-data-parallelism)."""
    blackwell = compute_capability.split(".")[0] == "10"
    ceiling = _BLACKWELL_MAX_GRAPH_TOKENS if blackwell else _DEFAULT_MAX_GRAPH_TOKENS
    wanted = min(max_num_seqs * 2, ceiling)
    cap = min(max_num_batched_tokens, wanted)
    sizes = [size for size in (1, 2, 4) if size <= cap]
    sizes += list(range(8, min(cap + 1, 256), 8)) + list(range(256, cap + 1, 16))
    if max_num_batched_tokens <= cap:
        sizes.append(max_num_batched_tokens)
    if max_num_seqs <= wanted and max_num_seqs <= max_num_batched_tokens:
        sizes.append(max_num_seqs)
    return max(sizes)


def dp_padding_tokens(rank_tokens: Sequence[int], max_graph_tokens: int | None) -> int | None:
    """The tokens every rank of a DP group runs, or None where each runs its own
    (docs/clock.md#moe-under-data-parallelism). A rank asks for a CUDA graph where its batch
    fits the largest captured one; the ranks take the least graph mode any asked for, and
    unless that is none every rank pads to the largest rank's batch
    (``v1/worker/gpu/dp_utils.py:156-200``, the V1 runner's ``v1/worker/dp_utils.py:170-185``).
    ``max_graph_tokens`` None: ``enforce_eager``, no graphs."""
    if max_graph_tokens is None:
        return None
    largest = max(rank_tokens)
    return largest if largest <= max_graph_tokens else None


@dataclass(frozen=True)
class MoEGroupPart:
    """The MoE layers of one group step, as every rank waits for them (seconds summed over
    the MoE layers): the most loaded GPU's expert GEMMs and expert weight reads, and the
    collective's time."""

    compute_s: float
    weights_s: float
    communication_s: float
    flops: float  # on the most loaded GPU
    weight_bytes: float  # on the most loaded GPU
    fixed_s: float = 0.0  # the fitted floor and per-token time (0 without a MoE fit)

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.weights_s) + self.fixed_s + self.communication_s


def expected_max_gpu_pairs(num_tokens: int, num_experts: int, top_k: int, experts_per_gpu: int,
                           num_gpus: int) -> float:
    """Expected (token, expert) pairs on the most loaded of ``num_gpus`` GPUs holding
    ``experts_per_gpu`` experts each, when ``num_tokens`` tokens each pick ``top_k``
    distinct experts uniformly: the mean plus ``sqrt(2 ln num_gpus)`` standard deviations
    (hypergeometric per token, independent tokens), capped at what the GPU could get."""
    share = experts_per_gpu / num_experts
    mean = num_tokens * top_k * share
    if num_gpus <= 1 or num_experts <= 1:
        return mean
    variance = num_tokens * top_k * share * (1.0 - share) * (num_experts - top_k) / (num_experts - 1)
    bound = mean + math.sqrt(max(variance, 0.0) * 2.0 * math.log(num_gpus))
    return min(bound, float(num_tokens * min(top_k, experts_per_gpu)))


class MoEGroupCost:
    """Prices the MoE part of a DP group's step (docs/clock.md#moe-under-data-parallelism)."""

    def __init__(self, model: ModelPreset, gpu: GPUSpec, *, tensor_parallel_size: int, data_parallel_size: int,
                 expert_parallel: bool, efficiency: Efficiency = Efficiency(),
                 collective: str = ALLGATHER_REDUCESCATTER, sequence_parallel: bool = True,
                 eplb_redundant_experts: int | None = None, deepep_mode: str | None = None):
        if not model.num_experts:
            raise ValueError(f"{model.name} has no routed experts")
        if collective not in (ALLGATHER_REDUCESCATTER, ALL_TO_ALL):
            raise ValueError(f"collective {collective!r}")
        tp, dp = tensor_parallel_size, data_parallel_size
        self.model = model
        self.tp, self.dp = tp, dp
        self.shards = tp * dp
        self.expert_parallel = expert_parallel and self.shards > 1
        self.collective = collective
        self.num_experts = model.num_experts
        self.top_k = model.num_experts_per_token
        self.moe_layers = model.num_moe_layers
        # Bytes of one whole routed expert in one layer (``CostModel._experts`` at TP 1).
        self.expert_bytes, _ = CostModel._experts(model, 1)
        # EPLB (``eplb_redundant_experts`` not None, EP only) spreads the experts and its
        # redundant replicas evenly, and rebalances them to the measured load.
        self.eplb = self.expert_parallel and eplb_redundant_experts is not None
        physical = self.num_experts + (eplb_redundant_experts or 0) if self.eplb else self.num_experts
        self.experts_per_gpu = math.ceil(physical / self.shards) if self.expert_parallel else self.num_experts
        # Bytes of each expert a GPU holds: whole with EP, a 1/(DP x TP) slice without.
        self.held_expert_bytes = self.expert_bytes if self.expert_parallel else self.expert_bytes / self.shards
        self.pair_flops = 2.0 * 3 * model.hidden_size * model.moe_intermediate_size * self.moe_layers
        self.flops_per_s = gpu.bf16_flops
        self.bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * efficiency.hbm_bandwidth_fraction
        self.matmul_flops_fraction = float(efficiency.matmul_flops_fraction)
        self.matmul_half_tokens = float(efficiency.matmul_half_tokens)
        # A fit of the experts' own (sim/calibration/fit/moe_kernels.py) replaces the dense
        # GEMMs' factors and uniform routing's expected maximum.
        self.fitted = efficiency.moe_fitted
        if self.fitted and efficiency.moe_hbm_bandwidth_fraction:
            self.bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * efficiency.moe_hbm_bandwidth_fraction
        self.moe_flops_fraction = float(efficiency.moe_flops_fraction)
        self.moe_expert_half_tokens = float(efficiency.moe_expert_half_tokens)
        self.imbalance = float(efficiency.moe_ep_imbalance if self.expert_parallel else efficiency.moe_tp_imbalance)
        self.floor_s = float(efficiency.moe_floor_s)
        self.s_per_token = float(efficiency.moe_s_per_token_value) * model.hidden_size
        # The collective's group: the DP group, or the EP group with sequence-parallel MoE.
        self.collective_gpus = self.shards if self.expert_parallel and tp > 1 else dp
        self.token_split = tp if self.expert_parallel and tp > 1 and sequence_parallel else 1
        link = gpu.interconnect_bytes_per_s
        if self.shards > GPUS_PER_NODE and gpu.nic_bytes_per_s > 0:
            link = gpu.nic_bytes_per_s
        self.link_bytes_per_s = float(link) * efficiency.interconnect_fraction
        self.latency_s = float(efficiency.allreduce_latency_s)
        within_node = self.shards <= GPUS_PER_NODE
        n = self.collective_gpus
        self.curve = efficiency.allreduce_curve(n) if within_node else None
        self.token_bytes = model.hidden_size * _ACTIVATION_BYTES
        # The measured tables that price the collective, where the calibration has one
        # for this group; else the all-reduce curve or the link (``pricing`` says which).
        self.allgather, self.reducescatter, self.alltoall, self.deepep, self.pricing = self._collective_tables(
            efficiency, deepep_mode, within_node)

    def _collective_tables(self, efficiency: Efficiency, deepep_mode: str | None, within_node: bool) -> tuple[
            CollectiveCurve | None, CollectiveCurve | None, CollectiveCurve | None, DeepEPTable | None, str]:
        """The all-gather, reduce-scatter, all-to-all and DeepEP tables that price this
        group's collective (None where the calibration has none for it), and what priced it
        in words (docs/clock.md#moe-under-data-parallelism)."""
        allgather: CollectiveCurve | None = None
        reducescatter: CollectiveCurve | None = None
        alltoall: CollectiveCurve | None = None
        deepep: DeepEPTable | None = None
        n, collective = self.collective_gpus, self.collective
        nodes = math.ceil(self.shards / GPUS_PER_NODE)
        if collective == ALL_TO_ALL and deepep_mode is not None:
            deepep = efficiency.deepep_table(deepep_mode, nodes)
        if deepep is None and within_node and collective == ALL_TO_ALL:
            alltoall = efficiency.collective_curve("alltoall", n)
        if within_node and collective == ALLGATHER_REDUCESCATTER:
            gather, scatter = efficiency.collective_curve("allgather", n), efficiency.collective_curve("reducescatter", n)
            if gather is not None and scatter is not None:
                allgather, reducescatter = gather, scatter
        if n <= 1:
            pricing = "none (one GPU in the collective)"
        elif deepep is not None:
            pricing = f"measured DeepEP {deepep_mode} dispatch and combine ({nodes} node(s))"
        elif allgather is not None:
            pricing = f"measured NCCL all-gather and reduce-scatter ({n} GPUs)"
        elif alltoall is not None:
            pricing = f"measured NCCL all-to-all ({n} GPUs)"
        elif self.curve is not None:
            pricing = f"measured all-reduce of the same bytes ({n} GPUs)"
        else:
            group = f" ({self.shards} GPUs in the group)" if self.shards != n else ""
            pricing = (f"bandwidth model: {n} GPUs over {'the NIC' if not within_node else 'NVLink'}{group}, "
                       "no measured table")
        return allgather, reducescatter, alltoall, deepep, pricing

    def pairs_on_busiest_gpu(self, group_tokens: int) -> float:
        """(token, expert) pairs the most loaded GPU computes in one MoE layer: uniform
        routing's expected maximum, or with a MoE fit the mean times the fitted load factor
        (capped at what the GPU could get); with EPLB the mean, as its rebalancing leaves
        every GPU the same load."""
        if self.eplb:
            return min(group_tokens * self.top_k / self.shards, float(group_tokens * min(self.top_k,
                                                                                        self.experts_per_gpu)))
        if not self.expert_parallel:
            return group_tokens * self.top_k / self.shards * (self.imbalance if self.fitted else 1.0)
        if self.fitted:
            mean = group_tokens * self.top_k * self.experts_per_gpu / self.num_experts
            return min(mean * self.imbalance, float(group_tokens * min(self.top_k, self.experts_per_gpu)))
        return expected_max_gpu_pairs(group_tokens, self.num_experts, self.top_k, self.experts_per_gpu, self.shards)

    def weight_bytes(self, group_tokens: int) -> float:
        """Expert weight bytes one GPU reads in a step: its share of the experts the
        group's tokens touch, in expectation for uniform routing."""
        experts, top_k = self.num_experts, self.top_k
        touched_fraction = 1.0 - (1.0 - top_k / experts) ** group_tokens
        return self.experts_per_gpu * touched_fraction * self.held_expert_bytes * self.moe_layers

    def communication_s(self, rank_tokens: Sequence[int]) -> float:
        """Seconds of the collectives of all MoE layers of one step (dispatch and combine)."""
        n = self.collective_gpus
        if n <= 1:
            return 0.0
        if self.collective == ALL_TO_ALL:
            if self.deepep is not None:
                # The table's model sends top_k x hidden values a token: another model's
                # tokens count as the table's tokens of the same bytes.
                table = self.deepep
                tokens = max(rank_tokens) / self.token_split
                equivalent = tokens * self.top_k * self.model.hidden_size / (table.top_k * table.hidden_size)
                return table.seconds_for(equivalent) * self.moe_layers
            # The busiest GPU sends its tokens' top-k copies, (n-1)/n of them to other GPUs
            # (dispatch), and gets them back (combine): per GPU the bytes of one all-reduce
            # of ``tokens x top_k`` hidden states, priced as that all-reduce; nccl-tests'
            # all-to-all of a send buffer that size where one is measured, once each way.
            message = max(rank_tokens) / self.token_split * self.top_k * self.token_bytes
            if self.alltoall is not None:
                return 2 * self.alltoall.seconds_for(message) * self.moe_layers
        else:
            # Every GPU gathers all the group's hidden states and scatters the outputs back:
            # the all-gather's output and the reduce-scatter's input are those bytes.
            message = sum(rank_tokens) * self.token_bytes
            if self.allgather is not None and self.reducescatter is not None:
                return (self.allgather.seconds_for(message) + self.reducescatter.seconds_for(message)) * self.moe_layers
        if self.curve is not None:
            per_layer = self.curve.seconds_for(message)
        else:
            bus_bytes = 2 * message * (n - 1) / n
            per_layer = (bus_bytes / self.link_bytes_per_s if self.link_bytes_per_s else 0.0) + 2 * self.latency_s
        return per_layer * self.moe_layers

    def part(self, rank_tokens: Sequence[int]) -> MoEGroupPart:
        """The group step's MoE part, given each rank's tokens (a dummy batch: 1)."""
        group_tokens = sum(rank_tokens)
        pairs = self.pairs_on_busiest_gpu(group_tokens)
        flops = pairs * self.pair_flops
        weight_bytes = self.weight_bytes(group_tokens)
        communication_s = self.communication_s(rank_tokens)
        if not self.fitted:
            fraction = gemm_fraction(self.matmul_flops_fraction, self.matmul_half_tokens, group_tokens)
            compute_s = flops / (self.flops_per_s * fraction) if flops else 0.0
            return MoEGroupPart(compute_s, weight_bytes / self.bytes_per_s, communication_s, flops, weight_bytes)
        # The grouped GEMM's efficiency follows each expert's rows, uniform routing's mean.
        fraction = gemm_fraction(self.moe_flops_fraction, self.moe_expert_half_tokens,
                                 group_tokens * self.top_k / self.num_experts)
        compute_s = flops / (self.flops_per_s * fraction) if flops else 0.0
        # Tokens entering a GPU's MoE layer: the whole group's after an all-gather, its
        # routed copies after an all-to-all.
        entering = min(float(group_tokens), pairs) if self.collective == ALL_TO_ALL else float(group_tokens)
        fixed_s = (self.floor_s + self.s_per_token * entering) * self.moe_layers
        return MoEGroupPart(compute_s, weight_bytes / self.bytes_per_s, communication_s, flops, weight_bytes,
                            fixed_s)


class DPRankCostModel(CostModel):
    """``CostModel`` of one rank of a DP MoE group without its routed experts: attention,
    dense layers, shared experts and the LM head on the rank's own tokens. It prices the GPU
    time and the CPU overhead as synchronous scheduling adds them (``total_s - overhead_s``
    is the GPU time); ``MoEDPGroup.rank_step_s`` adds the group's MoE part and combines
    them as the engine schedules (``group_async_scheduling``)."""

    def __init__(self, model: ModelPreset, gpu: GPUSpec, layer_specs: dict[str, KVCacheSpec], *,
                 async_scheduling: bool, tensor_parallel_size: int = 1, efficiency: Efficiency = Efficiency()):
        super().__init__(model, gpu, layer_specs, async_scheduling=False, tensor_parallel_size=tensor_parallel_size,
                         efficiency=efficiency)
        self.group_async_scheduling = async_scheduling
        routed_active = self.moe_layers * model.num_experts_per_token * 3 * model.hidden_size * \
            model.moe_intermediate_size
        self.linear_flops_per_token = 2.0 * max(model.body_params_active - routed_active, 0.0) / tensor_parallel_size
        self.dense_weight_bytes = self.weight_bytes - model.num_experts * self.expert_bytes * self.moe_layers

    def _weight_bytes_read(self, num_tokens: int) -> float:
        return self.dense_weight_bytes

    def padded(self, own: StepCost, num_tokens: int) -> StepCost:
        """``own`` with the rank's batch padded to ``num_tokens`` rows: the GEMMs of the
        body, the element-wise kernels and the TP all-reduces run every row (the padded
        rows are the graph's input buffer); attention, the LM head, the KV and weight reads
        and the CPU work stay those of the rank's requests, as the padded rows belong to
        none (docs/clock.md#moe-under-data-parallelism). ``num_tokens`` of the result is the
        rows the GEMMs ran."""
        if num_tokens <= own.num_tokens:
            return own
        body_flops = self.linear_flops_per_token * num_tokens
        gemm_compute_s = _gemm_s(self.matmul_flops_fraction, self.matmul_half_tokens, self.flops_per_s, body_flops,
                                 num_tokens, own.head_flops, own.num_requests)
        attention_compute_s = own.attention_work / (self.flops_per_s * self.attention_flops_fraction)
        weights_s = own.weight_bytes / self.bytes_per_s
        kv_s = own.kv_bytes / self.bytes_per_s
        elementwise_bytes = num_tokens * self.elementwise_bytes_per_token
        communication_s = self._tp_allreduce_s(num_tokens) if self.tp > 1 else 0.0
        gpu_s = (max(gemm_compute_s, weights_s) + max(attention_compute_s, kv_s) + elementwise_bytes / self.bytes_per_s
                 + own.extra_gpu_s + communication_s + own.draft_s)
        linear_flops = body_flops + own.head_flops
        return StepCost(gpu_s + own.overhead_s, gemm_compute_s + attention_compute_s, weights_s + kv_s,
                        communication_s, own.overhead_s, linear_flops + own.attention_flops, own.weight_bytes,
                        own.kv_bytes, linear_flops, own.attention_flops, own.num_requests, num_tokens, body_flops,
                        own.head_flops, elementwise_bytes, own.extra_gpu_s, own.attention_work, own.draft_s)


class MoEDPGroup:
    """What the lockstep group asks at each step (``dp_group.py``): each rank's seconds,
    its own part plus the group's MoE part, and the step's StepCost per rank.
    ``max_graph_tokens``: the largest batch a CUDA graph runs (None: ``enforce_eager``),
    which decides whether the ranks pad to the largest one (``dp_padding_tokens``)."""

    def __init__(self, rank_model: DPRankCostModel, moe: MoEGroupCost, *, max_graph_tokens: int | None = None):
        self.rank_model = rank_model
        self.moe = moe
        self.max_graph_tokens = max_graph_tokens
        self.dummy_cost = rank_model.split_step_cost([1], [])

    def rank_step(self, own: StepCost, part: MoEGroupPart) -> StepCost:
        """A rank's step: its own ``own`` (from ``DPRankCostModel``) with the group's MoE
        part added to its GPU time, the CPU overhead added (synchronous) or overlapped
        (asynchronous)."""
        gpu_s = own.total_s - own.overhead_s + part.total_s
        total_s = max(gpu_s, own.overhead_s) if self.rank_model.group_async_scheduling else gpu_s + own.overhead_s
        return StepCost(total_s, own.compute_s + part.compute_s, own.memory_s + part.weights_s,
                        own.communication_s + part.communication_s, own.overhead_s, own.flops + part.flops,
                        own.weight_bytes + part.weight_bytes, own.kv_bytes, own.linear_flops + part.flops,
                        own.attention_flops, own.num_requests, own.num_tokens, own.body_flops + part.flops,
                        own.head_flops, own.elementwise_bytes, own.extra_gpu_s, own.attention_work, own.draft_s,
                        moe_communication_s=part.communication_s)

    def step(self, own: Sequence[StepCost | None]) -> tuple[list[StepCost], float]:
        """Each rank's step (None: a dummy batch of one token) and the group step's seconds,
        the slowest rank's."""
        costs = [cost if cost is not None else self.dummy_cost for cost in own]
        rank_tokens = [max(cost.num_tokens, 1) for cost in costs]
        padded = dp_padding_tokens(rank_tokens, self.max_graph_tokens)
        if padded is not None:
            costs = [self.rank_model.padded(cost, padded) for cost in costs]
            rank_tokens = [padded] * len(costs)
        part = self.moe.part(rank_tokens)
        steps = [self.rank_step(cost, part) for cost in costs]
        return steps, max(step.total_s for step in steps)


def moe_dp_group(plan: Plan, efficiency: Efficiency) -> MoEDPGroup:
    """The pricing of a DP MoE plan's lockstep group: its ranks' cost model and its MoE part."""
    eng = plan.engine
    rank_model = DPRankCostModel(plan.model, plan.gpu, plan.layers.specs, async_scheduling=eng.async_scheduling,
                                 tensor_parallel_size=eng.tensor_parallel_size, efficiency=efficiency)
    moe = MoEGroupCost(plan.model, plan.gpu, tensor_parallel_size=eng.tensor_parallel_size,
                       data_parallel_size=eng.data_parallel_size, expert_parallel=eng.enable_expert_parallel,
                       efficiency=efficiency, collective=collective_for(eng.all2all_backend, eng.enable_expert_parallel),
                       sequence_parallel=eng.all2all_backend in SEQUENCE_PARALLEL_BACKENDS,
                       eplb_redundant_experts=eng.num_redundant_experts if eng.enable_eplb else None,
                       deepep_mode=DEEPEP_BACKEND_MODES.get(eng.all2all_backend) if eng.enable_expert_parallel
                       else None)
    scheduler = eng.scheduler
    max_graph_tokens = None if eng.enforce_eager else max_cudagraph_capture_tokens(
        scheduler.max_num_seqs, scheduler.max_num_batched_tokens, plan.gpu.compute_capability)
    return MoEDPGroup(rank_model, moe, max_graph_tokens=max_graph_tokens)
