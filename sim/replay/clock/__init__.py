"""The replay's simulated clock, in SimPy: arrivals, replicas, their engine processes.

``Cluster`` (``cluster.py``) holds the replicas behind a router and runs them in one
environment; ``arrivals.py`` adds each request at its arrival time; ``engine_processes.py``
holds the synchronous and the asynchronous engine process; a ``Replica`` (``replica.py``)
is one engine with its executor, wake event and ``DeviceTimeline`` (``timeline.py``).
The architecture is in docs/architecture.md#one-core-three-clocks.
"""
