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
from kvtwin.sim.scenario.deployment import ROUTER_NAMES

LINKS = ("nvlink", "rdma")
NVLINK_LATENCY_US = 5.0
RDMA_BANDWIDTH_GBPS = 400.0
RDMA_LATENCY_US = 10.0


@dataclass(frozen=True)
class Disaggregation:
    """``prefill_replicas`` P engines and ``decode_replicas`` D engines over ``link``."""

    prefill_replicas: int = 1
    decode_replicas: int = 1
    link: str = "rdma"
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    prefill_router: str = "prefix_aware"
    decode_router: str = "least_loaded"

    def __post_init__(self) -> None:
        for name in ("prefill_replicas", "decode_replicas"):
            value = getattr(self, name)
            require(is_int(value) and value > 0, name, "a positive integer (at least one instance of each role)",
                    value)
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
    def num_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

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
