"""Paged kernels on a GPU: correctness at real sizes, then speed, per backend.

1. Correctness: every usable backend (triton, vllm_flash_attn, torch) against the torch
   reference on Llama-shaped batches (bf16, 32 query / 8 kv heads, head dim 128, block 16):
   decodes, mixed prefill chunks, sliding window, chunked local; write_kv; the state update
   with checkpoints (Triton).
2. Decode attention bandwidth: bytes of K/V read per second over long contexts, against
   the HBM peak (target: at least 60% with Triton at 32k context on an H200), plus a small
   sweep of Triton tile settings.
3. Prefill throughput: tokens/s and TFLOP/s for fresh prompts and for chunks with context.
4. State update decode bandwidth (Triton).

Needs no network: everything is generated. Prints a table and writes one parquet row per
measurement to ``$OUT/gpu_kernels.parquet`` (``bench/out/`` when ``$OUT`` is unset).
Exits 1 if a correctness check fails. ``--smoke`` runs the same code on CPU at toy sizes
(Triton under ``TRITON_INTERPRET=1`` if set), so the script is tested without a GPU.

    python bench/gpu_kernels.py [--quick] [--backends triton,vllm_flash_attn] [--peak-tbps 4.8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from kvtwin.kernels import backends, cases, reference  # noqa: E402

# HBM peak by device name (TB/s); the first match wins, so specific names come first.
HBM_PEAK_TBPS = (("H200", 4.8), ("GH200", 4.0), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35),
                 ("A100-SXM4-80GB", 2.039), ("A100", 1.555), ("L40S", 0.864), ("L4", 0.3))

ATOL = 3e-2  # bf16 output rounding on values of order one


@dataclass(frozen=True)
class Sizes:
    """Every size the run uses; ``full``, ``quick`` (about a minute) and ``smoke`` (CPU)."""

    device: str
    dtype: torch.dtype
    heads: dict  # attention layout: kv heads, query heads per kv head, head dim, block size
    correctness: dict  # name -> (query_lens, seq_lens, extra attention arguments)
    write_kv: tuple  # (query_lens, seq_lens)
    state: dict  # state_case arguments
    contexts: tuple
    batches: tuple
    max_batch_tokens: int  # skip decode sizes above this many context tokens (memory)
    sweep: tuple | None  # (context, batch) of the Triton tile sweep
    prefill: dict  # name -> (query_lens, seq_lens)
    state_decode: tuple  # (batch, heads, dim)


def full_sizes() -> Sizes:
    return Sizes(
        device="cuda", dtype=torch.bfloat16, heads=dict(num_kv_heads=8, group=4, head_dim=128, block_size=16),
        correctness={
            "decode": ([1] * 16, [1000 + 431 * i for i in range(16)], {}),
            "mixed_chunks": ([512, 1, 1, 2048, 1, 300], [4608, 3000, 7000, 2048, 100, 1300], {}),
            "sliding_window_4096": ([1, 1, 700], [10000, 5000, 9000], dict(sliding_window=4096)),
            "chunked_local_8192": ([1, 900, 1], [12000, 8600, 8192], dict(chunk_size=8192)),
        },
        write_kv=([4096, 1, 1, 2000], [9000, 3000, 20, 2000]),
        state=dict(query_lens=[64, 1, 1, 37], seq_lens=[200, 513, 90, 37], num_heads=16, key_dim=128,
                   value_dim=128, conv_width=4, block_size=64),
        contexts=(8192, 32768, 131072), batches=(1, 8, 32, 128), max_batch_tokens=128 * 32768,
        sweep=(32768, 32),
        prefill={"fresh 4x8192": ([8192] * 4, [8192] * 4), "chunks 4x2048 at 16k": ([2048] * 4, [16384] * 4)},
        state_decode=(256, 32, 128),
    )


def quick_sizes() -> Sizes:
    full = full_sizes()
    return Sizes(**{**full.__dict__, "contexts": (32768,), "batches": (8, 64), "sweep": (32768, 32),
                    "prefill": {"fresh 2x4096": ([4096] * 2, [4096] * 2)}})


def smoke_sizes() -> Sizes:
    return Sizes(
        device="cpu", dtype=torch.float32, heads=dict(num_kv_heads=2, group=2, head_dim=16, block_size=8),
        correctness={"mixed_chunks": ([5, 1], [21, 9], {}), "sliding_window": ([1, 4], [30, 12], dict(sliding_window=9)),
                     "chunked_local": ([3, 1], [20, 17], dict(chunk_size=16))},
        write_kv=([5, 1], [21, 9]),
        state=dict(query_lens=[5, 1], seq_lens=[9, 6], num_heads=2, key_dim=8, value_dim=8, conv_width=4,
                   block_size=4),
        contexts=(40,), batches=(2,), max_batch_tokens=10_000, sweep=(40, 2),
        prefill={"fresh 1x24": ([24], [24])}, state_decode=(2, 2, 8),
    )


def peak_tbps(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for name, tbps in HBM_PEAK_TBPS:
        if name in device_name:
            return tbps
    return None


def time_ms(fn, device: str, warmup: int = 3, iters: int = 20) -> float:
    """Median time of one call: CUDA events on a GPU, the wall clock otherwise."""
    if device != "cuda":
        samples = []
        for _ in range(2):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
        return statistics.median(samples)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def row(section: str, backend: str, case: str, **values) -> dict:
    base = dict(section=section, backend=backend, case=case, config="", batch=None, context_tokens=None,
                time_ms=None, bytes=None, gb_per_s=None, fraction_of_peak=None, tokens_per_s=None, tflops=None,
                max_abs_error=None, passed=None, note="")
    base.update(values)
    return base


def _error_row(section: str, backend: str, case: str, err: Exception, **values) -> dict:
    return row(section, backend, case, passed=False, note=f"{type(err).__name__}: {err}"[:300], **values)


# --------------------------------------------------------------------------------------
# 1. Correctness
# --------------------------------------------------------------------------------------


def check_attention(chosen: dict[str, backends.Backend], sizes: Sizes) -> list[dict]:
    rows = []
    for name, (query_lens, seq_lens, extra) in sizes.correctness.items():
        case = cases.attention_case(query_lens, seq_lens, dtype=sizes.dtype, device=sizes.device, seed=1,
                                    **sizes.heads, **extra)
        reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
        want = reference.paged_attention(**case.attention_args()).float()
        for label, backend in chosen.items():
            args = case.attention_args()
            if label == "vllm_flash_attn":
                # Flash multiplies masked probabilities by V, so unwritten slots must be finite.
                args |= dict(k_cache=case.k_cache.nan_to_num(0.0), v_cache=case.v_cache.nan_to_num(0.0))
            try:
                got = backend.paged_attention(**args).float()
            except Exception as err:
                rows.append(_error_row("correctness", label, f"attention {name}", err))
                continue
            error = (got - want).abs().max().item()
            rows.append(row("correctness", label, f"attention {name}", max_abs_error=error,
                            passed=bool(error <= ATOL), note="NaN in output" if got.isnan().any() else ""))
    return rows


def check_write_kv(chosen: dict[str, backends.Backend], sizes: Sizes) -> list[dict]:
    case = cases.filled_batch(*sizes.write_kv, dtype=sizes.dtype, device=sizes.device, **sizes.heads)
    slots = case.slot_mapping.clone()
    slots[::7] = -1  # padding tokens
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    reference.write_kv(case.key, case.value, want_k, want_v, slots)
    rows = []
    for label, backend in chosen.items():
        k, v = case.k_cache.clone(), case.v_cache.clone()
        try:
            backend.write_kv(case.key, case.value, k, v, slots)
        except Exception as err:
            rows.append(_error_row("correctness", label, "write_kv", err))
            continue
        same = torch.equal(k, want_k) and torch.equal(v, want_v)
        rows.append(row("correctness", label, "write_kv", passed=bool(same), note=f"write_kv of {label}"))
    return rows


def check_state_update(chosen: dict[str, backends.Backend], sizes: Sizes) -> list[dict]:
    case = cases.state_case(**sizes.state, dtype=sizes.dtype, device=sizes.device, checkpoint_every_block=True)
    want = case.clone_states()
    y_want = reference.state_update(**want.args()).float()
    rows = []
    for label, backend in chosen.items():
        if backend.state_update is reference.state_update:
            continue
        got = case.clone_states()
        try:
            y = backend.state_update(**got.args()).float()
        except Exception as err:
            rows.append(_error_row("correctness", label, "state_update", err))
            continue
        error = max((y - y_want).abs().max().item(),
                    (got.ssm_state.float() - want.ssm_state.float()).nan_to_num(0.0).abs().max().item(),
                    (got.conv_state.float() - want.conv_state.float()).nan_to_num(0.0).abs().max().item())
        same_nan = torch.equal(got.ssm_state.isnan(), want.ssm_state.isnan())
        rows.append(row("correctness", label, "state_update", max_abs_error=error,
                        passed=bool(error <= ATOL and same_nan), note=f"state_update of {label}"))
    return rows


# --------------------------------------------------------------------------------------
# 2-4. Speed
# --------------------------------------------------------------------------------------


def kv_bytes(case: cases.AttentionCase) -> int:
    """K and V bytes a decode step must read: every context token, every kv head."""
    _, _, heads, dim = case.k_cache.shape
    return 2 * int(case.seq_lens.sum()) * heads * dim * case.k_cache.element_size()


def _bandwidth_row(section, backend, case, batch, context, ms, moved, peak, config="default"):
    gbps = moved / (ms * 1e-3) / 1e9
    return row(section, backend, case, config=config, batch=batch, context_tokens=context, time_ms=ms,
               bytes=moved, gb_per_s=gbps, fraction_of_peak=gbps / (peak * 1e3) if peak else None)


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def decode_bandwidth(chosen: dict[str, backends.Backend], sizes: Sizes, peak: float | None) -> list[dict]:
    rows = []
    for context in sizes.contexts:
        for batch in sizes.batches:
            if batch * context > sizes.max_batch_tokens:
                continue
            case = cases.filled_batch([1] * batch, [context] * batch, dtype=sizes.dtype, device=sizes.device,
                                      **sizes.heads)
            moved = kv_bytes(case)
            for label, backend in chosen.items():
                if label == "torch":
                    continue  # the reference loops in Python: not a speed backend
                try:
                    ms = time_ms(lambda: backend.paged_attention(**case.attention_args()), sizes.device)
                except Exception as err:
                    rows.append(_error_row("decode", label, f"decode ctx {context}", err, batch=batch))
                    continue
                rows.append(_bandwidth_row("decode", label, f"decode ctx {context}", batch, context, ms, moved, peak))
            _free(sizes.device)
    return rows


def triton_decode_sweep(sizes: Sizes, peak: float | None) -> list[dict]:
    """A few Triton tile settings at one size, to see how far the defaults are from the best."""
    from kvtwin.kernels import triton_attention

    context, batch = sizes.sweep
    case = cases.filled_batch([1] * batch, [context] * batch, dtype=sizes.dtype, device=sizes.device, **sizes.heads)
    moved = kv_bytes(case)
    rows = []
    for block_n, stages, splits in ((64, 3, 1), (64, 4, 1), (128, 2, 1), (32, 4, 1), (64, 3, 2), (64, 3, 4),
                                    (128, 3, 4)):
        config = f"block_n={block_n} stages={stages} splits={splits}"
        try:
            ms = time_ms(lambda: triton_attention.paged_attention(**case.attention_args(), block_n=block_n,
                                                                  num_stages=stages, num_splits=splits),
                         sizes.device)
        except Exception as err:  # e.g. out of shared memory for a large tile
            rows.append(row("decode_sweep", "triton", f"decode ctx {context}", config=config,
                            note=f"{type(err).__name__}: {err}"[:300]))
            continue
        rows.append(_bandwidth_row("decode_sweep", "triton", f"decode ctx {context}", batch, context, ms, moved,
                                   peak, config=config))
    return rows


def prefill_throughput(chosen: dict[str, backends.Backend], sizes: Sizes) -> list[dict]:
    rows = []
    heads = sizes.heads["num_kv_heads"] * sizes.heads["group"]
    for name, (query_lens, seq_lens) in sizes.prefill.items():
        case = cases.filled_batch(query_lens, seq_lens, dtype=sizes.dtype, device=sizes.device, **sizes.heads)
        # Causal: the query at position p sees p + 1 keys; QK^T and PV are 2 FLOPs per MAC each.
        visible = sum(sum(range(n - q + 1, n + 1)) for q, n in zip(query_lens, seq_lens))
        flops = 4 * heads * sizes.heads["head_dim"] * visible
        for label, backend in chosen.items():
            if label == "torch":
                continue
            try:
                ms = time_ms(lambda: backend.paged_attention(**case.attention_args()), sizes.device, iters=10)
            except Exception as err:
                rows.append(_error_row("prefill", label, f"prefill {name}", err))
                continue
            rows.append(row("prefill", label, f"prefill {name}", batch=len(query_lens), context_tokens=max(seq_lens),
                            time_ms=ms, tokens_per_s=sum(query_lens) / (ms * 1e-3),
                            tflops=flops / (ms * 1e-3) / 1e12))
        _free(sizes.device)
    return rows


def state_decode_bandwidth(chosen: dict[str, backends.Backend], sizes: Sizes, peak: float | None) -> list[dict]:
    if "triton" not in chosen:
        return []
    batch, heads, dim = sizes.state_decode
    # One block a sequence holds its state (resumed and written in place), as a decode does.
    case = cases.state_case([1] * batch, [9] * batch, num_heads=heads, key_dim=dim, value_dim=dim, conv_width=4,
                            block_size=16, dtype=sizes.dtype, device=sizes.device)
    moved = 2 * batch * heads * dim * dim * case.ssm_state.element_size()  # state read and written per token
    name = f"state_update decode {heads}x{dim}x{dim}"
    try:
        ms = time_ms(lambda: chosen["triton"].state_update(**case.args()), sizes.device)
    except Exception as err:
        return [_error_row("state_decode", "triton", name, err, batch=batch)]
    gbps = moved / (ms * 1e-3) / 1e9
    return [row("state_decode", "triton", name, batch=batch, time_ms=ms, bytes=moved, gb_per_s=gbps,
                fraction_of_peak=gbps / (peak * 1e3) if peak else None, tokens_per_s=batch / (ms * 1e-3))]


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def usable_backends(wanted: list[str], device: str) -> tuple[dict[str, backends.Backend], list[dict]]:
    chosen, rows = {}, []
    for item in backends.availability(device):
        if item.name not in wanted:
            continue
        print(f"{item.name + ':':<17} {'usable' if item.usable else 'not usable':<11} {item.detail}")
        if item.usable:
            chosen[item.name] = backends.resolve(item.name, device)
        else:
            rows.append(row("availability", item.name, "availability", note=item.detail))
    return chosen, rows


def print_table(rows: list[dict]) -> None:
    columns = ("section", "backend", "case", "config", "batch", "time_ms", "gb_per_s", "fraction_of_peak",
               "tokens_per_s", "tflops", "max_abs_error", "passed")

    def fmt(value) -> str:
        if value is None:
            return "-"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    table = [[fmt(r[c]) for c in columns] for r in rows if r["section"] != "availability"]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    for r in rows:
        if r["note"] and r["passed"] is False:
            print(f"FAILED {r['backend']} {r['case']}: {r['note']}")


def write_parquet(rows: list[dict], out_dir: Path, metadata: dict) -> Path:
    """Written to a temporary name and renamed, so a reader never sees half a file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows).replace_schema_metadata({k: str(v) for k, v in metadata.items()})
    path = out_dir / "gpu_kernels.parquet"
    tmp = out_dir / "gpu_kernels.parquet.tmp"
    pq.write_table(table, tmp)
    tmp.rename(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Fewer sizes (about a minute).")
    parser.add_argument("--smoke", action="store_true", help="Toy sizes on CPU: tests the script, measures nothing.")
    parser.add_argument("--backends", default="triton,vllm_flash_attn,torch",
                        help="Comma-separated backends to measure (those usable here).")
    parser.add_argument("--peak-tbps", type=float, default=None, help="HBM peak in TB/s (default: by device name).")
    parser.add_argument("--out", type=Path, default=None, help="Output directory (default: $OUT or bench/out).")
    args = parser.parse_args(argv)
    sizes = smoke_sizes() if args.smoke else quick_sizes() if args.quick else full_sizes()
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device (use --smoke to exercise the script on CPU)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu"
    peak = peak_tbps(device_name, args.peak_tbps)
    import triton

    print(f"{device_name}, HBM peak {peak or 'unknown'} TB/s, torch {torch.__version__}, triton {triton.__version__}")
    started = time.perf_counter()
    chosen, rows = usable_backends([b.strip() for b in args.backends.split(",") if b.strip()], sizes.device)
    if not chosen:
        print("gpu_kernels: no usable backend", file=sys.stderr)
        return 2
    rows += check_attention(chosen, sizes) + check_write_kv(chosen, sizes) + check_state_update(chosen, sizes)
    rows += decode_bandwidth(chosen, sizes, peak)
    if "triton" in chosen and sizes.sweep:
        rows += triton_decode_sweep(sizes, peak)
    rows += prefill_throughput(chosen, sizes)
    rows += state_decode_bandwidth(chosen, sizes, peak)
    print_table(rows)

    out_dir = args.out or Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    path = write_parquet(rows, out_dir, dict(device=device_name, hbm_peak_tbps=peak, torch=torch.__version__,
                                             triton=triton.__version__, seconds=time.perf_counter() - started))
    print(f"wrote {path}")
    target = [r for r in rows if r["section"] in ("decode", "decode_sweep") and r["backend"] == "triton"
              and r["context_tokens"] == 32768 and r["fraction_of_peak"] is not None]
    if target:
        best = max(target, key=lambda r: r["fraction_of_peak"])
        verdict = "meets" if best["fraction_of_peak"] >= 0.6 else "MISSES"
        print(f"triton decode at 32k: best {best['fraction_of_peak']:.0%} of HBM peak (batch {best['batch']}, "
              f"{best['config']}) — {verdict} the 60% target")
    failed = [r for r in rows if r["passed"] is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
