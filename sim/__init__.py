"""kvtwin's simulator: KV cache specs, block pool, managers, coordinators, the KV cache
manager, the scheduler and the engine step function.

The KV-cache core and the scheduler are pure Python: they never import torch, SimPy or
the executor, so the lockstep runner, the SimPy replay and the GPU executor all drive the
very same code.
"""
