"""The four layouts vLLM 0.33's own planner produced (tests/planner/golden, copied from
the vLLM oracle's planner outputs): the documented command must reproduce each of them, field by
field, for every max_model_len the file holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.json"))
MODEL_NAMES = {"Llama-3.1-8B": "llama-3.1-8b", "Gemma-3-27B": "gemma-3-27b", "gpt-oss-20b": "gpt-oss-20b"}
GROUP_FIELDS = ("kind", "num_layers", "num_padding_layers", "block_size", "page_bytes", "unpadded_page_bytes",
                "layer_indices", "sliding_window", "attention_chunk_size", "compute_only_sliding_window",
                "num_kv_heads", "head_size", "head_size_v")


def _cases():
    for path in GOLDEN_FILES:
        golden = json.loads(path.read_text())
        for length in golden["max_model_len_values"]:
            yield pytest.param(golden, length, id=f"{path.stem}-{length}")


def test_all_four_golden_files_are_here():
    assert len(GOLDEN_FILES) == 4


def _command(golden: dict, length: int, *, batched: int | None = None, asynchronous: bool | None = None) -> list:
    args = ["--model", MODEL_NAMES[golden["model"]], "--gpu", "h200",
            "--kv-cache-memory-bytes", golden["kv_cache_memory_bytes"], "--max-model-len", length,
            "--max-num-batched-tokens", batched or golden["max_num_batched_tokens"],
            "--max-num-seqs", golden["max_num_seqs"],
            "--async-scheduling" if (asynchronous if asynchronous is not None else golden["async_scheduling"])
            else "--no-async-scheduling", "--json"]
    if not golden["is_vllm_default_hybrid_setting"]:
        args.append("--hybrid-kv-cache" if golden["hybrid_kv_cache_manager"] else "--no-hybrid-kv-cache")
    return args


@pytest.mark.parametrize("golden,length", list(_cases()))
def test_plan_reproduces_vllm_layout(run_plan, golden, length):
    ours = run_plan(*_command(golden, length)).json()
    key = str(length)
    assert ours["num_blocks"] == golden["num_blocks"]
    assert ours["bytes_per_block"] == golden["bytes_per_block"]
    assert ours["block_size"] == golden["block_size"]
    assert ours["hybrid_kv_cache_manager"] == golden["hybrid_kv_cache_manager"]
    assert ours["kv_cache_tokens"] == golden["kv_cache_tokens"][key]
    assert ours["max_concurrency"] == golden[f"max_concurrency_{length}"]
    if golden["blocks_per_request"][key] is not None:
        assert ours["blocks_per_request"] == golden["blocks_per_request"][key]
    assert ours["num_groups"] == golden["num_groups"] == len(ours["groups"])
    for mine, theirs in zip(ours["groups"], golden["groups"], strict=True):
        assert mine["group_id"] == theirs["group_id"]
        for field in GROUP_FIELDS:
            assert mine.get(field) == theirs.get(field), (theirs["group_id"], field)
        if theirs["blocks_per_request"][key] is not None:
            assert mine["blocks_per_request"] == theirs["blocks_per_request"][key]
    assert ours["waste"]["vllm_padding_warnings"] == golden["vllm_padding_warnings"]
    error = golden["startup_errors"].get(key)
    assert ours["fits"] is (error is None)
    if error is not None:
        assert ours["estimated_max_model_len"] == error["estimated_max_model_len"]


def _sensitivity_cases():
    for path in GOLDEN_FILES:
        golden = json.loads(path.read_text())
        for entry in golden["sensitivity_other_batching"]:
            for length in golden["max_model_len_values"]:
                tag = f"{entry['max_num_batched_tokens']}-{'async' if entry['async_scheduling'] else 'sync'}"
                yield pytest.param(golden, entry, length, id=f"{path.stem}-{tag}-{length}")


@pytest.mark.parametrize("golden,entry,length", list(_sensitivity_cases()))
def test_batching_sensitivity_matches_vllm(run_plan, golden, entry, length):
    """Async scheduling doubles the in-flight tokens of the sliding-window admission cap:
    8192 tokens async plans exactly like 16384 tokens sync, as vLLM's planner did."""
    ours = run_plan(*_command(golden, length, batched=entry["max_num_batched_tokens"],
                              asynchronous=entry["async_scheduling"])).json()
    assert ours["max_in_flight_tokens"] == entry["max_in_flight_tokens"]
    assert ours["blocks_per_request"] == entry[f"blocks_per_request_{length}"]
    assert ours["kv_cache_tokens"] == entry[f"kv_cache_tokens_{length}"]
    assert ours["max_concurrency"] == entry[f"max_concurrency_{length}"]
