"""Compile every Triton kernel for the H200 (sm_90) without a GPU.

The interpreter that runs the kernels on CPU checks their arithmetic but not what only
the GPU compiler sees (layouts, tl.dot shapes and dtypes, register and shared-memory
limits, ptxas). This module lowers each kernel, in the variants the launchers really use,
through ``triton.compile`` for a CUDA target of compute capability 90, down to a cubin
(Triton wheels ship ptxas). Run it as ``python -m kernels.compile_check`` in a process
*without* ``TRITON_INTERPRET=1`` (which replaces the kernels by interpreted functions).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

from kvtwin.kernels import triton_attention, triton_state_update, triton_write_kv

# tl.dot input dtypes by cache dtype name; fp32 runs exact ("ieee"), the others tensor cores.
DOT_PRECISION = {"fp16": "tf32", "bf16": "tf32", "fp32": "ieee"}


@dataclass(frozen=True)
class Variant:
    label: str
    kernel: object
    pointers: dict[str, str]  # argument name -> pointer type, e.g. "*fp16"
    floats: tuple[str, ...]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3

    def source(self) -> "triton.compiler.ASTSource":
        signature = {}
        for name in self.kernel.arg_names:
            if name in self.constexprs:
                signature[name] = "constexpr"
            elif name in self.pointers:
                signature[name] = self.pointers[name]
            else:
                signature[name] = "fp32" if name in self.floats else "i32"
        # Real launches mark pointers (torch allocations are 16-byte aligned) and integers
        # that are multiples of 16 (the strides of real head sizes) as such; do the same so
        # the vectorised, pipelined code paths are the ones compiled.
        aligned = [name for name in self.kernel.arg_names if name in self.pointers or name.startswith("stride_")]
        attrs = {(self.kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        return triton.compiler.ASTSource(fn=self.kernel, signature=signature, constexprs=self.constexprs,
                                         attrs=attrs)


def attention_variant(dtype: str, head_dim: int, group: int, decode: bool, window: bool = False,
                      chunk: bool = False, block_size: int = 16, splits: int = 1) -> Variant:
    config = triton_attention.tile_config(num_tokens=1 if decode else 1024, num_seqs=1, group=group,
                                          head_dim=head_dim, element_bytes=4 if dtype == "fp32" else 2,
                                          interpreted=False)
    block_q = config["block_q"]
    data = f"*{dtype}"
    return Variant(
        label=(f"paged_attention {dtype} d{head_dim} group{group} {'decode' if decode else 'prefill'}"
               f"{' window' if window else ''}{' chunk' if chunk else ''} bs{block_size}"
               f"{f' splits{splits}' if splits > 1 else ''}"),
        kernel=triton_attention.paged_attention_kernel,
        pointers={"q_ptr": data, "k_cache_ptr": data, "v_cache_ptr": data, "out_ptr": data,
                  "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                  "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"},
        floats=("scale_log2e",),
        constexprs=dict(BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
                        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q,
                        BLOCK_M=triton_attention.launch_shape(block_q, group), BLOCK_N=config["block_n"],
                        USE_WINDOW=window, USE_CHUNK=chunk, DOT_PRECISION=DOT_PRECISION[dtype],
                        NUM_SPLITS=splits),
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def combine_variant(dtype: str, num_heads: int, head_dim: int, splits: int) -> Variant:
    return Variant(
        label=f"combine_splits {dtype} heads{num_heads} d{head_dim} splits{splits}",
        kernel=triton_attention.combine_splits_kernel,
        pointers={"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "out_ptr": f"*{dtype}"},
        floats=(),
        constexprs=dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
                        NUM_SPLITS=splits, SPLITS_P=max(2, triton.next_power_of_2(splits))),
        num_stages=1,
    )


def write_kv_variant(dtype: str, num_kv_heads: int, head_dim: int, block_size: int = 16) -> Variant:
    data = f"*{dtype}"
    return Variant(
        label=f"write_kv {dtype} heads{num_kv_heads} d{head_dim} bs{block_size}",
        kernel=triton_write_kv.write_kv_kernel,
        pointers={"key_ptr": data, "value_ptr": data, "k_cache_ptr": data, "v_cache_ptr": data,
                  "slot_mapping_ptr": "*i64"},
        floats=(),
        constexprs=dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim)),
        num_stages=1,
    )


def state_update_variant(dtype: str, state_dtype: str, num_heads: int, key_dim: int, value_dim: int,
                         width: int) -> Variant:
    data = f"*{dtype}"
    return Variant(
        label=f"state_update {dtype}/{state_dtype} heads{num_heads} k{key_dim} v{value_dim} width{width}",
        kernel=triton_state_update.state_update_kernel,
        pointers={"x_ptr": data, "weight_ptr": data, "log_decay_ptr": data, "beta_ptr": data,
                  "conv_ptr": f"*{state_dtype}", "ssm_ptr": f"*{state_dtype}", "y_ptr": data,
                  "history_ptr": f"*{state_dtype}",
                  "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"},
        floats=(),
        constexprs=dict(NUM_HEADS=num_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
                        KEY_P=triton.next_power_of_2(key_dim),
                        BLOCK_V=triton_state_update.value_block(key_dim, value_dim, interpreted=False), W=width),
        num_stages=1,
    )


def variants() -> list[Variant]:
    """The shapes real models launch: Llama-style GQA (d128, group 4/8), MHA, odd head dims,
    sliding window and chunked local, every cache dtype; Mamba-2 / gated DeltaNet states."""
    return [
        attention_variant("bf16", 128, 4, decode=True),
        attention_variant("bf16", 128, 4, decode=False),
        attention_variant("fp16", 128, 8, decode=True, window=True),
        attention_variant("fp16", 128, 8, decode=False, window=True),
        attention_variant("bf16", 128, 1, decode=False, chunk=True, block_size=32),
        attention_variant("bf16", 64, 2, decode=True, chunk=True),
        attention_variant("fp16", 80, 4, decode=False, block_size=64),
        attention_variant("fp32", 64, 2, decode=False, window=True),
        attention_variant("bf16", 128, 8, decode=True, splits=8),
        attention_variant("fp16", 128, 4, decode=True, window=True, splits=3),
        combine_variant("bf16", 64, 128, 8),
        combine_variant("fp16", 32, 80, 3),
        write_kv_variant("bf16", 8, 128),
        write_kv_variant("fp16", 3, 80, block_size=64),
        write_kv_variant("fp32", 2, 64),
        state_update_variant("bf16", "fp32", 16, 128, 128, 4),
        state_update_variant("fp16", "fp16", 4, 64, 32, 2),
        state_update_variant("fp32", "fp32", 2, 16, 16, 1),
    ]


def compile_variant(variant: Variant, capability: int = 90):
    """The compiled kernel (raises on any compile error)."""
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(variant.source(), target=target,
                          options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})


def resource_usage(compiled) -> dict[str, int]:
    """Registers and stack bytes (spills) a thread uses, read from the cubin with the
    cuobjdump that Triton wheels ship; empty if it is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", text)}


def main(capability: int = 90) -> int:
    if not hasattr(triton_attention.paged_attention_kernel, "arg_names") or \
            type(triton_attention.paged_attention_kernel).__name__ == "InterpretedFunction":
        print("compile_check: TRITON_INTERPRET=1 is set; run without it", file=sys.stderr)
        return 2
    failures = 0
    for variant in variants():
        started = time.perf_counter()
        try:
            compiled = compile_variant(variant, capability)
            shared = getattr(compiled.metadata, "shared", 0)
            usage = resource_usage(compiled)
            regs = f", {usage['reg']} registers, {usage['stack']} B stack" if usage else ""
            print(f"ok    {variant.label}  ({time.perf_counter() - started:.1f}s, {shared} B shared{regs})")
        except Exception as err:
            failures += 1
            print(f"FAIL  {variant.label}: {type(err).__name__}: {str(err).strip()[:2000]}")
    print(f"triton {triton.__version__}, sm_{capability}: {len(variants()) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
