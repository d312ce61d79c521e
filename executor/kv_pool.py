"""The device KV pool: the planned number of blocks, one page layout per group, shared.

vLLM allocates one raw tensor per position within a group and lets the layer at that
position of *every* group view it (``KVCacheTensor.shared_by``): block ``b`` of group 0
and block ``b`` of group 1 are the same bytes, which is safe only because the block pool
never hands one block to two groups at once. The executor does the same, so a pool that
did would show up as wrong numbers.

Each page (one block of one tensor) is laid out block-major, as vLLM's hybrid
attention-plus-Mamba layout is: an attention layer's page holds its K rows then its V
rows (``[2, block_size, kv_heads, head_dim]``), an MLA layer's page one latent row per
token, a state layer's page its conv window then its fp32 recurrent state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtwin.executor.shapes import MIXER_ATTENTION, MIXER_LATENT, LayerShape, ModelShape


@dataclass
class LayerCache:
    """One layer's views into the pool (``k``/``v`` for attention — the same tensor for
    MLA — or ``conv``/``ssm`` for a state layer), each ``[num_blocks, ...]``."""

    layer: LayerShape
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


def _view(pages: torch.Tensor, offset_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``pages[:, offset:offset+n]`` (uint8, one row per block) seen as ``[num_blocks, *shape]``."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    raw = pages[:, offset_bytes:offset_bytes + count * nbytes]
    return raw.view(dtype).view(pages.shape[0], *shape)


class KVPool:
    def __init__(self, shape: ModelShape, num_blocks: int, page_bytes: list[int], *, dtype: torch.dtype,
                 device: torch.device):
        self.num_blocks = num_blocks
        self.dtype = dtype
        # Zeroed: flash attention multiplies masked probabilities by V, so never-written
        # slots must hold finite numbers.
        self.tensors = [torch.zeros((num_blocks, page), dtype=torch.uint8, device=device) for page in page_bytes]
        self.layers: dict[str, LayerCache] = {}
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        for layer in shape.layers:
            pages = self.tensors[layer.slot]
            bs = layer.block_size
            if layer.mixer == MIXER_ATTENTION:
                kv = _view(pages, 0, dtype, (2, bs, layer.num_kv_heads, layer.head_dim))
                self.layers[layer.name] = LayerCache(layer, k=kv[:, 0], v=kv[:, 1])
            elif layer.mixer == MIXER_LATENT:
                latent = _view(pages, 0, dtype, (bs, 1, layer.head_dim))
                self.layers[layer.name] = LayerCache(layer, k=latent, v=latent)
            else:
                conv = _view(pages, 0, dtype, (layer.conv_width - 1, layer.conv_dim))
                ssm = _view(pages, layer.conv_state_bytes(dtype_bytes), torch.float32,
                            (layer.num_heads, layer.key_dim, layer.value_dim))
                self.layers[layer.name] = LayerCache(layer, conv=conv, ssm=ssm)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def copy_states(self, layer_names: list[str], src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
        """Copy recurrent states block to block (vLLM's align-mode pre-copy)."""
        for name in layer_names:
            cache = self.layers[name]
            cache.conv[dst_blocks] = cache.conv[src_blocks]
            cache.ssm[dst_blocks] = cache.ssm[src_blocks]
