"""Prefix-cache hit rate against KV cache capacity, for every capacity in one pass.

The model is a plain LRU cache of KV blocks fed by the trace in arrival order. For each
request: first its prompt blocks are looked up (the hit is the longest leading run of
cached blocks, at most ``(P - 1) // b`` blocks, since vLLM always computes a prompt's last
token); then the request's blocks are touched, last block first, so its first blocks are the
most recently used (as vLLM's free queue gets a freed request's blocks in reverse order,
evicting its last blocks first); the blocks its outputs fill (``(P + O - 1) // b`` full
blocks in all, less the prompt's identified ones) are touched before the prompt's, as unique
blocks that take room but never hit (the simulator's outputs are unique, and later turns
reuse earlier outputs only through the trace's own prompt identity).

With LRU, a block is cached at capacity C exactly when the total size of the distinct blocks
used since its last use, plus its own, is at most C (Mattson's stack inclusion): so one pass
computing each access's *stack distance* gives the hit rate at every C. Distances come from
a Fenwick tree over access positions (each block's latest access marked with its size), so
the pass is O(n log n) in block accesses. The trace's identity is taken at its own hash
block size H (512 tokens for Mooncake) when H is a multiple of the engine block size b, each
H-block weighing the b-blocks it fills; else at b. ``hit_rate`` is token-weighted, hit tokens
over prompt tokens, as the replay summary's ``prefix_cache_hit_rate``.

Where vLLM differs from this LRU, and what that does (the numbers are in the capacity
report of the bundled traces, ``bench/bench_capacity.py``):

* Blocks in use by running requests are not evictable: the cache's usable capacity for
  *reuse* is the free pool (all blocks less those held by requests in flight), which
  shrinks under load. The curve read at the pool's size is an upper bound; read it at the
  pool less the running requests' blocks for a load-aware estimate.
* While a request runs its blocks are pinned, and a request admitted meanwhile can hit
  them (a shared prefix stays cached however many blocks other requests churn); LRU sees
  only the accesses' order, not their lifetimes.
* Hits only count at admission, and a request waiting in the queue is looked up when it is
  admitted, not when it arrives; a preempted request is looked up again when readmitted
  (the summary counts those queries too).
* Freed blocks keep their place in the free queue by the time they were *freed*, not last
  *touched*: a long request's prompt blocks are freed when it finishes, after shorter
  requests that arrived later.
* Sliding-window and chunked-local groups free blocks outside their window while a request
  runs and only cache what is still held; Mamba groups cache a state per block boundary
  only in ``align`` mode; and under vLLM's default prefix-cache retention (interval 0) both
  cache only the blocks a hit at a prompt's end or at a shared-prefix junction needs
  (docs/semantics.md#prefix-cache-retention). This curve models a single full-attention
  group; for hybrid models read it as the full-attention group's hit rate, an upper bound
  on the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.traces.expand import table_block_ids
from kvtwin.traces.schema import hash_block_tokens_of

CURVE_POINTS = 64


def _unit(trace: pa.Table, block_size: int) -> int:
    hash_tokens = hash_block_tokens_of(trace)
    if hash_tokens is not None and hash_tokens >= block_size and hash_tokens % block_size == 0:
        return hash_tokens
    return block_size


class ReuseProfile:
    """The per-access thresholds of one pass: a hit-rate curve over any capacities.

    ``thresholds[k]``: the smallest capacity (blocks of ``block_size``) at which increment
    ``k`` of hit blocks is a hit; ``increments[k]``: those hit blocks.
    """

    def __init__(self, thresholds: np.ndarray, increments: np.ndarray, prompt_tokens: int, block_size: int,
                 max_capacity_blocks: int, num_accesses: int):
        order = np.argsort(thresholds, kind="stable")
        self.thresholds = thresholds[order]
        self.cumulative = np.cumsum(increments[order].astype(np.int64))
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.max_capacity_blocks = max_capacity_blocks
        self.num_accesses = num_accesses

    def hit_blocks(self, capacity_blocks: np.ndarray | Sequence[int] | int) -> np.ndarray:
        capacity = np.asarray(capacity_blocks, dtype=np.float64)
        index = np.searchsorted(self.thresholds, capacity, side="right")
        padded = np.concatenate(([0], self.cumulative))
        return padded[index]

    def hit_rate(self, capacity_blocks) -> np.ndarray:
        if self.prompt_tokens == 0:
            return np.zeros(np.shape(capacity_blocks))
        return self.hit_blocks(capacity_blocks) * self.block_size / self.prompt_tokens

    def default_capacities(self, points: int = CURVE_POINTS) -> np.ndarray:
        top = max(self.max_capacity_blocks, 1)
        grid = np.unique(np.round(np.geomspace(1, top, points)).astype(np.int64))
        return grid

    def table(self, capacities: Sequence[int] | None = None) -> pa.Table:
        """``hit_curve.parquet``: ``kv_cache_blocks``, ``kv_cache_tokens``, ``hit_rate``."""
        grid = self.default_capacities() if capacities is None else np.asarray(capacities, dtype=np.int64)
        grid = np.unique(np.concatenate((grid, self.default_capacities()))) if capacities is not None else grid
        return pa.table({
            "kv_cache_blocks": pa.array(grid, pa.int64()),
            "kv_cache_tokens": pa.array(grid * self.block_size, pa.int64()),
            "hit_rate": pa.array(self.hit_rate(grid), pa.float64()),
        })


@dataclass(frozen=True)
class _TraceBlocks:
    """The trace as the pass reads it: every row's identified blocks (dense small-int ids,
    flat, with row offsets) and its sizes in blocks."""

    per_unit: int  # blocks per identified unit
    offsets: list[int]  # row r's ids are dense[offsets[r]:offsets[r + 1]]
    dense: list[int]
    prompt_blocks: list[int]  # full blocks of each prompt
    total_blocks: list[int]  # full blocks of prompt and output together
    cap_blocks: list[int]  # the most blocks a lookup can hit (the last prompt token is computed)
    prompt_tokens: int

    @property
    def num_rows(self) -> int:
        return len(self.prompt_blocks)

    def weights(self, r: int) -> list[int]:
        """Blocks each of row ``r``'s identified units holds (the last one may be partial)."""
        full, per_unit = self.prompt_blocks[r], self.per_unit
        return [max(min(full, (k + 1) * per_unit) - k * per_unit, 0)
                for k in range(self.offsets[r + 1] - self.offsets[r])]


def _trace_blocks(trace: pa.Table, block_size: int) -> _TraceBlocks:
    unit = _unit(trace, block_size)
    prompt = trace.column("prompt_tokens").to_numpy().astype(np.int64)
    outputs = trace.column("output_tokens").to_numpy().astype(np.int64)
    ids_list = table_block_ids(trace, unit)
    if ids_list is None:
        offsets = np.zeros(trace.num_rows + 1, dtype=np.int64)
        flat = np.zeros(0, dtype=np.uint64)
    else:
        if isinstance(ids_list, pa.ChunkedArray):
            ids_list = ids_list.combine_chunks()
        lengths = pc.list_value_length(ids_list).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        flat = pc.list_flatten(ids_list).to_numpy(zero_copy_only=False).astype(np.uint64)
    # Dense ids: the Fenwick loop works on small ints.
    _, dense = np.unique(flat, return_inverse=True) if flat.size else (None, np.zeros(0, dtype=np.int64))
    return _TraceBlocks(per_unit=unit // block_size, offsets=offsets.tolist(), dense=dense.astype(np.int64).tolist(),
                        prompt_blocks=(prompt // block_size).tolist(),
                        total_blocks=(np.maximum(prompt + outputs - 1, 0) // block_size).tolist(),
                        cap_blocks=(np.maximum(prompt - 1, 0) // block_size).tolist(),
                        prompt_tokens=int(prompt.sum()))


class _LruStack:
    """The LRU stack of blocks, each weighted by the blocks it stands for. A block is still
    cached at a capacity of at least the weight touched since its last touch, its own
    included; a Fenwick tree over stack positions sums that weight in log time."""

    def __init__(self, positions: int):
        self.size = positions
        self.tree = [0] * (positions + 1)
        self.last_pos: dict[int, int] = {}
        self.last_weight: dict[int, int] = {}
        self.mass = 0  # weight on the stack
        self.pos = 1  # the next free position

    def _prefix(self, i: int) -> int:
        tree, s = self.tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def _add(self, i: int, delta: int) -> None:
        tree, size = self.tree, self.size
        while i <= size:
            tree[i] += delta
            i += i & -i
        self.mass += delta

    def capacity_to_hit(self, block: int) -> float:
        p = self.last_pos.get(block)
        return math.inf if p is None else self.mass - self._prefix(p) + self.last_weight[block]

    def push(self, weight: int) -> None:
        """Weight no later lookup finds (output blocks): it only pushes others down."""
        self._add(self.pos, weight)
        self.pos += 1

    def touch(self, block: int, weight: int) -> None:
        p = self.last_pos.get(block)
        if p is not None:
            self._add(p, -self.last_weight[block])
        self._add(self.pos, weight)
        self.last_pos[block] = self.pos
        self.last_weight[block] = weight
        self.pos += 1


def reuse_profile(trace: pa.Table, block_size: int, *, include_outputs: bool = True) -> ReuseProfile:
    """One LRU stack-distance pass over ``trace`` (rows in arrival order) at ``block_size``."""
    blocks = _trace_blocks(trace, block_size)
    stack = _LruStack(len(blocks.dense) + blocks.num_rows + 1)
    thresholds: list[float] = []
    increments: list[int] = []
    for r in range(blocks.num_rows):
        weights = blocks.weights(r)
        _lookup(stack, blocks, r, weights, thresholds, increments)
        _touch(stack, blocks, r, weights, include_outputs)
    return ReuseProfile(np.array(thresholds, dtype=np.float64), np.array(increments, dtype=np.int64),
                        blocks.prompt_tokens, block_size, max(int(stack.mass), 1), len(blocks.dense))


def _lookup(stack: _LruStack, blocks: _TraceBlocks, r: int, weights: list[int],
            thresholds: list[float], increments: list[int]) -> None:
    """Row ``r``'s blocks against the cache as the request found it: the capacity each
    further hit needs (a prefix hits only as far as every block before it does)."""
    start, cap = blocks.offsets[r], blocks.cap_blocks[r]
    dense, capacity_to_hit = blocks.dense, stack.capacity_to_hit  # bound once: the pass's inner loop
    reach = 0.0
    hit = 0
    for k, w in enumerate(weights):
        if hit >= cap:
            break
        reach = max(reach, capacity_to_hit(dense[start + k]))
        if reach == math.inf:
            break  # nothing further hits at any capacity
        gain = min(hit + w, cap) - hit
        if gain > 0:
            thresholds.append(reach)
            increments.append(gain)
            hit += gain


def _touch(stack: _LruStack, blocks: _TraceBlocks, r: int, weights: list[int], include_outputs: bool) -> None:
    """Row ``r`` into the cache: output blocks first (evicted first), then the prompt's,
    last to first."""
    pollution = blocks.total_blocks[r] - sum(weights) if include_outputs else 0
    if pollution > 0:
        stack.push(pollution)
    start, dense, touch = blocks.offsets[r], blocks.dense, stack.touch
    for k in range(len(weights) - 1, -1, -1):
        touch(dense[start + k], weights[k])


def hit_curve(trace: pa.Table, block_size: int, capacities: Sequence[int] | None = None, *,
              include_outputs: bool = True) -> pa.Table:
    """``hit_curve.parquet`` for ``trace`` at ``block_size`` (capacities in blocks; a
    geometric grid up to the whole working set is always included)."""
    return reuse_profile(trace, block_size, include_outputs=include_outputs).table(capacities)
