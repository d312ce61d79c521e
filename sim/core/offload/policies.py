"""Replacement policies of the CPU offloading tier: which resident chunk to drop next.

Reproduces vLLM 0.33's ``vllm/v1/kv_offload/cpu/policies`` with the same observable
decisions, one module per file of vLLM's: ``cache_policy.py`` the interface (vLLM's
``base.py``), ``lru_policy.py`` the LRU (``lru.py``), ``arc_policy.py`` the ARC
(``arc.py``), and this module the table of policies by name (``factory.py``).
"""

from __future__ import annotations

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.core.offload.arc_policy import ARCCachePolicy
from kvtwin.sim.core.offload.cache_policy import CachePolicy
from kvtwin.sim.core.offload.lru_policy import LRUCachePolicy

POLICIES = ("lru", "arc")
_POLICY_CLASSES: dict[str, type[CachePolicy]] = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    try:
        cls = _POLICY_CLASSES[name]
    except KeyError:
        raise ConfigError("offload.cache_policy", f"one of {', '.join(POLICIES)}", name) from None
    return cls(cache_capacity=capacity)
