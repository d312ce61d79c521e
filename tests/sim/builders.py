"""Small constructors shared by the sim tests."""

from __future__ import annotations

from kvtwin.sim.core.config import CacheConfig, SchedulerConfig
from kvtwin.sim.core.engine import EngineCore, Execution
from kvtwin.sim.core.hashing import BlockHasher, TokenPrompt, get_hash_fn
from kvtwin.sim.core.kv_cache_manager import KVCacheManager
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

BS = 16


def full(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size)


def kv_config(*specs: KVCacheSpec, num_blocks: int = 64, hash_block_size: int = 0) -> KVCacheConfig:
    groups = tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(specs or (full(),)))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, hash_block_size=hash_block_size)


def kv_manager(*specs: KVCacheSpec, num_blocks: int = 64, max_model_len: int = 4096, in_flight: int = 256,
               caching: bool = True, watermark: float = 0.0) -> KVCacheManager:
    return KVCacheManager(kv_config(*specs, num_blocks=num_blocks), max_model_len, in_flight,
                          enable_caching=caching, watermark=watermark)


def request(request_id: str, tokens, max_tokens: int = 8, *, hash_block_size: int = BS, priority: int = 0,
            arrival_time: float = 0.0, algo: str = "builtin") -> Request:
    r = Request(request_id, TokenPrompt(list(tokens)), max_tokens, priority=priority, arrival_time=arrival_time)
    r.attach_hasher(BlockHasher(get_hash_fn(algo), hash_block_size))
    return r


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def block_ids(kvm: KVCacheManager, request_id: str, group: int = 0) -> list[int]:
    return kvm.get_block_ids(request_id)[group]


def engine(*specs: KVCacheSpec, num_blocks: int = 64, caching: bool = True, **scheduler_kwargs) -> EngineCore:
    scheduler_kwargs.setdefault("max_model_len", 4096)
    # The synchronous scheduler unless a test asks for the asynchronous one.
    scheduler_kwargs.setdefault("async_scheduling", False)
    return EngineCore(kv_config(*specs, num_blocks=num_blocks), SchedulerConfig(**scheduler_kwargs),
                      CacheConfig(enable_prefix_caching=caching))


class EchoModel:
    """A model executor that samples token 50000 + output index for every request that samples."""

    def execute(self, output):
        return Execution({rid: [50_000 + index] for rid, index in output.num_output_tokens.items()}, 1.0)


def new_request(request_id: str, toks, max_tokens: int = 4, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(request_id, TokenPrompt(list(toks)), max_tokens, priority=priority, arrival_time=arrival_time)
