"""CPU offloading of KV blocks: vLLM v1's ``kv_offload`` tier, standard library only.

``base`` holds the value types shared by every tier (offload keys, lookup results, the
per-request context), ``policies`` the table of cache policies (``cache_policy`` their
interface, ``lru_policy`` and ``arc_policy`` the two) and ``cpu_manager`` the
scheduler-side manager that owns the CPU chunk pool.
"""
