"""The simulator's own memory: what the block pools of a replay take on the machine running
it, estimated before any pool is built.

A replay holds one Python object per KV block of every replica's pool (``BlockPool``
makes them all up front), and each block, once cached, a hash and an entry in the pool's
hash map. So a plan of many blocks, or many replicas of one, can need more memory than the
machine has: ``kv_cache_memory_bytes = 1e20`` or ``replicas = 100000`` would build pools
for minutes and then fail, or swap. ``require_host_memory`` refuses such a run at once,
saying how much it would need and how much there is.

The two constants are measured, not derived: ``python bench/bench_sim_memory.py`` measures
them with ``tracemalloc`` (a pool with every block cached, and whole replays with many
replicas of a small pool), and ``tests/planner/test_host_memory.py`` checks that they
still cover the measurement, with a margin, on the core that runs (the interpreted one,
which boxes each block's id in an int object, is the larger).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtwin.sim.core.errors import ConfigError

# One KV block with its hash cached: the KVCacheBlock, its slot in the pool's list, its id,
# its hash and its hash-map entry. Measured: 224 bytes interpreted (136 as built, before
# any block is cached), 200 compiled (112); sha256 hashes (32-byte digests) add 30.
BYTES_PER_BLOCK = 280
# One replica beyond its blocks: its engine, scheduler, KV cache manager, cost model,
# executor and its share of the recorder. Measured: 16.5 KB interpreted, 9.6 KB compiled.
BYTES_PER_REPLICA = 32 * 1024
GIB = 1 << 30


@dataclass(frozen=True)
class HostMemoryEstimate:
    """What a replay's pools need (``needed_bytes``) against what the machine has free
    (``available_bytes``; None when it cannot tell, and then nothing is refused)."""

    num_blocks: int
    num_replicas: int
    needed_bytes: int
    available_bytes: int | None

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.needed_bytes <= self.available_bytes

    def describe(self) -> str:
        available = "an unknown amount" if self.available_bytes is None else _gib(self.available_bytes)
        return (f"{self.num_replicas:,} replica{'s' if self.num_replicas != 1 else ''} x {self.num_blocks:,} KV blocks "
                f"need about {_gib(self.needed_bytes)} of this machine's memory to simulate, {available} is "
                "available")


def _gib(num_bytes: int) -> str:
    if num_bytes < GIB:
        return f"{num_bytes / 2**20:,.0f} MiB"
    return f"{num_bytes / GIB:,.1f} GiB"


def simulator_bytes(num_blocks: int, num_replicas: int) -> int:
    """The memory ``num_replicas`` pools of ``num_blocks`` blocks each take, every block
    cached (the most a replay's pools hold)."""
    return num_replicas * (num_blocks * BYTES_PER_BLOCK + BYTES_PER_REPLICA)


def available_memory_bytes() -> int | None:
    """Memory the machine can give a new allocation without swapping: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else the free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_bytes = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None


def estimate_host_memory(num_blocks: int, num_replicas: int,
                         available_bytes: int | None = None) -> HostMemoryEstimate:
    """The estimate for ``num_replicas`` pools of ``num_blocks``, against
    ``available_bytes`` (default: what the machine has free now)."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    return HostMemoryEstimate(num_blocks, num_replicas, simulator_bytes(num_blocks, num_replicas), available)


def require_host_memory(num_blocks: int, num_replicas: int, *, field: str, got: object, source: str | None = None,
                        available_bytes: int | None = None) -> HostMemoryEstimate:
    """The estimate, or a ``ConfigError`` naming ``field`` (the setting to change) when the
    pools would not fit in the machine's memory."""
    estimate = estimate_host_memory(num_blocks, num_replicas, available_bytes)
    if not estimate.fits:
        raise ConfigError(field, f"a deployment whose KV block pools fit in memory: {estimate.describe()} (use fewer "
                          "replicas, a smaller kv_cache_memory_bytes or gpu_memory_utilization)", got, source=source)
    return estimate
