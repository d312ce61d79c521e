"""The LRU offload policy against a plain reference of vLLM 0.33's LRU rule.

``LRUCachePolicy`` keeps its eviction order lazily (a FIFO and a heap of entries that go
stale, compacted now and then) and packs vLLM's ``(rank, -end_token)`` pair into one int,
all for speed. ``_ReferenceLRU`` below states the rule the plain way: a dict of rank pairs,
a set of evictable keys, and an eviction that sorts the evictable keys by ``(rank, key)``
and takes the first ``n`` unprotected ones (or none at all). Random runs of the manager
with either policy must agree on every answer and on the policy's order after every
operation, with enough keys in play that the lazy structures are compacted many times.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.offload.base import LookupResult, ReqContext, make_offload_key
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.cache_policy import CachePolicy, ChunkStatus, chunk_row


# A compiled core (mypyc) takes no Python subclass of its policy class, nor a Python object
# in the manager's policy slot: there the reference runs only in the interpreted test run.
_PLUGGABLE = hasattr(CachePolicy.insert, "__code__")
_needs_pluggable = pytest.mark.skipif(not _PLUGGABLE, reason="compiled core: a Python policy cannot be plugged in")


class _ReferenceRank:
    """This reference's per-request rank slot (its own type, so it shares no slot)."""

    def __init__(self, owner: object, generation: int, rank: int):
        self.owner, self.generation, self.rank = owner, generation, rank


class _ReferenceLRU(CachePolicy if _PLUGGABLE else object):  # type: ignore[misc]
    """vLLM's LRU as the rule reads: ranks ``(rank, -end_token)``, evict least first."""

    def __init__(self, cache_capacity: int):
        self.cache_capacity = cache_capacity
        self.observes_store_misses = False
        self.chunks: dict = {}
        self.ranks: dict = {}
        self.evictable: set = set()
        self.next_rank = 0
        self.generation = 0

    def _fresh(self) -> int:
        self.next_rank += 1
        return self.next_rank

    def _request_rank(self, ctx: ReqContext) -> int:
        state = ctx.get_state(_ReferenceRank)
        if state is None or state.owner is not self or state.generation != self.generation:
            state = _ReferenceRank(self, self.generation, self._fresh())
            ctx.set_state(state)
        return state.rank

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, req_context):
        self.chunks[key] = chunk
        position = req_context.get_offload_key_position(key)
        self.ranks[key] = (self._fresh(), 0) if position is None else (self._request_rank(req_context), -position)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)

    def remove(self, key):
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys, req_context):
        for key in reversed(list(keys)):
            if key in self.chunks:
                self.ranks[key] = (self._fresh(), 0)

    def on_store_miss(self, keys, req_context):
        return

    def on_request_access(self, keys, req_context):
        request_rank = self._request_rank(req_context)
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is not None and key in self.chunks and self.ranks[key] < (request_rank, -position):
                self.ranks[key] = (request_rank, -position)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        keys = [key for group in key_groups for key in group]
        if len(key_groups) > 1:
            positions = [req_context.get_offload_key_position(key) for key in keys]
            if None not in positions:
                keys = [key for _, key in sorted(zip(positions, keys), key=lambda pair: pair[0])]
        self.touch(keys, req_context)

    def evict(self, n, protected):
        if n == 0:
            return []
        order = sorted((key for key in self.evictable if key not in protected), key=lambda k: (self.ranks[k], k))
        if len(order) < n:
            return None
        evicted = []
        for key in order[:n]:
            evicted.append((key, self.chunks[key]))
            self.remove(key)
        return evicted

    def clear(self):
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.next_rank = 0
        self.generation += 1

    def mark_evictable(self, key, *chunk):
        self.evictable.add(key)

    def mark_non_evictable(self, key, *chunk):
        self.evictable.remove(key)

    def snapshot(self):
        order = sorted(self.chunks, key=lambda key: (self.ranks[key], key))
        return {"lru": [chunk_row(key, self.chunks[key]) for key in order]}


def _outcome(value):
    """A manager call's answer as plain data (chunk ids and keys, not objects)."""
    if value is None or isinstance(value, (list, LookupResult, tuple, int)):
        return value
    return (value.keys_to_store, value.evicted_keys, value.chunk_ids)


def _run(seed: int, num_chunks: int, num_hashes: int, num_ops: int) -> None:
    rng = random.Random(seed)
    real = CPUOffloadingManager(num_chunks, "lru")
    reference = CPUOffloadingManager(num_chunks, "lru")
    reference._policy = _ReferenceLRU(num_chunks)
    managers = (real, reference)
    contexts: list[list[ReqContext]] = [[ReqContext(f"r{i}"), ReqContext(f"r{i}")] for i in range(6)]
    generation = 0
    stores: list[tuple[int, list]] = []
    loads: list[tuple[int, list]] = []

    def new_contexts(slot: int) -> None:
        nonlocal generation
        generation += 1
        contexts[slot] = [ReqContext(f"r{slot}.{generation}"), ReqContext(f"r{slot}.{generation}")]

    for step in range(num_ops):
        roll = rng.random()
        slot = rng.randrange(len(contexts))
        if roll < 0.35:
            # A run of a prefix, in one or two groups, some keys without a position.
            start = rng.randrange(num_hashes)
            length = rng.randint(1, 24)
            groups = (0, 1) if rng.random() < 0.3 else (0,)
            keys = [make_offload_key((start + i) % num_hashes, g) for g in groups for i in range(length)]
            positioned = [key for key in keys if rng.random() < 0.97]
            for ctx in contexts[slot]:
                for key in positioned:
                    ctx.set_offload_key_position(key, (key[0] + 1) * 16)
            answers = [_outcome(m.prepare_store(keys, ctx)) for m, ctx in zip(managers, contexts[slot])]
            assert answers[0] == answers[1]
            if answers[0] is not None and answers[0][0]:
                stores.append((slot, list(answers[0][0])))
        elif roll < 0.65 and stores:
            index = rng.randrange(len(stores))
            store_slot, keys = stores.pop(index)
            success = rng.random() < 0.95
            for m, ctx in zip(managers, contexts[store_slot]):
                m.complete_store(keys, ctx, success=success)
        elif roll < 0.75:
            start = rng.randrange(num_hashes)
            keys = [make_offload_key((start + i) % num_hashes, 0) for i in range(rng.randint(1, 8))]
            keys = [key for key in keys if real.lookup(key, contexts[slot][0]) is LookupResult.HIT]
            if keys:
                answers = [m.prepare_load(keys, ctx) for m, ctx in zip(managers, contexts[slot])]
                assert answers[0] == answers[1]
                loads.append((slot, keys))
        elif roll < 0.85 and loads:
            load_slot, keys = loads.pop(rng.randrange(len(loads)))
            for m, ctx in zip(managers, contexts[load_slot]):
                m.complete_load(keys, ctx)
        elif roll < 0.97:
            for m, ctx in zip(managers, contexts[slot]):
                m.on_request_finished(ctx)
            new_contexts(slot)
        elif roll < 0.99:
            start = rng.randrange(num_hashes)
            keys = [make_offload_key((start + i) % num_hashes, 0) for i in range(rng.randint(1, 6))]
            for m, ctx in zip(managers, contexts[slot]):
                m.touch(keys, ctx)
        else:
            for m in managers:
                m.reset_cache()
            stores.clear()
            loads.clear()
        assert real.policy.snapshot() == reference.policy.snapshot(), f"op {step} (roll {roll:.2f}, slot {slot})"
        assert (real.num_used_chunks, real.num_evictable_chunks, real.num_write_pending_chunks) == (
            reference.num_used_chunks, reference.num_evictable_chunks, reference.num_write_pending_chunks)


@_needs_pluggable
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_chunks=st.integers(8, 600), num_hashes=st.sampled_from([40, 400]))
def test_lru_agrees_with_the_reference_rule(seed: int, num_chunks: int, num_hashes: int):
    # 40 hashes in a large cache: every key stays resident and is ranked again and again,
    # so the FIFO fills with stale entries; 400 in a small one: evictions all the time.
    _run(seed, num_chunks, num_hashes=num_hashes, num_ops=600)


def test_lru_chunk_status_is_the_managers_object():
    """The policy keeps the manager's ChunkStatus objects: a pin is seen through ``get``."""
    policy_manager = CPUOffloadingManager(2, "lru")
    ctx = ReqContext("a")
    key = make_offload_key(1, 0)
    policy_manager.prepare_store([key], ctx)
    policy_manager.complete_store([key], ctx)
    chunk = policy_manager.policy.get(key)
    assert isinstance(chunk, ChunkStatus) and chunk.ref_cnt == 0
    policy_manager.prepare_load([key], ctx)
    assert policy_manager.policy.get(key) is chunk and chunk.ref_cnt == 1
