"""The three operations, dispatched to the backend selected for the tensors' device
(``kernels.backends.select_backend``). Signatures and meaning: ``kernels.reference``."""

from __future__ import annotations

import torch

from kvtwin.kernels.backends import select_backend


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    select_backend(k_cache.device.type).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
    return select_backend(q.device.type).paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                         query_start_loc, scale, sliding_window, chunk_size)


def state_update(x: torch.Tensor, conv_weight: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
                 conv_state: torch.Tensor, ssm_state: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int) -> torch.Tensor:
    return select_backend(x.device.type).state_update(x, conv_weight, log_decay, beta, conv_state, ssm_state,
                                                      block_tables, seq_lens, query_start_loc, block_size)
