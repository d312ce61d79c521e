"""The offload tiers of a scenario (``[offload]``): vLLM 0.33's native CPU KV offloading,
and a disk tier below it, sized against a plan.

``OffloadConfig`` is the scenario table (and the ``--offload-*`` flags), checked when it
is built; ``OffloadConfig.resolve(plan)`` turns bytes into chunks the way vLLM's
``CPUOffloadingSpec`` does (``vllm/v1/kv_offload/cpu/spec.py``):

* one CPU chunk holds one offloaded block (``blocks_per_chunk = 1``) of one KV cache
  group, from every tensor-parallel worker: ``worker bytes per block x world size``
  (``plan.bytes_per_block`` is the per-GPU figure), rounded up to the mmap page (4096
  bytes) of the shared host region; ``num_cpu_chunks = cpu_bytes // that``. With MLA and
  tensor parallelism the workers hold the same latent cache and vLLM keeps one copy
  (its "replicated layout"), so the world-size factor is 1 there;
* the disk tier (``disk_bytes``) is counted in the same chunks; it sits below the CPU
  tier (vLLM's tiering backends), so it needs a CPU tier (``cpu_bytes > 0``);
* transfers: a chunk is moved by every worker over its own PCIe link at once, so a load
  of ``k`` chunks takes ``k x bytes_per_key / h2d_bytes_per_s`` with
  ``bytes_per_key = worker bytes per block x copies`` (unrounded) and the link rate
  ``GPUSpec.pcie_h2d_bytes_per_s x copies`` (stores likewise on the device-to-host
  link); that is, each worker's share over one GPU's link. The disk tier's jobs take
  ``disk_latency_s + bytes / disk_bandwidth_bytes_per_s`` on one queue per replica.

Each data-parallel replica (``engine.replicas``) has its own tiers of these sizes, as
each vLLM instance has its own ``--kv-offloading-size``. Both schedulers offload: the
synchronous one and vLLM's default asynchronous one (two batches in flight).
``cpu_bytes = 0`` (the default) is no offloading at all: the run is exactly the one
without an ``[offload]`` table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.core.config import BYTE_FORMS, byte_count, byte_rate, is_number
from kvtwin.sim.core.errors import ConfigError, config_from_table, require

OFFLOAD_POLICIES = ("lru", "arc")
DEFAULT_DISK_LATENCY_S = 1e-4
# vLLM rounds a CPU chunk up to the page of its shared mmap region (``mmap.PAGESIZE``).
CPU_CHUNK_ALIGNMENT_BYTES = 4096
BLOCKS_PER_CHUNK = 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """The ``[offload]`` table. ``cpu_bytes = 0``: no offloading."""

    cpu_bytes: int = 0
    policy: str = "lru"
    disk_bytes: int = 0
    disk_bandwidth_bytes_per_s: float | None = None
    disk_latency_s: float = DEFAULT_DISK_LATENCY_S

    def __post_init__(self) -> None:
        # Byte sizes in any of their forms (1TB, 1e12), one spelling after: an int.
        object.__setattr__(self, "cpu_bytes", byte_count(
            self.cpu_bytes, "cpu_bytes", f"a non-negative number of bytes of host memory, 0 = no offloading "
            f"({BYTE_FORMS})"))
        require(isinstance(self.policy, str) and self.policy in OFFLOAD_POLICIES, "policy",
                f"one of {', '.join(OFFLOAD_POLICIES)}", self.policy)
        object.__setattr__(self, "disk_bytes", byte_count(
            self.disk_bytes, "disk_bytes", f"a non-negative number of bytes of disk, 0 = no disk tier ({BYTE_FORMS})"))
        if self.disk_bandwidth_bytes_per_s is not None:
            object.__setattr__(self, "disk_bandwidth_bytes_per_s", byte_rate(
                self.disk_bandwidth_bytes_per_s, "disk_bandwidth_bytes_per_s",
                "a positive number of bytes per second (2e9, or with a unit: 2GB/s)", positive=True))
        require(is_number(self.disk_latency_s) and self.disk_latency_s >= 0, "disk_latency_s",
                "a non-negative number of seconds", self.disk_latency_s)
        if self.disk_bytes > 0:
            require(self.cpu_bytes > 0, "disk_bytes",
                    "0 unless cpu_bytes > 0 (the disk tier sits below the CPU tier, as in vLLM's tiering)",
                    self.disk_bytes)
            require(self.disk_bandwidth_bytes_per_s is not None, "disk_bandwidth_bytes_per_s",
                    "a positive number of bytes per second when disk_bytes > 0")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0

    def resolve(self, plan) -> ResolvedOffload | None:
        """Chunks and transfer rates for ``plan`` (None when offloading is off)."""
        if not self.enabled:
            return None
        eng = plan.engine
        # Outside align mode a Mamba group hashes at the scheduler's whole-sequence block,
        # which no attention block divides: vLLM 0.33's offloading config asserts and asks for
        # --enable-prefix-caching. A scenario is refused when it is resolved (the table of
        # features, docs/architecture.md#features-and-their-combinations).
        assert "mamba" not in plan.model.layer_kinds or eng.mamba_cache_mode == "align", \
            "offloading a hybrid Mamba model needs prefix caching on"
        tp = eng.tensor_parallel_size
        copies = 1 if plan.model.uses_mla and tp > 1 else tp
        worker_bytes = plan.bytes_per_block * BLOCKS_PER_CHUNK
        kv_bytes_per_chunk = worker_bytes * copies
        chunk_bytes = _round_up(kv_bytes_per_chunk, CPU_CHUNK_ALIGNMENT_BYTES)
        num_cpu_chunks = self.cpu_bytes // chunk_bytes
        if num_cpu_chunks == 0:
            raise ConfigError("offload.cpu_bytes", f"at least one CPU chunk: {chunk_bytes:,} bytes for "
                              f"{plan.model.name} at tensor parallel {tp}", self.cpu_bytes)
        num_disk_chunks = self.disk_bytes // chunk_bytes
        if self.disk_bytes and num_disk_chunks == 0:
            raise ConfigError("offload.disk_bytes", f"0 or at least one chunk: {chunk_bytes:,} bytes", self.disk_bytes)
        gpu = plan.gpu
        for name in ("pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s"):
            if not getattr(gpu, name) > 0:
                raise ConfigError(f"hardware.{name}", f"a positive PCIe bandwidth for {gpu.name} (offloading "
                                  "moves KV over it)", getattr(gpu, name))
        return ResolvedOffload(
            config=self, chunk_bytes=chunk_bytes, kv_bytes_per_chunk=kv_bytes_per_chunk, copies=copies,
            num_cpu_chunks=num_cpu_chunks, num_disk_chunks=num_disk_chunks,
            h2d_bytes_per_s=gpu.pcie_h2d_bytes_per_s * copies, d2h_bytes_per_s=gpu.pcie_d2h_bytes_per_s * copies)


@dataclass(frozen=True, kw_only=True)
class ResolvedOffload:
    """An ``OffloadConfig`` sized for one plan (per replica)."""

    config: OffloadConfig
    chunk_bytes: int  # host bytes of one chunk (page-aligned)
    kv_bytes_per_chunk: int  # KV bytes one chunk moves, over every worker (unaligned)
    copies: int  # workers that each hold their own share (tensor parallel size; 1 with MLA)
    num_cpu_chunks: int
    num_disk_chunks: int
    h2d_bytes_per_s: float  # every worker's link together
    d2h_bytes_per_s: float

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def bytes_per_key(self) -> int:
        return self.kv_bytes_per_chunk

    @property
    def has_disk(self) -> bool:
        return self.num_disk_chunks > 0

    def describe(self) -> dict:
        """The summary's static offload columns."""
        return {"offload_policy": self.policy, "offload_cpu_bytes": self.config.cpu_bytes,
                "offload_cpu_chunks": self.num_cpu_chunks, "offload_chunk_bytes": self.chunk_bytes,
                "offload_disk_bytes": self.config.disk_bytes, "offload_disk_chunks": self.num_disk_chunks}


OFFLOAD_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(OffloadConfig))


def offload_config_from_mapping(entry: object, *, where: str = "offload") -> OffloadConfig:
    """The ``[offload]`` table of a scenario; errors name the table's key."""
    return config_from_table(OffloadConfig, entry, where=where, table_is="a table of offload settings",
                             known=OFFLOAD_KEYS, expected=f"one of {', '.join(OFFLOAD_KEYS)}")
