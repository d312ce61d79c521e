"""vLLM 0.33's KV cache planner: model and GPU presets (``data/``), HF config mapping, page
size unification, grouping, the memory budget and the plan (a ``KVCacheConfig`` plus the
capacity figures ``kvtwin plan`` prints). Builds on ``sim.core`` only.
"""
