"""The KV-cache core and the scheduler: vLLM v1's rules, standard library only.

One file per vLLM concept, named as vLLM names it: ``spec`` (KVCacheSpec and the layout),
``hashing``, ``block_pool``, the single-type managers (``single_type_manager``, their base;
``attention_managers``, ``mamba_manager``; ``managers``, which spec gets which), ``coordinator``,
``kv_cache_blocks``, ``kv_cache_manager``, ``request``, ``request_queue``, ``scheduler`` (its
connector paths in ``connector_scheduling``), ``scheduler_output`` (the whole contract with an executor), ``engine`` (the one step
function every clock drives, and the ``ModelExecutor`` protocol), ``decode_window`` (the
window and its port; ``window_members``, ``window_pricing``, ``window_opening``,
``windowed_batch_queue``),
``config`` and ``errors``; ``offload/`` holds the KV connector and the CPU and disk tiers.
Nothing here knows which clock runs it; ``tests/test_layout.py`` enforces that it imports nothing else.
"""
