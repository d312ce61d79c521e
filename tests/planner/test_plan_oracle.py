"""``kvtwin plan``'s sizes recomputed by hand from the models' configs.

For each model the expected figures are written out from its architecture (layers, KV
heads, head widths, dtype) and the engine settings given on the command line, following
docs/semantics.md#number-of-blocks as vLLM 0.33 computes them:

* page bytes of one layer = block_size x KV heads per GPU x (K width + V width) x dtype
  bytes; for MLA one latent of kv_lora_rank + qk_rope_head_dim per token, *replicated*
  on every TP rank (not divided by TP);
* bytes per block = layers per group x page bytes (the largest group);
* num_blocks = KV cache bytes // bytes per block (the null block included, one less usable);
* blocks per request = each group's cap summed: full attention ceil(max_model_len / block),
  a sliding window ceil(min(window - 1 + tokens in flight, max_model_len) / block) + 1,
  tokens in flight being 2 x max_num_batched_tokens with async scheduling (1 x decode token
  per batch in the steady state);
* max concurrency = num_blocks / blocks per request; KV cache tokens =
  int(concurrency x max_model_len).

Models: Llama-3.1-8B (dense GQA, TP 1 and 2), DeepSeek-V3 (MLA, TP 4 and 8, on Hopper's
16-token and Blackwell's 128-token MLA kernel blocks) and gpt-oss-20b (sliding window
128 alternating with full attention). The memory estimate (no --kv-cache-memory-bytes) is
recomputed term by term for Llama. The JSON and the printed text are both checked.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvtwin.cli import app
from kvtwin.sim.planner.hardware import get_gpu

GIB = 2**30
BF16 = 2


def plan_json(*args) -> dict:
    result = CliRunner().invoke(app, ["plan", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def plan_text(*args) -> str:
    result = CliRunner().invoke(app, ["plan", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


def check_pool(j: dict, *, kv_bytes: int, bytes_per_block: int, blocks_per_request: int, max_model_len: int):
    num_blocks = kv_bytes // bytes_per_block
    assert j["bytes_per_block"] == bytes_per_block
    assert j["num_blocks"] == num_blocks
    assert j["num_usable_blocks"] == num_blocks - 1
    assert j["blocks_per_request"] == blocks_per_request
    assert j["max_concurrency"] == pytest.approx(num_blocks / blocks_per_request, rel=1e-12)
    assert j["kv_cache_tokens"] == int(num_blocks / blocks_per_request * max_model_len)
    assert j["needed_bytes_per_request"] == blocks_per_request * bytes_per_block
    assert j["memory"]["kv_cache_used_bytes"] == num_blocks * bytes_per_block
    assert j["memory"]["kv_cache_unused_bytes"] == kv_bytes - num_blocks * bytes_per_block
    return num_blocks


# -- dense GQA -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_gqa_sizes(tp):
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128 (K) + 128 (V), bf16; heads sharded by TP.
    kv_bytes, max_model_len = 4 * GIB, 8192
    args = ("--model", "llama-3.1-8b", "--gpu", "h100", "--tp", tp, "--kv-cache-memory-bytes", kv_bytes,
            "--max-model-len", max_model_len, "--max-num-batched-tokens", 8192, "--max-num-seqs", 256)
    j = plan_json(*args)
    page = 16 * (8 // tp) * (128 + 128) * BF16
    assert [(g["kind"], g["num_layers"], g["block_size"], g["page_bytes"]) for g in j["groups"]] == [
        ("full_attention", 32, 16, page)]
    num_blocks = check_pool(j, kv_bytes=kv_bytes, bytes_per_block=32 * page,
                            blocks_per_request=math.ceil(max_model_len / 16), max_model_len=max_model_len)
    assert j["groups"][0]["kv_tokens"] == (num_blocks - 1) * 16
    text = plan_text(*args)
    concurrency = num_blocks / math.ceil(max_model_len / 16)
    assert f"bytes per block       {32 * page:,}" in text
    assert f"num_blocks            {num_blocks:,} (null block included; {num_blocks - 1:,} usable)" in text
    assert f"KV cache tokens       {int(concurrency * max_model_len):,}" in text
    assert f"max concurrency       {concurrency:,.2f}x requests of {max_model_len:,} tokens" in text
    assert f"KV cache              {kv_bytes / GIB:,.2f} GiB  (--kv-cache-memory-bytes {kv_bytes:,}" in text


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_memory_estimate(tp):
    """No --kv-cache-memory-bytes: the KV cache is what the GPU's usable share leaves after
    the weights, the profiled activation peak, CUDA graphs and non-torch memory
    (docs/semantics.md#memory-budget), each term recomputed from Llama's shape; with TP
    the weights and the activations are split over the ranks and NCCL adds 512 MiB."""
    util, batched, seqs = 0.9, 8192, 256
    j = plan_json("--model", "llama-3.1-8b", "--gpu", "h100", "--tp", tp, "--gpu-memory-utilization", util,
                  "--max-model-len", 8192, "--max-num-batched-tokens", batched, "--max-num-seqs", seqs)
    total = get_gpu("h100").memory_bytes
    requested = math.ceil(total * util)
    weights = math.ceil(8.03e9 * 2 / tp)
    hidden, heads, kv_heads, head, inter, vocab = 4096, 32, 8, 128, 14336, 128256
    # Widest point of a layer: residual + normed hidden, QKV + attention output, gate/up/act.
    per_token = (2 * hidden + (heads * head + 2 * kv_heads * head + heads * head) // tp + 3 * inter // tp) * BF16
    activation = max(batched * per_token, 2 * seqs * vocab * 4)
    # Graphs captured up to 256 tokens: 1, 2, 4, 8..248 by 8, 256 = 35 graphs.
    graphs = 256 * per_token + 35 * 2 * 2**20
    non_torch = 256 * 2**20 + (512 * 2**20 if tp > 1 else 0)
    kv = requested - weights - activation - graphs - non_torch
    m = j["memory"]
    assert (m["requested_bytes"], m["weights_bytes"], m["activation_peak_bytes"], m["cuda_graph_bytes"],
            m["non_torch_bytes"], m["kv_cache_bytes"]) == (requested, weights, activation, graphs, non_torch, kv)
    check_pool(j, kv_bytes=kv, bytes_per_block=32 * 16 * (kv_heads // tp) * 2 * head * BF16, blocks_per_request=512,
               max_model_len=8192)


# -- MLA -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu, block", [("h200", 16), ("b200", 128)])
@pytest.mark.parametrize("tp", [4, 8])
def test_deepseek_mla_latent_is_replicated(gpu, block, tp):
    # DeepSeek-V3: 61 MLA layers caching one latent of 512 + 64 values per token, bf16.
    # Hopper's FlashMLA takes 16-token blocks, Blackwell's CUTLASS MLA 128.
    kv_bytes, max_model_len = 8 * GIB, 16384
    j = plan_json("--model", "deepseek-v3", "--gpu", gpu, "--tp", tp, "--kv-cache-memory-bytes", kv_bytes,
                  "--max-model-len", max_model_len, "--max-num-batched-tokens", 16384, "--max-num-seqs", 64)
    page = block * (512 + 64) * BF16  # whatever TP: every rank holds the whole latent
    assert [(g["kind"], g["num_layers"], g["block_size"], g["page_bytes"]) for g in j["groups"]] == [
        ("mla", 61, block, page)]
    check_pool(j, kv_bytes=kv_bytes, bytes_per_block=61 * page,
               blocks_per_request=math.ceil(max_model_len / block), max_model_len=max_model_len)


# -- sliding window ------------------------------------------------------------------------


def test_gpt_oss_sliding_window_sizes():
    # gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 8 KV heads
    # of 64 + 64, bf16: two groups of 12 layers with one page size.
    kv_bytes, max_model_len, batched = 4 * GIB, 8192, 2048
    args = ("--model", "gpt-oss-20b", "--gpu", "h100", "--kv-cache-memory-bytes", kv_bytes,
            "--max-model-len", max_model_len, "--max-num-batched-tokens", batched, "--max-num-seqs", 64)
    j = plan_json(*args)
    page = 16 * 8 * (64 + 64) * BF16
    in_flight = 2 * batched  # async scheduling: two batches in flight
    window_blocks = math.ceil(min(128 - 1 + in_flight, max_model_len) / 16) + 1
    window_steady = math.ceil(min(128 - 1 + 2, max_model_len) / 16) + 1
    full_blocks = math.ceil(max_model_len / 16)
    groups = sorted((g["kind"], g["num_layers"], g["page_bytes"], g["blocks_per_request"],
                     g["steady_state_blocks_per_request"]) for g in j["groups"])
    assert groups == [("full_attention", 12, page, full_blocks, full_blocks),
                      ("sliding_window", 12, page, window_blocks, window_steady)]
    num_blocks = check_pool(j, kv_bytes=kv_bytes, bytes_per_block=12 * page,
                            blocks_per_request=full_blocks + window_blocks, max_model_len=max_model_len)
    steady = num_blocks / (full_blocks + window_steady)
    assert j["steady_state_blocks_per_request"] == full_blocks + window_steady
    assert j["steady_state_concurrency"] == pytest.approx(steady, rel=1e-12)
    assert j["concurrency_limit"] == min(math.floor(steady), 64)
    text = plan_text(*args)
    assert (f"max concurrency       {num_blocks / (full_blocks + window_blocks):,.2f}x requests of "
            f"{max_model_len:,} tokens (vLLM's figure; {full_blocks + window_blocks:,} blocks per request)") in text
    assert (f"steady state          {steady:,.2f}x requests of {max_model_len:,} tokens once prefills are done "
            f"({full_blocks + window_steady:,} blocks per request)") in text
    assert f"at once               {math.floor(steady)} requests of {max_model_len:,} tokens fit together" in text
