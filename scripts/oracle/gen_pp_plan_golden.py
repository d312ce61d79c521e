"""Golden pipeline-parallel KV cache plans from vLLM 0.33's own planning code.

For each case the harness builds, per pipeline stage, the KV cache specs one worker of that
stage reports (its layers from vLLM's ``get_pp_indices``, one spec per attention layer as
the model's attention modules build them: KV heads per TP rank, head size, bf16), gives
every worker the same available memory (``kv_cache_memory_bytes``, which is what each
worker's profile returns when that option is set) and calls what
``EngineCore._initialize_kv_caches`` calls: ``get_global_kv_cache_groups`` (grouping of the
merged specs), ``get_kv_cache_configs`` (per-worker projection, per-worker ``num_blocks``,
then the smallest of them on every worker) and ``generate_scheduler_kv_cache_config``. To
see each worker's own block count before vLLM lowers it to the smallest, it also records
what ``get_kv_cache_configs`` computes per worker before the minimum (the same function
called with that one worker's specs).

Writes ``tests/planner/golden_pp/<case>.json``; ``tests/planner/test_pp_golden.py`` checks
``kvtwin plan --pipeline-parallel-size`` against them field by field.

    PYTHONWARNINGS=ignore ~/.cache/kvtwin-oracle-venv/bin/python scripts/oracle/gen_pp_plan_golden.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_common import REPO, prepare_environment, tiny_model_dir, write_json  # noqa: E402

_CACHE = prepare_environment("kvtwin-pp-plan-oracle")
# The stand-in config says 8192 positions; the layouts here need longer requests (no
# positions are ever computed).
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.utils import get_pp_indices  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_capacity  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

OUT = os.path.join(REPO, "tests", "planner", "golden_pp")
GIB = 1 << 30

# name -> the model's attention layers as one TP=1 worker sees them. ``pattern``: one letter
# per layer, repeated (F full attention, S sliding window).
MODELS = {
    "llama-3.1-8b": dict(num_layers=32, pattern="F", kv_heads=8, head_size=128, window=None),
    "gpt-oss-20b": dict(num_layers=24, pattern="SF", kv_heads=8, head_size=64, window=128),
    "gemma-3-27b": dict(num_layers=62, pattern="SSSSSF", kv_heads=16, head_size=128, window=1024),
}

# (case name, model, pipeline_parallel_size, kv_cache_memory_bytes, max_model_len)
CASES = [
    ("llama-3.1-8b__pp2", "llama-3.1-8b", 2, 40 * GIB, 32768),
    ("llama-3.1-8b__pp4", "llama-3.1-8b", 4, 40 * GIB, 131072),
    ("llama-3.1-8b__pp3", "llama-3.1-8b", 3, 20 * GIB, 32768),  # 32 layers over 3: an uneven split
    ("gpt-oss-20b__pp2", "gpt-oss-20b", 2, 40 * GIB, 131072),
    ("gpt-oss-20b__pp3", "gpt-oss-20b", 3, 8 * GIB, 32768),
    ("gemma-3-27b__pp2", "gemma-3-27b", 2, 40 * GIB, 32768),
    ("gemma-3-27b__pp4", "gemma-3-27b", 4, 40 * GIB, 131072),
]
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 1024


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def layer_spec(model: dict, i: int):
    letter = model["pattern"][i % len(model["pattern"])]
    common = dict(block_size=BLOCK_SIZE, num_kv_heads=model["kv_heads"], head_size=model["head_size"],
                  dtype=torch.bfloat16)
    if letter == "S":
        return SlidingWindowSpec(**common, sliding_window=model["window"])
    return FullAttentionSpec(**common)


def worker_specs(model: dict, pp: int) -> tuple[list[dict], list[tuple[int, int]]]:
    specs, ranges = [], []
    for rank in range(pp):
        start, end = get_pp_indices(model["num_layers"], rank, pp)
        ranges.append((start, end))
        specs.append({layer_name(i): layer_spec(model, i) for i in range(start, end)})
    return specs, ranges


def make_config(max_model_len: int, pp: int) -> VllmConfig:
    model_config = ModelConfig(model=tiny_model_dir(_CACHE), skip_tokenizer_init=True, max_model_len=max_model_len,
                               dtype="bfloat16")
    scheduler_config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                       max_model_len=max_model_len, async_scheduling=False, is_encoder_decoder=False)
    # The engine's own parallel config: its pipeline stages set the batches in flight
    # (max_concurrent_batches), which the sliding-window groups' per-request worst case and
    # so the capacity figures count.
    config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=BLOCK_SIZE),
                        scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"),
                        parallel_config=ParallelConfig(pipeline_parallel_size=pp))
    assert config.max_concurrent_batches == pp, config.max_concurrent_batches
    # As on a GPU: vLLM turns the hybrid KV cache manager off only because the CPU platform
    # lacks it (VllmConfig.__post_init__), and these are the layouts a GPU gets.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # The layout the existing planner goldens were made with (FlashAttention on Hopper).
    config.cache_config.kv_cache_layout = "LBNHC"
    return config


def run_case(name: str, model_name: str, pp: int, memory: int, max_model_len: int) -> dict:
    model = MODELS[model_name]
    specs, ranges = worker_specs(model, pp)
    config = make_config(max_model_len, pp)
    groups = get_global_kv_cache_groups(config, specs)
    # Each worker alone: the block count its own memory gives, before vLLM takes the smallest.
    own = []
    for rank in range(pp):
        alone = get_kv_cache_configs(config, [specs[rank]], [memory], groups)[0]
        own.append(alone.num_blocks)
    configs = get_kv_cache_configs(config, specs, [memory] * pp, groups)
    scheduler = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(config, scheduler)
    stages = []
    for rank, (cfg, (start, end)) in enumerate(zip(configs, ranges)):
        cached = sorted(int(n.split(".")[2]) for g in cfg.kv_cache_groups for n in g.layer_names)
        stages.append({"stage": rank, "layer_start": start, "layer_end": end, "cached_layer_indices": cached,
                       "num_blocks_alone": own[rank], "num_blocks": cfg.num_blocks,
                       "bytes_per_block": own_bytes_per_block(cfg),
                       "groups_layer_indices": [[int(n.split(".")[2]) for n in g.layer_names]
                                                for g in cfg.kv_cache_groups]})
    return {
        "case": name, "model": model_name, "vllm_version": vllm.__version__, "pipeline_parallel_size": pp,
        "tensor_parallel_size": 1, "kv_cache_memory_bytes": memory, "max_model_len": max_model_len,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_num_seqs": MAX_NUM_SEQS, "async_scheduling": False,
        "block_size": BLOCK_SIZE, "kv_cache_layout": "LBNHC",
        "num_groups": len(groups),
        "global_groups_layer_indices": [[int(n.split(".")[2]) for n in g.layer_names] for g in groups],
        "num_blocks": scheduler.num_blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency,
        "stages": stages,
        "made_by": "scripts/oracle/gen_pp_plan_golden.py: vLLM's get_pp_indices, get_global_kv_cache_groups, "
                   "get_kv_cache_configs, generate_scheduler_kv_cache_config, get_kv_cache_capacity",
    }


def own_bytes_per_block(cfg) -> int:
    """The bytes one block takes on this worker: its one backing tensor's size per block."""
    sizes = {t.size for t in cfg.kv_cache_tensors}
    assert len(sizes) == 1, sizes
    return sizes.pop() // cfg.num_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        golden = run_case(*case)
        write_json(os.path.join(args.out, f"{golden['case']}.json"), golden)
        print(golden["case"], "num_blocks", golden["num_blocks"],
              [(s["layer_start"], s["layer_end"], s["num_blocks_alone"], s["bytes_per_block"])
               for s in golden["stages"]])


if __name__ == "__main__":
    main()
