"""The replay's simulated clock, in SimPy: arrivals, replicas, their engine processes.

``Cluster`` (``cluster.py``) holds the replicas behind one ``Front`` (a router's
``RoutedFront``, or the P/D front of ``pd_front.py``) and runs them in one environment;
``arrivals.py`` hands each request to the front at its arrival time; ``engine_processes.py``
holds the synchronous and the asynchronous engine process; a ``Replica`` (``replica.py``)
is one engine with its executor, wake event and ``DeviceTimeline`` (``timeline.py``).
The architecture is in docs/architecture.md#one-core-three-clocks.
"""
