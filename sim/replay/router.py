"""Routers: which data-parallel replica serves an arriving request (``Deployment.router``).

``engine.replicas = N`` runs N engines behind one router in the same SimPy environment
(``sim/replay/clock``). A router sees only what a real one in front of vLLM
replicas sees:

* per replica its *outstanding tokens*: the router's own count of the work it sent there
  and has not seen complete, each request counting ``prompt tokens + max_tokens`` from
  when it is routed until it finishes (or is rejected). This is what a gateway knows
  without asking the engine (llm-d's queue/load scorers, Dynamo's active-block count);
* (``prefix_aware`` only) the block hashes each replica's KV cache holds: its block
  pool's hash map, the state a KV-event subscriber rebuilds from ``BlockStored`` /
  ``BlockRemoved`` events. A freed block that has not been evicted is still cached (it
  is still hittable), as in the events.

Every router breaks ties towards the lowest replica index, so a run is deterministic.

Routers by name (``ROUTERS``, keyed by the scenario's ``ROUTER_NAMES``):

``round_robin``
    Arrival ``i`` goes to replica ``i mod N`` (rejected arrivals count).
``least_loaded``
    The replica with the fewest outstanding tokens.
``session_affinity``
    A session's first request goes to the least loaded replica and the session stays
    there; a request without a session id goes to the least loaded replica.
``prefix_aware``
    For each replica, ``cached_r`` is the number of the prompt's tokens covered by the
    longest prefix of its block hashes cached on that replica (whole blocks of the
    reference KV cache group: the first full-attention group, else group 0), as llm-d's
    precise prefix-cache scorer and Dynamo's KV router compute it from KV events. The
    replica with the lowest cost wins::

        cost_r = PREFILL_WEIGHT * (prompt_tokens - cached_r) + LOAD_WEIGHT * outstanding_r

    with ``PREFILL_WEIGHT = 1.0`` and ``LOAD_WEIGHT = 1.0``: both terms are tokens of work,
    the prefill the request would cost there and what is already queued there (Dynamo's
    default ``overlap_score_weight`` of 1 between new prefill blocks and active blocks).
    A replica that holds more of the prompt wins until the others are lighter by more
    than the difference in the prefill it saves. Without prefix caching every
    ``cached_r`` is 0 and this is ``least_loaded``.

The hashes are computed with the engine's own hasher, lazily: block ``j`` is hashed only
while some replica still matches blocks ``0 .. j-1``, so a request costs its longest
match plus one block (for a trace's hash-id prompts, one ``hash`` of a small tuple per
block). The engine hashes the request again when it is added (the scheduler attaches its
own hash sequence), which for a hash-id prompt is again on demand.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.engine import EngineCore, RequestSnapshot
from kvtwin.sim.core.hashing import HashIdPrompt
from kvtwin.sim.core.request import Request
from kvtwin.sim.core.spec import FullAttentionSpec
from kvtwin.sim.scenario.deployment import ROUTER_NAMES

PREFILL_WEIGHT = 1.0
LOAD_WEIGHT = 1.0


def request_load(request: Request | RequestSnapshot) -> int:
    """The tokens one outstanding request counts for: its prompt and its output budget."""
    return request.num_prompt_tokens + request.max_tokens


class Router:
    """The router protocol and the outstanding-token bookkeeping every router shares.

    ``route`` picks a replica for an arriving request and counts it as outstanding there;
    ``release`` is called when a routed request finishes or is rejected.
    """


    def __init__(self, engines: Sequence[EngineCore]):
        if not engines:
            raise ValueError("a router needs at least one replica")
        self.num_replicas = len(engines)
        self.outstanding = [0] * self.num_replicas
        self.routed = [0] * self.num_replicas

    def choose(self, request: Request, session_id: str | None) -> int:
        raise NotImplementedError

    def route(self, request: Request, session_id: str | None = None) -> int:
        replica = self.choose(request, session_id) if self.num_replicas > 1 else 0
        self.outstanding[replica] += request_load(request)
        self.routed[replica] += 1
        return replica

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        self.outstanding[replica] -= request_load(request)

    def least_loaded(self) -> int:
        outstanding = self.outstanding
        return outstanding.index(min(outstanding))  # index() finds the lowest on a tie


class SingleReplicaRouter(Router):
    """The router of a run with one replica: everything goes there, and nothing needs
    counting (no choice ever reads the outstanding tokens)."""

    def __init__(self) -> None:
        self.num_replicas = 1
        self.outstanding = [0]
        self.routed = [0]

    def route(self, request: Request, session_id: str | None = None) -> int:
        return 0

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        pass


class RoundRobinRouter(Router):
    """``round_robin`` (module docstring)."""

    def __init__(self, engines: Sequence[EngineCore]):
        super().__init__(engines)
        self._next = 0

    def choose(self, request: Request, session_id: str | None) -> int:
        replica = self._next
        self._next = (replica + 1) % self.num_replicas
        return replica


class LeastLoadedRouter(Router):
    """``least_loaded`` (module docstring)."""

    def choose(self, request: Request, session_id: str | None) -> int:
        return self.least_loaded()


class SessionAffinityRouter(Router):
    """``session_affinity`` (module docstring)."""

    def __init__(self, engines: Sequence[EngineCore]):
        super().__init__(engines)
        self.sessions: dict[str, int] = {}

    def choose(self, request: Request, session_id: str | None) -> int:
        if session_id is None:
            return self.least_loaded()
        replica = self.sessions.get(session_id)
        if replica is None:
            replica = self.sessions[session_id] = self.least_loaded()
        return replica


def _reference_group(engine: EngineCore) -> int:
    groups = engine.kv_cache_config.groups
    for gid, group in enumerate(groups):
        if isinstance(group.spec, FullAttentionSpec):
            return gid
    return 0


class PrefixAwareRouter(Router):
    """``prefix_aware`` (module docstring)."""

    def __init__(self, engines: Sequence[EngineCore], *, prefill_weight: float = PREFILL_WEIGHT,
                 load_weight: float = LOAD_WEIGHT):
        super().__init__(engines)
        self.prefill_weight = prefill_weight
        self.load_weight = load_weight
        first = engines[0]
        self.hasher = first.block_hasher  # None without prefix caching
        gid = _reference_group(first)
        config = first.kv_cache_config
        self.group_block_size = config.groups[gid].spec.block_size
        self.factor = self.group_block_size // config.hash_block_size
        # Each replica's hash → block map of the reference group (its KV events' state).
        self.cached = [engine.cached_blocks_by_hash(gid) for engine in engines]

    def cached_tokens(self, request: Request) -> list[int]:
        """Per replica, the prompt tokens its longest cached prefix of whole blocks covers."""
        n = self.num_replicas
        matched = [0] * n
        hasher = self.hasher
        if hasher is None:
            return matched
        prompt = request.prompt
        factor = self.factor
        num_blocks = request.num_prompt_tokens // self.group_block_size
        if isinstance(prompt, HashIdPrompt):
            fine = hasher.new_hashes(prompt)  # on demand, one hash per block asked for

            def key(j: int) -> object:
                return fine[(j + 1) * factor - 1]
        else:
            chain: list = []
            hash_fn, bs = hasher.hash_fn, hasher.hash_block_size

            def key(j: int) -> object:
                stop = (j + 1) * factor
                parent = chain[-1] if chain else hasher.none_hash
                while len(chain) < stop:
                    start = len(chain) * bs
                    parent = hash_fn((parent, prompt.block_identity(start, start + bs, []), None))
                    chain.append(parent)
                return chain[stop - 1]
        alive = list(range(n))
        maps = self.cached
        for j in range(num_blocks):
            block_hash = key(j)
            still = [r for r in alive if block_hash in maps[r]]
            if len(still) != len(alive):
                for r in alive:
                    if r not in still:
                        matched[r] = j
                alive = still
                if not alive:
                    break
        for r in alive:
            matched[r] = num_blocks
        bs = self.group_block_size
        return [m * bs for m in matched]

    def costs(self, request: Request) -> list[float]:
        prompt_tokens = request.num_prompt_tokens
        return [self.prefill_weight * (prompt_tokens - cached) + self.load_weight * load
                for cached, load in zip(self.cached_tokens(request), self.outstanding)]

    def choose(self, request: Request, session_id: str | None) -> int:
        costs = self.costs(request)
        return costs.index(min(costs))


# Each router the scenario may name, in ``ROUTER_NAMES``'s order (the names' one home).
ROUTERS: dict[str, type[Router]] = dict(zip(ROUTER_NAMES, (
    RoundRobinRouter, LeastLoadedRouter, SessionAffinityRouter, PrefixAwareRouter), strict=True))


def make_router(name: str, engines: Sequence[EngineCore]) -> Router:
    """The router ``name`` in front of ``engines``; with one engine, the single-replica
    router whatever the name (a one-replica run is exactly the single-engine replay)."""
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}: one of {', '.join(ROUTERS)}") from None
    return SingleReplicaRouter() if len(engines) == 1 else cls(engines)
