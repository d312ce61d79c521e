"""The CPU offloading manager against vLLM's own, and its invariants.

``test_replays_vllm_recording`` replays every sequence recorded from vLLM 0.33's real
``CPUOffloadingManager`` (``tests/golden/offload_manager/``, written by
``scripts/oracle/record_manager_ops.py``) and demands the same answer to every call, the
same chunk counts after it and the same policy order (a digest of ``snapshot()``).
The hypothesis tests drive kvtwin's manager alone with random operations and check what
must hold whatever the policy decides.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.offload.base import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
    offload_key_group,
)
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.cache_policy import ChunkStatus
from kvtwin.sim.core.offload.lru_policy import packed_rank
from kvtwin.sim.core.offload.policies import POLICIES, make_policy

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "offload_manager"
RECORDINGS = sorted(GOLDEN_DIR.glob("*.jsonl"))


def _key(pair: list[int]) -> tuple:
    return make_offload_key(pair[0], pair[1])


def _keys(pairs: list[list[int]]) -> list[tuple]:
    return [_key(pair) for pair in pairs]


def _digest(snapshot: dict) -> str:
    text = json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _apply(manager: CPUOffloadingManager, contexts: dict[str, ReqContext], record: dict):
    op = record["op"]
    if op == "reset_cache":
        manager.reset_cache()
        return None
    ctx = contexts.setdefault(record["req"], ReqContext(record["req"]))
    keys = _keys(record.get("keys", []))
    for key, position in zip(keys, record.get("pos") or []):
        if position is not None:
            ctx.set_offload_key_position(key, position)
    if op == "on_new_request":
        return manager.on_new_request(ctx).policy.name
    if op == "lookup":
        return [manager.lookup(key, ctx).name for key in keys]
    if op == "prepare_load":
        return manager.prepare_load(keys, ctx)
    if op == "complete_load":
        return manager.complete_load(keys, ctx)
    if op == "prepare_store":
        out = manager.prepare_store(keys, ctx)
        if out is None:
            return None
        return {"keys_to_store": [list(k) for k in out.keys_to_store],
                "evicted_keys": [list(k) for k in out.evicted_keys], "chunk_ids": out.chunk_ids}
    if op == "complete_store":
        return manager.complete_store(keys, ctx, success=record["success"])
    if op == "touch":
        return manager.touch(keys, ctx)
    if op == "on_request_finished":
        return manager.on_request_finished(ctx)
    raise AssertionError(f"unknown op {op!r}")


def replay(path: Path) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header, records = lines[0], lines[1:]
    manager = CPUOffloadingManager(header["num_chunks"], header["policy"],
                                   store_threshold=header["store_threshold"],
                                   max_tracker_size=header["max_tracker_size"])
    contexts: dict[str, ReqContext] = {}
    for index, record in enumerate(records, start=1):
        got = _apply(manager, contexts, record)
        where = f"{path.name} op {index} ({record['op']})"
        assert got == record["result"], f"{where}: got {got}, vLLM {record['result']}"
        counts = (manager.num_used_chunks, manager.num_evictable_chunks, manager.num_write_pending_chunks)
        assert counts == (record["used"], record["evictable"], record["pending"]), f"{where}: counts {counts}"
        snapshot = manager.policy.snapshot()
        assert _digest(snapshot) == record["digest"], f"{where}: policy order differs: {snapshot}"


def test_recordings_present_and_small():
    assert len(RECORDINGS) >= 12
    assert {json.loads(p.read_text().splitlines()[0])["policy"] for p in RECORDINGS} == set(POLICIES)
    assert sum(p.stat().st_size for p in RECORDINGS) < 1_500_000


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_replays_vllm_recording(path: Path):
    replay(path)


# --- small direct checks ------------------------------------------------------------


def test_interface_defaults():
    manager = CPUOffloadingManager(2)
    ctx = ReqContext("a")
    assert manager.on_new_request(ctx) == RequestOffloadingContext(OffloadPolicy.CHUNK_LEVEL)
    key = make_offload_key(7, 1)
    assert offload_key_group(key) == 1
    assert manager.lookup(key, ctx) is LookupResult.MISS
    out = manager.prepare_store([key], ctx)
    assert out.keys_to_store == [key] and out.chunk_ids == [0]
    assert manager.lookup(key, ctx) is LookupResult.HIT_PENDING
    manager.complete_store([key], ctx)
    assert manager.lookup(key, ctx) is LookupResult.HIT
    assert manager.get_load_source(key, ctx) == "cpu"
    assert not manager.has_pending_work()
    manager.on_schedule_end(None)


def test_chunk_ids_fresh_first_then_last_freed():
    manager = CPUOffloadingManager(4)
    ctx = ReqContext("a")
    keys = [make_offload_key(h, 0) for h in range(6)]
    assert manager.prepare_store(keys[:3], ctx).chunk_ids == [0, 1, 2]
    manager.complete_store(keys[:3], ctx, success=False)  # frees 0, 1, 2 in that order
    assert manager.prepare_store(keys[3:], ctx).chunk_ids == [3, 2, 1]


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ValueError, match="cache_policy"):
        make_policy("fifo", 4)


# --- properties ---------------------------------------------------------------------

NUM_HASHES = 6
ALL_KEYS = [make_offload_key(h, g) for h in range(NUM_HASHES) for g in (0, 1)]
_key_st = st.tuples(st.integers(0, NUM_HASHES - 1), st.integers(0, 1))
_store = st.tuples(st.just("store"), st.integers(0, 3), st.lists(_key_st, min_size=1, max_size=5, unique=True))
_complete_store = st.tuples(st.just("complete_store"), st.integers(0, 99), st.integers(0, 4).map(bool))
# Pin up to n loadable keys, scanning from a rotating offset.
_load = st.tuples(st.just("load"), st.integers(0, 3), st.integers(0, len(ALL_KEYS) - 1), st.integers(1, 4))
_complete_load = st.tuples(st.just("complete_load"), st.integers(0, 99))
_OP_STRATEGIES = {
    "store": _store,
    "complete_store": _complete_store,
    "load": _load,
    "complete_load": _complete_load,
    "touch": st.tuples(st.just("touch"), st.integers(0, 3), st.lists(_key_st, max_size=4, unique=True)),
    "finish": st.tuples(st.just("finish"), st.integers(0, 3)),
    "reset": st.tuples(st.just("reset")),
}
# Weighted towards the transfers that create pins and eviction pressure; resets are rare.
_OP_WEIGHTS = {"store": 5, "complete_store": 7, "load": 4, "complete_load": 4, "touch": 1, "finish": 1, "reset": 0.25}
_op_st = st.sampled_from([kind for kind, w in _OP_WEIGHTS.items() for _ in range(int(w * 4))]).flatmap(
    _OP_STRATEGIES.__getitem__)


def _residents(manager: CPUOffloadingManager) -> dict:
    snapshot = manager.policy.snapshot()
    rows = snapshot["lru"] if "lru" in snapshot else snapshot["t1"] + snapshot["t2"]
    return {tuple(key): (chunk_id, ref_cnt) for key, chunk_id, ref_cnt in rows}


def _pool_state(manager: CPUOffloadingManager) -> tuple:
    return (_residents(manager), manager.num_used_chunks, manager.num_free_chunks, manager.num_evictable_chunks,
            manager.num_write_pending_chunks, list(manager._free_list), manager._num_allocated_chunks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), num_chunks=st.integers(1, 6), ops=st.lists(_op_st, min_size=10, max_size=80))
def test_manager_invariants(policy: str, num_chunks: int, ops: list):
    manager = CPUOffloadingManager(num_chunks, policy)
    contexts = [ReqContext(f"r{i}") for i in range(4)]
    generation = [0] * 4  # a finished request is replaced by a fresh one
    loads: list[tuple[int, list]] = []
    stores: list[tuple[int, list]] = []
    base = (0, 0, 0)  # (stored, evicted, failed) at the last reset

    for op in ops:
        kind = op[0]
        if kind == "store":
            slot, pairs = op[1], op[2]
            keys = [make_offload_key(h, g) for h, g in pairs]
            for key in keys:
                contexts[slot].set_offload_key_position(key, (key[0] + 1) * 16)
            before = _pool_state(manager)
            pinned_or_pending = {k for k, (_, ref) in before[0].items() if ref != 0}
            out = manager.prepare_store(keys, contexts[slot])
            if out is None:
                event("prepare_store refused")
                # Refused for want of idle chunks outside the offer, and the pool is as it
                # was (the policy still saw the access, as in vLLM).
                assert _pool_state(manager) == before
                idle_outside = sum(1 for k, (_, ref) in before[0].items() if ref == 0 and k not in keys)
                absent = sum(1 for k in keys if k not in before[0])
                assert absent - before[2] > idle_outside
            else:
                evicted = set(out.evicted_keys)
                if evicted and any(ref > 0 for _, ref in before[0].values()):
                    event("eviction while a chunk is pinned")
                if evicted and any(k in before[0] and before[0][k][1] == 0 for k in keys):
                    event("eviction while an offered key is idle")
                assert not evicted & set(keys), "an offer evicted one of its own keys"
                assert not evicted & pinned_or_pending, "a pinned or in-flight chunk was evicted"
                assert set(out.keys_to_store) == {k for k in keys if k not in before[0]}
                assert len(set(out.chunk_ids)) == len(out.chunk_ids)
                if out.keys_to_store:
                    stores.append((slot, out.keys_to_store))
        elif kind == "complete_store" and stores:
            slot, keys = stores.pop(op[1] % len(stores))
            manager.complete_store(keys, contexts[slot], success=op[2])
        elif kind == "load":
            slot, offset, count = op[1], op[2], op[3]
            rotated = ALL_KEYS[offset:] + ALL_KEYS[:offset]
            keys = [k for k in rotated if manager.lookup(k, contexts[slot]) is LookupResult.HIT][:count]
            if keys:
                manager.prepare_load(keys, contexts[slot])
                loads.append((slot, keys))
        elif kind == "complete_load" and loads:
            slot, keys = loads.pop(op[1] % len(loads))
            manager.complete_load(keys, contexts[slot])
        elif kind == "touch":
            manager.touch([make_offload_key(h, g) for h, g in op[2]], contexts[op[1]])
        elif kind == "finish":
            slot = op[1]
            manager.on_request_finished(contexts[slot])
            generation[slot] += 1
            contexts[slot] = ReqContext(f"r{slot}.{generation[slot]}")
        elif kind == "reset":
            manager.reset_cache()
            loads.clear()
            stores.clear()
            base = (manager.num_stored_keys, manager.num_evicted_keys, manager.num_store_failed_keys)

        residents = _residents(manager)
        assert manager.num_used_chunks == len(residents) <= num_chunks
        assert manager.num_evictable_chunks == sum(1 for _, ref in residents.values() if ref == 0)
        assert manager.num_write_pending_chunks == sum(1 for _, ref in residents.values() if ref < 0)
        assert len({chunk_id for chunk_id, _ in residents.values()}) == len(residents)
        assert all(0 <= chunk_id < num_chunks for chunk_id, _ in residents.values())
        stored = manager.num_stored_keys - base[0]
        evicted = manager.num_evicted_keys - base[1]
        failed = manager.num_store_failed_keys - base[2]
        assert stored - evicted - failed == len(residents)


@given(st.integers(0, 1 << 40), st.integers(0, 1 << 30), st.integers(0, 1 << 40), st.integers(0, 1 << 30))
def test_packed_ranks_order_as_vllms_rank_pairs(rank_a, end_a, rank_b, end_b):
    """The LRU packs vLLM's ``(rank, -end_token)`` into one int; every comparison agrees."""
    a, b = packed_rank(rank_a, end_a), packed_rank(rank_b, end_b)
    pair_a, pair_b = (rank_a, -end_a), (rank_b, -end_b)
    assert (a < b) == (pair_a < pair_b) and (a == b) == (pair_a == pair_b)


def test_lru_released_pin_of_an_older_rank_goes_first():
    """A chunk ranked before a later request finished but evictable only afterwards (its
    store completed late) is pushed out of rank order, and still goes before newer keys."""
    policy = make_policy("lru", 8)
    old, new = ReqContext("old"), ReqContext("new")
    old_key, new_key = make_offload_key(1, 0), make_offload_key(2, 0)
    policy.insert(old_key, ChunkStatus(0), old)  # being written: not evictable yet
    policy.on_request_finished(((old_key,),), set(), set(), old)
    policy.insert(new_key, ChunkStatus(1), new)
    policy.get(new_key).ref_cnt = 0
    policy.mark_evictable(new_key, policy.get(new_key))
    policy.on_request_finished(((new_key,),), set(), set(), new)
    policy.get(old_key).ref_cnt = 0
    policy.mark_evictable(old_key, policy.get(old_key))  # the store completes after the newer request finished
    assert [key for key, _ in policy.evict(1, set())] == [old_key]
