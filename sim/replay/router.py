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

Every router but ``dp_lb`` breaks ties towards the lowest replica index (``dp_lb`` breaks
them as vLLM does, from its rotating index), so a run is deterministic.

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
``dp_lb``
    vLLM's own data-parallel load balancer (``DPLBAsyncMPClient``): the lowest score from
    the per-engine waiting and running counts its coordinator last published, raised by the
    router's own picks since and by its requests still in flight, the scan starting from a
    rotating index (``DPBalancer``, ``DPCoordinator``;
    docs/semantics.md#data-parallel-load-balancing). It is the one router that reads each
    engine's counts (``EngineCore.request_counts``), as the engines send them to vLLM's
    coordinator; its ties do not go to the lowest index.

``prefix_aware``'s hashes are computed with the engine's own hasher, lazily: block ``j`` is hashed only
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

    # Whether the front reports each engine's changes (``observe``): only ``dp_lb`` reads
    # the engines' counts, so the front skips the call for the others.
    observes_engines = False

    def observe(self, replica: int, now_s: float) -> None:
        """``replica``'s engine may have changed at ``now_s`` (a request was added to it, or
        one of its batches was applied): the moments vLLM's engine sends its counts."""

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


# vLLM's DP coordinator publishes at most every 100 ms while the counts change
# (DPCoordinatorProc's min_stats_update_interval_ms), else every 5 s (coordinator.py:267).
DP_STATS_PUBLISH_INTERVAL_S = 0.1
DP_STATS_IDLE_PUBLISH_INTERVAL_S = 5.0
# A waiting request scores WAITING_KV_PENALTY * (usage - KV_PENALTY_FROM) more when the
# engine's KV cache is more than half used (core_client.py:1787-1794).
WAITING_KV_PENALTY = 6.0
KV_PENALTY_FROM = 0.5


class DPBalancer:
    """The choice vLLM's front end makes per request (``DPLBAsyncMPClient.
    get_core_engine_for_request``), with no clock: the counts last published, the local
    increments since, the requests in flight and the rotating scan start
    (docs/semantics.md#data-parallel-load-balancing).

    ``counts[r]`` is ``[waiting, running, kv_cache_usage]`` as published, plus this
    client's increments to ``waiting`` since; ``inflight[r]`` its requests on ``r`` not
    finished. ``client_count`` front ends share the engines; this is client ``client_index``."""

    def __init__(self, num_ranks: int, client_count: int = 1, client_index: int = 0):
        if num_ranks < 1:
            raise ValueError("a DP balancer needs at least one rank")
        self.num_ranks = num_ranks
        self.client_count = client_count
        self.counts: list[list[float]] = [[0, 0, 0.0] for _ in range(num_ranks)]
        self.inflight = [0] * num_ranks
        self.start_index = (num_ranks * client_index) // client_count

    def receive(self, counts: Sequence[Sequence[float]]) -> None:
        """A publication: it replaces the counts, and with them the increments since the last."""
        self.counts = [[waiting, running, usage] for waiting, running, usage in counts]

    def score(self, rank: int) -> float:
        waiting, running, usage = self.counts[rank]
        # The client's own requests in flight are a floor that a stale publication cannot erase.
        score = max(self.client_count * self.inflight[rank], waiting + running)
        if waiting:
            score += waiting * WAITING_KV_PENALTY * max(0.0, usage - KV_PENALTY_FROM)
        return score

    def pick(self, named_rank: int | None = None) -> int:
        """The rank of the next request; ``named_rank`` is the request's own
        (``data_parallel_rank``): taken as it is, with no increment and no rotation."""
        rank = named_rank
        if rank is None:
            n = self.num_ranks
            best = float("inf")
            rank = 0
            for i in range(n):
                idx = (self.start_index + i) % n
                score = self.score(idx)
                if score < best:  # strictly: the first in scan order keeps a tie
                    best, rank = score, idx
            self.counts[rank][0] += self.client_count
            self.start_index = (self.start_index + 1) % n
        self.inflight[rank] += 1
        return rank

    def finished(self, rank: int) -> None:
        """A request this client sent to ``rank`` finished there."""
        self.inflight[rank] -= 1


class DPCoordinator:
    """When vLLM's DP coordinator publishes the engines' counts, in simulated time, to the
    ``balancer`` it feeds (docs/semantics.md#data-parallel-load-balancing).

    An engine reports ``(waiting, running)`` with its KV usage when the pair differs from
    what it reported last (``report``). The coordinator publishes every engine's last
    report: ``DP_STATS_PUBLISH_INTERVAL_S`` after its last publication if a report came in
    since, or at the report if it came later than that; with no report,
    ``DP_STATS_IDLE_PUBLISH_INTERVAL_S`` after the last. The first publication is at
    ``start_s``. Events are handed in in time order; a publication at ``t`` carries the
    reports made at ``t`` and reaches a choice made after ``t`` (``advance``)."""

    def __init__(self, balancer: DPBalancer, start_s: float = 0.0):
        self.balancer = balancer
        n = balancer.num_ranks
        self.table: list[list[float]] = [[0, 0, 0.0] for _ in range(n)]
        self.reported: list[tuple[int, int]] = [(0, 0)] * n
        self.last_publish_s = start_s
        self.changed_since_s: float | None = None  # the first report since the last publication
        self.publications = 0
        self._publish(start_s)

    def next_publication_s(self) -> float:
        changed = self.changed_since_s
        if changed is None:
            return self.last_publish_s + DP_STATS_IDLE_PUBLISH_INTERVAL_S
        return max(self.last_publish_s + DP_STATS_PUBLISH_INTERVAL_S, changed)

    def _publish(self, at_s: float) -> None:
        self.balancer.receive(self.table)
        self.last_publish_s = at_s
        self.changed_since_s = None
        self.publications += 1

    def advance(self, now_s: float) -> None:
        """Make every publication due before ``now_s``."""
        while (due := self.next_publication_s()) < now_s:
            self._publish(due)

    def report(self, rank: int, waiting: int, running: int, kv_cache_usage: float, now_s: float) -> None:
        """``rank``'s engine has these counts at ``now_s``."""
        self.advance(now_s)
        if (waiting, running) == self.reported[rank]:
            return  # the engine sends nothing when its counts have not changed
        self.reported[rank] = (waiting, running)
        self.table[rank] = [waiting, running, kv_cache_usage]
        if self.changed_since_s is None:
            self.changed_since_s = now_s


class DPLoadBalancerRouter(Router):
    """``dp_lb`` (module docstring): vLLM's balancer, fed by its coordinator's publications
    of the engines' counts in simulated time. The replay's requests name no rank (the
    trace has no such column), so every one is balanced."""

    observes_engines = True

    def __init__(self, engines: Sequence[EngineCore]):
        super().__init__(engines)
        self.engines = list(engines)
        self.balancer = DPBalancer(self.num_replicas)
        self.coordinator = DPCoordinator(self.balancer)

    def choose(self, request: Request, session_id: str | None) -> int:
        self.coordinator.advance(request.arrival_time)
        return self.balancer.pick()

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        super().release(replica, request)
        self.balancer.finished(replica)

    def observe(self, replica: int, now_s: float) -> None:
        engine = self.engines[replica]
        waiting, running = engine.request_counts()
        self.coordinator.report(replica, waiting, running, engine.kv_cache_usage(), now_s)


# Each router the scenario may name, in ``ROUTER_NAMES``'s order (the names' one home).
ROUTERS: dict[str, type[Router]] = dict(zip(ROUTER_NAMES, (
    RoundRobinRouter, LeastLoadedRouter, SessionAffinityRouter, PrefixAwareRouter, DPLoadBalancerRouter), strict=True))


def make_router(name: str, engines: Sequence[EngineCore]) -> Router:
    """The router ``name`` in front of ``engines``; with one engine, the single-replica
    router whatever the name (a one-replica run is exactly the single-engine replay)."""
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}: one of {', '.join(ROUTERS)}") from None
    return SingleReplicaRouter() if len(engines) == 1 else cls(engines)
