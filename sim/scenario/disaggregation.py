"""Disaggregated prefill/decode in a scenario: the ``[disaggregation]`` table.

docs/semantics.md#disaggregated-prefill-and-decode for what the replay does with it. A
P/D deployment runs ``prefill_replicas`` engines that only prefill (each request there
with ``max_tokens = 1``) and ``decode_replicas`` engines that read the prompt's KV from
the prefill engine and decode; every replica is one planned engine (its
``tensor_parallel_size`` GPUs), so xPyD uses ``(x + y) * tp`` GPUs.

The KV moves over ``link``:

* ``"nvlink"``: the GPU's peer link (``interconnect_bytes_per_s`` of its preset, per GPU)
  with ``latency_us`` (default ``NVLINK_LATENCY_US``);
* ``"rdma"``: a NIC per GPU of ``bandwidth_gbps`` gigabits per second (default: the GPU
  preset's ``nic_bytes_per_s``, the NIC its vendor's reference system gives each GPU,
  e.g. a 400G ConnectX-7 for H100, H200 and B200 and a 200G ConnectX-6 for A100; for a
  GPU without one, ``RDMA_BANDWIDTH_GBPS``) and ``latency_us`` (default
  ``RDMA_LATENCY_US``).

``bandwidth_gbps`` also overrides NVLink's rate. Each tensor-parallel worker moves its
own share of the KV over its own link, so a read takes one worker's bytes over one
link's bandwidth.

Wide-EP P/D: ``prefill_data_parallel_size`` / ``decode_data_parallel_size`` > 1 make that
side one vLLM DP engine of that many ranks (its ``*_replicas`` then 1), each rank an engine
with its pool planned for the side's DP size, a MoE model's ranks in lockstep per side
(docs/semantics.md#data-parallel-pd-sides; ``sim/replay/pd_sides.py``).

Routers: ``prefill_router`` picks the prefill replica (``prefix_aware`` by default: the
prefix-cache-aware choice of Dynamo's and llm-d's disaggregated routers), and
``decode_router`` the decode replica (``least_loaded`` by default: the decode side is
chosen by load); both are picked when the request arrives, as vLLM's proxy does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtwin.sim.core.config import is_int, is_number
from kvtwin.sim.core.errors import ConfigError, reject_unknown_keys, require
from kvtwin.sim.planner.engine_config import EngineConfig
from kvtwin.sim.planner.hardware import GPUSpec
from kvtwin.sim.planner.models import ModelPreset
from kvtwin.sim.scenario.deployment import ROUTER_NAMES

LINKS = ("nvlink", "rdma")
NVLINK_LATENCY_US = 5.0
RDMA_BANDWIDTH_GBPS = 400.0
RDMA_LATENCY_US = 10.0


@dataclass(frozen=True)
class Disaggregation:
    """``prefill_replicas`` P engines and ``decode_replicas`` D engines over ``link`` (or,
    with a side's DP size above 1, that side's one DP engine of that many ranks)."""

    prefill_replicas: int = 1
    decode_replicas: int = 1
    link: str = "rdma"
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    prefill_router: str = "prefix_aware"
    decode_router: str = "least_loaded"
    # Wide-EP P/D: a side that is one vLLM DP engine of this many ranks (1: its replicas
    # are plain engines). Each side's pool is planned with its own DP size.
    prefill_data_parallel_size: int = 1
    decode_data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_replicas", "decode_replicas"):
            value = getattr(self, name)
            require(is_int(value) and value > 0, name, "a positive integer (at least one instance of each role)",
                    value)
        for role in ("prefill", "decode"):
            name = f"{role}_data_parallel_size"
            value = getattr(self, name)
            require(is_int(value) and value > 0, name, "a positive integer (the side's DP ranks; 1: none)", value)
            # One DP engine per side: several copies of a DP engine are not modelled.
            require(value == 1 or getattr(self, f"{role}_replicas") == 1, f"{role}_replicas",
                    f"1 with {name} > 1 (the side is one DP engine of {value} ranks)",
                    getattr(self, f"{role}_replicas"))
        require(isinstance(self.link, str) and self.link in LINKS, "link", f"one of {', '.join(LINKS)}", self.link)
        if self.bandwidth_gbps is not None:
            require(is_number(self.bandwidth_gbps) and self.bandwidth_gbps > 0, "bandwidth_gbps",
                    "a positive link bandwidth in gigabits per second", self.bandwidth_gbps)
        if self.latency_us is not None:
            require(is_number(self.latency_us) and self.latency_us >= 0, "latency_us",
                    "a non-negative link latency in microseconds", self.latency_us)
        for name in ("prefill_router", "decode_router"):
            value = getattr(self, name)
            require(isinstance(value, str) and value in ROUTER_NAMES, name, f"one of {', '.join(ROUTER_NAMES)}",
                    value)

    @property
    def prefill_engines(self) -> int:
        """The prefill side's engines: its replicas, or its DP engine's ranks."""
        return self.prefill_replicas * self.prefill_data_parallel_size

    @property
    def decode_engines(self) -> int:
        return self.decode_replicas * self.decode_data_parallel_size

    @property
    def has_data_parallel_sides(self) -> bool:
        return self.prefill_data_parallel_size > 1 or self.decode_data_parallel_size > 1

    @property
    def num_replicas(self) -> int:
        """Every engine of the run: both sides' replicas, or DP ranks."""
        return self.prefill_engines + self.decode_engines

    def link_bytes_per_s(self, interconnect_bytes_per_s: float, nic_bytes_per_s: float = 0.0) -> float:
        """One worker's link rate; ``interconnect_bytes_per_s`` is the GPU preset's NVLink
        and ``nic_bytes_per_s`` its NIC (0: none published)."""
        if self.bandwidth_gbps is not None:
            return self.bandwidth_gbps * 1e9 / 8
        if self.link == "rdma":
            return nic_bytes_per_s if nic_bytes_per_s > 0 else RDMA_BANDWIDTH_GBPS * 1e9 / 8
        if not interconnect_bytes_per_s > 0:
            raise ConfigError("disaggregation.link", "rdma, or a GPU with an NVLink rate "
                              "(hardware.interconnect_bytes_per_s) or disaggregation.bandwidth_gbps", self.link)
        return interconnect_bytes_per_s

    @property
    def link_latency_s(self) -> float:
        if self.latency_us is not None:
            return self.latency_us * 1e-6
        return (NVLINK_LATENCY_US if self.link == "nvlink" else RDMA_LATENCY_US) * 1e-6

    def describe(self) -> dict:
        """The summary's static P/D columns."""
        return {"pd_prefill_replicas": self.prefill_replicas, "pd_decode_replicas": self.decode_replicas,
                "pd_link": self.link}


DISAGGREGATION_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Disaggregation))


def disaggregation_from_mapping(table: object, where: str = "disaggregation") -> Disaggregation | None:
    """The ``[disaggregation]`` table (None when absent or empty); errors name its key."""
    if table is None or table == {}:
        return None
    if not isinstance(table, dict):
        raise ConfigError(where, "a table of disaggregation settings", table)
    reject_unknown_keys(table, DISAGGREGATION_KEYS, where=where,
                        expected=f"one of {', '.join(DISAGGREGATION_KEYS)}")
    try:
        return Disaggregation(**table)
    except ConfigError as err:
        raise ConfigError(f"{where}.{err.field}", err.expected, err.got) from None


def require_sides_plannable(disaggregation: Disaggregation | None, model: ModelPreset, gpu: GPUSpec,
                            engine: EngineConfig, where: str | None = None) -> None:
    """A side's DP ranks (docs/semantics.md#data-parallel-pd-sides) mean a MoE model's DP
    engine: a dense model's DP ranks are independent engines, which the side's replicas
    already are. Each side's engine, with its DP size, must resolve (expert parallelism
    and EPLB split the experts over that side's GPUs); the error names the side's key."""
    if disaggregation is None:
        return
    for role in ("prefill", "decode"):
        name = f"{role}_data_parallel_size"
        size = getattr(disaggregation, name)
        if size == 1:
            continue
        field = f"disaggregation.{name}"
        if not model.num_experts:
            raise ConfigError(field, f"1 for dense {model.name} (its DP ranks are independent engines: set "
                              f"disaggregation.{role}_replicas instead)", size, source=where)
        try:
            dataclasses.replace(engine, data_parallel_size=size).resolve(model, gpu)
        except ConfigError as err:
            raise ConfigError(field, f"a size {model.name}'s engine resolves with ({err.field}: expected "
                              f"{err.expected})", size, source=where) from None