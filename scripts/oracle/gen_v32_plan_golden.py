"""Golden DeepSeek-V3.2 KV cache plans from vLLM 0.33's own planning code.

DeepSeek-V3.2 caches two things per decoder layer (vLLM 0.33
``model_executor/models/deepseek_v2.py``): the sparse-MLA latent
(``MLAAttention.get_kv_cache_spec``, ``model_executor/layers/attention/mla_attention.py``
l.1371-1400: one "head" of kv_lora_rank + qk_rope_head_dim = 576, bf16 unless the KV cache
dtype is quantised, then the 656-byte ``fp8_ds_mla`` record) and the sparse-attention
indexer's keys (``DeepseekV32IndexerCache.get_kv_cache_spec``, l.658-666: an
``MLAAttentionSpec`` with ``cache_role=INDEXER``, head size index_head_dim + index_head_dim /
128 * 4 = 132, uint8, l.731-736). The harness builds those specs for one worker (every
tensor-parallel or data-parallel-attention rank holds the same: ``max_tp_shards=1``), lets
the backends adjust them as the worker does (``customize_attention_spec``,
``v1/worker/utils.py``: FlashAttention-MLA-sparse for a bf16 cache on Hopper,
FlashMLA-sparse for fp8_ds_mla, the V3.2 indexer backend), resolves the layout from the
backends' declarations (``resolve_kv_cache_layout``), and calls what
``EngineCore._initialize_kv_caches`` calls: ``get_global_kv_cache_groups``,
``get_kv_cache_configs``, ``generate_scheduler_kv_cache_config`` and
``get_kv_cache_capacity``.

The block size is the one vLLM's platform picks for these backends
(``Platform._preferred_block_size_for_backends``): the indexer takes exactly 64 on CUDA,
the sparse MLA backends multiples of 64, so 64.

Writes ``tests/planner/golden_v32/<case>.json``; ``tests/planner/test_v32_golden.py`` checks
``kvtwin plan --model deepseek-v3.2`` against them.

    PYTHONWARNINGS=ignore ~/.cache/kvtwin-oracle-venv/bin/python scripts/oracle/gen_v32_plan_golden.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_common import REPO, prepare_environment, tiny_model_dir, write_json  # noqa: E402

_CACHE = prepare_environment("kvtwin-v32-plan-oracle")
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend  # noqa: E402
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_capacity  # noqa: E402
from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, SparseCacheRole, UniformTypeKVCacheSpecs  # noqa: E402
from vllm.v1.kv_cache_interface import get_kv_quant_mode  # noqa: E402
from vllm.v1.worker.utils import customize_attention_spec  # noqa: E402

OUT = os.path.join(REPO, "tests", "planner", "golden_v32")
GIB = 1 << 30

# DeepSeek-V3.2-Exp's config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64,
# index_head_dim 128, index_topk 2048.
NUM_LAYERS = 61
MLA_HEAD_SIZE = 512 + 64
INDEX_HEAD_DIM = 128
INDEX_QUANT_BLOCK = 128  # Indexer.quant_block_size: one fp32 scale per 128 fp8 values
BLOCK_SIZE = 64
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 1024

# (case name, kvtwin's parallel flags, the engine's kv_cache_dtype, kv_cache_memory_bytes, max_model_len)
CASES = [
    ("deepseek-v3.2__tp8_bf16_40g", dict(tensor_parallel_size=8), "auto", 40 * GIB, 131072),
    ("deepseek-v3.2__tp8_bf16_60g", dict(tensor_parallel_size=8), "auto", 60 * GIB, 32768),
    ("deepseek-v3.2__tp8_fp8_40g", dict(tensor_parallel_size=8), "fp8", 40 * GIB, 163840),
    ("deepseek-v3.2__dp8_ep_fp8_20g", dict(data_parallel_size=8, enable_expert_parallel=True), "fp8", 20 * GIB,
     65536),
]


class FlashAttnMLASparseStandIn:
    """What ``FlashAttnMLASparseBackend`` (v1/attention/backends/mla/flashattn_mla_sparse.py
    l.50-55) says about the cache: kernel blocks of any multiple of 64, blocks whole rows
    apart, no layout of its own. Its module needs the CUDA flash-attention extensions, which
    the CPU oracle venv lacks, so these three answers stand in for it."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(64)]

    @classmethod
    def customize_spec(cls, spec):
        return align_blocks_to_rows(spec)

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None


def mla_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def worker_specs(kv_cache_dtype: str) -> tuple[dict, list]:
    """One worker's specs, as the layers build them and the backends adjust them."""
    if kv_cache_dtype == "auto":
        mla_backend, cache_dtype_str, dtype, content = FlashAttnMLASparseStandIn, "auto", torch.bfloat16, None
    else:
        # _canonicalize_sparse_mla_kv_cache_dtype: any quantised dtype on FlashMLA-sparse is
        # served as fp8_ds_mla, whose record is 656 bytes (mla_attention.py l.1384-1389).
        mla_backend, cache_dtype_str, dtype, content = FlashMLASparseBackend, "fp8_ds_mla", torch.uint8, 656
    specs = {}
    for i in range(NUM_LAYERS):
        mla = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1, head_size=MLA_HEAD_SIZE,
                               dtype=dtype, cache_dtype_str=cache_dtype_str,
                               kv_quant_mode=get_kv_quant_mode(cache_dtype_str), state_content_bytes=content,
                               topk_buffer_width=2048, is_index_group_leader=True)
        specs[mla_name(i)] = customize_attention_spec(mla_backend, mla)
        indexer = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, max_tp_shards=1,
                                   head_size=INDEX_HEAD_DIM + INDEX_HEAD_DIM // INDEX_QUANT_BLOCK * 4,
                                   dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
        specs[indexer_name(i)] = customize_attention_spec(DeepseekV32IndexerBackend, indexer)
    return specs, [mla_backend, DeepseekV32IndexerBackend]


def make_config(max_model_len: int, kv_cache_dtype: str) -> VllmConfig:
    model_config = ModelConfig(model=tiny_model_dir(_CACHE), skip_tokenizer_init=True, max_model_len=max_model_len,
                               dtype="bfloat16")
    scheduler_config = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                       max_model_len=max_model_len, async_scheduling=False, is_encoder_decoder=False)
    config = VllmConfig(model_config=model_config,
                        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype=kv_cache_dtype),
                        scheduler_config=scheduler_config, device_config=DeviceConfig(device="cpu"),
                        parallel_config=ParallelConfig())
    # As on a GPU (the CPU platform alone turns the hybrid manager off).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_ref(name: str) -> list:
    """[layer index, "mla" | "indexer"]."""
    return [int(name.split(".")[2]), "indexer" if name.endswith("k_cache") else "mla"]


def run_case(name: str, parallel: dict, kv_cache_dtype: str, memory: int, max_model_len: int) -> dict:
    specs, backends = worker_specs(kv_cache_dtype)
    config = make_config(max_model_len, kv_cache_dtype)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(config, [layouts], specs.values())
    groups = get_global_kv_cache_groups(config, [specs])
    configs = get_kv_cache_configs(config, [specs], [memory], groups)
    scheduler = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(config, scheduler)
    cfg = configs[0]
    group_specs = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        group_specs.append({
            "spec_class": type(spec).__name__,
            "layers": [layer_ref(n) for n in g.layer_names],
            "prefix_cacheable": spec.prefix_cacheable,
            "page_bytes": spec.page_size_bytes,
        })
    mla, indexer = specs[mla_name(0)], specs[indexer_name(0)]
    return {
        "case": name, "model": "deepseek-v3.2", "vllm_version": vllm.__version__, **parallel,
        "kv_cache_dtype": kv_cache_dtype, "kv_cache_memory_bytes": memory, "max_model_len": max_model_len,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_num_seqs": MAX_NUM_SEQS, "async_scheduling": False,
        "block_size": BLOCK_SIZE, "kv_cache_layout": layout.name,
        "mla_cache_dtype_str": mla.cache_dtype_str, "mla_bytes_per_token": mla.state_content_size_bytes,
        "mla_page_bytes": mla.page_size_bytes, "indexer_head_size": indexer.head_size,
        "indexer_bytes_per_token": indexer.state_content_size_bytes, "indexer_page_bytes": indexer.page_size_bytes,
        "num_groups": len(groups), "groups": group_specs,
        "bytes_per_block": own_bytes_per_block(cfg),
        "num_blocks": scheduler.num_blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency,
        "made_by": "scripts/oracle/gen_v32_plan_golden.py: vLLM's customize_attention_spec, "
                   "resolve_kv_cache_layout, get_global_kv_cache_groups, get_kv_cache_configs, "
                   "generate_scheduler_kv_cache_config, get_kv_cache_capacity",
    }


def own_bytes_per_block(cfg) -> int:
    """The bytes one block takes on this worker: the backing tensor's size per block (every
    tensor of the one group aliases the same whole buffer)."""
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
        print(golden["case"], golden["kv_cache_layout"], "groups", golden["num_groups"],
              [g["spec_class"] for g in golden["groups"]], "bytes/block", golden["bytes_per_block"],
              "blocks", golden["num_blocks"], "tokens", golden["kv_cache_tokens"], "conc", golden["max_concurrency"])


if __name__ == "__main__":
    main()
