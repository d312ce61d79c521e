"""Pipeline-parallel KV cache plans against vLLM 0.33's own planning code
(tests/planner/golden_pp, made by scripts/oracle/gen_pp_plan_golden.py): each stage's
layers, the bytes one block costs on it, the blocks its own memory gives, and the engine's
``num_blocks`` (the fewest of all stages, docs/semantics.md#parallel-layouts), field by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN = sorted((Path(__file__).parent / "golden_pp").glob("*.json"))


def test_the_golden_cases_are_here():
    names = {p.stem for p in GOLDEN}
    assert {"llama-3.1-8b__pp2", "llama-3.1-8b__pp4", "gpt-oss-20b__pp2", "gemma-3-27b__pp2"} <= names
    # At least one case where the stages' own counts differ, so the minimum is exercised.
    assert any(len({s["num_blocks_alone"] for s in json.loads(p.read_text())["stages"]}) > 1 for p in GOLDEN)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_pipeline_stages_match_vllm(run_plan, path):
    golden = json.loads(path.read_text())
    ours = run_plan("--model", golden["model"], "--gpu", "h200", "--tp", golden["tensor_parallel_size"],
                    "--pipeline-parallel-size", golden["pipeline_parallel_size"],
                    "--kv-cache-memory-bytes", golden["kv_cache_memory_bytes"],
                    "--max-model-len", golden["max_model_len"],
                    "--max-num-batched-tokens", golden["max_num_batched_tokens"],
                    "--max-num-seqs", golden["max_num_seqs"], "--no-async-scheduling",
                    "--block-size", golden["block_size"], "--json").json()
    assert ours["pipeline_parallel_size"] == golden["pipeline_parallel_size"]
    assert ours["num_gpus"] == golden["pipeline_parallel_size"] * golden["tensor_parallel_size"]
    assert ours["num_groups"] == golden["num_groups"]
    assert [g["layer_indices"] for g in ours["groups"]] == golden["global_groups_layer_indices"]
    assert len(ours["pipeline_stages"]) == len(golden["stages"])
    for mine, theirs in zip(ours["pipeline_stages"], golden["stages"], strict=True):
        for field in ("stage", "layer_start", "layer_end", "cached_layer_indices", "bytes_per_block"):
            assert mine[field] == theirs[field], (theirs["stage"], field)
        assert mine["num_blocks"] == theirs["num_blocks_alone"], theirs["stage"]
        # vLLM lowers every worker to the smallest count: the engine's.
        assert theirs["num_blocks"] == golden["num_blocks"]
    assert ours["num_blocks"] == golden["num_blocks"]
    assert ours["pipeline_stages"][ours["limiting_stage"]]["num_blocks"] == golden["num_blocks"]
    assert ours["kv_cache_tokens"] == golden["kv_cache_tokens"]
    assert ours["max_concurrency"] == golden["max_concurrency"]
