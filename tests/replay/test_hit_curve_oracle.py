"""hit_curve.parquet, computed a second time by brute force.

For a handful of requests with chained block hashes, every row of ``hit_curve`` (its
capacity grid, tokens and hit rate) is recomputed by simulating, at each capacity, a
plain LRU cache of weighted entries request by request, as ``sim/replay/reuse_curve.py``'s
docstring defines the model: the prompt's leading cached units hit (at most
``(P - 1) // b`` blocks), then the output blocks are touched (unique, never hit), then the
prompt's units last to first; an entry at the trace's hash block size ``H`` weighs the
``b``-blocks of the prompt it holds. The grid is the geometric one up to the working set.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pytest

from kvtwin.sim.replay.reuse_curve import hit_curve
from kvtwin.traces.schema import TRACE_SCHEMA


def _trace(rows: list[tuple[int, int, list[int]]], hash_block_tokens: int) -> pa.Table:
    """(prompt tokens, output tokens, chained hash ids) per request, in arrival order."""
    return pa.Table.from_pylist([
        {"request_id": f"r{i}", "arrival_time_s": float(i), "prompt_tokens": p, "output_tokens": o,
         "session_id": None, "turn": None, "priority": None, "block_hashes": hashes,
         "hash_block_tokens": hash_block_tokens, "prompt_token_ids": None}
        for i, (p, o, hashes) in enumerate(rows)], schema=TRACE_SCHEMA)


# Chained ids: requests share their first k ids exactly when they share their first k hash blocks.
ROWS_H8 = [
    (22, 9, [1, 2, 3]),  # 5 full 4-token blocks: units of 2, 2, 1
    (24, 4, [1, 2, 4]),  # shares two units with r0
    (16, 12, [5, 6]),
    (30, 3, [1, 2, 4, 7]),  # shares three units with r1 (cap (30 - 1) // 4 = 7 blocks)
    (20, 6, [5, 6, 8]),
    (12, 2, [1, 9]),
    (16, 2, [5, 6]),  # r2's prompt again: a hit up to the last block, which is computed
]


def _brute_force(rows, hash_block_tokens: int, block_size: int, capacity: int) -> float:
    """Hit tokens over prompt tokens with an LRU cache of ``capacity`` blocks."""
    per_unit = hash_block_tokens // block_size if hash_block_tokens % block_size == 0 else None
    cache: OrderedDict = OrderedDict()
    held = 0
    hit_blocks = 0
    for r, (prompt, output, hashes) in enumerate(rows):
        full = prompt // block_size
        if per_unit is not None:
            # One entry per hash block, weighing the full b-blocks of the prompt within it.
            keys = [tuple(hashes[:k + 1]) for k in range(len(hashes))]
            weights = [max(min(full, (k + 1) * per_unit) - k * per_unit, 0) for k in range(len(hashes))]
        else:
            # One entry per b-block, named by its end (capped at the hashes' coverage): the
            # hash blocks up to the one it ends in, and where in that one it ends.
            ends = [min((k + 1) * block_size, len(hashes) * hash_block_tokens)
                    for k in range(math.ceil(prompt / block_size))]
            keys = [(tuple(hashes[:(end - 1) // hash_block_tokens + 1]), (end - 1) % hash_block_tokens + 1)
                    for end in ends]
            weights = [1 if k < full else 0 for k in range(len(keys))]
        cap = (prompt - 1) // block_size  # the last prompt token is always computed
        hit = 0
        for key, weight in zip(keys, weights):
            if hit >= cap or key not in cache:
                break
            hit += min(hit + weight, cap) - hit
        hit_blocks += hit
        outputs = (prompt + output - 1) // block_size - sum(weights)
        touched = ([(("outputs", r), outputs)] if outputs > 0 else []) + list(zip(keys, weights))[::-1]
        for key, weight in touched:
            if key in cache:
                held -= cache.pop(key)
            cache[key] = weight
            held += weight
            while held > capacity:
                held -= cache.popitem(last=False)[1]
    return hit_blocks * block_size / sum(p for p, _, _ in rows)


def _working_set(rows, hash_block_tokens: int, block_size: int) -> int:
    """Blocks an infinite cache ends up holding: every distinct entry's weight, every output."""
    per_unit = hash_block_tokens // block_size
    last: dict = {}
    outputs = 0
    for prompt, output, hashes in rows:
        full = prompt // block_size
        weights = [max(min(full, (k + 1) * per_unit) - k * per_unit, 0) for k in range(len(hashes))]
        for k, weight in enumerate(weights):
            last[tuple(hashes[:k + 1])] = weight
        outputs += max((prompt + output - 1) // block_size - sum(weights), 0)
    return sum(last.values()) + outputs


def test_every_row_of_the_curve_is_an_lru_simulation():
    trace = _trace(ROWS_H8, 8)
    curve = hit_curve(trace, 4).to_pylist()
    top = _working_set(ROWS_H8, 8, 4)
    grid = sorted({int(round(x)) for x in np.geomspace(1, top, 64)})
    assert [row["kv_cache_blocks"] for row in curve] == grid
    for row in curve:
        assert row["kv_cache_tokens"] == row["kv_cache_blocks"] * 4
        assert row["hit_rate"] == pytest.approx(_brute_force(ROWS_H8, 8, 4, row["kv_cache_blocks"]), abs=1e-12), row
    # The curve is not flat: some capacity loses hits an infinite cache has.
    rates = [row["hit_rate"] for row in curve]
    assert 0 < rates[-1] and rates[0] < rates[-1]


def test_asked_capacities_join_the_grid():
    trace = _trace(ROWS_H8, 8)
    curve = hit_curve(trace, 4, [7, 1000]).to_pylist()
    blocks = [row["kv_cache_blocks"] for row in curve]
    assert {7, 1000} <= set(blocks) and blocks == sorted(blocks)
    for row in curve:
        assert row["hit_rate"] == pytest.approx(_brute_force(ROWS_H8, 8, 4, row["kv_cache_blocks"]), abs=1e-12)


def test_hash_blocks_that_are_not_a_multiple_of_the_block_are_reblocked():
    rows = [(22, 5, [1, 2, 3, 4]), (24, 3, [1, 2, 3, 9]), (13, 2, [1, 2, 7])]
    trace = _trace(rows, 6)
    for capacity in (1, 3, 5, 8, 12, 40):
        rate = hit_curve(trace, 4, [capacity]).to_pylist()
        by_blocks = {row["kv_cache_blocks"]: row["hit_rate"] for row in rate}
        assert by_blocks[capacity] == pytest.approx(_brute_force(rows, 6, 4, capacity), abs=1e-12)
