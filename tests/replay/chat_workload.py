"""The workload several replay tests share: multi-turn chat sessions behind a few shared
system prompts (most of each prompt is the session's history, which routing and offload
tiers can keep), on Llama-3.1-8B / one H100 with 3 GiB of KV cache (about 24k tokens, so
sessions compete for it)."""

from __future__ import annotations

import pyarrow as pa

from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import get_gpu
from kvtwin.sim.planner.models import get_model
from kvtwin.sim.planner.plan import Plan, plan
from kvtwin.traces.synth import synthesize
from kvtwin.traces.synth_spec import parse_spec

KV_BYTES = 3 * 2**30


def chat_trace(num_requests: int) -> pa.Table:
    return synthesize(parse_spec({
        "kind": "chat", "seed": 3, "num_requests": num_requests, "block_tokens": 16,
        "arrival": {"process": "poisson", "rate_per_s": 1.0},
        "shared_prefix": {"count": 4, "tokens": 800, "zipf_s": 1.0},
        "turns": {"dist": "zipf", "s": 1.2, "max": 12},
        "user_tokens": {"dist": "lognormal", "mean": 300, "sigma": 0.5},
        "output_tokens": {"dist": "lognormal", "mean": 100, "sigma": 0.5},
        "turn_gap_s": {"dist": "exponential", "mean": 10}, "max_prompt_tokens": 12000}))


def llama_plan(**engine) -> Plan:
    """The plan, with ``engine`` overriding its EngineConfig fields."""
    settings = {"max_model_len": 16896, "kv_cache_memory_bytes": KV_BYTES, **engine}
    return plan(get_model("llama-3.1-8b"), get_gpu("h100"), EngineConfig(**settings))
