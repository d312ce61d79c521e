"""A fixed pure-Python workload, timed next to a benchmark so its figure can be read as a
ratio: these machines are shared and noisy, and a ratio to work of the same kind timed in
the same run moves far less than wall seconds do.

The loop does what the simulator's hot path does most (attribute reads, dict lookups and
updates, list appends and pops, small method calls) with nothing from kvtwin, so a change
to kvtwin never changes it.
"""

from __future__ import annotations

import time


class _Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None

    def touch(self) -> None:
        self.ref_cnt += 1


def _work(iterations: int) -> int:
    blocks = [_Block(i) for i in range(4096)]
    by_hash: dict[int, _Block] = {}
    free = list(blocks)
    held: list[_Block] = []
    checksum = 0
    for i in range(iterations):
        if free and (i % 3 or not held):
            block = free.pop()
            block.touch()
            block.block_hash = (i * 2654435761) & 0xFFFFFFFF
            by_hash[block.block_hash] = block
            held.append(block)
        else:
            block = held.pop(0 if i % 7 else -1)
            block.ref_cnt -= 1
            hit = by_hash.pop(block.block_hash, None)
            checksum += hit.block_id if hit is not None else 0
            free.append(block)
    return checksum


def reference_seconds(iterations: int = 1_500_000, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timings of the fixed loop (about a second each)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        _work(iterations)
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    print(f"reference loop: {reference_seconds():.3f} s")
