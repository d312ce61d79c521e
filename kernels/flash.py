"""Adapter for vLLM's flash attention kernels (``vllm_flash_attn``), attention only.

Imported lazily: from ``vllm.vllm_flash_attn`` (a machine with vLLM, which vendors the
kernels) or from the standalone ``vllm_flash_attn`` package (``pip install kvtwin[flash]``;
that wheel pins torch 2.4 and CUDA 12, hence optional). Neither is a dependency.

The two builds order ``flash_attn_varlen_func``'s arguments differently and name the
paged key lengths differently (vLLM: ``seqused_k``, which ``block_table`` needs; older
standalone builds: ``cu_seqlens_k``), so the call is made by keyword after reading the
signature. Chunked local attention, which flash attention has no mask for, is served by
re-cutting the batch into per-chunk virtual sequences (``kernels.layout``).

``load()`` returns a ``FlashAttention`` or raises ``FlashUnavailable`` with the reason;
``check()`` compares it once with another implementation on a tiny case.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch

from kvtwin.kernels.layout import check_attention_args, local_virtual_batches

MODULES = ("vllm.vllm_flash_attn", "vllm_flash_attn")


class FlashUnavailable(RuntimeError):
    """vllm_flash_attn cannot be used here; the message says why."""


class FlashAttention:
    """``paged_attention`` with the signature of ``kernels.reference.paged_attention``."""

    def __init__(self, varlen_fn: Callable, module_name: str) -> None:
        self.varlen_fn = varlen_fn
        self.module_name = module_name
        params = inspect.signature(varlen_fn).parameters
        self.uses_seqused_k = "seqused_k" in params
        if "block_table" not in params:
            raise FlashUnavailable(f"{module_name}.flash_attn_varlen_func takes no block_table (no paged KV)")

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                 sliding_window: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
        check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
        if chunk_size is not None:
            batch = local_virtual_batches(block_tables, seq_lens, query_start_loc, chunk_size, k_cache.shape[1])
            return self._run(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             scale, sliding_window, batch.max_query_len, batch.max_seq_len)
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(query_lens.max()) if len(query_lens) else 0
        max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
        return self._run(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                         max_query_len, max_seq_len)

    def _run(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
             max_query_len: int, max_seq_len: int) -> torch.Tensor:
        if q.shape[0] == 0 or max_query_len == 0:
            return torch.zeros_like(q)
        kwargs = dict(
            q=q, k=k_cache, v=v_cache,
            cu_seqlens_q=query_start_loc.to(torch.int32), max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
            softmax_scale=scale, causal=True, block_table=block_tables.to(torch.int32),
        )
        seq_lens = seq_lens.to(torch.int32)
        if self.uses_seqused_k:
            kwargs["seqused_k"] = seq_lens
        else:
            kwargs["cu_seqlens_k"] = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        if sliding_window is not None:
            # flash's window counts keys left of the query; ours counts the query too.
            kwargs["window_size"] = (sliding_window - 1, 0)
        out = self.varlen_fn(**kwargs)
        return out[0] if isinstance(out, tuple) else out


def load() -> FlashAttention:
    """Import the first module of ``MODULES`` that works; raise ``FlashUnavailable``
    naming why each failed."""
    failures = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            return FlashAttention(module.flash_attn_varlen_func, name)
        except FlashUnavailable as err:
            failures.append(str(err))
        except Exception as err:  # an ImportError, or a broken build raising anything on import
            failures.append(f"{name}: {type(err).__name__}: {err}".strip())
    raise FlashUnavailable("; ".join(failures))


def check(candidate: Callable, baseline: Callable, device: torch.device | str, atol: float = 5e-3) -> str | None:
    """None if ``candidate`` matches ``baseline`` on a tiny fp16 batch (a prefill chunk with
    cached context, a decode, a fresh prompt; grouped-query heads), plain and with a sliding
    window; else the reason. Unwritten slots hold zeros here: flash attention multiplies
    masked probabilities by whatever V holds, so NaN there would poison its output."""
    from kvtwin.kernels import cases, reference

    for window in (None, 24):
        case = cases.attention_case([5, 1, 20], [37, 50, 20], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                                    dtype=torch.float16, device=device, sliding_window=window, fill=0.0)
        reference.write_kv(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
        try:
            got = candidate(**case.attention_args())
        except Exception as err:
            return f"failed on a tiny case: {type(err).__name__}: {err}"
        want = baseline(**case.attention_args())
        error = (got.float() - want.float()).abs().max().item()
        if not error <= atol:
            what = f"sliding window {window}" if window else "full attention"
            return f"disagrees with the baseline on a tiny case ({what}): max abs error {error:.3g}"
    return None
