"""The arrival process: each request joins its replica's queue at its arrival time.

Arrivals at the same instant as a step boundary are added before that step schedules, as
the lockstep clock does, so both clocks make the same decisions for the same arrival
order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import simpy
from simpy.events import URGENT, Event

from kvtwin.sim.core.request import Request
from kvtwin.sim.replay.clock.replica import Replica


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    request: Request
    session_id: str | None = None


class UrgentTimeout(Event):
    """A timeout processed before ordinary events at the same instant.

    SimPy orders same-time events by priority, then creation; arrivals use the urgent
    priority so a request arriving exactly when a step ends is seen by the next step.
    """

    def __init__(self, env: simpy.Environment, delay: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


class ArrivalSite(Protocol):
    """Where arrivals go (the ``Cluster``): its clock, its replicas, and who takes each."""

    env: simpy.Environment
    replicas: list[Replica]
    all_arrived: bool

    def arrive(self, arrival: Arrival) -> None:
        ...


def arrival_process(cluster: ArrivalSite, arrivals: Iterator[Arrival]):
    """Hand each arrival to the cluster (its front picks the replica), then wake every
    replica once the arrivals are done (an idle one may then stop). ``arrivals`` is consumed one at a time:
    a request exists from its arrival on, and a finished one is not kept alive by a list
    of them all."""
    env = cluster.env
    for arrival in arrivals:
        delay = arrival.arrival_s - env.now
        if delay > 0:
            yield UrgentTimeout(env, delay)
        cluster.arrive(arrival)
    cluster.all_arrived = True
    for replica in cluster.replicas:
        replica.wake()
