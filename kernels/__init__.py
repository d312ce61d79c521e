"""Paged kernels for the executor: K/V write by slot mapping, paged attention (full,
sliding window, chunked local; grouped-query heads) and a gated linear recurrence with
paged state — each in three backends (vLLM flash attention, Triton, a torch reference).

``kernels.write_kv``, ``kernels.paged_attention`` and ``kernels.state_update`` dispatch to
the backend chosen for the tensors' device (``kernels.backends``); call a backend module
directly to pin one. Depends on torch (and optionally Triton, vllm_flash_attn), never on
``sim``. Nothing is imported until used, so the package imports without torch.
See ``kernels/README.md``.
"""

from __future__ import annotations

__all__ = ["write_kv", "paged_attention", "state_update"]


def __getattr__(name: str):
    if name in __all__:
        from kvtwin.kernels import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
