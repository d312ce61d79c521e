"""The P/D transfer columns recomputed from first principles.

A tiny disaggregated replay (1 prefill + 1 decode replica, a handful of requests far
apart so no read waits behind another) on two hand-made models, each at TP 1 and TP 2:

* a GQA model: 4 layers, 4 KV heads of width 64 (K and V), bf16. A 16-token block of one
  layer on one worker is ``16 * (4 / tp) * (64 + 64) * 2`` bytes: the heads are sharded,
  so each worker moves its share and the request's ``transfer_bytes`` (every worker's
  share) does not depend on TP, while one worker's read (what the link time is of)
  halves at TP 2;
* an MLA model: 4 layers of one latent of ``kv_lora_rank + qk_rope_head_dim`` = 96
  values per token, bf16: ``16 * 96 * 2`` bytes per block and layer. The latent is
  replicated on every TP rank, so one worker's read is the whole latent at any TP and
  ``transfer_bytes`` counts it once (reports/SCHEMA.md: "1 copy with MLA").

Blocks read: the decode side starts cold and the prompts share nothing, so it reads
``ceil(prompt / 16)`` blocks of every layer. ``transfer_s`` is one worker's bytes over the
link's rate (``bandwidth_gbps * 1e9 / 8`` bytes per second) plus its latency. The summary's
P/D columns are recomputed from the request rows with NumPy.

The timed worker's completion rule is pinned apart: a step reports the reads due by the
step's end (its start plus its duration), not by the clock's "now" when it is applied
(a synchronous step is applied when it starts); and the link is first in, first out.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtwin.sim.core.pd_connector import PDConnectorMetadata, PDLink, PDTransfers, RemoteRead
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import model_from_mapping
from kvtwin.sim.planner.plan import plan as make_plan
from kvtwin.sim.replay.run import run_replay
from kvtwin.sim.scenario.disaggregation import Disaggregation
from kvtwin.traces import schema as s

BLOCK = 16
LAYERS = 4
BF16 = 2
BANDWIDTH_GBPS = 8.0  # 1e9 bytes per second: a slow link, so the byte time dominates
LATENCY_US = 250.0
PROMPTS = [100, 37, 300, 64]
OUTPUTS = [4, 3, 5, 2]

GQA = {"num_layers": LAYERS, "layer_pattern": "F", "hidden_size": 512, "num_attention_heads": 8,
       "num_kv_heads": 4, "head_dim": 64, "max_position_embeddings": 4096, "params_total": 1e8}
MLA = {"num_layers": LAYERS, "layer_pattern": "A", "hidden_size": 512, "num_attention_heads": 8,
       "num_kv_heads": 8, "head_dim": 96, "head_dim_v": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
       "max_position_embeddings": 4096, "params_total": 1e8}


def worker_block_bytes(kind: str, tp: int) -> int:
    """One block of one layer on one TP worker, by hand."""
    if kind == "gqa":
        return BLOCK * (4 // tp) * (64 + 64) * BF16
    return BLOCK * (64 + 32) * BF16  # the latent, whole on every rank


def request_bytes(kind: str, tp: int) -> int:
    """Every worker's share of one block of one layer: what ``transfer_bytes`` counts."""
    if kind == "gqa":
        return tp * worker_block_bytes(kind, tp)
    return worker_block_bytes(kind, tp)  # replicated: counted once


def trace():
    # Arrivals 5 s apart: each read is long done before the next is issued.
    return s.build_table({s.REQUEST_ID: [f"r{i}" for i in range(len(PROMPTS))],
                          s.ARRIVAL_TIME_S: [5.0 * i for i in range(len(PROMPTS))],
                          s.PROMPT_TOKENS: PROMPTS, s.OUTPUT_TOKENS: OUTPUTS},
                         s.TraceMeta(source_format="test"))


def run(kind: str, tp: int):
    model = model_from_mapping(GQA if kind == "gqa" else MLA, name=f"tiny-{kind}")
    plan = make_plan(model, get_gpu("h100"), EngineConfig(max_model_len=1024, tensor_parallel_size=tp,
                                                          kv_cache_memory_bytes=64 * 2**20))
    disaggregation = Disaggregation(prefill_replicas=1, decode_replicas=1, link="rdma",
                                    bandwidth_gbps=BANDWIDTH_GBPS, latency_us=LATENCY_US)
    return run_replay(plan, trace(), disaggregation=disaggregation)


@pytest.fixture(scope="module")
def runs():
    return {(kind, tp): run(kind, tp) for kind in ("gqa", "mla") for tp in (1, 2)}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("tp", [1, 2])
def test_transfer_bytes_and_seconds_from_page_sizes_and_the_link(runs, kind, tp):
    requests = runs[kind, tp].requests.to_pydict()
    bytes_per_s = BANDWIDTH_GBPS * 1e9 / 8
    assert requests["status"] == ["finished"] * len(PROMPTS)
    assert requests["decode_prefix_hit_tokens"] == [0] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        blocks = math.ceil(prompt / BLOCK) * LAYERS
        assert requests["transfer_bytes"][i] == blocks * request_bytes(kind, tp), (kind, tp, i)
        # One worker's share goes over one worker's link, then the latency.
        expected_s = blocks * worker_block_bytes(kind, tp) / bytes_per_s + LATENCY_US * 1e-6
        assert requests["transfer_s"][i] == pytest.approx(expected_s, rel=1e-9), (kind, tp, i)


def test_tp_shares_gqa_sharded_mla_replicated(runs):
    """The same requests at TP 1 and 2: GQA moves the same bytes in all, each worker half of
    them (half the link time less latency); MLA moves the same bytes and each worker all
    of them (the same link time)."""
    latency_s = LATENCY_US * 1e-6
    for kind, worker_ratio in (("gqa", 0.5), ("mla", 1.0)):
        one, two = runs[kind, 1].requests, runs[kind, 2].requests
        np.testing.assert_array_equal(one.column("transfer_bytes").to_numpy(), two.column("transfer_bytes").to_numpy())
        np.testing.assert_allclose(two.column("transfer_s").to_numpy() - latency_s,
                                   worker_ratio * (one.column("transfer_s").to_numpy() - latency_s), rtol=1e-9)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("tp", [1, 2])
def test_summary_pd_columns_from_the_request_rows(runs, kind, tp):
    result = runs[kind, tp]
    summary = result.summary.to_pylist()[0]
    rows = result.requests.to_pydict()
    transfer = np.array(rows["transfer_s"])
    ttft = np.array(rows["ttft_s"])
    num_bytes = np.array(rows["transfer_bytes"], dtype=float)
    assert summary["pd_prefill_replicas"] == 1 and summary["pd_decode_replicas"] == 1
    assert summary["pd_link"] == "rdma"
    assert summary["pd_transfer_mean_ms"] == pytest.approx(np.mean(transfer) * 1000, rel=1e-12)
    assert summary["pd_transfer_bytes_mean"] == pytest.approx(np.mean(num_bytes), rel=1e-12)
    assert summary["pd_transfer_share_of_ttft"] == pytest.approx(np.mean(transfer / ttft), rel=1e-12)
    assert summary["pd_transfer_share_of_ttft_total"] == pytest.approx(transfer.sum() / ttft.sum(), rel=1e-12)
    # TTFT holds the prefill, the read and the decode side's first step: longer than the read.
    assert (ttft > transfer).all()
    prefill_done = np.array(rows["prefill_finish_time_s"])
    first_token = np.array(rows["first_token_time_s"])
    assert (first_token - prefill_done >= transfer - 1e-12).all()


# -- the timed worker -----------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def read(req_id: str, num_bytes: int) -> RemoteRead:
    return RemoteRead(req_id, num_tokens=16, num_blocks=(1,), num_bytes=num_bytes)


def test_reads_are_reported_by_the_steps_end_not_by_now():
    """A step applied when it starts (clock at its start) reports the reads that land
    before it ends: at 1e9 B/s a 4e8-byte read lands at 0.4 s + 1 ms latency, inside a
    1-second step; a 2e9-byte read issued after it lands at 2.401 s, after that step."""
    clock = Clock()
    worker = PDTransfers(clock, PDLink(1e9, 1e-3))
    worker.submit(PDConnectorMetadata([read("a", 400_000_000)]))
    out = worker.finish_step(1.0)  # clock still 0: applied at its start
    assert out.finished_recving == ["a"]
    worker.submit(PDConnectorMetadata([read("b", 2_000_000_000)]))
    clock.now_s = 1.0
    assert worker.finish_step(1.0).finished_recving == []  # due 2.401 > step end 1.0
    assert worker.next_completion_s() == pytest.approx(0.4 + 2.0 + 1e-3)
    clock.now_s = 2.0
    worker.submit(None)
    assert worker.finish_step(0.5).finished_recving == ["b"]  # 2.401 <= 2.5


def test_the_link_is_first_in_first_out():
    """Three reads: the second issued while the first is on the wire waits for it; the
    third, issued after the link went idle, does not. Latency is added after the bytes."""
    link = PDLink(1e9, 2e-3)
    assert link.transfer(0.0, 500_000_000) == pytest.approx(0.5 + 2e-3)
    assert link.transfer(0.1, 300_000_000) == pytest.approx(0.5 + 0.3 + 2e-3)  # waits until 0.5
    assert link.transfer(5.0, 100_000_000) == pytest.approx(5.0 + 0.1 + 2e-3)


def test_send_done_is_reported_by_the_steps_end():
    """The prefill side frees a request's blocks at the end of its first step that ends
    after the read landed."""
    clock = Clock()
    worker = PDTransfers(clock, PDLink(1e9, 0.0))
    worker.send_done("p", 0.75)
    worker.submit(None)
    assert worker.finish_step(0.5).finished_sending == []   # step [0, 0.5]
    clock.now_s = 0.5
    worker.submit(None)
    assert worker.finish_step(0.5).finished_sending == ["p"]  # step [0.5, 1.0]


def test_a_read_of_nothing_has_no_transfer_seconds_and_is_left_out_of_the_summary():
    """Nemotron-H (Mamba hybrid): the prefill side leaves the prompt's last token to the
    decode side, so a prompt of 2 blocks + 1 the decode replica decoded before is all in
    its own prefix cache: its read loads nothing (it only tells the prefill side to free).
    Such a request has no transfer (``transfer_s`` NaN, 0 bytes; reports/SCHEMA.md), and
    the summary's P/D figures are over the requests that read: here the first alone."""
    from kvtwin.sim.planner.models import get_model

    plan = make_plan(get_model("nemotron-h-8b"), get_gpu("h100"),
                     EngineConfig(max_model_len=4096, kv_cache_memory_bytes=2 * 2**30))
    block = max(g.spec.block_size for g in plan.require_fits().groups)
    prompt = list(range(1000, 1000 + 2 * block + 1))
    table = s.build_table({s.REQUEST_ID: ["a", "b"], s.ARRIVAL_TIME_S: [0.0, 5.0],
                           s.PROMPT_TOKENS: [len(prompt)] * 2, s.OUTPUT_TOKENS: [3, 3],
                           s.PROMPT_TOKEN_IDS: [prompt, prompt]},
                          s.TraceMeta(source_format="test", content_identity=s.IDENTITY_TOKEN_IDS))
    result = run_replay(plan, table, disaggregation=Disaggregation())
    rows = result.requests.to_pydict()
    assert rows["status"] == ["finished", "finished"]
    assert rows["decode_prefix_hit_tokens"] == [0, 2 * block]  # all the prefill side computed
    assert rows["transfer_bytes"][0] > 0 and rows["transfer_s"][0] > 0
    assert rows["transfer_bytes"][1] == 0 and math.isnan(rows["transfer_s"][1])
    summary = result.summary.to_pylist()[0]
    assert summary["pd_transfer_mean_ms"] == pytest.approx(rows["transfer_s"][0] * 1000, rel=1e-12)
    assert summary["pd_transfer_bytes_mean"] == rows["transfer_bytes"][0]
    assert summary["pd_transfer_share_of_ttft"] == pytest.approx(rows["transfer_s"][0] / rows["ttft_s"][0])
    assert summary["pd_transfer_share_of_ttft_total"] == pytest.approx(rows["transfer_s"][0] / rows["ttft_s"][0])
