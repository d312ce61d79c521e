"""How many copies of the planned engine serve the workload, and what routes between them.

The planner sizes one engine (one replica: ``tensor_parallel_size`` GPUs); the replay runs
``replicas`` identical ones behind the router named here. A scenario sets both in its
``[engine]`` table (``replicas``, ``router``), beside the engine's own knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtwin.sim.core.errors import require
from kvtwin.sim.core.config import is_int

# The routers the replay has (``kvtwin.sim.replay.router`` maps each name to its class).
ROUTER_NAMES = ("round_robin", "least_loaded", "session_affinity", "prefix_aware", "dp_lb")


@dataclass(frozen=True)
class Deployment:
    """Data parallelism in the replay: ``replicas`` identical engines behind ``router``."""

    replicas: int = 1
    router: str = "round_robin"
    # With data_parallel_size > 1: what picks each request's DP rank, "vllm" (vLLM's own
    # balancer, the dp_lb router) or a router that names ranks, as an external router does
    # (docs/semantics.md#data-parallel-lockstep).
    dp_rank_routing: str = "vllm"

    def __post_init__(self) -> None:
        require(is_int(self.replicas) and self.replicas > 0, "replicas", "a positive integer", self.replicas)
        require(isinstance(self.router, str) and self.router in ROUTER_NAMES, "router",
                f"one of {', '.join(ROUTER_NAMES)}", self.router)
        require(isinstance(self.dp_rank_routing, str) and self.dp_rank_routing in ("vllm", *ROUTER_NAMES),
                "dp_rank_routing", f"vllm or one of {', '.join(ROUTER_NAMES)}", self.dp_rank_routing)

    @property
    def dp_router(self) -> str:
        """The router in front of a data-parallel engine's ranks."""
        return "dp_lb" if self.dp_rank_routing == "vllm" else self.dp_rank_routing
