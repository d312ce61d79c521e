"""The shape of the model the executor runs: which layers, of which kind, how wide.

The layers come from the plan's ``KVCacheConfig``: every group keeps its spec (block size,
window, chunk size, state mode), so the KV cache manager and the scheduler make exactly the
decisions they make in the simulation. Two sizes:

- ``real`` (a GPU): every cached layer, with one GPU's share of the preset's heads and
  widths (the plan is per GPU of the TP group); pages are exactly the planned page bytes.
- ``scaled`` (a CPU): the same groups, each with at most ``layers_per_group`` layers, and
  narrow widths (a few heads of 16 dimensions, a 64-wide residual stream), so a workload
  with evictions and preemptions runs through the torch reference in seconds.

The recurrent mixer is the gated linear recurrence of ``kernels.state_update`` (a
stand-in for Mamba-2's SSD and gated DeltaNet with the same paging); at real size its
heads are as many as fit the planned state page, so a step moves as many state bytes as
the real layer's page holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.spec import AttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, MLAAttentionSpec
from kvtwin.sim.planner.models import ModelPreset

MIXER_ATTENTION = "attention"
MIXER_LATENT = "mla"
MIXER_STATE = "state"

SSM_STATE_BYTES = 4  # the recurrent state is kept in fp32 (vLLM's usual choice for Mamba-2)


@dataclass(frozen=True)
class LayerShape:
    """One executed layer. Attention: ``num_heads`` query heads over ``num_kv_heads`` of
    ``head_dim``; MLA: one latent of ``head_dim`` (its last ``rope_dim`` rotated) shared by
    the heads; state: ``num_heads`` x (``key_dim``, ``value_dim``) with a conv of
    ``conv_width``."""

    name: str
    index: int  # layer index in the model (order of execution)
    group_id: int
    slot: int  # which shared pool tensor holds its pages (its position within the group)
    spec: KVCacheSpec
    mixer: str
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_dim: int = 0
    key_dim: int = 0
    value_dim: int = 0
    conv_width: int = 0

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.spec, "sliding_window", None)

    @property
    def chunk_size(self) -> int | None:
        return getattr(self.spec, "attention_chunk_size", None)

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.key_dim + self.value_dim)

    def page_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one block of this layer in the executor's layout."""
        if self.mixer == MIXER_ATTENTION:
            return 2 * self.block_size * self.num_kv_heads * self.head_dim * dtype_bytes
        if self.mixer == MIXER_LATENT:
            return self.block_size * self.head_dim * dtype_bytes
        return self.conv_state_bytes(dtype_bytes) + self.num_heads * self.key_dim * self.value_dim * SSM_STATE_BYTES

    def conv_state_bytes(self, dtype_bytes: int) -> int:
        raw = (self.conv_width - 1) * self.conv_dim * dtype_bytes
        return -(-raw // SSM_STATE_BYTES) * SSM_STATE_BYTES  # the fp32 state after it stays aligned


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    layers: tuple[LayerShape, ...]
    scaled: bool
    num_slots: int  # pool tensors: the most layers any group has

    def layers_of_group(self, group_id: int) -> list[LayerShape]:
        return [layer for layer in self.layers if layer.group_id == group_id]


# The scaled-down widths (CPU): small enough for the torch reference, wide enough that a
# wrong block changes every logit.
SCALED = dict(hidden_size=64, intermediate_size=128, vocab_size=512, num_heads=4, head_dim=16, mla_latent=24,
              mla_rope=8, state_heads=2, state_key_dim=8, state_value_dim=8)


def _mixer(spec: KVCacheSpec) -> str:
    if isinstance(spec, MambaSpec):
        return MIXER_STATE
    if isinstance(spec, MLAAttentionSpec):
        return MIXER_LATENT
    if isinstance(spec, AttentionSpec):
        return MIXER_ATTENTION
    raise ConfigError("kv_cache_groups", "attention, MLA or state layers the executor can run", type(spec).__name__)


def _conv_width(spec: MambaSpec) -> int:
    # The conv state holds the last W-1 inputs: (W-1, conv_dim) in every state kind here.
    return spec.shapes[0][0] + 1 if spec.shapes else 4


def model_shape(model: ModelPreset, config: KVCacheConfig, layer_index: dict[str, int], *,
                tensor_parallel_size: int = 1, scaled: bool, layers_per_group: int = 2,
                dtype_bytes: int = 2) -> ModelShape:
    """The executed model for ``config`` (see the module docstring for the two sizes)."""
    layers = []
    for gid, group in enumerate(config.groups):
        names = sorted(group.layer_names, key=layer_index.__getitem__)
        if scaled:
            names = names[:layers_per_group]
        for slot, name in enumerate(names):
            layers.append(_layer(model, group.spec, name, layer_index[name], gid, slot, tensor_parallel_size,
                                 scaled, dtype_bytes))
    layers.sort(key=lambda layer: layer.index)
    num_slots = max(layer.slot for layer in layers) + 1
    if scaled:
        return ModelShape(SCALED["hidden_size"], SCALED["intermediate_size"], SCALED["vocab_size"], tuple(layers),
                          True, num_slots)
    tp = tensor_parallel_size
    intermediate = model.intermediate_size or (model.num_experts_per_token * model.moe_intermediate_size
                                               + model.shared_expert_intermediate_size)
    return ModelShape(model.hidden_size, max(1, intermediate // tp), max(1, model.vocab_size // tp),
                      tuple(layers), False, num_slots)


def _layer(model: ModelPreset, spec: KVCacheSpec, name: str, index: int, gid: int, slot: int, tp: int,
           scaled: bool, dtype_bytes: int) -> LayerShape:
    mixer = _mixer(spec)
    common = dict(name=name, index=index, group_id=gid, slot=slot, spec=spec, mixer=mixer)
    if mixer == MIXER_ATTENTION:
        if scaled:
            kv_heads = 2 if spec.num_kv_heads >= 2 else 1
            return LayerShape(**common, num_heads=SCALED["num_heads"], num_kv_heads=kv_heads,
                              head_dim=SCALED["head_dim"])
        heads = max(spec.num_kv_heads, model.num_attention_heads // tp)
        return LayerShape(**common, num_heads=heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size)
    if mixer == MIXER_LATENT:
        if scaled:
            return LayerShape(**common, num_heads=SCALED["num_heads"], num_kv_heads=1,
                              head_dim=SCALED["mla_latent"] + SCALED["mla_rope"], rope_dim=SCALED["mla_rope"])
        return LayerShape(**common, num_heads=max(1, model.num_attention_heads // tp), num_kv_heads=1,
                          head_dim=spec.head_size, rope_dim=model.qk_rope_head_dim or 0)
    width = _conv_width(spec)
    if scaled:
        return LayerShape(**common, num_heads=SCALED["state_heads"], key_dim=SCALED["state_key_dim"],
                          value_dim=SCALED["state_value_dim"], conv_width=width)
    # As many 64 x 64 heads as fit the planned page (see the module docstring).
    key_dim = value_dim = 64
    probe = LayerShape(**common, num_heads=1, key_dim=key_dim, value_dim=value_dim, conv_width=width)
    heads = spec.page_size_bytes // probe.page_bytes(dtype_bytes)
    while heads > 1 and LayerShape(**common, num_heads=heads, key_dim=key_dim, value_dim=value_dim,
                                   conv_width=width).page_bytes(dtype_bytes) > spec.page_size_bytes:
        heads -= 1
    if heads < 1:
        raise ConfigError(f"kv_cache_groups[{gid}]", f"a state page of at least {probe.page_bytes(dtype_bytes)} "
                          "bytes for the executor's state kernel", spec.page_size_bytes)
    return LayerShape(**common, num_heads=heads, key_dim=key_dim, value_dim=value_dim, conv_width=width)


def pool_page_bytes(shape: ModelShape, config: KVCacheConfig, dtype_bytes: int) -> list[int]:
    """Bytes per block of each shared pool tensor: the planned page at real size (vLLM's
    unified page), the largest executed layer's page when scaled."""
    pages = [0] * shape.num_slots
    for layer in shape.layers:
        need = layer.page_bytes(dtype_bytes)
        if not shape.scaled:
            planned = config.groups[layer.group_id].spec.page_size_bytes
            if need > planned:
                raise ConfigError(f"kv_cache_groups[{layer.group_id}]", f"a page of at least {need} bytes for "
                                  f"{layer.name}", planned)
            need = planned
        pages[layer.slot] = max(pages[layer.slot], need)
    return [-(-p // 16) * 16 for p in pages]  # 16-byte pages keep every dtype view aligned
