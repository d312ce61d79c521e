"""The P/D router: a prefill replica and a decode replica for each arriving request.

A disaggregated deployment (``sim/scenario/disaggregation.py``) puts its prefill replicas
first (cluster indexes ``0 .. P-1``) and its decode replicas after them (``P .. P+D-1``).
The pair is picked when the request arrives, as vLLM's P/D proxy and llm-d's
disaggregated scheduler do: the prefill side by one of the routers of ``router.py`` over
the prefill replicas (``prefix_aware`` by default: the prompt's cached prefix on each
prefill replica against its outstanding tokens, as Dynamo's KV router and llm-d's
prefix scorer weigh them), the decode side by another over the decode replicas
(``least_loaded`` by default: decode instances are chosen by load).

Each side keeps its own outstanding tokens: the prefill side counts the prefill request
(prompt plus its one output token) until it finishes there; the decode side counts the
client's request (prompt plus ``max_tokens``) until it finishes there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtwin.sim.core.engine import EngineCore, RequestSnapshot
from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.router import Router, make_router


class PDRouter:
    """A prefill router and a decode router behind one cluster's replica indexes. Not a
    ``Router``: it picks a pair for each arrival (``route_pair``, the P/D front's call),
    never one replica."""

    def __init__(self, prefill_engines: Sequence[EngineCore], decode_engines: Sequence[EngineCore],
                 prefill_router: str = "prefix_aware", decode_router: str = "least_loaded"):
        if not prefill_engines or not decode_engines:
            raise ValueError("a P/D router needs at least one prefill and one decode replica")
        self.prefill: Router = make_router(prefill_router, prefill_engines)
        self.decode: Router = make_router(decode_router, decode_engines)
        self.num_prefill = len(prefill_engines)
        self.num_replicas = len(prefill_engines) + len(decode_engines)
        self.observes_engines = self.prefill.observes_engines or self.decode.observes_engines

    def route_pair(self, prefill_request: Request, request: Request, session_id: str | None) -> tuple[int, int]:
        """The prefill replica of ``prefill_request`` and the decode replica of ``request``
        (cluster indexes)."""
        prefill = self.prefill.route(prefill_request, session_id)
        decode = self.decode.route(request, session_id)
        return prefill, self.num_prefill + decode

    def release(self, replica: int, request: Request | RequestSnapshot) -> None:
        if replica < self.num_prefill:
            self.prefill.release(replica, request)
        else:
            self.decode.release(replica - self.num_prefill, request)

    def observe(self, replica: int, now_s: float) -> None:
        """``replica``'s engine may have changed (``Router.observe``; cluster index)."""
        if replica < self.num_prefill:
            self.prefill.observe(replica, now_s)
        else:
            self.decode.observe(replica - self.num_prefill, now_s)
