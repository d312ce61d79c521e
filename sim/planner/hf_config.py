"""A local Hugging Face ``config.json`` -> a ``ModelPreset`` (no network).

For the architectures of the built-in presets (``sim/planner/data/models.toml``) this reads the fields
vLLM's model classes read to build their KV cache specs: the layer pattern (``layer_types``,
``sliding_window_pattern``, ``no_rope_layers``, ``attn_layer_period``,
``hybrid_override_pattern``, ``attn_type_list``, ``full_attention_interval``), the attention
shape, MLA ranks and the recurrent-state shapes. Multimodal configs are read through their
``text_config``.

A ``config.json`` has no parameter count, so ``params_total`` / ``params_active`` are
estimated from the shapes (embeddings, attention, MLP or experts, mixers); a scenario can
override them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.models import ModelPreset, model_from_mapping

# layer_types values used by transformers configs -> layer_pattern letters
_LAYER_TYPE_LETTERS = {
    "full_attention": "F", "attention": "F", "global": "F",
    "sliding_attention": "S", "sliding_window": "S", "local": "S",
    "chunked_attention": "C",
    "linear_attention": "M", "mamba": "M", "mamba2": "M",
}

_ARCH_FAMILIES = {
    "LlamaForCausalLM": "dense", "MistralForCausalLM": "dense", "Qwen2ForCausalLM": "dense",
    "Qwen3ForCausalLM": "dense", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4", "Llama4ForConditionalGeneration": "llama4",
    "DeepseekV3ForCausalLM": "deepseek", "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV32ForCausalLM": "deepseek",
    "Qwen3NextForCausalLM": "qwen3_next",
    "JambaForCausalLM": "jamba",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "MiniMaxText01ForCausalLM": "minimax", "MiniMaxM1ForCausalLM": "minimax",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCH_FAMILIES)


class _Fields:
    """Field access that names the file and field on a missing or malformed value."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise ConfigError(key, "an integer (required for this architecture)", source=self.source)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(key, "an integer", value, source=self.source)
        return value


def _letters_from_layer_types(types: list, f: _Fields) -> str:
    letters = []
    for i, t in enumerate(types):
        if t not in _LAYER_TYPE_LETTERS:
            raise ConfigError(f"layer_types[{i}]", f"one of {', '.join(_LAYER_TYPE_LETTERS)}", t, source=f.source)
        letters.append(_LAYER_TYPE_LETTERS[t])
    return "".join(letters)


def _dtype(f: _Fields) -> str:
    dtype = f.get("torch_dtype", f.get("dtype", "bfloat16"))
    return dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"


def _quant_method(raw: dict) -> str | None:
    qc = raw.get("quantization_config") or {}
    return qc.get("quant_method") if isinstance(qc, dict) else None


@dataclass(frozen=True)
class _Config:
    """What each family's reader needs of one config.json: the raw mapping (for the
    quantization block), its text fields, the architecture, and the layer pattern its
    ``layer_types`` list spells (None without one)."""

    raw: dict[str, Any]
    f: _Fields
    arch: str
    pattern: str | None

    @property
    def source(self) -> str:
        return self.f.source


def hf_config_to_mapping(raw: dict[str, Any], *, source: str = "config.json") -> dict[str, Any]:
    """The ``ModelPreset`` fields of a HF config (without a name)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json", "a JSON object", type(raw).__name__, source=source)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    family = _ARCH_FAMILIES.get(arch)
    if family is None:
        raise ConfigError("architectures", f"one of {', '.join(supported_architectures())}", arch, source=source)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    f = _Fields(text, source)
    out = _common_fields(raw, f, arch)
    layer_types = f.get("layer_types")
    pattern = _letters_from_layer_types(layer_types, f) if isinstance(layer_types, list) else None
    _FAMILY_READERS[family](_Config(raw, f, arch, pattern), out)

    if "M" in out["layer_pattern"] and "state" not in out:
        raise ConfigError("architectures", "an architecture whose recurrent layers kvtwin knows", arch, source=source)
    moe_period, moe_offset = 1, 0
    if family == "jamba":
        moe_period, moe_offset = f.int("expert_layer_period", 2), f.int("expert_layer_offset", 1)
    total, active = estimate_params(out, tie_embeddings=bool(f.get("tie_word_embeddings", False)),
                                    moe_period=moe_period, moe_offset=moe_offset)
    if moe_period != 1:
        out["moe_layer_period"], out["moe_layer_offset"] = moe_period, moe_offset
    out["params_total"], out["params_active"] = total, active
    out["tie_word_embeddings"] = bool(f.get("tie_word_embeddings", False))
    return out


def _common_fields(raw: dict[str, Any], f: _Fields, arch: str) -> dict[str, Any]:
    """The attention shape and sizes every family reads the same way."""
    layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    return {
        "architecture": arch,
        "hf_id": raw.get("_name_or_path", ""),
        "source": f"local config.json: {f.source}",
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": f.int("num_key_value_heads", heads),
        "head_dim": f.int("head_dim", hidden // heads),
        "intermediate_size": f.get("intermediate_size", 0),
        "vocab_size": f.get("vocab_size", 0),
        "max_position_embeddings": f.int("max_position_embeddings"),
        "dtype": _dtype(f),
    }


# One reader per family: each adds the layer pattern and the family's own fields to the
# common ones, in place (the mapping's key order is what the presets print).


def _moe_fields(f: Any, out: dict[str, Any], *, experts: str, intermediate: str, shared: str | None = None) -> None:
    """The routed experts of a family whose configs may have none (zeros then), under the
    family's own key names; the experts per token are always ``num_experts_per_tok``."""
    out["num_experts"] = f.get(experts, 0)
    out["num_experts_per_token"] = f.get("num_experts_per_tok", 0)
    out["moe_intermediate_size"] = f.get(intermediate, 0)
    if shared is not None:
        out["shared_expert_intermediate_size"] = f.get(shared, 0)

def _read_dense(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    window = f.get("sliding_window")
    uses_window = window is not None and (c.arch not in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM")
                                          or bool(f.get("use_sliding_window", False)))
    out["layer_pattern"] = c.pattern or ("S" if uses_window else "F")
    if "S" in out["layer_pattern"]:
        out["sliding_window"] = window


def _read_qwen3_moe(c: _Config, out: dict[str, Any]) -> None:
    """Qwen3-MoE: Qwen3's attention, every layer's MLP routed (``decoder_sparse_step`` 1)."""
    _read_dense(c, out)
    _moe_fields(c.f, out, experts="num_experts", intermediate="moe_intermediate_size")


def _read_gemma3(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    every = f.int("sliding_window_pattern", 6)
    out["layer_pattern"] = c.pattern or "".join("F" if (i + 1) % every == 0 else "S" for i in range(out["num_layers"]))
    out["sliding_window"] = f.int("sliding_window")


def _read_gpt_oss(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    out["layer_pattern"] = c.pattern or "SF"
    out["sliding_window"] = f.int("sliding_window")
    out["num_experts"] = f.int("num_local_experts")
    out["num_experts_per_token"] = f.get("num_experts_per_tok", f.get("experts_per_token", 4))
    out["moe_intermediate_size"] = f.int("intermediate_size")
    out["intermediate_size"] = 0
    if _quant_method(c.raw) == "mxfp4":
        out["weight_format"] = "mxfp4_moe"


def _read_llama4(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    chunk = f.get("attention_chunk_size")
    no_rope = f.get("no_rope_layers")
    if not isinstance(no_rope, list) or not no_rope:
        interval = f.int("no_rope_layer_interval", 4)
        no_rope = [0 if (i + 1) % interval == 0 else 1 for i in range(out["num_layers"])]
    # 1 = RoPE layer: chunked-local when the model has a chunk size; 0 = global NoPE layer.
    out["layer_pattern"] = "".join("C" if use_rope and chunk else "F" for use_rope in no_rope)
    if chunk:
        out["attention_chunk_size"] = chunk
    out["num_experts"] = f.int("num_local_experts")
    out["num_experts_per_token"] = f.get("num_experts_per_tok", 1)
    out["moe_intermediate_size"] = f.int("intermediate_size")
    out["shared_expert_intermediate_size"] = f.get("intermediate_size", 0)
    out["intermediate_size"] = 0


def _read_deepseek(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    out["layer_pattern"] = "A"
    out["kv_lora_rank"] = f.int("kv_lora_rank")
    out["qk_rope_head_dim"] = f.int("qk_rope_head_dim")
    out["q_lora_rank"] = f.get("q_lora_rank")
    out["head_dim"] = f.int("qk_nope_head_dim") + out["qk_rope_head_dim"]
    out["head_dim_v"] = f.int("v_head_dim")
    out["first_dense_layers"] = f.get("first_k_dense_replace", 0)
    # vLLM 0.33 builds the sparse-attention indexer wherever the config has index_topk
    # (deepseek_v2.py ``is_v32 = hasattr(config, "index_topk")``).
    if f.get("index_topk") is not None:
        for key in ("index_head_dim", "index_n_heads", "index_topk"):
            out[key] = f.int(key)
    _moe_fields(f, out, experts="n_routed_experts", intermediate="moe_intermediate_size")
    out["shared_expert_intermediate_size"] = f.get("n_shared_experts", 0) * out["moe_intermediate_size"]
    if _quant_method(c.raw) == "fp8":
        out["weight_format"] = "fp8"


def _read_qwen3_next(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    interval = f.int("full_attention_interval", 4)
    out["layer_pattern"] = c.pattern or "".join("F" if (i + 1) % interval == 0 else "M"
                                                for i in range(out["num_layers"]))
    out["state"] = {"kind": "gated_deltanet", "conv_kernel": f.int("linear_conv_kernel_dim"),
                    "num_k_heads": f.int("linear_num_key_heads"), "num_v_heads": f.int("linear_num_value_heads"),
                    "head_k_dim": f.int("linear_key_head_dim"), "head_v_dim": f.int("linear_value_head_dim")}
    _moe_fields(f, out, experts="num_experts", intermediate="moe_intermediate_size",
                shared="shared_expert_intermediate_size")
    out["intermediate_size"] = 0


def _read_jamba(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    period, offset = f.int("attn_layer_period", 8), f.int("attn_layer_offset", 4)
    out["layer_pattern"] = "".join("F" if i % period == offset else "M" for i in range(out["num_layers"]))
    out["state"] = {"kind": "mamba1", "d_state": f.int("mamba_d_state"), "d_conv": f.int("mamba_d_conv"),
                    "expand": f.int("mamba_expand")}
    _moe_fields(f, out, experts="num_experts", intermediate="intermediate_size")


def _read_granite_hybrid(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    if c.pattern is None:
        raise ConfigError("layer_types", "a list of mamba/attention per layer", source=c.source)
    out["layer_pattern"] = c.pattern
    out["state"] = {"kind": "mamba2", "d_state": f.int("mamba_d_state"), "d_conv": f.int("mamba_d_conv"),
                    "num_heads": f.int("mamba_n_heads"), "head_dim": f.int("mamba_d_head"),
                    "n_groups": f.int("mamba_n_groups", 1)}
    _moe_fields(f, out, experts="num_local_experts", intermediate="intermediate_size",
                shared="shared_intermediate_size")
    out["intermediate_size"] = 0


def _read_nemotron_h(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    layers = out["num_layers"]
    override = f.get("hybrid_override_pattern")
    if not isinstance(override, str) or len(override) != layers:
        raise ConfigError("hybrid_override_pattern", f"a string of {layers} layer letters (M, *, -)", override,
                          source=c.source)
    out["layer_pattern"] = override.replace("*", "F").replace("E", "-")
    out["state"] = {"kind": "mamba2", "d_state": f.int("ssm_state_size"), "d_conv": f.int("conv_kernel"),
                    "num_heads": f.int("mamba_num_heads"), "head_dim": f.int("mamba_head_dim"),
                    "n_groups": f.int("n_groups", 1)}
    out["mamba_ssm_cache_dtype"] = f.get("mamba_ssm_cache_dtype", "float32")


def _read_minimax(c: _Config, out: dict[str, Any]) -> None:
    f = c.f
    layers = out["num_layers"]
    types = f.get("attn_type_list")
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError("attn_type_list", f"a list of {layers} entries (1 softmax, 0 lightning)", types,
                          source=c.source)
    out["layer_pattern"] = "".join("F" if t == 1 else "M" for t in types)
    out["state"] = {"kind": "linear_attention", "num_heads": out["num_attention_heads"], "head_dim": out["head_dim"]}
    _moe_fields(f, out, experts="num_local_experts", intermediate="intermediate_size")
    out["intermediate_size"] = 0


_FAMILY_READERS: dict[str, Callable[[_Config, dict[str, Any]], None]] = {
    "dense": _read_dense, "qwen3_moe": _read_qwen3_moe, "gemma3": _read_gemma3, "gpt_oss": _read_gpt_oss, "llama4": _read_llama4,
    "deepseek": _read_deepseek, "qwen3_next": _read_qwen3_next, "jamba": _read_jamba,
    "granite_hybrid": _read_granite_hybrid, "nemotron_h": _read_nemotron_h, "minimax": _read_minimax,
}


def indexer_params(m: dict[str, Any], hidden: int) -> int:
    """One layer's lightning indexer (vLLM 0.33 ``Indexer``): queries from the q latent
    (``wq_b``), one key (``wk``) and per-head weights from the hidden state, the key's
    LayerNorm (weight and bias)."""
    dim, heads = m["index_head_dim"], m["index_n_heads"]
    return (m.get("q_lora_rank") or hidden) * heads * dim + hidden * dim + hidden * heads + 2 * dim


def estimate_params(m: dict[str, Any], *, tie_embeddings: bool, moe_period: int = 1,
                    moe_offset: int = 0) -> tuple[float, float]:
    """Parameter count (total, active per token) from the shapes of a model mapping.

    MoE layers are those at or after ``first_dense_layers`` with ``(i - moe_offset) %
    moe_period == 0`` (Jamba alternates dense and MoE MLPs)."""
    hidden, heads, kv = m["hidden_size"], m["num_attention_heads"], m["num_kv_heads"]
    hd, hd_v = m["head_dim"], m.get("head_dim_v") or m["head_dim"]
    pattern = m["layer_pattern"]
    kinds = (pattern * (m["num_layers"] // len(pattern) + 1))[: m["num_layers"]]
    embeddings = m.get("vocab_size", 0) * hidden * (1 if tie_embeddings else 2)
    total = active = float(embeddings)
    state = m.get("state") or {}
    experts = m.get("num_experts", 0)
    for i, k in enumerate(kinds):
        if k in "FSC":
            mixer = hidden * (heads * hd + 2 * kv * hd) + heads * hd_v * hidden
        elif k == "A":
            q = (m.get("q_lora_rank") or hidden) * heads * hd + hidden * (m.get("q_lora_rank") or 0)
            mixer = q + hidden * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) \
                + m["kv_lora_rank"] * heads * (hd - m["qk_rope_head_dim"] + hd_v) + heads * hd_v * hidden
            if m.get("index_topk") is not None:
                mixer += indexer_params(m, hidden)
        elif k == "M":
            inner = _state_inner(state, hidden)
            mixer = 3 * hidden * inner
        else:
            mixer = 0
        dense = 3 * hidden * m.get("intermediate_size", 0)
        if experts and i >= m.get("first_dense_layers", 0) and (i - moe_offset) % moe_period == 0:
            routed = 3 * hidden * m.get("moe_intermediate_size", 0)
            shared = 3 * hidden * m.get("shared_expert_intermediate_size", 0)
            total += mixer + experts * routed + shared + hidden * experts
            active += mixer + m.get("num_experts_per_token", 0) * routed + shared + hidden * experts
        else:
            total += mixer + dense
            active += mixer + dense
    return total, active


def _state_inner(state: dict, hidden: int) -> int:
    kind = state.get("kind")
    if kind == "mamba1":
        return state["expand"] * hidden
    if kind == "mamba2":
        return state["num_heads"] * state["head_dim"]
    if kind == "gated_deltanet":
        return state["num_k_heads"] * state["head_k_dim"] + state["num_v_heads"] * state["head_v_dim"]
    if kind == "linear_attention":
        return state["num_heads"] * state["head_dim"]
    return hidden


def load_hf_config(path: str | Path, *, name: str | None = None, overrides: dict | None = None) -> ModelPreset:
    """Read a local ``config.json`` (or a directory holding one) into a model preset."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("config.json", "valid JSON", f"{err.msg} at line {err.lineno}", source=str(p)) from None
    mapping = hf_config_to_mapping(raw, source=str(p))
    mapping["name"] = name or (raw.get("_name_or_path") or p.parent.name or "hf-config")
    mapping.update(overrides or {})
    try:
        return model_from_mapping(mapping, where="model")
    except ConfigError as err:
        raise err.with_source(str(p)) from None
