"""A draft head's share of the GPU (docs/semantics.md#draft-heads-in-the-memory-plan,
``sim/planner/draft_head.py``): its layers join the target's in the KV cache groups, and
its weights come out of the KV cache budget. Figures derived here from the presets' facts."""

from __future__ import annotations

import pytest

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.planner.draft_head import DraftHead
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import plan

GIB = 1 << 30


def both(model: str, gpu: str, head: DraftHead, **engine):
    """The plan without and with the head, on an estimated memory budget."""
    m, g, e = get_model(model), get_gpu(gpu), EngineConfig(max_model_len=8192, **engine)
    return plan(m, g, e, num_speculative_tokens=3), plan(m, g, e, num_speculative_tokens=3, draft_head=head)


def test_an_eagle3_head_on_llama_adds_one_layer_to_the_group_and_its_weights():
    plain, head = both("llama-3.1-8b", "h100", DraftHead("eagle3", 1, 3))
    (group,) = head.groups
    assert len(group.layer_names) == 33 and head.to_json()["draft_head"]["layer_indices"] == [32]
    assert head.bytes_per_block == plain.bytes_per_block * 33 // 32
    # One average Llama-3.1-8B layer (no embedding, no LM head) plus EAGLE-3's 3h x h fusion, bf16.
    model = get_model("llama-3.1-8b")
    layer = (model.params_total - 2 * model.vocab_size * model.hidden_size) / model.num_layers
    expected = 2 * (layer + 3 * model.hidden_size ** 2)
    grown = head.memory.weights_bytes - plain.memory.weights_bytes
    assert grown == pytest.approx(expected, abs=1)
    assert 0.4 * GIB < grown < 0.7 * GIB
    assert head.memory.kv_cache_bytes == plain.memory.kv_cache_bytes - grown
    assert head.num_blocks == head.memory.kv_cache_bytes // head.bytes_per_block < plain.num_blocks


def test_deepseek_mtp_layer_adds_one_latent_per_token():
    # 61 MLA layers of one latent each (kv_lora_rank 512 + rope 64, 2 bytes): 61 x 1,152 bytes
    # per token, and the MTP layer one latent more.
    plain, head = both("deepseek-v3", "h200", DraftHead("mtp", 1, 3), tensor_parallel_size=8)
    block = head.layers.attention_block_size
    assert plain.bytes_per_block == 61 * 1152 * block
    assert head.bytes_per_block == 62 * 1152 * block
    # fp8 weights: one byte per parameter, sharded over the 8 ranks.
    model = get_model("deepseek-v3")
    layer = (model.params_total - 2 * model.vocab_size * model.hidden_size) / model.num_layers
    grown = head.memory.weights_bytes - plain.memory.weights_bytes
    assert grown == pytest.approx((layer + 2 * model.hidden_size ** 2) / 8, abs=1)


def test_gpt_oss_eagle_pads_the_sliding_window_layers_as_vllm_says():
    # vLLM 0.33 kv_cache_planning.py l.523-531: "gpt-oss-20b + eagle, with 12 sw + 13 full.
    # We pad it to (13 sw, 13 full)".
    plain, head = both("gpt-oss-20b", "h100", DraftHead("eagle", 1, 3))
    kinds = {g.spec.kind: (len(g.layer_names), g.num_padding_layers) for g in head.groups}
    assert kinds == {"sliding_window": (12, 1), "full_attention": (13, 0)}
    assert head.bytes_per_block == plain.bytes_per_block * 13 // 12


def test_a_hybrid_head_is_a_full_attention_layer_beside_the_mamba_groups():
    plain, head = both("qwen3-next-80b-a3b", "h200", DraftHead("mtp", 1, 3), tensor_parallel_size=4)
    full = [g for g in head.groups if g.spec.kind == "full_attention"]
    assert sum(len(g.layer_names) for g in full) == 13
    assert head.layers.attention_block_size == plain.layers.attention_block_size
    assert head.num_blocks < plain.num_blocks


def test_more_draft_layers_cost_more():
    one = both("llama-3.1-8b", "h100", DraftHead("eagle", 1, 3))[1]
    two = both("llama-3.1-8b", "h100", DraftHead("eagle", 2, 3))[1]
    assert len(two.groups[0].layer_names) == 34 and two.num_blocks < one.num_blocks
    assert two.memory.weights_bytes > one.memory.weights_bytes


def test_given_kv_cache_bytes_keep_the_budget_and_the_layers_still_count():
    plain, head = both("llama-3.1-8b", "h100", DraftHead("eagle3", 1, 3), kv_cache_memory_bytes=40 * GIB)
    assert head.memory.kv_cache_bytes == plain.memory.kv_cache_bytes == 40 * GIB
    assert head.num_blocks == 40 * GIB // head.bytes_per_block < plain.num_blocks


@pytest.mark.parametrize("method,layers,passes,field", [("ngram", 1, 3, "speculative.method"),
                                                        ("eagle", 0, 3, "speculative.draft_layers"),
                                                        ("mtp", True, 3, "speculative.draft_layers"),
                                                        ("eagle", 1, 0, "speculative.num_speculative_tokens"),
                                                        ("eagle3", 1, 2.0, "speculative.num_speculative_tokens")])
def test_a_head_needs_a_head_method_layers_and_passes(method, layers, passes, field):
    with pytest.raises(ConfigError) as err:
        DraftHead(method, layers, passes)
    assert err.value.field == field


def test_the_speculative_methods_have_one_home():
    # sim/core/config.py lists the methods; the scenario layer, the golden-case loader and
    # the draft head read that list, and the head's per-method table covers exactly the
    # methods with a head.
    import ast
    from pathlib import Path

    from kvtwin.sim.core.config import HEAD_METHODS, SPEC_METHODS
    from kvtwin.sim.planner.draft_head import INPUT_PROJECTION_SQUARES

    assert set(HEAD_METHODS) < set(SPEC_METHODS) and "ngram" not in HEAD_METHODS
    assert tuple(INPUT_PROJECTION_SQUARES) == HEAD_METHODS
    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "sim").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and all(isinstance(e, ast.Constant) for e in node.elts):
                values = {e.value for e in node.elts}
                # A second literal list of the methods anywhere in sim/ is a second home.
                if {"eagle", "eagle3"} <= values and path.name != "config.py":
                    raise AssertionError(f"{path.relative_to(root)}:{node.lineno} lists the methods again")
