"""Per-group block lists: what the KV cache manager hands the scheduler (vLLM ``KVCacheBlocks``).

A prefix hit, the blocks an allocation appended, or a request's whole table: one sequence
of blocks per KV cache group, in group order. The scheduler turns them into block ids for
its output (``get_block_ids``), which is all an executor ever sees of them.

The object is treated as immutable once built. Each ``KVCacheManager`` keeps one empty
instance (``empty_blocks``) whose groups are empty tuples, so the decode fast path can
return it without allocating and callers can test for "nothing" by identity.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvtwin.sim.core.block_pool import KVCacheBlock


class KVCacheBlocks:
    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]):
        self.blocks = blocks

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        return cls(((),) * num_groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group; null placeholders are block 0, so positions line up."""
        blocks = self.blocks
        if len(blocks) == 1:
            return ([b.block_id for b in blocks[0]],)
        return tuple([[b.block_id for b in group] for group in blocks])

    def __getitem__(self, group: int) -> Sequence[KVCacheBlock]:
        return self.blocks[group]

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Sequence[KVCacheBlock]]:
        return iter(self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"
