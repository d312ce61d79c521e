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

    def __post_init__(self) -> None:
        require(is_int(self.replicas) and self.replicas > 0, "replicas", "a positive integer", self.replicas)
        require(isinstance(self.router, str) and self.router in ROUTER_NAMES, "router",
                f"one of {', '.join(ROUTER_NAMES)}", self.router)
