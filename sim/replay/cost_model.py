"""Step duration from the batch: a roofline per GPU, term by term, per layer type.

docs/architecture.md#the-simulated-clock. One engine step runs every scheduled request's new tokens
through the model once. Per GPU of the tensor-parallel group it

* reads the weights once (MoE: only the experts the step's tokens are routed to, in
  expectation for uniform routing; never the input embedding table, from which a lookup
  gathers a row per token),
* reads each sequence's KV once per layer: full attention and MLA their whole context,
  sliding-window layers at most the window, chunked-local layers the current chunk,
  recurrent layers their state (read and written), and writes the new tokens' KV,
* with DeepSeek Sparse Attention (``index_topk``) prices each layer's latent attention
  over at most ``index_topk`` keys per query and its indexer, which scores every cached
  key, as a kernel of its own (docs/clock.md#sparse-attention),
* does 2 FLOPs per body parameter per token, plus QK^T and PV over what each query
  token attends (closed forms for causal, windowed and chunked masks), and runs the LM
  head only at the positions that sample: one per scheduled request, as vLLM's model
  runner computes logits only at each request's last scheduled token,
* runs GEMMs at an efficiency that grows with the tokens of the step (a GEMM of a few
  rows cannot fill the tensor cores): ``fraction * n / (n + half_tokens)``,
* moves the activations through the element-wise kernels between the GEMMs (fused
  residual add and RMSNorm twice, SiLU-and-mul, rotary), which stream from HBM and do
  not overlap the GEMMs,
* pays a fixed GPU time per layer and per step (launch gaps, small kernels, sampling),
* all-reduces the activations twice per layer when TP > 1, from a measured curve of
  seconds against message size for that TP degree when the calibration has one,
* and pays a CPU overhead per step and per scheduled request.

Speculative decoding (docs/semantics.md#speculative-decoding): a verify step's ``1 + d``
query tokens of a request go through the target model's GEMMs as tokens and through the
decode attention kernel (its KV read once, its FLOPs unweighted: ``verify_items``; the
split is the caller's, ``sim/replay/run.py``), and a drafter with a model (``DraftHead``, ``sim/planner/draft_head.py``: EAGLE, EAGLE-3, MTP) then runs
``k`` passes of its few layers (the target's layer shape) in the same step, on the GPU
after the target's forward: the first pass over every token the step scheduled (the head
keeps its own KV of the whole sequence, prefill chunks included), each later one a token
per drafting request (those that sampled). A pass reads the head's weights once and each
drafting request's KV of its context in the head's layers, and samples one row per drafting
request through the target's LM head (EAGLE-3's smaller draft vocabulary is not
modelled: an overestimate), at the step's GEMM efficiency (or the weights' read) plus the
KV read (its attention is a kernel of its own, as the target's) and the per-layer fixed time;
its TP all-reduces are not modelled. ``StepCost.draft_s`` is that time; it adds to the GPU
time. n-gram drafting has no model and costs nothing here (its CPU lookup is in the
per-step overhead).

GPU time is ``max(GEMMs, weights) + max(attention, KV) + element-wise + fixed +
communication``: the GEMMs and the attention are separate kernels in vLLM, one after the
other in every layer, so each sits on its own roofline and their times add. The GEMMs are
bound by their FLOPs or by streaming the weights, the attention by its FLOPs or by reading
the KV it attends; a decode's KV read is never hidden under a prefill's GEMMs
(docs/architecture.md#the-simulated-clock). With
synchronous scheduling the CPU overhead adds to it; with asynchronous scheduling (vLLM's
default) the next step is prepared while this one runs, so the step takes the longer of
the two. Efficiency factors scale the datasheet peaks; a calibration file (bundled per GPU
in ``sim/replay/data/calibration``, fitted by ``kvtwin calibrate`` or ``kvtwin validate``)
sets them. However they are set, no step is priced below its roofline at 100% efficiency
(docs/invariants.md#the-clocks-physical-floor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.planner.hardware import GPUSpec, require_cost_model_inputs
from kvtwin.sim.planner.memory_budget import weights_bytes_per_gpu
from kvtwin.sim.planner.models import ModelPreset
from kvtwin.sim.planner.plan import is_indexer_layer
from kvtwin.sim.core.window_pricing import CHUNK_KEYS, FULL_KEYS, NO_KEYS, WINDOW_KEYS
from kvtwin.sim.core.spec import (AttentionSpec, ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec,
                                  MLAAttentionSpec, SlidingWindowSpec, window_decode_keys, window_keys)
from kvtwin.sim.calibration.efficiency import Efficiency

_MXFP4_BYTES_PER_PARAM = 4.25 / 8


@dataclass(frozen=True)
class LayerClass:
    """Layers with one spec, as one GPU of the TP group holds them. What a step reads in
    them (keys attended, KV tokens read, a recurrent state) is the spec's to say."""

    spec: KVCacheSpec
    num_layers: int
    attention_width: int = 0  # q heads per GPU x (d_k + d_v): FLOPs per attended key / 2
    kv_bytes_per_token: float = 0.0  # per layer
    state_bytes: int = 0  # per layer per request (recurrent)
    # Sparse attention: the most keys one query attends (``index_topk``), the indexer
    # having picked them; 0: the keys the spec says (docs/clock.md#sparse-attention).
    key_cap: int = 0
    # Attention work per FLOP: below 1 for a kernel running faster than bf16 (the
    # indexer's fp8 logits), so that ``attention_work`` stays seconds at the bf16 rate.
    work_per_flop: float = 1.0
    decode_heads: int = 0  # query heads per layer whose decode kernel pays the per-head time


@dataclass  # not frozen: one is made every step, and a compiled frozen dataclass sets each field through object.__setattr__
class StepCost:
    total_s: float
    compute_s: float  # GEMMs and attention at their efficiencies
    memory_s: float  # weights and KV from HBM
    communication_s: float
    overhead_s: float  # CPU
    flops: float  # linear_flops + attention_flops
    weight_bytes: float
    kv_bytes: float
    # The raw terms a calibration refits the efficiency factors from (calibration.py).
    linear_flops: float  # every GEMM, the LM head included
    attention_flops: float
    num_requests: int  # decodes + prefill items: what the per-request overhead multiplies, and the sampling positions
    num_tokens: int = 0
    body_flops: float = 0.0  # linear_flops = body_flops + head_flops
    head_flops: float = 0.0  # the LM head's: one row per sampling position
    elementwise_bytes: float = 0.0  # HBM traffic of the element-wise kernels: serial, overlaps nothing
    extra_gpu_s: float = 0.0  # GPU time the roofline does not see: kernel floors, decode attention's per-head work
    attention_work: float = 0.0  # attention_flops with short prefill chunks weighed up: what compute_s charges
    draft_s: float = 0.0  # speculative decoding: the draft head's passes (0 without one)
    # Pipeline parallelism (``pipeline_cost.py``): each stage's GPU time and its send to the
    # next stage (0 after the last); None: one stage, whose time is ``total_s``.
    stage_compute_s: list[float] | None = None
    stage_send_s: list[float] | None = None
    # A DP MoE group (``moe_group_cost.py``): the MoE collectives' share of communication_s.
    moe_communication_s: float = 0.0

    # Spelled out: a compiled dataclass keeps the generated __init__, which runs as Python.
    def __init__(self, total_s: float, compute_s: float, memory_s: float, communication_s: float,
                 overhead_s: float, flops: float, weight_bytes: float, kv_bytes: float, linear_flops: float,
                 attention_flops: float, num_requests: int, num_tokens: int = 0, body_flops: float = 0.0,
                 head_flops: float = 0.0, elementwise_bytes: float = 0.0, extra_gpu_s: float = 0.0,
                 attention_work: float = 0.0, draft_s: float = 0.0, stage_compute_s: list[float] | None = None,
                 stage_send_s: list[float] | None = None, moe_communication_s: float = 0.0):
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
        self.num_tokens = num_tokens
        self.body_flops = body_flops
        self.head_flops = head_flops
        self.elementwise_bytes = elementwise_bytes
        self.extra_gpu_s = extra_gpu_s
        self.attention_work = attention_work
        self.draft_s = draft_s
        self.stage_compute_s = stage_compute_s
        self.stage_send_s = stage_send_s
        self.moe_communication_s = moe_communication_s

    def stage_s(self) -> list[float]:
        """Each pipeline stage's time, its send to the next included (one stage: ``total_s``)."""
        compute, send = self.stage_compute_s, self.stage_send_s
        if compute is None or send is None:
            return [self.total_s]
        return [c + s for c, s in zip(compute, send)]

    @property
    def slowest_stage_s(self) -> float:
        """How long the batch holds each stage of a full pipeline: a pipeline advances at
        its slowest stage (docs/clock.md#pipeline-parallelism); ``total_s`` with one stage."""
        return max(self.stage_s())


def gemm_s(eff: Efficiency, flops_per_s: float, body_flops: float, num_tokens: int, head_flops: float,
           num_requests: int) -> float:
    """Seconds of a step's GEMMs: the body's have a row per token, the LM head's a row
    per sampling position. The one formula the cost model and the calibration fit share."""
    return _gemm_s(eff.matmul_flops_fraction, eff.matmul_half_tokens, flops_per_s, body_flops, num_tokens,
                   head_flops, num_requests)


def gemm_fraction(fraction: float, half_tokens: float, rows: float) -> float:
    """The fraction of peak FLOP/s a GEMM of ``rows`` rows (tokens) reaches: ``fraction``
    (``matmul_flops_fraction``) for a large one, half of it at ``half_tokens`` rows
    (``matmul_half_tokens``; 0 means no ramp)."""
    return fraction if not half_tokens else fraction * rows / (rows + half_tokens)


def _gemm_s(fraction: float, half_tokens: float, flops_per_s: float, body_flops: float, num_tokens: int,
            head_flops: float, num_requests: int) -> float:
    """``gemm_s`` on the two efficiency factors it reads, as plain floats."""
    seconds = body_flops / (flops_per_s * gemm_fraction(fraction, half_tokens, num_tokens)) if body_flops else 0.0
    if head_flops:
        seconds += head_flops / (flops_per_s * gemm_fraction(fraction, half_tokens, num_requests))
    return seconds


def _add_decodes(lc: LayerClass, attended: int, num_decodes: int, kv_bytes: float,
                 attention_flops: float, attention_work: float) -> tuple[float, float, float]:
    """``kv_bytes``, ``attention_flops`` and ``attention_work`` plus what ``num_decodes``
    decodes attending ``attended`` keys in all cost in the layers of ``lc`` (they read those
    keys, write their token, and read and write a recurrent state once each). A decode's
    attention is charged at the plain fraction: its kernel splits the keys, not the queries."""
    kv_bytes += ((attended + num_decodes) * lc.kv_bytes_per_token + 2 * lc.state_bytes * num_decodes) * lc.num_layers
    flops = 2.0 * lc.attention_width * lc.num_layers * attended
    return kv_bytes, attention_flops + flops, attention_work + flops * lc.work_per_flop


class CostModel:
    """Predicts the seconds one engine step takes on one TP group of ``gpu``."""

    def __init__(self, model: ModelPreset, gpu: GPUSpec, layer_specs: dict[str, KVCacheSpec], *,
                 async_scheduling: bool, tensor_parallel_size: int = 1, efficiency: Efficiency = Efficiency(),
                 draft_head: DraftHead | None = None):
        """``async_scheduling`` has no default here: the engine config's is the one."""
        require_cost_model_inputs(gpu)
        self.model = model
        self.gpu = gpu
        self.tp = tensor_parallel_size
        self.async_scheduling = async_scheduling
        self.eff = efficiency
        self.layer_classes = self._layer_classes(model, gpu, layer_specs, tensor_parallel_size)
        self.weight_bytes = float(weights_bytes_per_gpu(model, tp=tensor_parallel_size)) - self._embedding_table_bytes(
            model, tensor_parallel_size)
        self.expert_bytes, self.moe_layers = self._experts(model, tensor_parallel_size)
        self.linear_flops_per_token = 2.0 * model.body_params_active / tensor_parallel_size
        self.head_flops_per_sample = 2.0 * model.lm_head_params / tensor_parallel_size
        self.activation_bytes_per_token = model.hidden_size * 2
        self.num_layers = model.num_layers
        self.flops_per_s = gpu.bf16_flops
        self.bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * efficiency.hbm_bandwidth_fraction
        self.elementwise_bytes_per_token = self._elementwise_bytes_per_token(model, tensor_parallel_size)
        self.fixed_gpu_s = model.num_layers * efficiency.layer_fixed_s + efficiency.step_gpu_fixed_s
        # A decode's attention work beyond its KV read: per query head and attention layer.
        self.decode_head_s = efficiency.decode_attention_s_per_head * sum(
            lc.num_layers * lc.decode_heads for lc in self.layer_classes)
        self.allreduce_curve = efficiency.allreduce_curve(tensor_parallel_size)
        # The factors every step reads, held as plain floats: ``Efficiency`` is a scenario
        # type, and reading its fields per step costs more than the step's arithmetic.
        self.matmul_flops_fraction = float(efficiency.matmul_flops_fraction)
        self.matmul_half_tokens = float(efficiency.matmul_half_tokens)
        self.attention_flops_fraction = float(efficiency.attention_flops_fraction)
        self.attention_half_query_tokens = float(efficiency.attention_half_query_tokens)
        self.interconnect_fraction = float(efficiency.interconnect_fraction)
        self.allreduce_latency_s = float(efficiency.allreduce_latency_s)
        self.step_overhead_s = float(efficiency.step_overhead_s)
        self.per_request_overhead_s = float(efficiency.per_request_overhead_s)
        self.draft_head = draft_head
        if self.draft_head is not None:
            self._draft_terms(model)

    def _draft_terms(self, model: ModelPreset) -> None:
        """Per-layer figures of the draft head: a layer's weights (the body's share, the LM
        head's bf16 bytes set apart), its FLOPs per token, and its KV bytes per token (the
        mean over the target's attention layers)."""
        head_bytes = 2.0 * model.lm_head_params / self.tp
        self.draft_head_bytes = head_bytes
        self.draft_layer_bytes = max(self.weight_bytes - head_bytes, 0.0) / model.num_layers
        self.draft_layer_flops_per_token = self.linear_flops_per_token / model.num_layers
        kv_layers = sum(lc.num_layers for lc in self.layer_classes if lc.kv_bytes_per_token)
        self.draft_kv_bytes_per_token = (sum(lc.kv_bytes_per_token * lc.num_layers for lc in self.layer_classes)
                                         / kv_layers if kv_layers else 0.0)

    def draft_s(self, num_step_tokens: int, draft_ends: list[int]) -> float:
        """Seconds of the draft head's passes in a step that scheduled ``num_step_tokens``
        tokens, for drafting requests whose contexts end at ``draft_ends``."""
        head = self.draft_head
        if head is None or not draft_ends:
            return 0.0
        layers = head.num_layers
        layer_fixed_s = layers * self.eff.layer_fixed_s
        num_drafting = len(draft_ends)
        context_bytes = float(sum(draft_ends)) * self.draft_kv_bytes_per_token * layers
        weights = self.draft_layer_bytes * layers + self.draft_head_bytes
        head_flops = self.head_flops_per_sample * num_drafting
        total = 0.0
        for index in range(head.num_passes):
            tokens = num_step_tokens if index == 0 else num_drafting
            compute = _gemm_s(self.matmul_flops_fraction, self.matmul_half_tokens, self.flops_per_s,
                              self.draft_layer_flops_per_token * layers * tokens, tokens, head_flops, num_drafting)
            kv_s = (context_bytes + tokens * self.draft_kv_bytes_per_token * layers) / self.bytes_per_s
            total += max(compute, weights / self.bytes_per_s) + kv_s + layer_fixed_s
        return total

    @staticmethod
    def _embedding_table_bytes(model: ModelPreset, tp: int) -> float:
        """Bytes of the input embedding table on one GPU (vocabulary-parallel): held but not
        read by a step, whose lookup gathers a row per token. Tied to the LM head, the one
        matrix is read whole as the head, and nothing is taken off."""
        if model.tie_word_embeddings:
            return 0.0
        return model.lm_head_params * (1 if model.weight_format == "fp8" else 2) / tp

    @staticmethod
    def _elementwise_bytes_per_token(model: ModelPreset, tp: int) -> float:
        """HBM bytes one token moves through the element-wise kernels of all layers, per
        GPU: two fused residual-add + RMSNorms (read x and the residual, write both, on the
        whole hidden vector: every TP rank holds it), SiLU-and-mul on the MLP's inner
        width (read two halves, write one; sharded), rotary on q and k (read and write;
        sharded). Activations are 16-bit."""
        hidden = model.hidden_size
        inner = model.intermediate_size or (model.num_experts_per_token * model.moe_intermediate_size
                                             + model.shared_expert_intermediate_size)
        per_layer = 2 * 4 * hidden + 3 * inner / tp
        attention_layers = sum(1 for k in model.layer_letters if k in "FSCA")
        rotary = 2 * (model.num_attention_heads + model.num_kv_heads) * model.head_dim / tp
        return 2.0 * (model.num_layers * per_layer + attention_layers * rotary)

    @staticmethod
    def _layer_classes(model: ModelPreset, gpu: GPUSpec, specs: dict[str, KVCacheSpec],
                       tp: int) -> tuple[LayerClass, ...]:
        q_heads = max(1, model.num_attention_heads // tp)
        counts: dict[tuple[KVCacheSpec, bool], int] = {}
        for name, spec in specs.items():
            # Padding a page to a unified size changes no byte a step reads.
            key = (dataclasses.replace(spec, page_size_padded=None) if isinstance(spec, (AttentionSpec, MambaSpec))
                   else spec)
            indexer = is_indexer_layer(name)
            counts[(key, indexer)] = counts.get((key, indexer), 0) + 1
        classes: list[LayerClass] = []
        for (spec, indexer), n in counts.items():
            if indexer:
                classes.append(CostModel._indexer_class(model, gpu, spec, n))
                continue
            width = q_heads * spec.attention_width_per_head
            key_cap = 0
            if model.index_topk is not None and isinstance(spec, MLAAttentionSpec):
                key_cap = model.index_topk
            classes.append(LayerClass(spec, n, width, spec.kv_bytes_per_token, spec.state_bytes, key_cap=key_cap,
                                      decode_heads=q_heads if width else 0))
        return tuple(classes)

    @staticmethod
    def _indexer_class(model: ModelPreset, gpu: GPUSpec, spec: KVCacheSpec, num_layers: int) -> LayerClass:
        """The lightning indexers of DeepSeek Sparse Attention (docs/clock.md#sparse-attention):
        each query scores every cached key causally with ``index_n_heads`` heads of
        ``index_head_dim`` (replicated: every TP rank runs them all), reading the keys' fp8
        cache, ``kv_bytes_per_token`` of the spec, once per sequence. The logits are fp8
        GEMMs, at the fp8 rate where the GPU has one. Its kernel has no per-head decode time
        of its own in the model: its heads are summed into one score per key."""
        assert model.index_n_heads is not None and model.index_head_dim is not None
        width = model.index_n_heads * model.index_head_dim
        work_per_flop = gpu.bf16_flops / gpu.fp8_flops if gpu.fp8_flops else 1.0
        return LayerClass(spec, num_layers, width, spec.kv_bytes_per_token, spec.state_bytes,
                          work_per_flop=work_per_flop)

    @staticmethod
    def _experts(model: ModelPreset, tp: int) -> tuple[float, int]:
        """Bytes of one routed expert in one layer on one GPU, and the number of MoE layers."""
        if not model.num_experts:
            return 0.0, 0
        per_param = _MXFP4_BYTES_PER_PARAM if model.weight_format == "mxfp4_moe" else \
            (1 if model.weight_format == "fp8" else 2)
        params = 3 * model.hidden_size * model.moe_intermediate_size
        return params * per_param / tp, model.num_moe_layers

    def _weight_bytes_read(self, num_tokens: int) -> float:
        if not self.moe_layers:
            return self.weight_bytes
        model = self.model
        experts, top_k = model.num_experts, model.num_experts_per_token
        all_experts = experts * self.expert_bytes * self.moe_layers
        # Expected distinct experts hit by num_tokens tokens each routed to top_k of them.
        touched = experts * (1.0 - (1.0 - top_k / experts) ** num_tokens)
        return self.weight_bytes - all_experts + touched * self.expert_bytes * self.moe_layers

    def split_step_cost(self, decode_ends: list[int], prefill_items: list[tuple[int, int]],
                        draft_ends: list[int] | None = None,
                        verify_items: list[tuple[int, int]] | None = None) -> StepCost:
        """Seconds of one step: decodes (one new token each) given by the context length
        after the step, prefill chunks as (new tokens, tokens computed before). Decodes are
        most requests of most steps, so their terms are sums over contexts. Speculative
        decoding: ``verify_items`` are verify steps as (1 + drafts, tokens computed before),
        ``draft_ends`` the contexts after the step of the requests a draft head drafts for."""
        num_tokens, kv_bytes, attention_flops, attention_work = self._prefill_terms(prefill_items)
        num_decodes = len(decode_ends)
        if num_decodes:
            for lc in self.layer_classes:
                cap = lc.key_cap
                attended = window_decode_keys(cap, decode_ends) if cap else lc.spec.decode_attended_keys(decode_ends)
                kv_bytes, attention_flops, attention_work = _add_decodes(
                    lc, attended, num_decodes, kv_bytes, attention_flops, attention_work)
        if verify_items:
            verify_tokens, kv_bytes, attention_flops, attention_work = self._prefill_terms(
                verify_items, kv_bytes, attention_flops, attention_work, weigh_short=False)
            num_tokens += verify_tokens
            num_decodes += len(verify_items)
        draft_s = self.draft_s(num_tokens + len(decode_ends), draft_ends) if draft_ends else 0.0
        return self._step_cost(num_tokens + len(decode_ends), kv_bytes, attention_flops, attention_work,
                               num_decodes + len(prefill_items), num_decodes, draft_s)

    def _prefill_terms(self, prefill_items: list[tuple[int, int]], kv_bytes: float = 0.0,
                       attention_flops: float = 0.0, attention_work: float = 0.0,
                       weigh_short: bool = True) -> tuple[int, float, float, float]:
        """(tokens, KV bytes, attention FLOPs, attention work) of a step's prefill chunks,
        added to the given sums. The work is the FLOPs at the rate of a long chunk: a chunk
        of few query tokens fills fewer of the kernel's query tiles, so its FLOPs count
        ``(new + half) / new`` times (``attention_half_query_tokens``). A verify step of
        speculative decoding (``weigh_short`` False) runs in the decode kernel, which splits
        the keys, not the queries: its FLOPs count once, as a decode's do."""
        num_tokens = 0
        half = self.attention_half_query_tokens if weigh_short else 0.0
        layer_classes = self.layer_classes
        for new, before in prefill_items:
            num_tokens += new
            end = before + new
            chunk_flops = 0.0
            chunk_work = 0.0
            for lc in layer_classes:
                spec = lc.spec
                # A chunk reads what its queries attend and writes its new tokens; a
                # recurrent layer reads and writes its state once. A sparse layer's queries
                # each gather their own top keys, which over a chunk cover most of the
                # context: it reads its whole context, as dense MLA does.
                kv_bytes += ((spec.kv_tokens_read(before, new) + new) * lc.kv_bytes_per_token
                             + 2 * lc.state_bytes) * lc.num_layers
                cap = lc.key_cap
                keys = window_keys(cap, before, end) if cap else spec.attended_keys(before, end)
                flops = 2.0 * lc.attention_width * lc.num_layers * keys
                chunk_flops += flops
                chunk_work += flops * lc.work_per_flop
            attention_flops += chunk_flops
            attention_work += chunk_work * (new + half) / new if half else chunk_work
        return num_tokens, kv_bytes, attention_flops, attention_work

    @property
    def decodes_cost_by_context_sum(self) -> bool:
        """Whether a step's decodes cost depends on their contexts only through their sum
        (every layer attends its whole context): ``decode_step_cost`` then applies."""
        return all(type(lc.spec).decode_attended_keys is FullAttentionSpec.decode_attended_keys
                   and isinstance(lc.spec, FullAttentionSpec)
                   and lc.spec.sliding_window is None and lc.spec.attention_chunk_size is None
                   and not lc.key_cap for lc in self.layer_classes)

    def decode_key_shapes(self) -> list[tuple[int, int]] | None:
        """Per layer class, how its decodes attend their context, as a decode window
        keeps it in closed form (``sim/core/decode_window.py``: ``FULL_KEYS``,
        ``WINDOW_KEYS`` and its window, ``CHUNK_KEYS`` and its chunk, ``NO_KEYS``); None
        if some class attends otherwise. A sparse layer's decode attends ``min(context,
        index_topk)`` keys, as a sliding window of ``index_topk`` would."""
        shapes: list[tuple[int, int]] = []
        for lc in self.layer_classes:
            spec = lc.spec
            method = type(spec).decode_attended_keys
            if lc.key_cap:
                shapes.append((WINDOW_KEYS, lc.key_cap))
            elif method is KVCacheSpec.decode_attended_keys:
                shapes.append((NO_KEYS, 0))  # a recurrent state: no keys
            elif method is SlidingWindowSpec.decode_attended_keys and isinstance(spec, SlidingWindowSpec):
                shapes.append((WINDOW_KEYS, spec.sliding_window))
            elif (method is ChunkedLocalAttentionSpec.decode_attended_keys
                  and isinstance(spec, ChunkedLocalAttentionSpec)):
                shapes.append((CHUNK_KEYS, spec.attention_chunk_size))
            elif method is FullAttentionSpec.decode_attended_keys and isinstance(spec, FullAttentionSpec):
                # Hybrid manager off: a windowed layer kept as full attention still
                # computes over its window.
                if spec.sliding_window is not None:
                    shapes.append((WINDOW_KEYS, spec.sliding_window))
                elif spec.attention_chunk_size is not None:
                    shapes.append((CHUNK_KEYS, spec.attention_chunk_size))
                else:
                    shapes.append((FULL_KEYS, 0))
            elif method is AttentionSpec.decode_attended_keys:
                shapes.append((FULL_KEYS, 0))
            else:
                return None
        return shapes

    def decode_step_cost_by_keys(self, num_decodes: int, attended_keys: list[int],
                                 prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        """``decode_step_cost`` for any layout ``decode_key_shapes`` describes: the keys
        the decodes attend are given per layer class (what ``decode_attended_keys`` of
        their ends returns), so the float operations are ``split_step_cost``'s, in order."""
        num_tokens, kv_bytes, attention_flops, attention_work = self._prefill_terms(prefill_items or [])
        if num_decodes:
            for lc, attended in zip(self.layer_classes, attended_keys):
                kv_bytes, attention_flops, attention_work = _add_decodes(lc, attended, num_decodes, kv_bytes,
                                                                         attention_flops, attention_work)
        return self._step_cost(num_tokens + num_decodes, kv_bytes, attention_flops, attention_work,
                               num_decodes + (len(prefill_items) if prefill_items else 0), num_decodes)

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> StepCost:
        """``split_step_cost`` of ``num_decodes`` decodes whose context ends sum to
        ``context_ends_sum`` (and ``prefill_items``), without the list of ends: decode
        windows (``sim/core/decode_window.py``). Only where ``decodes_cost_by_context_sum``;
        the same float operations in the same order, so the same seconds to the last bit."""
        num_tokens, kv_bytes, attention_flops, attention_work = self._prefill_terms(prefill_items or [])
        if num_decodes:
            for lc in self.layer_classes:
                kv_bytes, attention_flops, attention_work = _add_decodes(lc, context_ends_sum, num_decodes, kv_bytes,
                                                                         attention_flops, attention_work)
        return self._step_cost(num_tokens + num_decodes, kv_bytes, attention_flops, attention_work,
                               num_decodes + (len(prefill_items) if prefill_items else 0), num_decodes)

    def _tp_allreduce_s(self, num_tokens: int) -> float:
        """Seconds of a step's TP all-reduces (two a layer) of ``num_tokens`` hidden states."""
        message_bytes = num_tokens * self.activation_bytes_per_token
        curve = self.allreduce_curve
        if curve is not None:
            per_layer = curve.seconds_for(message_bytes)
        else:
            bandwidth = self.gpu.interconnect_bytes_per_s * self.interconnect_fraction
            bus_bytes = message_bytes * 2 * (self.tp - 1) / self.tp
            per_layer = (bus_bytes / bandwidth if bandwidth else 0.0) + self.allreduce_latency_s
        return 2 * self.num_layers * per_layer

    def _step_cost(self, num_tokens: int, kv_bytes: float, attention_flops: float, attention_work: float,
                   num_requests: int, num_decodes: int, draft_s: float = 0.0) -> StepCost:
        body_flops = self.linear_flops_per_token * num_tokens
        head_flops = self.head_flops_per_sample * num_requests
        gemm_compute_s = _gemm_s(self.matmul_flops_fraction, self.matmul_half_tokens, self.flops_per_s, body_flops,
                                 num_tokens, head_flops, num_requests)
        attention_compute_s = attention_work / (self.flops_per_s * self.attention_flops_fraction)
        compute_s = gemm_compute_s + attention_compute_s
        weight_bytes = self._weight_bytes_read(num_tokens)
        weights_s = weight_bytes / self.bytes_per_s
        kv_s = kv_bytes / self.bytes_per_s
        memory_s = weights_s + kv_s
        elementwise_bytes = num_tokens * self.elementwise_bytes_per_token
        communication_s = self._tp_allreduce_s(num_tokens) if self.tp > 1 else 0.0
        overhead_s = self.step_overhead_s + self.per_request_overhead_s * num_requests
        extra_gpu_s = self.fixed_gpu_s + self.decode_head_s * num_decodes if num_decodes else self.fixed_gpu_s
        gpu_s = (max(gemm_compute_s, weights_s) + max(attention_compute_s, kv_s) + elementwise_bytes / self.bytes_per_s
                 + extra_gpu_s + communication_s)
        if draft_s:
            gpu_s += draft_s
        total_s = max(gpu_s, overhead_s) if self.async_scheduling else gpu_s + overhead_s
        linear_flops = body_flops + head_flops
        return StepCost(total_s, compute_s, memory_s, communication_s, overhead_s,
                        linear_flops + attention_flops, weight_bytes, kv_bytes,
                        linear_flops, attention_flops, num_requests, num_tokens, body_flops, head_flops,
                        elementwise_bytes, extra_gpu_s, attention_work, draft_s)
