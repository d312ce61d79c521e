"""The step clock: the golden case format and the runner that plays a case one engine step
per tick with a scripted model, for comparison with vLLM's own results. Builds on
``sim.core`` only.
"""
