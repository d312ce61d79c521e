"""The KV-cache core and the scheduler: vLLM v1's rules, standard library only.

One file per vLLM concept, named as vLLM names it: ``spec`` (KVCacheSpec and the layout),
``hashing``, ``block_pool``, ``managers`` (single-type managers), ``coordinator``,
``kv_cache_manager``, ``request``, ``request_queue``, ``scheduler``, ``engine`` (the one
step function every clock drives), ``config`` and ``errors``. Nothing here knows which
clock runs it; ``tests/test_layout.py`` enforces that it imports nothing else.
"""
