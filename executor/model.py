"""A model-shaped forward pass with seeded random weights.

Embedding, then per layer (in model order) an RMS-normed mixer with a residual — paged
attention (full, sliding window, chunked local: rotary positions, grouped KV heads), an
MLA-shaped latent cache (one latent row per token, its last ``rope_dim`` rotated, read by
every head in absorbed form), or the recurrent state update — then an RMS-normed SiLU
MLP; finally the logits of the tokens that sample. The weights are random but fixed by
the seed, so two runs of the same batch agree bit for bit on one device, and a run that
reused a cached block agrees with one that recomputed it to rounding.

The kernels come from ``kernels`` (one ``Backend``: vllm-flash-attn, Triton or the torch
reference); nothing here knows which.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvtwin.executor.inputs import BatchInputs
from kvtwin.executor.kv_pool import KVPool
from kvtwin.executor.shapes import MIXER_ATTENTION, MIXER_LATENT, LayerShape, ModelShape
from kvtwin.kernels.backends import Backend

ROPE_BASE = 10000.0


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last axis (halves style): ``x [tokens, heads, dim]``."""
    half = x.shape[-1] // 2
    if half == 0:
        return x
    inv_freq = ROPE_BASE ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    if 2 * half == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


class RandomModel:
    def __init__(self, shape: ModelShape, *, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.shape = shape
        self.device = device
        self.dtype = dtype
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)

        def weight(rows: int, cols: int, scale: float | None = None) -> torch.Tensor:
            scale = scale if scale is not None else 1.0 / math.sqrt(rows)
            w = torch.randn((rows, cols), generator=generator, device=device, dtype=torch.float32) * scale
            return w.to(dtype)

        hidden = shape.hidden_size
        self.embedding = weight(shape.vocab_size, hidden, 1.0)
        self.lm_head = weight(hidden, shape.vocab_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        for layer in shape.layers:
            w: dict[str, torch.Tensor] = {}
            if layer.mixer == MIXER_ATTENTION:
                w["q"] = weight(hidden, layer.num_heads * layer.head_dim)
                w["k"] = weight(hidden, layer.num_kv_heads * layer.head_dim)
                w["v"] = weight(hidden, layer.num_kv_heads * layer.head_dim)
                w["o"] = weight(layer.num_heads * layer.head_dim, hidden)
            elif layer.mixer == MIXER_LATENT:
                w["q"] = weight(hidden, layer.num_heads * layer.head_dim)
                w["kv"] = weight(hidden, layer.head_dim)
                w["o"] = weight(layer.num_heads * layer.head_dim, hidden)
            else:
                w["in"] = weight(hidden, layer.conv_dim)
                w["conv"] = weight(layer.conv_dim, layer.conv_width, 1.0 / math.sqrt(layer.conv_width))
                w["decay"] = weight(hidden, layer.num_heads)
                w["beta"] = weight(hidden, layer.num_heads)
                w["out"] = weight(layer.num_heads * layer.value_dim, hidden)
            w["up"] = weight(hidden, shape.intermediate_size)
            w["down"] = weight(shape.intermediate_size, hidden)
            self.layers.append(w)

    @property
    def nbytes(self) -> int:
        tensors = [self.embedding, self.lm_head] + [t for w in self.layers for t in w.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, inputs: BatchInputs, pool: KVPool, kernels: Backend) -> torch.Tensor:
        """Runs the step (writing K/V and states into the pool); returns the float32 logits
        ``[num_sampling, vocab]`` of the sampling requests' last tokens."""
        x = self.embedding[inputs.token_ids]
        for layer, w in zip(self.shape.layers, self.layers):
            h = _rms_norm(x)
            if layer.mixer == MIXER_ATTENTION:
                x = x + self._attention(layer, w, h, inputs, pool, kernels)
            elif layer.mixer == MIXER_LATENT:
                x = x + self._latent_attention(layer, w, h, inputs, pool, kernels)
            else:
                x = x + self._state(layer, w, h, inputs, pool, kernels)
            x = x + F.silu(_rms_norm(x) @ w["up"]) @ w["down"]
        last = _rms_norm(x[inputs.sample_rows])
        return (last @ self.lm_head).float()

    def _attention(self, layer: LayerShape, w, h, inputs: BatchInputs, pool: KVPool, kernels: Backend):
        tokens, heads, kv_heads, dim = h.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = _rotate((h @ w["q"]).view(tokens, heads, dim), inputs.positions)
        k = _rotate((h @ w["k"]).view(tokens, kv_heads, dim), inputs.positions)
        v = (h @ w["v"]).view(tokens, kv_heads, dim)
        cache = pool.layers[layer.name]
        gid = layer.group_id
        kernels.write_kv(k, v, cache.k, cache.v, inputs.slot_mappings[gid])
        out = kernels.paged_attention(q, cache.k, cache.v, inputs.block_tables[gid], inputs.seq_lens,
                                      inputs.query_start_loc, dim ** -0.5, layer.sliding_window, layer.chunk_size)
        return out.reshape(tokens, heads * dim) @ w["o"]

    def _latent_attention(self, layer: LayerShape, w, h, inputs: BatchInputs, pool: KVPool, kernels: Backend):
        tokens, heads, dim, rope = h.shape[0], layer.num_heads, layer.head_dim, layer.rope_dim
        latent = (h @ w["kv"]).view(tokens, 1, dim)
        q = (h @ w["q"]).view(tokens, heads, dim)
        if rope:
            latent = torch.cat([latent[..., :dim - rope], _rotate(latent[..., dim - rope:], inputs.positions)], -1)
            q = torch.cat([q[..., :dim - rope], _rotate(q[..., dim - rope:], inputs.positions)], -1)
        cache = pool.layers[layer.name]
        gid = layer.group_id
        kernels.write_kv(latent, latent, cache.k, cache.v, inputs.slot_mappings[gid])
        out = kernels.paged_attention(q.contiguous(), cache.k, cache.v, inputs.block_tables[gid], inputs.seq_lens,
                                      inputs.query_start_loc, dim ** -0.5, layer.sliding_window, layer.chunk_size)
        return out.reshape(tokens, heads * dim) @ w["o"]

    def _state(self, layer: LayerShape, w, h, inputs: BatchInputs, pool: KVPool, kernels: Backend):
        cache = pool.layers[layer.name]
        mixed = (h @ w["in"]).contiguous()
        # A decay in (0, 1) per head and token (log <= 0), a write strength in (0, 1).
        log_decay = -F.softplus((h @ w["decay"]).float() + 1.0).contiguous()
        beta = torch.sigmoid((h @ w["beta"]).float()).contiguous()
        y = kernels.state_update(mixed, w["conv"].contiguous(), log_decay, beta, cache.conv, cache.ssm,
                                 inputs.block_tables[layer.group_id], inputs.seq_lens, inputs.query_start_loc,
                                 layer.block_size)
        return y.reshape(h.shape[0], layer.num_heads * layer.value_dim).to(h.dtype) @ w["out"]
