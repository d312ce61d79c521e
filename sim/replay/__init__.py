"""The simulated clock: the cost model (step seconds from a roofline), the SimPy workload
and engine processes, trace rows turned into requests, metrics, and the replay that puts
them together. Builds on ``sim.core``, ``sim.planner`` and ``traces``.
"""
