"""The KV cache manager's side of the decode window's port (``decode_window.py``;
docs/architecture.md#decode-windows).

Unlike the scheduler's and the engine's sides, a base class ``KVCacheManager`` derives
from rather than a ``Protocol``: the window calls the manager for every member of every
batch it leaves implicit, and a compiled module calls through a ``Protocol`` as Python does
(method lookup, argument parsing, boxed results), about 1% of a windowed replay's
instructions; through a base class the call is native.
"""

from __future__ import annotations

from kvtwin.sim.core.kv_cache_blocks import KVCacheBlocks
from kvtwin.sim.core.request import Request


class WindowKVCacheManager:
    """What a window asks of the KV cache manager (``KVCacheManager``, which derives from it)."""

    def allocate_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots`` for a running request's decode or prefill chunk, as the
        scheduler's running pass calls it."""
        raise NotImplementedError

    def take_replaced_block_ids(self, request_id: str) -> list[tuple[int, int, int]] | None:
        """The table entries the request's allocations changed in place, taken into the
        batch's output as the running pass takes them (None: none)."""
        raise NotImplementedError

    def get_empty_blocks(self) -> KVCacheBlocks:
        """What ``allocate_slots`` returns when it appended nothing (by identity)."""
        raise NotImplementedError

    def num_kv_cache_groups(self) -> int:
        raise NotImplementedError

    def num_free_blocks(self) -> int:
        """The block pool's free blocks (vLLM's ``get_num_free_blocks``)."""
        raise NotImplementedError

    def allocation_horizon(self, request_id: str) -> int:
        """The token count up to which allocating for the request changes nothing (the
        running pass skips ``allocate_slots`` below it); -1: none known."""
        raise NotImplementedError

    def blocks_lacking(self, request_id: str, num_tokens: int) -> int:
        """Summed over the groups, the blocks the request's tables lack for ``num_tokens``."""
        raise NotImplementedError

    def blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """The blocks ``allocate_slots`` would take for a running chunk (vLLM's
        ``get_num_blocks_to_allocate``)."""
        raise NotImplementedError
