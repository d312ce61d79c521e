"""The disk tier below the CPU tier (``tiered_manager``): invariants, the CPU manager's
exact behaviour without a disk, the clocks, and one sequence computed by hand.

The hypothesis tests drive the manager the way the connector does (a store is completed
with the context that prepared it, a load only follows a HIT, no completion of a job
started before ``reset_cache`` arrives after it) with random operations on a small key
universe and check, after every call:

* capacity: neither tier holds more chunks than it has, and the chunk counts agree with
  the keys resident;
* pins: a CPU chunk pinned or being written, and a disk chunk being written or read by a
  promotion, is still there after the call (only ``reset_cache`` drops CPU chunks, only a
  failed store drops its own pending chunks);
* conservation: every key ever stored to the CPU is in the CPU, on the disk, or was seen
  leaving both (or its disk write was dropped); the keys seen leaving each tier are
  exactly its eviction counter; disk chunks = writes finished + writes in flight -
  evictions; a write drops exactly the keys that ``disk_dropped_keys`` counts;
* the inclusive design, exactly: a disk chunk only ever comes from a CPU store; a key
  being promoted is "reading" on disk and "pending" in the CPU; a key being written is
  "writing" on disk and pinned in the CPU; with a disk at least as large as the key
  universe, every readable CPU chunk is also on disk (write-through, no disk eviction);
* timing: a promotion started in step s and a write started in step s finish in step
  s + steps (s + write_steps), not earlier and not later, unless a reset drains them.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.offload.base import LookupResult, ReqContext, make_offload_key
from kvtwin.sim.core.offload.cpu_manager import CPUOffloadingManager
from kvtwin.sim.core.offload.policies import POLICIES
from kvtwin.sim.core.offload.promotion_clock import StepPromotions, TimedPromotions
from kvtwin.sim.core.offload.tiered_manager import TieredOffloadingManager

KEYS = [make_offload_key(h, g) for h in range(3) for g in range(2)]
REQS = ("r0", "r1", "r2")


def _ctx(name: str, serial: int) -> ReqContext:
    ctx = ReqContext(f"{name}-{serial}")
    for key in KEYS:
        ctx.set_offload_key_position(key, 16 * (key[0] + 1))
    return ctx


_keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)
_req_st = st.sampled_from(REQS)
_OPS = (
    # (weight, strategy): stores and their completions, steps and loads dominate, so that
    # chunks move CPU -> disk -> CPU; a reset is rare (one ticket in 68).
    (8, st.tuples(st.just("store"), _req_st, _keys_st)),
    (8, st.tuples(st.just("complete_store"), st.integers(0, 7), st.just(True))),
    (1, st.tuples(st.just("complete_store"), st.integers(0, 7), st.just(False))),
    (14, st.tuples(st.just("end"),)),
    (8, st.tuples(st.just("load"), _req_st, _keys_st)),
    (3, st.tuples(st.just("lookup"), _req_st, st.sampled_from(KEYS))),
    (6, st.tuples(st.just("complete_load"), st.integers(0, 7))),
    (2, st.tuples(st.just("finish"), _req_st)),
    (1, st.tuples(st.just("touch"), _req_st, _keys_st)),
    # What the connector does for one request: look its prefix up (and load it), offer
    # the keys for storing, and later the store completes.
    (10, st.tuples(st.just("serve"), _req_st, _keys_st)),
    # A request whose lookup was deferred (HIT_PENDING) looks the same keys up again.
    (6, st.tuples(st.just("retry"), _req_st)),
)
_OPS = _OPS + ((1, st.tuples(st.just("reset"),)),)
# sampled_from keeps duplicates (one_of would not weigh them): each entry is one ticket.
_op_st = st.sampled_from([strategy for weight, strategy in _OPS for _ in range(weight)]).flatmap(lambda s: s)


def load_hits(keys: list, results: list) -> list:
    """The connector's prefix lookup: keys up to the first MISS are hits, and nothing is
    loaded this step if one of them is still pending (it looks them all up again later)."""
    hits = []
    for key, result in zip(keys, results):
        if result is LookupResult.MISS:
            break
        if result is not LookupResult.HIT:
            return []
        hits.append(key)
    return hits


class Driver:
    """Applies operations to one manager as the connector would; returns each answer."""

    def __init__(self, manager):
        self.m = manager
        self.live: dict[str, ReqContext] = {}
        self.serial = 0
        self.store_jobs: list[tuple[ReqContext, list]] = []
        self.load_jobs: list[tuple[ReqContext, list]] = []
        self.deferred: dict[str, list] = {}  # request -> the keys of its deferred lookup

    def expand(self, op: tuple):
        """The calls behind one operation, yielded one at a time (each after the one
        before it ran). ``serve`` is what the connector does for one scheduled request:
        look its prefix up and load it, and unless the lookup was deferred (the request
        then waits and is not scheduled), offer its keys for storing and later complete
        the store. A deferred request is served with its own keys again (``retry`` only
        serves deferred requests)."""
        if op[0] in ("serve", "retry") and op[1] in self.deferred:
            op = ("serve", op[1], self.deferred[op[1]])  # a waiting request keeps its keys
        elif op[0] == "retry":
            return
        if op[0] != "serve":
            yield op
            return
        yield ("load", op[1], op[2], "serve")
        if op[1] in self.deferred:
            return
        yield ("store", op[1], op[2])
        yield ("complete_store", -1, True)

    def ctx(self, name: str) -> ReqContext:
        ctx = self.live.get(name)
        if ctx is None:
            self.serial += 1
            ctx = self.live[name] = _ctx(name, self.serial)
            self.m.on_new_request(ctx)
        return ctx

    def note_deferral(self, op: tuple, results: list) -> None:
        """A served request whose lookup hit a pending chunk waits for it (and retries)."""
        if len(op) < 4:
            return  # a bare lookup-and-load, not a scheduled request
        req, keys = op[1], op[2]
        if any(result is LookupResult.HIT_PENDING for result in results):
            self.deferred[req] = keys
        else:
            self.deferred.pop(req, None)

    def apply(self, op: tuple):
        m, kind = self.m, op[0]
        if kind in ("serve", "retry"):
            return tuple(self.apply(sub) for sub in self.expand(op))
        if kind == "lookup":
            return m.lookup(op[2], self.ctx(op[1]))
        if kind == "store":
            ctx = self.ctx(op[1])
            out = m.prepare_store(op[2], ctx)
            if out is not None and out.keys_to_store:
                self.store_jobs.append((ctx, list(out.keys_to_store)))
            return out
        if kind == "complete_store":
            if not self.store_jobs:
                return None
            ctx, keys = self.store_jobs.pop(op[1] % len(self.store_jobs))
            m.complete_store(keys, ctx, op[2])
            return ("completed", tuple(keys), op[2])
        if kind == "load":
            ctx = self.ctx(op[1])
            results = []
            for key in op[2]:
                results.append(m.lookup(key, ctx))
                if results[-1] is LookupResult.MISS:
                    break
            hits = load_hits(op[2], results)
            self.note_deferral(op, results)
            if not hits:
                return results
            chunk_ids = m.prepare_load(hits, ctx)
            self.load_jobs.append((ctx, hits))
            return results, chunk_ids, [m.get_load_source(key, ctx) for key in hits]
        if kind == "prepare_load":
            ctx = self.ctx(op[1])
            chunk_ids = m.prepare_load(op[2], ctx)
            self.load_jobs.append((ctx, list(op[2])))
            return chunk_ids, [m.get_load_source(key, ctx) for key in op[2]]
        if kind == "complete_load":
            if not self.load_jobs:
                return None
            ctx, keys = self.load_jobs.pop(op[1] % len(self.load_jobs))
            m.complete_load(keys, ctx)
            return ("loaded", tuple(keys))
        if kind == "finish":
            self.deferred.pop(op[1], None)
            ctx = self.live.pop(op[1], None)
            if ctx is not None:
                m.on_request_finished(ctx)
            return None
        if kind == "end":
            m.on_schedule_end()
            return m.has_pending_work()
        if kind == "touch":
            m.touch(op[2], self.ctx(op[1]))
            return None
        assert kind == "reset"
        m.reset_cache()
        # The scheduler guarantees that no completion of a pre-reset job arrives later.
        self.store_jobs.clear()
        self.load_jobs.clear()
        return None


def _counters(m) -> tuple:
    return (m.num_used_chunks, m.num_stored_keys, m.num_loaded_keys, m.num_evicted_keys,
            m.num_store_failed_keys, m.num_skipped_store_keys, m.num_evictable_chunks,
            m.num_write_pending_chunks, m.has_pending_work())


# --- without a disk, exactly the CPU manager ---------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), num_chunks=st.integers(1, 4), store_threshold=st.integers(1, 2),
       ops=st.lists(_op_st, min_size=10, max_size=60))
def test_without_disk_it_is_the_cpu_manager(policy, num_chunks, store_threshold, ops):
    plain = Driver(CPUOffloadingManager(num_chunks, policy, store_threshold=store_threshold))
    tiered = Driver(TieredOffloadingManager(CPUOffloadingManager(num_chunks, policy, store_threshold=store_threshold),
                                            0, policy, StepPromotions(1)))
    for op in ops:
        assert tiered.apply(op) == plain.apply(op), op
        assert _counters(tiered.m) == _counters(plain.m), op
        assert tiered.m.cpu.policy.snapshot() == plain.m.policy.snapshot(), op
    assert tiered.m.promotions == tiered.m.disk_stored_keys == tiered.m.num_disk_used_chunks == 0


# --- invariants with a disk --------------------------------------------------------------


def _cpu_resident(m) -> set:
    return {key for key in KEYS if m.cpu_status(key) is not None}


def _disk_resident(m) -> set:
    return {key for key in KEYS if m.disk_status(key) is not None}


def _check_static(m, ever_stored: set) -> None:
    cpu, disk = _cpu_resident(m), _disk_resident(m)
    # Capacity, and the chunk counts agree with the residents.
    assert len(cpu) == m.num_used_chunks <= m.num_chunks
    assert len(disk) == m.num_disk_used_chunks <= m.disk_num_chunks
    # Disk chunks come only from CPU stores (write-through of GPU stores).
    assert disk <= ever_stored
    # Promotions: reading on disk, pending in the CPU; writes: writing on disk, pinned in CPU.
    assert m.promoting_keys() == {key for key in KEYS if m.disk_status(key) == "reading"}
    assert all(m.cpu_status(key) == "pending" for key in m.promoting_keys())
    assert m.writing_keys() == {key for key in KEYS if m.disk_status(key) == "writing"}
    assert all(m.cpu_status(key) == "pinned" for key in m.writing_keys())
    # Disk chunks = writes finished + writes in flight - evictions.
    assert m.num_disk_used_chunks == m.disk_stored_keys + len(m.writing_keys()) - m.disk_evicted_keys
    assert m.cpu_hits + m.disk_hits == m.num_loaded_keys
    if m.disk_num_chunks >= len(KEYS):
        # Inclusive and never full: every readable CPU chunk is on disk too.
        assert {key for key in cpu if m.cpu_status(key) in ("ready", "pinned")} <= disk
        assert m.disk_dropped_keys == m.disk_evicted_keys == 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), cpu_chunks=st.integers(1, 4), disk_chunks=st.one_of(st.integers(1, 4), st.integers(1, 8)),
       steps=st.integers(1, 3), write_steps=st.integers(1, 3), ops=st.lists(_op_st, min_size=20, max_size=80))
def test_tiered_invariants(policy, cpu_chunks, disk_chunks, steps, write_steps, ops):
    clock = StepPromotions(steps, write_steps)
    m = TieredOffloadingManager(CPUOffloadingManager(cpu_chunks, policy), disk_chunks, policy, clock)
    driver = Driver(m)
    ever_stored: set = set()
    cpu_gone: set = set()
    disk_gone: set = set()
    dropped: set = set()
    seen = {"cpu_evictions": 0, "disk_evictions": 0}
    promotion_step: dict = {}
    write_step: dict = {}

    def step(op):
        """Apply one manager call and check everything after it."""
        cpu_before, disk_before = _cpu_resident(m), _disk_resident(m)
        status_before = {key: (m.cpu_status(key), m.disk_status(key)) for key in KEYS}
        promoting_before, writing_before = m.promoting_keys(), m.writing_keys()
        dropped_before = m.disk_dropped_keys
        job = None
        if op[0] == "complete_store" and driver.store_jobs:
            job = driver.store_jobs[op[1] % len(driver.store_jobs)]
        step_at_call = clock.step
        answer = driver.apply(op)
        assert answer is not LookupResult.RETRY

        cpu_after, disk_after = _cpu_resident(m), _disk_resident(m)
        failed_store_keys = set(job[1]) if job is not None and not op[2] else set()
        # Pinned and not-ready chunks are never evicted: a GPU load or store still in
        # flight keeps its CPU chunk, a CPU/disk transfer still in flight keeps both (one
        # that finishes at this call's poll releases its chunks, which may then go).
        if op[0] != "reset":
            gpu_pinned = {key for _, keys in driver.load_jobs + driver.store_jobs for key in keys}
            assert gpu_pinned <= cpu_after, op
        still_moving = (promoting_before & m.promoting_keys()) | (writing_before & m.writing_keys())
        assert still_moving <= disk_after, op
        if op[0] != "reset":
            assert still_moving <= cpu_after, op
        if op[0] in ("complete_store", "complete_load", "touch", "finish"):
            # These never poll the clock: nothing is released, so nothing pinned goes.
            for key, (cpu_status, disk_status) in status_before.items():
                if cpu_status in ("pinned", "pending") and key not in failed_store_keys:
                    assert m.cpu_status(key) is not None, (op, key)
                if disk_status in ("writing", "reading"):
                    assert m.disk_status(key) is not None, (op, key)
        # What left a tier was evicted, except the CPU reset and a failed store's own chunks.
        left_cpu, left_disk = cpu_before - cpu_after, disk_before - disk_after
        cpu_gone.update(left_cpu)
        disk_gone.update(left_disk)
        if op[0] != "reset":
            seen["cpu_evictions"] += len(left_cpu - failed_store_keys)
        seen["disk_evictions"] += len(left_disk)
        assert seen["cpu_evictions"] == m.num_evicted_keys
        assert seen["disk_evictions"] == m.disk_evicted_keys
        # The keys a successful store made readable are written through, or counted dropped.
        if job is not None and op[2]:
            turned_ready = {key for key in job[1] if status_before[key][0] == "pending"
                            and m.cpu_status(key) in ("ready", "pinned")}
            assert turned_ready == set(job[1])
            ever_stored.update(turned_ready)
            not_on_disk = {key for key in turned_ready if m.disk_status(key) is None}
            assert len(not_on_disk) == m.disk_dropped_keys - dropped_before
            dropped.update(not_on_disk)
            for key in turned_ready - not_on_disk:
                if status_before[key][1] is None:
                    write_step[key] = step_at_call
        else:
            assert m.disk_dropped_keys == dropped_before
        # Conservation: every stored key is somewhere, or was seen leaving both tiers.
        for key in ever_stored:
            assert key in cpu_after or key in disk_after or (
                key in cpu_gone and (key in disk_gone or key in dropped)), key
        # Timing of the lockstep clock (a job finishes at a poll during its due step).
        for key in m.promoting_keys() - promoting_before:
            promotion_step[key] = step_at_call
        for key in m.writing_keys() - writing_before:
            assert write_step[key] == step_at_call
        if op[0] != "reset":
            for key in promoting_before - m.promoting_keys():
                assert step_at_call == promotion_step[key] + steps, (op, key)
            for key in writing_before - m.writing_keys():
                assert step_at_call == write_step[key] + write_steps, (op, key)
        _check_static(m, ever_stored)
        return answer

    def expanded():
        for op in ops + [("end",)] * 4:
            yield from driver.expand(op)

    for op in expanded():
        if op[0] == "load":
            # One lookup at a time (a lookup's promotion may evict a key a later lookup of
            # the same batch promotes back), then the load of the hits.
            answers = []
            for key in op[2]:
                answers.append(step(("lookup", op[1], key)))
                if answers[-1] is LookupResult.MISS:
                    break
            hits = load_hits(op[2], answers)
            driver.note_deferral(op, answers)
            if hits:
                step(("prepare_load", op[1], hits))
        else:
            step(op)
    # Enough steps drain every transfer.
    assert not m.has_pending_work() and not m.promoting_keys() and not m.writing_keys()


def test_promoted_chunk_is_a_disk_hit_only_for_its_request():
    m = TieredOffloadingManager(CPUOffloadingManager(1, "lru"), 4, "lru", StepPromotions(1))
    a, b = ReqContext("a"), ReqContext("b")
    x, y = make_offload_key(1, 0), make_offload_key(2, 0)
    for ctx in (a, b):
        m.on_new_request(ctx)
    m.prepare_store([x], a)
    m.complete_store([x], a)
    m.on_schedule_end()  # the write of x finishes at the start of step 1
    assert m.prepare_store([y], a).evicted_keys == [x]  # the only CPU chunk: x goes to disk only
    m.complete_store([y], a)
    m.on_schedule_end()
    assert m.tier_of(x) == "disk" and m.tier_of(y) == "cpu+disk"
    assert m.lookup(x, b) is LookupResult.HIT_PENDING  # promotion started, y evicted for it
    assert m.tier_of(y) == "disk" and m.promotions == 1
    m.on_schedule_end()
    assert m.lookup(x, a) is LookupResult.HIT and m.lookup(x, b) is LookupResult.HIT
    assert m.get_load_source(x, b) == "disk" and m.get_load_source(x, a) == "cpu"
    m.prepare_load([x], a)
    m.prepare_load([x], b)
    assert (m.cpu_hits, m.disk_hits, m.num_loaded_keys, m.num_stored_keys) == (1, 1, 2, 2)
    m.reset_cache()  # forgets which request promoted what; the disk stays
    assert m.get_load_source(x, b) == "cpu" and m.tier_of(x) == "disk"


def test_disk_policy_keeps_out_of_the_cpu_policys_state():
    """The disk LRU keeps its request ranks in views of its own: the CPU LRU orders one
    request exactly as without a disk, and the disk orders write batches oldest first,
    each tail first."""
    k0, k1, k2 = make_offload_key(0, 0), make_offload_key(1, 0), make_offload_key(2, 0)
    j0 = make_offload_key(0, 1)  # positions: k0 and j0 16, k1 32, k2 48

    def run(manager, cpu):
        ctx = _ctx("a", 0)
        manager.on_new_request(ctx)
        for batch in ([k0, k1], [k2, j0]):
            manager.prepare_store(batch, ctx)
            manager.complete_store(batch, ctx)
            manager.on_schedule_end()
        manager.on_schedule_end()
        return [tuple(row[0]) for row in cpu.policy.snapshot()["lru"]]

    cpu = CPUOffloadingManager(8, "lru")
    tiered = TieredOffloadingManager(cpu, 8, "lru", StepPromotions(1))
    plain = CPUOffloadingManager(8, "lru")
    # One provisional rank for the running request, tails first: k2, k1, then k0 and j0.
    assert run(tiered, cpu) == run(plain, plain) == [k2, k1, k0, j0]
    assert [tuple(row[0]) for row in tiered.disk.policy.snapshot()["lru"]] == [k1, k0, k2, j0]


def test_full_cpu_turns_a_disk_hit_into_a_miss():
    m = TieredOffloadingManager(CPUOffloadingManager(1, "lru"), 4, "lru", StepPromotions(1))
    a = ReqContext("a")
    m.on_new_request(a)
    x, y = make_offload_key(1, 0), make_offload_key(2, 0)
    m.prepare_store([x], a)
    m.complete_store([x], a)
    m.on_schedule_end()
    m.prepare_store([y], a)  # evicts x (on disk now); y's store is in flight: not evictable
    assert m.lookup(x, a) is LookupResult.MISS and m.promotion_failures == 1 and m.promotions == 0


def test_full_disk_drops_the_tail_of_a_write():
    m = TieredOffloadingManager(CPUOffloadingManager(4, "lru"), 1, "lru", StepPromotions(1))
    a = ReqContext("a")
    m.on_new_request(a)
    keys = [make_offload_key(h, 0) for h in range(3)]
    m.prepare_store(keys, a)
    m.complete_store(keys, a)
    assert [m.disk_status(k) for k in keys] == ["writing", None, None] and m.disk_dropped_keys == 2
    assert [m.cpu_status(k) for k in keys] == ["pinned", "ready", "ready"]


def test_timed_clock_is_one_fifo_queue():
    now = [0.0]
    clock = TimedPromotions(100.0, 0.5, lambda: now[0])
    clock.start("p1", 100)  # 0 + 0.5 + 1.0 = 1.5
    clock.start("w1", 50, write=True)  # max(0, 1.5) + 0.5 + 0.5 = 2.5: writes queue with reads
    assert clock.next_finish_s() == 1.5
    now[0] = 1.4
    assert clock.poll() == []
    now[0] = 1.5
    assert clock.poll() == ["p1"]
    now[0] = 3.0
    clock.start("p2", 0)  # the queue is idle: 3.0 + 0.5
    assert clock.poll() == ["w1"] and clock.busy_until_s == 3.5
    assert clock.drain() == ["p2"] and clock.pending() == 0


def test_timed_promotion_waits_behind_the_writes():
    now = [0.0]
    clock = TimedPromotions(1000.0, 0.0, lambda: now[0])
    m = TieredOffloadingManager(CPUOffloadingManager(3, "lru"), 8, "lru", clock, chunk_bytes=1000)
    a = ReqContext("a")
    m.on_new_request(a)
    x, v, y, z = (make_offload_key(h, 0) for h in range(1, 5))
    m.prepare_store([x, v], a)
    m.complete_store([x, v], a)  # write W1, 2000 B: [0, 2] s
    now[0] = 2.0
    assert m.prepare_store([y, z], a).evicted_keys == [x]  # W1 done; one free chunk: evict the LRU, x
    m.complete_store([y, z], a)  # write W2: [2, 4] s
    m.on_schedule_end()
    assert m.lookup(x, a) is LookupResult.HIT_PENDING  # v evicted for the promotion
    m.on_schedule_end()  # the promotion starts at 2 s, queued behind W2: [4, 5] s (alone: [2, 3])
    now[0] = 4.5
    assert m.lookup(x, a) is LookupResult.HIT_PENDING and not m.writing_keys()
    m.on_schedule_end()
    now[0] = 5.0
    assert m.lookup(x, a) is LookupResult.HIT and m.disk_loaded_keys == 1
    assert m.get_load_source(x, a) == "disk"


def test_clock_arguments_are_checked():
    from kvtwin.sim.core.errors import ConfigError
    import pytest
    with pytest.raises(ConfigError):
        StepPromotions(0)
    with pytest.raises(ConfigError):
        TimedPromotions(0, 0.0, lambda: 0.0)
    with pytest.raises(ConfigError):
        TieredOffloadingManager(CPUOffloadingManager(1), -1, "lru", StepPromotions())


# --- one sequence, by hand ---------------------------------------------------------------


def test_hand_computed_sequence():
    """CPU 2 chunks, disk 4 chunks, LRU in both, StepPromotions(1) (writes too).

    Keys a..e carry no token positions, so LRU ranks follow insertion order and request
    finishes (tails first, so a request's head ends up most recent). ``tiers`` lists
    ``tier_of`` for a..e after each step of the sequence.
    """
    clock = StepPromotions(1)
    m = TieredOffloadingManager(CPUOffloadingManager(2, "lru"), 4, "lru", clock)
    a, b, c, d, e = (make_offload_key(h, 0) for h in range(1, 6))
    A, B, C = ReqContext("A"), ReqContext("B"), ReqContext("C")

    def tiers():
        return [m.tier_of(k) for k in (a, b, c, d, e)]

    # --- step 0
    m.on_new_request(A)
    out = m.prepare_store([a, b], A)  # CPU empty: two fresh chunks, nothing evicted
    assert (out.keys_to_store, out.evicted_keys) == ([a, b], [])
    m.complete_store([a, b], A)  # a, b ready in the CPU, pinned by the write-through (job W1, due step 1)
    assert tiers() == ["cpu+disk", "cpu+disk", "none", "none", "none"]
    assert [m.cpu_status(a), m.disk_status(a)] == ["pinned", "writing"]
    m.on_request_finished(A)  # CPU LRU, least recent first: b, a (the head a is the most recent)
    m.on_schedule_end()  # nothing due at step 0; the clock moves to step 1

    # --- step 1
    m.on_new_request(B)
    out = m.prepare_store([c], B)
    # Its poll finishes W1 (due 1): a, b ready on disk (disk LRU: a, b), unpinned in the CPU.
    # The CPU is full: evict its least recent idle chunk, b.
    assert (out.keys_to_store, out.evicted_keys) == ([c], [b])
    assert tiers() == ["cpu+disk", "disk", "cpu", "none", "none"]
    m.complete_store([c], B)  # c written through (W2, due step 2); disk LRU a, b, c
    assert m.lookup(b, B) is LookupResult.HIT_PENDING
    # b is on disk only: promote it. Its CPU chunk comes from evicting a (c is pinned by W2).
    # The disk LRU counts the read as a use: a, c, b.
    assert tiers() == ["disk", "cpu+disk", "cpu+disk", "none", "none"]
    assert [m.cpu_status(b), m.disk_status(b)] == ["pending", "reading"]
    assert m.lookup(a, B) is LookupResult.MISS
    # a is on disk, but the CPU has no evictable chunk (b pending, c pinned): MISS.
    assert (m.promotions, m.promotion_failures) == (1, 1)
    m.on_schedule_end()  # the promotion P1 of b starts at step 1, due step 2; clock -> 2

    # --- step 2
    assert m.lookup(b, B) is LookupResult.HIT  # the poll finishes W2 then P1: b ready in the CPU
    assert tiers() == ["disk", "cpu+disk", "cpu+disk", "none", "none"]
    m.prepare_load([b], B)
    assert m.get_load_source(b, B) == "disk"  # promoted for B: a disk hit
    m.complete_load([b], B)
    # B's first sights were c (stored), b (the promotion's store), a (the failed promotion's
    # offer); its finish ranks them tail first (a is not resident), so the CPU LRU is b, c.
    m.on_request_finished(B)
    m.on_new_request(C)
    assert m.lookup(b, C) is LookupResult.HIT
    m.prepare_load([b], C)
    assert m.get_load_source(b, C) == "cpu"  # C did not promote it: a CPU hit
    m.complete_load([b], C)
    out = m.prepare_store([d, e], C)  # evict both idle CPU chunks, LRU first: b, c
    assert (out.keys_to_store, out.evicted_keys) == ([d, e], [b, c])
    assert tiers() == ["disk", "disk", "disk", "cpu", "cpu"]
    m.complete_store([d, e], C)
    # The write-through needs 2 disk chunks, 1 is free: evict the disk's LRU, a (W3, due 3).
    assert tiers() == ["none", "disk", "disk", "cpu+disk", "cpu+disk"]
    assert m.lookup(a, C) is LookupResult.MISS  # evicted from both tiers
    m.on_schedule_end()  # clock -> 3

    # --- step 3
    assert m.lookup(d, C) is LookupResult.HIT  # the poll finishes W3
    assert [m.disk_status(d), m.cpu_status(d)] == ["ready", "ready"]
    assert m.tier_counters() == {
        "cpu": {"stored": 5, "loaded": 2, "evicted": 4, "hits": 1, "promoted_in": 1, "used_chunks": 2},
        "disk": {"stored": 5, "loaded": 1, "evicted": 1, "dropped": 0, "hits": 1, "promotions": 1,
                 "promotion_failures": 1, "used_chunks": 4},
    }
    assert not m.has_pending_work() and clock.step == 3
