"""Scenario files and their resolution: a TOML file plus command-line overrides become one
checked description of a run (model, hardware, engine, workload, SLO, cost model).
Shared by every command that runs the engine (plan, replay, capacity, validate).
"""
