"""CPU offloading of KV blocks: vLLM v1's ``kv_offload`` tier, standard library only.

``base`` holds the value types shared by every tier (offload keys, lookup results, the
per-request context), ``policies`` the two cache policies (LRU and ARC) and
``cpu_manager`` the scheduler-side manager that owns the CPU chunk pool.
"""
