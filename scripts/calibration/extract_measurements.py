#!/usr/bin/env python3
"""Extract public real-GPU kernel measurements into small CSV files.

This script rebuilds ``sim/replay/data/measurements/`` (CSV files plus
``SOURCES.toml``) from two public repositories, read straight out of their
bare git directories (no work tree needed):

* ``ai-dynamo/aiconfigurator`` (Apache-2.0): per-op kernel timings collected
  with vLLM (GEMM, custom all-reduce, context / generation attention, fused MoE) and
  with nccl-tests (NCCL all-reduce, all-gather, reduce-scatter, all-to-all), and
  DeepEP dispatch/combine timed with SGLang's DeepEP benchmarks, under
  ``aic-core/src/aiconfigurator_core/systems/data/<system>/<family>/<backend>/<version>/``.
  Latencies there are milliseconds per single op call.
* ``microsoft/vidur`` (MIT): per-layer operation profiles
  (``data/profiling/compute/<gpu>/<model>/mlp.csv``, times in ms, measured
  with sarathi-serve's vidur branch) and NCCL all-reduce profiles
  (``data/profiling/network/<gpu>_dgx/all_reduce.csv``, ms, fp16 elements).

Nothing is fitted here: rows are filtered / subsampled and converted to SI
units (seconds, bytes) only.

Usage::

    python scripts/calibration/extract_measurements.py \
        --aic-git-dir /path/to/ai-dynamo+aiconfigurator/repo \
        --vidur-git-dir /path/to/microsoft+vidur/repo \
        [--out sim/replay/data/measurements]

Dependencies: the standard library, plus ``pyarrow`` *only* for the
aiconfigurator part, because aiconfigurator stores its tables as
zstd-compressed Parquet since commit f93be4ae (May 2026) and the older
``*.txt`` tables are Git-LFS pointers whose content is not in the git
history. Pass ``--skip-aic`` to run the vidur part with the standard library
alone.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import subprocess
import sys
from collections import defaultdict

# --------------------------------------------------------------------------
# What to take
# --------------------------------------------------------------------------

AIC_REPO = "ai-dynamo/aiconfigurator"
AIC_LICENCE = "Apache-2.0"
AIC_DATA = "aic-core/src/aiconfigurator_core/systems/data"

# Per GPU: the aiconfigurator system folder, and for each table the
# "<family>/<backend>/<version>" folder.  The newest vLLM version that has
# native (not re-labelled) data was chosen for each GPU; A100 has vLLM 0.14.0
# only.  The L40S vllm/0.22.0 custom all-reduce file is byte-identical to the
# 0.14.0 one (rows say 0.14.0), so the 0.14.0 path is cited.
AIC_SELECTION = {
    "h100": {
        "system": "h100_sxm", "gpu": "H100 SXM (NVIDIA H100 80GB HBM3)",
        "gemm": "gemm/vllm/0.24.0", "allreduce": "comm/vllm/0.24.0",
        "nccl": "comm/nccl/2.29.2", "attention": "attention/vllm/0.24.0",
        "moe": "moe/vllm/0.24.0",
    },
    "h200": {
        "system": "h200_sxm", "gpu": "H200 SXM (NVIDIA H200)",
        "gemm": "gemm/vllm/0.24.0", "allreduce": "comm/vllm/0.24.0",
        "nccl": "comm/nccl/2.29.2", "attention": "attention/vllm/0.24.0",
        "moe": "moe/vllm/0.24.0",
    },
    "b200": {
        "system": "b200_sxm", "gpu": "B200 SXM (NVIDIA B200)",
        "gemm": "gemm/vllm/0.24.0", "allreduce": "comm/vllm/0.24.0",
        "nccl": "comm/nccl/2.29.2", "attention": "attention/vllm/0.24.0",
        "moe": "moe/vllm/0.24.0",
    },
    "a100": {
        "system": "a100_sxm", "gpu": "A100 SXM (NVIDIA A100-SXM4-80GB)",
        "gemm": "gemm/vllm/0.14.0", "allreduce": "comm/vllm/0.14.0",
        "nccl": "comm/nccl/2.27.3", "attention": "attention/vllm/0.14.0",
    },
    "l40s": {
        "system": "l40s", "gpu": "L40S (NVIDIA L40S)",
        "gemm": "gemm/vllm/0.24.0", "allreduce": "comm/vllm/0.14.0",
        "nccl": "comm/nccl/2.27.3", "attention": "attention/vllm/0.24.0",
    },
}

# aiconfigurator's DeepEP tables (collected with SGLang's DeepEP benchmarks): per GPU
# the "comm/sglang/<version>" folder. 0.5.6.post2 is the newest with several node counts
# (1, 2, 4, 8 nodes of 8 GPUs) for H100/H200; B200 has 0.5.12, one node only.
AIC_DEEPEP = {"h100": "comm/sglang/0.5.6.post2", "h200": "comm/sglang/0.5.6.post2", "b200": "comm/sglang/0.5.12"}
# The one MoE shape measured at every node count (DeepSeek-V3's hidden size, top-k and
# experts), and DeepEP's default SM budget (deep_ep.Buffer.num_sms, which vLLM keeps)
# for the high-throughput ("normal") kernels swept over several budgets.
DEEPEP_SHAPE = {"hidden_size": 7168, "num_topk": 8, "num_experts": 256}
DEEPEP_SMS = 20
# nccl-tests collectives taken besides the all-reduce (op_name -> file name part).
COLLECTIVE_OPS = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "alltoall": "alltoall"}
US = 1e-6  # microseconds -> seconds

# GEMM (n, k) shapes kept: y[m, n] = x[m, k] @ W[n, k]^T.  aiconfigurator
# sweeps a generic grid of n, k (32 ... 65536), so Llama-3.1 shapes that are
# on the grid are kept exactly and off-grid ones (14336, 28672, 57344, 1792,
# 1280) are represented by their grid neighbours.
GEMM_SHAPES = [
    # Llama-3.1-8B (hidden 4096, q 32 x 128, kv 8 x 128, ffn 14336), TP 1/2/4/8
    (6144, 4096), (3072, 4096), (1536, 4096), (768, 4096),   # qkv_proj
    (4096, 4096), (4096, 2048), (4096, 1024), (4096, 512),   # o_proj
    (16384, 4096), (7168, 4096), (3584, 4096),               # gate_up (28672 -> 16384 nearest)
    (4096, 16384), (4096, 7168), (4096, 3584),               # down (k 14336 -> 16384 nearest)
    # Llama-3.1-70B (hidden 8192, q 64 x 128, kv 8 x 128, ffn 28672), TP 1/2/4/8
    (10240, 8192), (5120, 8192), (2560, 8192), (1536, 8192),  # qkv_proj (1280 -> 1536)
    (8192, 8192), (8192, 4096), (8192, 2048), (8192, 1024),   # o_proj
    (16384, 8192), (7168, 8192),                              # gate_up (14336 -> 16384, 7168 exact)
    (8192, 16384), (8192, 7168), (8192, 3584),                # down (k 28672/14336 -> 16384)
]
# Token counts (m) kept; whatever of these the file has (1 ... 8192 or 32768).
GEMM_M = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
          1536, 2048, 3072, 4096, 8192, 16384, 32768]
GEMM_DTYPES = {"bfloat16", "float16"}  # never fp8 / fp8_block / nvfp4

# Attention: bf16 activations and bf16 KV cache, head_dim 128, and the
# (q heads, kv heads) per GPU of Llama-3.1-8B / 70B at TP 1, 2, 4, 8.
ATTN_HEAD_DIM = 128
ATTN_HEADS = [(32, 8), (16, 4), (8, 2), (4, 1),     # 8B  TP1..8
              (64, 8), (32, 4), (16, 2), (8, 1)]    # 70B TP1..8
ATTN_HEADS = sorted(set(ATTN_HEADS))

# MoE experts (one fused-MoE layer, routed experts only): the (hidden, moe_intermediate,
# top_k, experts) of the bundled MoE presets that aiconfigurator measured exactly --
# gpt-oss-20b, gpt-oss-120b, Llama-4-Scout, Qwen3-235B-A22B, DeepSeek-V3, Kimi-K2
# (sim/planner/data/models.toml). Qwen3-Next, Granite-4.0-H, Jamba and MiniMax-Text-01
# shapes are not in the tables.
MOE_SHAPES = [(2880, 2880, 4, 32), (2880, 2880, 4, 128), (5120, 8192, 1, 16),
              (4096, 1536, 8, 128), (7168, 2048, 8, 256), (7168, 2048, 8, 384)]
# Weight formats the cost model prices (weight_format bf16, "fp8" = DeepSeek's block FP8,
# "mxfp4_moe" = gpt-oss's MXFP4 experts), and per GPU family the kernel vLLM picks for
# each by default, as ``kernel_source`` names it: (dtype, expert parallel?) -> kernel.
# Hopper: Triton for unquantized and for block FP8 under TP, FlashInfer CUTLASS for block
# FP8 under EP (vLLM fused_moe/oracle/fp8.py, "On Hopper for Block Fp8, prefer Triton for
# TP and FI CUTLASS for EP"; oracle/unquantized.py moves FlashInfer behind Triton on
# SM90); Blackwell: FlashInfer TRT-LLM first (oracle/unquantized.py, oracle/fp8.py
# priority lists).
MOE_DTYPES = ("bfloat16", "fp8_block", "w4a16_mxfp4")
MOE_KERNELS = {
    "hopper": {("bfloat16", False): "vllm_unquantizedfusedmoe_triton_tritonexperts",
               ("bfloat16", True): "vllm_unquantizedfusedmoe_triton_tritonexperts",
               ("fp8_block", False): "vllm_fp8moe_triton_tritonexperts",
               ("fp8_block", True): "vllm_fp8moe_flashinfer_cutlass_flashinferexperts",
               ("w4a16_mxfp4", False): "vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic",
               ("w4a16_mxfp4", True): "vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic"},
    "blackwell": {("bfloat16", False): "vllm_unquantizedfusedmoe_flashinfer_trtllm_trtllmbf16experts",
                  ("bfloat16", True): "vllm_unquantizedfusedmoe_flashinfer_trtllm_trtllmbf16experts",
                  ("fp8_block", False): "vllm_fp8moe_flashinfer_trtllm_trtllmfp8expertsmonolithic",
                  ("fp8_block", True): "vllm_fp8moe_flashinfer_trtllm_trtllmfp8expertsmonolithic",
                  ("w4a16_mxfp4", False):
                      "vllm_gptossmxfp4moe_flashinfer_trtllm_mxfp4_bf16_trtllmmxfp4expertsmonolithic",
                  ("w4a16_mxfp4", True):
                      "vllm_gptossmxfp4moe_flashinfer_trtllm_mxfp4_bf16_trtllmmxfp4expertsmonolithic"},
}
MOE_FAMILY = {"h100": "hopper", "h200": "hopper", "b200": "blackwell"}

VIDUR_REPO = "microsoft/vidur"
VIDUR_LICENCE = "MIT"
VIDUR_ENGINE = "sarathi-serve (vidur branch), per docs/profiling.md"
VIDUR_MODELS = {
    "a100": ["meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B",
             "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf"],
    "h100": ["meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf"],
}
# vidur docs/profiling.md: the 'a100' compute profile is shared by its A100-PCIe
# pair-NVLink and A100-DGX node configs, so the exact A100 form factor is not stated.
VIDUR_GPU = {"a100": "A100 80GB (vidur 'a100' compute profile; SXM vs PCIe not stated)",
             "h100": "H100 80GB (vidur 'h100' compute profile)"}
VIDUR_NET_GPU = {"a100": "A100 DGX, 8x A100 80GB, NVSwitch (vidur network_device a100_dgx)",
                 "h100": "H100 DGX, 8x H100, NVSwitch (vidur network_device h100_dgx)"}
VIDUR_NETWORK = {"a100": "a100_dgx", "h100": "h100_dgx"}
VIDUR_TOKENS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                768, 1024, 1536, 2048, 3072, 4096, 8192, 16384, 32768]
# vidur all-reduce sizes are a dense linear sweep; keep the measured size
# nearest to each point of a geometric grid (2 points per octave).
ALLREDUCE_GRID_PER_OCTAVE = 2

MS = 1e-3  # milliseconds -> seconds
FP16_BYTES = 2


# --------------------------------------------------------------------------
# git helpers
# --------------------------------------------------------------------------

def git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(["git", "--git-dir", git_dir, *args],
                          check=True, capture_output=True).stdout


def head_commit(git_dir: str) -> str:
    return git(git_dir, "rev-parse", "HEAD").decode().strip()


def last_change(git_dir: str, path: str) -> str:
    return git(git_dir, "log", "-1", "--format=%H", "HEAD", "--", path).decode().strip()


def read_blob(git_dir: str, path: str) -> bytes:
    return git(git_dir, "show", f"HEAD:{path}")


def read_parquet_rows(git_dir: str, path: str) -> list[dict]:
    import pyarrow.parquet as pq  # only needed for aiconfigurator
    return pq.read_table(io.BytesIO(read_blob(git_dir, path))).to_pylist()


def read_csv_rows(git_dir: str, path: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(read_blob(git_dir, path).decode())))


def fmt(x: float) -> str:
    return f"{x:.5g}"  # 5 significant digits; run-to-run noise is larger


# --------------------------------------------------------------------------
# Output bookkeeping
# --------------------------------------------------------------------------

class Out:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.sources: dict[str, dict] = {}
        self.tables: dict[str, tuple[list[str], list[list]]] = {}

    def add_source(self, key: str, **fields) -> None:
        self.sources[key] = fields

    def add_rows(self, name: str, header: list[str], rows: list[list]) -> None:
        if name not in self.tables:
            self.tables[name] = (header, [])
        assert self.tables[name][0] == header, name
        self.tables[name][1].extend(rows)

    def write(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        for name, (header, rows) in sorted(self.tables.items()):
            with open(os.path.join(self.out_dir, name), "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                w.writerows(rows)
            print(f"{name}: {len(rows)} rows", file=sys.stderr)
        with open(os.path.join(self.out_dir, "SOURCES.toml"), "w") as f:
            f.write("# Provenance of every `source` key used in the CSV files of this folder.\n"
                    "# commit = snapshot commit the file was read at; file_commit = last commit\n"
                    "# that changed the file. Regenerate with\n"
                    "# scripts/calibration/extract_measurements.py.\n")
            for key, fields in self.sources.items():
                f.write(f"\n[{key}]\n")
                for k, v in fields.items():
                    v = str(v).replace("\\", "\\\\").replace('"', '\\"')
                    f.write(f'{k} = "{v}"\n')


# --------------------------------------------------------------------------
# aiconfigurator
# --------------------------------------------------------------------------

def aic_engine(rows: list[dict], backend: str) -> str:
    versions = sorted({str(r["version"]) for r in rows})
    name = {"vllm": "vLLM", "nccl": "NCCL (nccl-tests)"}[backend]
    return f"{name} {'/'.join(versions)}"


def extract_aic(gd: str, out: Out) -> None:
    commit = head_commit(gd)
    for gpu, sel in AIC_SELECTION.items():
        base = f"{AIC_DATA}/{sel['system']}"

        def src(table: str, fname: str, key: str, rows: list[dict], notes: str, backend: str) -> str:
            path = f"{base}/{sel[table]}/{fname}"
            out.add_source(key, repository=AIC_REPO, path=path, commit=commit,
                           file_commit=last_change(gd, path), licence=AIC_LICENCE,
                           engine=aic_engine(rows, backend), gpu=sel["gpu"],
                           device_string=sorted({r["device"] for r in rows})[0], notes=notes)
            return key

        # ---- GEMM
        path = f"{base}/{sel['gemm']}/gemm_perf.parquet"
        rows = read_parquet_rows(gd, path)
        by_shape = defaultdict(list)
        for r in rows:
            if r["gemm_dtype"] in GEMM_DTYPES:
                by_shape[(r["m"], r["n"], r["k"])].append(r["latency"])
        key = src("gemm", "gemm_perf.parquet", f"aic-{gpu}-vllm-gemm", rows,
                  "bf16 rows only (fp8/fp8_block/nvfp4 dropped); vLLM RowParallelLinear (unquantized "
                  "=> torch.nn.functional.linear), x[m,k] @ W[n,k]^T, CUDA-graph timed over 6 weight "
                  "copies and divided by 6 (per-op latency, L2-cold weights), ms converted to s; kept (n,k) = Llama-3.1-8B/70B TP1-8 shapes on the aiconfigurator grid and "
                  "m in {1..32768} subset", "vllm")
        out_rows = []
        for n, k in GEMM_SHAPES:
            for m in GEMM_M:
                lat = by_shape.get((m, n, k))
                if lat:
                    lat_ms = sorted(lat)[len(lat) // 2]  # one row per shape in practice
                    out_rows.append([m, n, k, fmt(lat_ms * MS), key])
        out.add_rows(f"gemm_{gpu}.csv", ["m", "n", "k", "latency_s", "source"], out_rows)

        # ---- vLLM custom all-reduce (graph mode) -- message_size is in elements
        rows = read_parquet_rows(gd, f"{base}/{sel['allreduce']}/custom_allreduce_perf.parquet")
        key = src("allreduce", "custom_allreduce_perf.parquet", f"aic-{gpu}-vllm-allreduce", rows,
                  "vLLM tensor_model_parallel_all_reduce, bf16, CUDA-graph mode rows only "
                  "(backend vllm_graph; eager rows dropped); vLLM itself picks custom AR or NCCL by "
                  "size; message_size is a count of bf16 elements -> bytes x2; latency ms -> s", "vllm")
        out_rows = [[r["num_gpus"], r["message_size"] * FP16_BYTES, fmt(r["latency"] * MS),
                     "custom_allreduce", key]
                    for r in rows if r["backend"] == "vllm_graph" and r["allreduce_dtype"] == "bfloat16"]
        # ---- NCCL all-reduce (nccl-tests) -- message_size = bytes // 2 for 'half'
        rows = read_parquet_rows(gd, f"{base}/{sel['nccl']}/nccl_perf.parquet")
        key = src("nccl", "nccl_perf.parquet", f"aic-{gpu}-nccl", rows,
                  "nccl-tests all_reduce, dtype half, out-of-place time; message_size is elements "
                  "(collector stores bytes//2) -> bytes x2; latency ms -> s; rows carry "
                  "framework='TRTLLM' (collector label, not the engine)", "nccl")
        out_rows += [[r["num_gpus"], r["message_size"] * FP16_BYTES, fmt(r["latency"] * MS), "nccl", key]
                     for r in rows if r["op_name"] == "all_reduce" and r["nccl_dtype"] == "half"]
        out.add_rows(f"allreduce_{gpu}.csv",
                     ["tp", "message_bytes", "latency_s", "implementation", "source"], out_rows)

        # ---- NCCL all-gather, reduce-scatter, all-to-all (nccl-tests), from the same file
        key = src("nccl", "nccl_perf.parquet", f"aic-{gpu}-nccl-collectives", rows,
                  "nccl-tests all_gather_perf / reduce_scatter_perf / alltoall_perf (collector/network/"
                  "collect_nccl.py: '-b size -e size', out-of-place time, column 5 of the result line), dtype half "
                  "only (int8 dropped); message_size is the nccl-tests size in elements (the collector stores "
                  "size // 2) -> bytes x2; nccl-tests' size is the whole buffer of one GPU: the all-gather's "
                  "gathered output (each GPU contributes size/n), the reduce-scatter's input (each GPU keeps "
                  "size/n), the all-to-all's send buffer (size/n to each GPU); latency ms -> s", "nccl")
        out_rows = [[r["op_name"], r["num_gpus"], r["message_size"] * FP16_BYTES, fmt(r["latency"] * MS), key]
                    for r in rows if r["op_name"] in COLLECTIVE_OPS and r["nccl_dtype"] == "half"]
        out_rows.sort(key=lambda x: (x[0], x[1], x[2]))
        out.add_rows(f"collectives_{gpu}.csv", ["op", "num_gpus", "message_bytes", "seconds", "source"],
                     out_rows)

        # ---- DeepEP dispatch / combine (SGLang's DeepEP benchmarks)
        if gpu in AIC_DEEPEP:
            out_rows = []
            for mode, fname in (("ll", "wideep_deepep_ll_perf.parquet"),
                                ("normal", "wideep_deepep_normal_perf.parquet")):
                path = f"{base}/{AIC_DEEPEP[gpu]}/{fname}"
                rows = read_parquet_rows(gd, path)
                key = f"aic-{gpu}-deepep-{mode}"
                out.add_source(key, repository=AIC_REPO, path=path, commit=commit,
                               file_commit=last_change(gd, path), licence=AIC_LICENCE,
                               engine=f"DeepEP via SGLang {'/'.join(sorted({str(r['version']) for r in rows}))}",
                               gpu=sel["gpu"], device_string=sorted({r["device"] for r in rows})[0],
                               notes=("DeepEP " + ("low-latency dispatch/combine (collector/wideep/sglang/"
                                                   "collect_deepep_ll.py, deepep/test_low_latency.py): "
                                                   "dispatch_avg_t_us, combine_avg_t_us"
                                                   if mode == "ll" else
                                                   "normal (high-throughput) dispatch/combine (collector/wideep/"
                                                   "sglang/collect_deepep_normal.py, deepep/test_intranode.py and "
                                                   f"test_internode.py): dispatch_sms = combine_sms = {DEEPEP_SMS} "
                                                   "only (DeepEP's default), time = transmit_us + notify_us")
                                      + "; num_token = tokens each rank dispatches; node_num = nodes of 8 GPUs; "
                                        "hidden 7168, top-8, 256 experts only; us -> s"))
                for r in rows:
                    if any(r[k] != v for k, v in DEEPEP_SHAPE.items()):
                        continue
                    if mode == "ll":
                        dispatch_us, combine_us = r["dispatch_avg_t_us"], r["combine_avg_t_us"]
                    elif r["dispatch_sms"] != DEEPEP_SMS or r["combine_sms"] != DEEPEP_SMS:
                        continue
                    else:
                        dispatch_us = r["dispatch_transmit_us"] + r["dispatch_notify_us"]
                        combine_us = r["combine_transmit_us"] + r["combine_notify_us"]
                    out_rows.append([mode, r["node_num"], r["num_token"], fmt(dispatch_us * US),
                                     fmt(combine_us * US), key])
            out_rows.sort(key=lambda x: (x[0], x[1], x[2]))
            out.add_rows(f"deepep_{gpu}.csv", ["mode", "nodes", "tokens_per_rank", "dispatch_s", "combine_s",
                                                "source"], out_rows)

        # ---- attention
        header = ["phase", "batch", "q_len", "past_len", "num_heads", "num_kv_heads", "head_dim",
                  "latency_s", "kernel", "source"]
        for phase, fname in (("context", "context_attention_perf.parquet"),
                             ("generation", "generation_attention_perf.parquet")):
            rows = read_parquet_rows(gd, f"{base}/{sel['attention']}/{fname}")
            short = "ctxattn" if phase == "context" else "genattn"
            key = src("attention", fname, f"aic-{gpu}-vllm-{short}", rows,
                      f"{phase} attention, one layer, bf16 activations + bf16 KV cache, head_dim 128, "
                      "(heads, kv_heads) of Llama-3.1-8B/70B at TP1-8, full attention only (window_size 0 where "
                      "the column exists; sliding-window rows dropped); "
                      + ("context: q_len = isl, past_len = 0 (no prefix)" if phase == "context" else
                         "generation: q_len = 1, past_len = step (KV history before the new token)")
                      + "; latency ms -> s", "vllm")
            out_rows = []
            for r in rows:
                if (r["attn_dtype"] != "bfloat16" or r["kv_cache_dtype"] != "bfloat16"
                        or r["head_dim"] != ATTN_HEAD_DIM or r["beam_width"] != 1
                        or r.get("window_size", 0) != 0  # 0 = full attention; 128 = sliding window
                        or (r["num_heads"], r["num_key_value_heads"]) not in ATTN_HEADS):
                    continue
                q_len, past = (r["isl"], 0) if phase == "context" else (1, r["step"])
                out_rows.append([phase, r["batch_size"], q_len, past, r["num_heads"],
                                 r["num_key_value_heads"], r["head_dim"], fmt(r["latency"] * MS),
                                 r["kernel_source"], key])
            out_rows.sort(key=lambda x: (x[4], x[5], x[1], x[2], x[3]))
            out.add_rows(f"attention_{gpu}.csv", header, out_rows)

        # ---- MoE experts (fused MoE, one layer on one GPU)
        if "moe" in sel:
            rows = read_parquet_rows(gd, f"{base}/{sel['moe']}/moe_perf.parquet")
            kernels = MOE_KERNELS[MOE_FAMILY[gpu]]
            key = src("moe", "moe_perf.parquet", f"aic-{gpu}-vllm-moe", rows,
                      "vLLM FusedMoE layer (routed experts only: gate-up GEMM, activation, down GEMM, "
                      "top-k combine; no router GEMM, no all-to-all), one physical GPU timed as rank 0 of "
                      "moe_tp x moe_ep (TP: every expert's intermediate split; EP: experts split); "
                      "num_tokens = tokens entering the layer, routed over all experts; distributions "
                      "balanced, power_law_1.01, power_law_1.2; kept: shapes (hidden, inter, topk, experts) of "
                      "kvtwin's bundled MoE presets, dtypes bfloat16 / fp8_block / w4a16_mxfp4, vLLM's default "
                      "kernel for the dtype and GPU family (scripts/calibration/extract_measurements.py "
                      "MOE_KERNELS); latency ms -> s", "vllm")
            out_rows = []
            for r in rows:
                shape = (r["hidden_size"], r["inter_size"], r["topk"], r["num_experts"])
                if r["moe_dtype"] not in MOE_DTYPES or shape not in MOE_SHAPES:
                    continue
                if r["kernel_source"] != kernels[(r["moe_dtype"], r["moe_ep_size"] > 1)]:
                    continue
                out_rows.append([r["moe_dtype"], r["num_tokens"], *shape, r["moe_tp_size"], r["moe_ep_size"],
                                 r["distribution"], fmt(r["latency"] * MS), r["kernel_source"], key])
            out_rows.sort(key=lambda x: (x[0], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[1]))
            out.add_rows(f"moe_{gpu}.csv", ["dtype", "num_tokens", "hidden_size", "inter_size", "topk",
                                            "num_experts", "moe_tp", "moe_ep", "distribution", "latency_s",
                                            "kernel", "source"], out_rows)


# --------------------------------------------------------------------------
# vidur
# --------------------------------------------------------------------------

def extract_vidur(gd: str, out: Out) -> None:
    commit = head_commit(gd)
    for gpu, models in VIDUR_MODELS.items():
        out_rows = []
        for model in models:
            path = f"data/profiling/compute/{gpu}/{model}/mlp.csv"
            rows = read_csv_rows(gd, path)
            short = model.split("/")[-1].lower().replace("meta-", "").replace("-hf", "")
            key = f"vidur-{gpu}-{short}"
            max_tokens = max(int(r["num_tokens"]) for r in rows)
            cfg = {c: rows[0][c] for c in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd")}
            ops = sorted({c.split(".")[1] for c in rows[0] if c.startswith("time_stats.")})
            out.add_source(key, repository=VIDUR_REPO, path=path, commit=commit,
                           file_commit=last_change(gd, path), licence=VIDUR_LICENCE,
                           engine=VIDUR_ENGINE, gpu=VIDUR_GPU[gpu],
                           notes=f"model {model} ({', '.join(f'{k}={v}' for k, v in cfg.items())}); "
                                 f"ops {', '.join(ops)}; time_stats.<op>.median in ms -> s; "
                                 f"tp = num_tensor_parallel_workers; duplicate (num_tokens, tp) rows averaged; "
                                 f"num_tokens subsampled to a 1..{max_tokens} log grid")
            keep = set(VIDUR_TOKENS)
            # A few (num_tokens, tp) points were profiled twice; average their medians.
            samples = defaultdict(list)
            for r in rows:
                nt = int(r["num_tokens"])
                if nt not in keep:
                    continue
                for op in ops:
                    v = r.get(f"time_stats.{op}.median", "")
                    if v != "" and not math.isnan(float(v)):
                        samples[(int(r["num_tensor_parallel_workers"]), nt, op)].append(float(v))
            for (tp, nt, op), vals in samples.items():
                out_rows.append([model.split("/")[-1], tp, nt, op, fmt(sum(vals) / len(vals) * MS), key])
        out_rows.sort(key=lambda x: (x[0], x[3], x[1], x[2]))
        out.add_rows(f"layer_ops_{gpu}.csv", ["model", "tp", "num_tokens", "op", "latency_s", "source"],
                     out_rows)

        # ---- NCCL all-reduce (torch.distributed, fp16, CUDA graph), single node only
        path = f"data/profiling/network/{VIDUR_NETWORK[gpu]}/all_reduce.csv"
        rows = [r for r in read_csv_rows(gd, path)
                if r["collective"] == "all_reduce" and r["num_workers"] == r["devices_per_node"]]
        key = f"vidur-{gpu}-allreduce"
        out.add_source(key, repository=VIDUR_REPO, path=path, commit=commit,
                       file_commit=last_change(gd, path), licence=VIDUR_LICENCE,
                       engine="torch.distributed all_reduce (NCCL), CUDA-graph captured (vidur collectives profiler)",
                       gpu=VIDUR_NET_GPU[gpu],
                       notes="single-node rows only (num_workers == devices_per_node); size is fp16 elements "
                             "-> bytes x2; time_stats.all_reduce.median ms -> s; dense linear size sweep "
                             f"subsampled to nearest of a geometric grid ({ALLREDUCE_GRID_PER_OCTAVE}/octave)")
        by_tp = defaultdict(dict)
        for r in rows:
            by_tp[int(r["num_workers"])][int(r["size"])] = float(r["time_stats.all_reduce.median"])
        out_rows = []
        for tp, sizes in sorted(by_tp.items()):
            avail = sorted(sizes)
            chosen = set()
            lo, hi = math.log2(avail[0]), math.log2(avail[-1])
            steps = int((hi - lo) * ALLREDUCE_GRID_PER_OCTAVE) + 1
            for i in range(steps + 1):
                target = 2 ** (lo + i / ALLREDUCE_GRID_PER_OCTAVE)
                chosen.add(min(avail, key=lambda s: abs(math.log(s / target))))
            for s in sorted(chosen):
                out_rows.append([tp, s * FP16_BYTES, fmt(sizes[s] * MS), "nccl", key])
        out.add_rows(f"allreduce_{gpu}.csv", ["tp", "message_bytes", "latency_s", "implementation", "source"],
                     out_rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aic-git-dir", required=True)
    ap.add_argument("--vidur-git-dir", required=True)
    ap.add_argument("--out", default="sim/replay/data/measurements")
    ap.add_argument("--skip-aic", action="store_true", help="vidur only (no pyarrow needed)")
    args = ap.parse_args()
    out = Out(args.out)
    if not args.skip_aic:
        extract_aic(args.aic_git_dir, out)
    extract_vidur(args.vidur_git_dir, out)
    out.write()


if __name__ == "__main__":
    main()
