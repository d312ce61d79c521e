"""The step clock recomputed term by term from the model's shapes and the GPU's datasheet.

For Llama-3.1-8B on an H100 (TP 1 and 2) and an efficiency with every factor set to a
distinct, non-default value, each term of a step is written out here from first
principles: the GEMM FLOPs (2 per active body parameter per token, the LM head once per
sampling position), the attention FLOPs (2 x (d_k + d_v) per query head per attended key,
causal), the KV bytes (2 x KV heads per rank x head size x 2 bytes per token per layer),
the weights' bytes split over TP, the element-wise traffic, the all-reduces (a ring's
2(t-1)/t bus bytes twice per layer), the fixed GPU times (per layer, per step, and per
decode per query head on this rank per layer) and the CPU overheads, then combined as the
documented roofline. The draft head's passes are recomputed the same way. Then physical
invariants that hold whatever the factors: no step beats the HBM or the tensor cores at
their peak, a step grows with its tokens and contexts, TP 2 does less per rank.
"""

import math

import pytest

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.replay.cost_model import CostModel
from kvtwin.sim.calibration.efficiency import Efficiency

EFF = Efficiency(matmul_flops_fraction=0.5, attention_flops_fraction=0.4, hbm_bandwidth_fraction=0.75,
                 interconnect_fraction=0.6, allreduce_latency_s=1e-5, layer_fixed_s=2e-6,
                 decode_attention_s_per_head=1e-7, step_gpu_fixed_s=5e-5, step_overhead_s=1e-3,
                 per_request_overhead_s=2e-5)

MODEL = get_model("llama-3.1-8b")
GPU = get_gpu("h100")
# Llama-3.1-8B's shapes, as its HF config gives them.
LAYERS, HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
BF16 = 2


def cost_model(tp=1, eff=EFF, async_scheduling=True, draft_head=None):
    p = plan(MODEL, GPU, EngineConfig(tensor_parallel_size=tp, max_model_len=32768))
    return CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=async_scheduling,
                     efficiency=eff, draft_head=draft_head)


class Hand:
    """The step's terms by hand, per GPU of a TP group of ``tp``."""

    def __init__(self, tp, eff=EFF):
        self.tp, self.eff = tp, eff
        # Untied embeddings: the body is everything but the embedding table and the LM head.
        self.head_params = VOCAB * HIDDEN
        self.body_params = MODEL.params_active - 2 * self.head_params
        self.kv_bytes_per_token_layer = 2 * (KV_HEADS // tp) * HEAD_DIM * BF16  # K and V
        self.width = (Q_HEADS // tp) * (HEAD_DIM + HEAD_DIM)  # per attended key: QK^T (d_k) and PV (d_v)
        # Read per step: all but the input embedding table (a lookup gathers a row per token).
        self.weights = math.ceil(MODEL.weights_bytes / tp) - VOCAB * HIDDEN * BF16 / tp
        self.hbm = GPU.hbm_bandwidth_bytes_per_s * eff.hbm_bandwidth_fraction
        # Per token per layer: two fused add+RMSNorm (read x and residual, write both) on the
        # full hidden vector, SiLU-and-mul over the sharded inner width (read 2, write 1), and
        # rotary on the sharded q and k (read and write): 16-bit values.
        self.elementwise_per_token = BF16 * LAYERS * (2 * 4 * HIDDEN + 3 * INTER / tp
                                                      + 2 * (Q_HEADS + KV_HEADS) * HEAD_DIM / tp)

    def gemm_s(self, rows_body, rows_head):
        p = GPU.bf16_flops
        half = self.eff.matmul_half_tokens

        def rate(rows):
            return p * self.eff.matmul_flops_fraction * (rows / (rows + half) if half else 1.0)

        return (2 * self.body_params / self.tp * rows_body / rate(rows_body)
                + 2 * self.head_params / self.tp * rows_head / rate(rows_head))

    def comm_s(self, tokens):
        if self.tp == 1:
            return 0.0
        message = tokens * HIDDEN * BF16
        bus = message * 2 * (self.tp - 1) / self.tp
        per_all_reduce = bus / (GPU.interconnect_bytes_per_s * self.eff.interconnect_fraction) \
            + self.eff.allreduce_latency_s
        return 2 * LAYERS * per_all_reduce  # after attention and after the MLP

    def step(self, decode_ends, prefill_items, async_scheduling=True, draft_s=0.0):
        n_dec = len(decode_ends)
        tokens = n_dec + sum(new for new, _ in prefill_items)
        requests = n_dec + len(prefill_items)
        keys = sum(decode_ends)  # a decode's query attends its whole context, itself included
        kv_tokens = keys + n_dec  # read what it attends, write its new token
        attention_work = 0.0
        for new, before in prefill_items:
            chunk_keys = sum(p + 1 for p in range(before, before + new))  # causal
            keys += chunk_keys
            kv_tokens += before + new + new
            half = self.eff.attention_half_query_tokens
            attention_work += 2 * self.width * LAYERS * chunk_keys * ((new + half) / new if half else 1)
        attention_flops = 2 * self.width * LAYERS * keys
        attention_work += 2 * self.width * LAYERS * sum(decode_ends)
        kv_bytes = kv_tokens * self.kv_bytes_per_token_layer * LAYERS
        gemms = self.gemm_s(tokens, requests)
        attention = attention_work / (GPU.bf16_flops * self.eff.attention_flops_fraction)
        compute = gemms + attention
        memory = (self.weights + kv_bytes) / self.hbm
        fixed = LAYERS * self.eff.layer_fixed_s + self.eff.step_gpu_fixed_s \
            + self.eff.decode_attention_s_per_head * LAYERS * (Q_HEADS // self.tp) * n_dec
        # The GEMMs and the attention are kernels of their own, each on its roofline.
        gpu = max(gemms, self.weights / self.hbm) + max(attention, kv_bytes / self.hbm) \
            + tokens * self.elementwise_per_token / self.hbm + fixed + self.comm_s(tokens) + draft_s
        overhead = self.eff.step_overhead_s + self.eff.per_request_overhead_s * requests
        return dict(total_s=max(gpu, overhead) if async_scheduling else gpu + overhead, compute_s=compute,
                    memory_s=memory, communication_s=self.comm_s(tokens), overhead_s=overhead, kv_bytes=kv_bytes,
                    attention_flops=attention_flops, weight_bytes=self.weights, extra_gpu_s=fixed,
                    linear_flops=2 * (self.body_params * tokens + self.head_params * requests) / self.tp,
                    elementwise_bytes=tokens * self.elementwise_per_token)


def check(cost, expected):
    for name, value in expected.items():
        assert getattr(cost, name) == pytest.approx(value, rel=1e-9), name


DECODES = [1000, 2500, 17, 4096]
PREFILLS = [(512, 0), (200, 3000)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_decode_step_term_by_term(tp, async_scheduling):
    cost = cost_model(tp, async_scheduling=async_scheduling).split_step_cost(DECODES, [])
    check(cost, Hand(tp).step(DECODES, [], async_scheduling))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mixed_step_term_by_term(tp):
    cost = cost_model(tp).split_step_cost(DECODES, PREFILLS)
    check(cost, Hand(tp).step(DECODES, PREFILLS))


def test_a_prefill_step_is_compute_bound_and_term_by_term():
    cost = cost_model(1).split_step_cost([], [(4096, 0)])
    check(cost, Hand(1).step([], [(4096, 0)]))
    assert cost.compute_s > cost.memory_s


def test_a_decodes_kv_read_is_not_hidden_under_a_prefills_gemms():
    # docs/architecture.md#the-simulated-clock: the attention is a kernel of its own, so the
    # decodes' KV read adds to a compute-bound prefill's GEMMs instead of overlapping them.
    # Only the prefill's own attention FLOPs (the same kernel) can hide any of it.
    cm = cost_model(1)
    prefill = [(2048, 0)]
    alone = cm.split_step_cost([], prefill)
    mixed = cm.split_step_cost([8000] * 16, prefill)
    assert alone.compute_s > alone.memory_s  # the prefill's GEMMs bound it: one roofline hid the reads
    hbm = Hand(1).hbm
    kv_read_s = (mixed.kv_bytes - alone.kv_bytes) / hbm
    prefill_attention_s = alone.attention_work / (GPU.bf16_flops * EFF.attention_flops_fraction)
    decode_work_s = mixed.compute_s - alone.compute_s  # the decodes' 16 rows through the GEMMs, their attention
    serial_s = mixed.extra_gpu_s - alone.extra_gpu_s + (mixed.elementwise_bytes - alone.elementwise_bytes) / hbm
    grown = mixed.total_s - alone.total_s
    assert kv_read_s > 2 * prefill_attention_s and kv_read_s > 10 * decode_work_s
    assert grown >= kv_read_s - prefill_attention_s + serial_s - 1e-12
    assert grown <= kv_read_s + serial_s + decode_work_s + 1e-12


def test_small_gemms_and_short_chunks_run_below_the_fraction():
    eff = Efficiency(**{**EFF.__dict__, "matmul_half_tokens": 64.0, "attention_half_query_tokens": 32.0})
    for decodes, prefills in ((DECODES, []), ([], [(8, 100)]), (DECODES, PREFILLS)):
        check(cost_model(1, eff).split_step_cost(decodes, prefills), Hand(1, eff).step(decodes, prefills))


def test_the_decode_attention_time_per_head_is_per_rank():
    # The per-head term alone: everything else equal, it costs per query head on this rank.
    eff_a = Efficiency(**{**EFF.__dict__, "decode_attention_s_per_head": 0.0})
    for tp in (1, 2):
        with_heads = cost_model(tp).split_step_cost(DECODES, []).extra_gpu_s
        without = cost_model(tp, eff_a).split_step_cost(DECODES, []).extra_gpu_s
        assert with_heads - without == pytest.approx(
            EFF.decode_attention_s_per_head * LAYERS * (Q_HEADS // tp) * len(DECODES), rel=1e-9)


@pytest.mark.parametrize("layers, passes", [(1, 3), (2, 2)])
def test_the_draft_head_passes_by_hand(layers, passes):
    hand = Hand(1)
    drafting = [1200, 300, 77]
    step_tokens = len(DECODES) + sum(new for new, _ in PREFILLS)
    head_bytes = BF16 * hand.head_params
    layer_bytes = (hand.weights - head_bytes) / LAYERS
    layer_flops_per_token = 2 * hand.body_params / LAYERS
    draft = 0.0
    for index in range(passes):
        # The first pass runs every token the step scheduled; each later one a token per drafter.
        tokens = step_tokens if index == 0 else len(drafting)
        compute = (layer_flops_per_token * layers * tokens
                   + 2 * hand.head_params * len(drafting)) / (GPU.bf16_flops * EFF.matmul_flops_fraction)
        weights = (layer_bytes * layers + head_bytes) / hand.hbm
        kv = (sum(drafting) + tokens) * hand.kv_bytes_per_token_layer * layers / hand.hbm
        draft += max(compute, weights) + kv + layers * EFF.layer_fixed_s  # the fixed time of each draft layer
    cm = cost_model(1, draft_head=DraftHead("eagle", layers, passes))
    assert cm.draft_s(step_tokens, drafting) == pytest.approx(draft, rel=1e-9)
    cost = cm.split_step_cost(DECODES, PREFILLS, draft_ends=drafting)
    assert cost.draft_s == pytest.approx(draft, rel=1e-9)
    check(cost, Hand(1).step(DECODES, PREFILLS, draft_s=draft))


def test_a_verify_step_counts_its_drafts_as_tokens_at_the_decode_rate():
    eff = Efficiency(**{**EFF.__dict__, "attention_half_query_tokens": 32.0})
    hand = Hand(1, eff)
    verify = [(4, 996), (3, 500)]  # 1 + drafts query tokens after the tokens computed before
    cost = cost_model(1, eff).split_step_cost([2000], [], verify_items=verify)
    keys = 2000 + sum(sum(p + 1 for p in range(before, before + new)) for new, before in verify)
    assert cost.attention_flops == pytest.approx(2 * hand.width * LAYERS * keys, rel=1e-12)
    assert cost.attention_work == pytest.approx(cost.attention_flops, rel=1e-12)  # not weighed up as a chunk
    assert cost.num_tokens == 1 + 4 + 3 and cost.num_requests == 3
    # Verifies are decodes for the per-head term.
    assert cost.extra_gpu_s == pytest.approx(LAYERS * eff.layer_fixed_s + eff.step_gpu_fixed_s
                                             + eff.decode_attention_s_per_head * LAYERS * Q_HEADS * 3, rel=1e-12)


# -- physical invariants ------------------------------------------------------------------

STEPS = [([5000] * 64, []), ([100] * 4, []), ([], [(8192, 0)]), (DECODES, PREFILLS), ([300] * 200, [(64, 64)])]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("decodes, prefills", STEPS)
def test_no_step_beats_the_datasheet(tp, decodes, prefills):
    # Whatever the fractions: at most the peak, so never faster than the bytes at the full
    # bandwidth nor the FLOPs at the full tensor-core rate.
    cost = cost_model(tp).split_step_cost(decodes, prefills)
    assert cost.total_s >= (cost.weight_bytes + cost.kv_bytes) / GPU.hbm_bandwidth_bytes_per_s
    assert cost.total_s >= cost.flops / GPU.bf16_flops
    assert cost.total_s >= cost.overhead_s


def test_a_step_grows_with_its_tokens_and_contexts():
    cm = cost_model(1)
    totals = [cm.split_step_cost([2000] * n, []).total_s for n in (1, 8, 64, 256)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    contexts = [cm.split_step_cost([c] * 32, []).total_s for c in (100, 1000, 10000, 30000)]
    assert contexts == sorted(contexts) and contexts[0] < contexts[-1]
    chunks = [cm.split_step_cost([], [(n, 0)]).total_s for n in (128, 1024, 8192)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]


@pytest.mark.parametrize("decodes, prefills", STEPS)
def test_two_ranks_do_less_each_than_one(decodes, prefills):
    one, two = cost_model(1).split_step_cost(decodes, prefills), cost_model(2).split_step_cost(decodes, prefills)
    assert two.compute_s < one.compute_s and two.memory_s < one.memory_s and two.kv_bytes < one.kv_bytes
    assert two.communication_s > 0 == one.communication_s


# -- MoE and MLA --------------------------------------------------------------------------


def test_a_moe_step_reads_the_experts_its_tokens_are_routed_to():
    # gpt-oss-20b: 24 MoE layers of 32 experts, 4 per token, gate/up/down of 2880 x 2880 in
    # MXFP4 (4.25 bits a parameter). Uniform routing: an expert is missed by a token with
    # probability 1 - 4/32, so n tokens touch 32 (1 - (28/32)^n) experts in expectation.
    model = get_model("gpt-oss-20b")
    p = plan(model, GPU, EngineConfig(max_model_len=8192))
    cm = CostModel(p.model, p.gpu, p.layers.specs, async_scheduling=True, efficiency=EFF)
    expert_bytes = 3 * 2880 * 2880 * 4.25 / 8
    all_experts = 32 * 24 * expert_bytes
    embedding_table = 201088 * 2880 * BF16  # untied, held but never read whole
    for n in (1, 4, 64, 2048):
        touched = 32 * (1 - (1 - 4 / 32) ** n)
        expected = math.ceil(model.weights_bytes) - embedding_table - all_experts + touched * 24 * expert_bytes
        cost = cm.split_step_cost([500] * n, [])
        assert cost.weight_bytes == pytest.approx(expected, rel=1e-9)
        assert cost.weight_bytes <= model.weights_bytes


@pytest.mark.parametrize("name, tied", [("llama-3.1-8b", False), ("gemma-3-12b", True)])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_never_reads_the_input_embedding_table(name, tied, tp):
    # The lookup gathers a row per token. An untied table is held (the memory plan counts
    # it) but a step reads only the LM head; tied, the one matrix is read whole as the head.
    model = get_model(name)
    assert model.tie_word_embeddings is tied
    p = plan(model, GPU, EngineConfig(tensor_parallel_size=tp, max_model_len=8192))
    cm = CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=True, efficiency=EFF)
    table = 0 if tied else model.vocab_size * model.hidden_size * BF16 / tp
    for decodes in ([100], [100] * 64):
        cost = cm.split_step_cost(decodes, [])
        assert cost.weight_bytes == pytest.approx(math.ceil(model.weights_bytes / tp) - table, rel=1e-12)


def test_mla_latent_kv_is_read_whole_on_every_rank():
    # DeepSeek-V3's MLA keeps one latent (512) + rope key (64) per token and layer, the same
    # on every TP rank: a rank's KV read does not shrink with TP, its query heads do.
    model = get_model("deepseek-v3")
    gpu = get_gpu("h200")
    costs = {}
    for tp in (1, 8):
        p = plan(model, gpu, EngineConfig(tensor_parallel_size=tp, max_model_len=8192))
        cm = CostModel(p.model, p.gpu, p.layers.specs, tensor_parallel_size=tp, async_scheduling=True,
                       efficiency=EFF)
        costs[tp] = cm.split_step_cost([1000, 3000], [])
        assert costs[tp].kv_bytes == pytest.approx((1000 + 3000 + 2) * (512 + 64) * 2 * model.num_layers, rel=1e-12)
        # (d_k + d_v) = 576 + 512 per attended key per query head on this rank.
        assert costs[tp].attention_flops == pytest.approx(
            2 * (model.num_attention_heads // tp) * (576 + 512) * model.num_layers * 4000, rel=1e-12)
