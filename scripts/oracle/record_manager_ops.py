"""Record vLLM's real CPU offloading manager on seeded random operation sequences.

Run with the oracle virtual environment (vLLM 0.33, CPU only)::

    PYTHONWARNINGS=ignore ~/.cache/kvtwin-oracle-venv/bin/python scripts/oracle/record_manager_ops.py

It drives ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` with both cache policies
through requests that share prefixes, store and load windows of their blocks in two KV
cache groups, pin chunks across transfers, fail some stores and finish in random order,
and writes one JSONL file per sequence to ``tests/golden/offload_manager/``: a header
line, then one line per operation with its arguments and vLLM's exact answer, the
manager's chunk counts afterwards and a digest of the policy's order.
``tests/sim/offload/test_cpu_manager.py`` replays the files through kvtwin's manager.

Keys are written as ``[hash_int, group]``. vLLM's key is built from the hash as 8 bytes
big-endian plus the group as 4 bytes big-endian; the script checks for every sequence that
sorting those byte keys gives the same order as sorting the ``(hash, group)`` tuples
kvtwin uses, so that any tie vLLM breaks by key comparison breaks the same way here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "golden" / "offload_manager"
BLOCK_TOKENS = 16
NUM_GROUPS = 2


@dataclass(frozen=True)
class SequenceSpec:
    name: str
    policy: str
    num_chunks: int
    num_ops: int
    seed: int
    num_chains: int = 4
    chain_blocks: int = 10
    max_active: int = 4
    max_window: int = 6
    reset_prob: float = 0.0
    load_weight: float = 1.0
    touch_weight: float = 0.7
    store_threshold: int = 1
    max_tracker_size: int = 64_000


SEQUENCES = (
    SequenceSpec("lru_tight_a", "lru", 6, 300, 101, max_window=3),
    SequenceSpec("lru_tight_pins", "lru", 8, 300, 102, max_window=3, load_weight=3.0),
    SequenceSpec("lru_tight_resets", "lru", 5, 300, 103, reset_prob=0.01),
    SequenceSpec("lru_medium", "lru", 14, 300, 104, max_active=5),
    SequenceSpec("lru_roomy", "lru", 30, 250, 105),
    SequenceSpec("arc_tight_a", "arc", 6, 300, 201, max_window=3),
    SequenceSpec("arc_tight_pins", "arc", 8, 300, 202, max_window=3, load_weight=3.0),
    SequenceSpec("arc_tight_resets", "arc", 5, 300, 203, reset_prob=0.01),
    SequenceSpec("arc_medium", "arc", 14, 300, 204, max_active=5),
    SequenceSpec("arc_roomy", "arc", 30, 250, 205),
    # Reuse-heavy (loads, touches): T2 fills, and B1 hits arrive while B2 is the longer list.
    SequenceSpec("arc_frequency", "arc", 8, 300, 503, num_chains=2, chain_blocks=8, max_window=4,
                 load_weight=2.0, touch_weight=3.0),
    SequenceSpec("lru_threshold", "lru", 8, 250, 301, store_threshold=2, max_tracker_size=12),
    SequenceSpec("arc_threshold", "arc", 8, 250, 302, store_threshold=2, max_tracker_size=5),
    # Long prefixes and a large pool: the LRU heap's bulk-rebuild path (64+ keys at once).
    SequenceSpec("lru_long", "lru", 96, 90, 401, num_chains=2, chain_blocks=44, max_window=40, max_active=3),
)


def key_of(hash_int: int, group: int) -> bytes:
    return make_offload_key(hash_int.to_bytes(8, "big"), group)


def key_json(key: bytes) -> list[int]:
    return [int.from_bytes(key[:-4], "big"), int.from_bytes(key[-4:], "big")]


def policy_snapshot(manager: CPUOffloadingManager) -> dict:
    """The policy's order in the form kvtwin's ``CachePolicy.snapshot`` gives it."""
    policy = manager._policy
    if isinstance(policy, LRUCachePolicy):
        order = sorted(policy.chunks, key=lambda k: (policy._ranks[k], k))
        return {"lru": [[key_json(k), policy.chunks[k].chunk_id, policy.chunks[k].ref_cnt] for k in order]}
    assert isinstance(policy, ARCCachePolicy)
    return {
        "t1": [[key_json(k), c.chunk_id, c.ref_cnt] for k, c in policy.t1.items()],
        "t2": [[key_json(k), c.chunk_id, c.ref_cnt] for k, c in policy.t2.items()],
        "b1": [key_json(k) for k in policy.b1],
        "b2": [key_json(k) for k in policy.b2],
        "target_t1_size": float(policy.target_t1_size),
    }


def digest(snapshot: dict) -> str:
    text = json.dumps(snapshot, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Request:
    req_id: str
    ctx: ReqContext
    hashes: list[int]
    position_mode: str  # "all", "partial" or "none"
    finished: bool = False
    positioned: set = field(default_factory=set)


class Recorder:
    def __init__(self, spec: SequenceSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.manager = CPUOffloadingManager(spec.num_chunks, cache_policy=spec.policy,
                                            store_threshold=spec.store_threshold,
                                            max_tracker_size=spec.max_tracker_size)
        self.all_hashes: set[int] = set()
        self.chains = [[self._fresh_hash() for _ in range(spec.chain_blocks)] for _ in range(spec.num_chains)]
        self.requests: dict[str, _Request] = {}
        self.next_req = 0
        self.loads: list[tuple[str, list[bytes]]] = []
        self.stores: list[tuple[str, list[bytes]]] = []
        self.lines: list[dict] = []

    def _fresh_hash(self) -> int:
        # Mostly full 64-bit hashes; some small ones, so leading zero bytes occur too.
        while True:
            h = self.rng.getrandbits(16 if self.rng.random() < 0.2 else 64)
            if h not in self.all_hashes:
                self.all_hashes.add(h)
                return h

    # --- helpers ------------------------------------------------------------------

    def _active(self) -> list[_Request]:
        return [r for r in self.requests.values() if not r.finished]

    def _positions_for(self, req: _Request, keys: list[bytes]) -> list | None:
        """Set end-token positions for keys not yet positioned, per the request's mode."""
        out = []
        any_set = False
        for key in keys:
            if key in req.positioned or req.position_mode == "none":
                out.append(None)
                continue
            if req.position_mode == "partial" and self.rng.random() < 0.5:
                out.append(None)
                continue
            block = req.hashes.index(int.from_bytes(key[:-4], "big"))
            position = (block + 1) * BLOCK_TOKENS
            req.ctx.set_offload_key_position(key, position)
            req.positioned.add(key)
            out.append(position)
            any_set = True
        return out if any_set else None

    def _window(self, req: _Request) -> list[bytes]:
        """A window of the request's blocks in one or both groups, in a random order."""
        n = len(req.hashes)
        length = self.rng.randint(1, min(self.spec.max_window, n))
        start = self.rng.randint(0, n - length)
        hashes = req.hashes[start:start + length]
        groups = self.rng.choice([(0,), (1,), (0, 1), (0, 1)])
        layout = self.rng.random()
        if layout < 0.5:
            keys = [key_of(h, g) for g in groups for h in hashes]
        else:
            keys = [key_of(h, g) for h in hashes for g in groups]
        if self.rng.random() < 0.15:
            keys.reverse()
        elif self.rng.random() < 0.1:
            self.rng.shuffle(keys)
        return keys

    def _emit(self, record: dict) -> None:
        m = self.manager
        record["used"] = m._num_allocated_chunks - len(m._free_list)
        record["evictable"] = m._num_evictable_cache_chunks
        record["pending"] = m._num_write_pending_chunks
        record["digest"] = digest(policy_snapshot(m))
        self.lines.append(record)

    # --- operations ---------------------------------------------------------------

    def op_new_request(self) -> None:
        req_id = f"r{self.next_req}"
        self.next_req += 1
        chain = self.rng.choice(self.chains)
        prefix = chain[: self.rng.randint(2, len(chain))]
        suffix = [self._fresh_hash() for _ in range(self.rng.choice([0, 0, 1, 2, 3]))]
        mode = self.rng.choices(["all", "partial", "none"], weights=[6, 2, 2])[0]
        req = _Request(req_id, ReqContext(req_id=req_id), prefix + suffix, mode)
        self.requests[req_id] = req
        result = self.manager.on_new_request(req.ctx)
        self._emit({"op": "on_new_request", "req": req_id, "result": result.policy.name})

    def op_lookup(self) -> None:
        req = self.rng.choice(list(self.requests.values()))
        group = self.rng.randrange(NUM_GROUPS)
        keys = [key_of(h, group) for h in req.hashes[: self.rng.randint(1, len(req.hashes))]]
        results = [self.manager.lookup(k, req.ctx).name for k in keys]
        self._emit({"op": "lookup", "req": req.req_id, "keys": [key_json(k) for k in keys], "result": results})

    def op_prepare_load(self) -> None:
        active = self._active()
        self.rng.shuffle(active)
        for req in active:
            # Loadable keys of the request, head to tail; a random run of them.
            hits = [key_of(h, g) for h in req.hashes for g in range(NUM_GROUPS)
                    if self.manager.lookup(key_of(h, g), req.ctx).name == "HIT"]
            if hits:
                break
        else:
            return
        start = self.rng.randrange(len(hits))
        candidates = hits[start:start + self.rng.randint(1, self.spec.max_window)]
        positions = self._positions_for(req, candidates)
        spec = self.manager.prepare_load(candidates, req.ctx)
        self.loads.append((req.req_id, candidates))
        self._emit({"op": "prepare_load", "req": req.req_id, "keys": [key_json(k) for k in candidates],
                    "pos": positions, "result": [int(b) for b in spec.block_ids]})

    def op_complete_load(self) -> None:
        if not self.loads:
            return
        req_id, keys = self.loads.pop(self.rng.randrange(len(self.loads)))
        self.manager.complete_load(keys, self.requests[req_id].ctx)
        self._emit({"op": "complete_load", "req": req_id, "keys": [key_json(k) for k in keys], "result": None})

    def op_prepare_store(self) -> None:
        active = self._active()
        if not active:
            return
        req = self.rng.choice(active)
        keys = self._window(req)
        positions = self._positions_for(req, keys)
        out = self.manager.prepare_store(keys, req.ctx)
        if out is None:
            result = None
        else:
            result = {"keys_to_store": [key_json(k) for k in out.keys_to_store],
                      "evicted_keys": [key_json(k) for k in out.evicted_keys],
                      "chunk_ids": [int(b) for b in out.store_spec.block_ids]}
            if out.keys_to_store:
                self.stores.append((req.req_id, list(out.keys_to_store)))
        self._emit({"op": "prepare_store", "req": req.req_id, "keys": [key_json(k) for k in keys],
                    "pos": positions, "result": result})

    def op_complete_store(self) -> None:
        if not self.stores:
            return
        req_id, keys = self.stores.pop(self.rng.randrange(len(self.stores)))
        if len(keys) > 1 and self.rng.random() < 0.15:
            # Complete part of a job now and the rest later.
            cut = self.rng.randint(1, len(keys) - 1)
            keys, rest = keys[:cut], keys[cut:]
            self.stores.append((req_id, rest))
        success = self.rng.random() < 0.85
        self.manager.complete_store(keys, self.requests[req_id].ctx, success=success)
        self._emit({"op": "complete_store", "req": req_id, "keys": [key_json(k) for k in keys],
                    "success": success, "result": None})

    def op_touch(self) -> None:
        req = self.rng.choice(list(self.requests.values()))
        keys = self._window(req)
        self.manager.touch(keys, req.ctx)
        self._emit({"op": "touch", "req": req.req_id, "keys": [key_json(k) for k in keys], "result": None})

    def op_finish(self) -> None:
        if self.rng.random() < 0.1 and self.requests:
            req = self.rng.choice(list(self.requests.values()))  # possibly finished already
        else:
            active = self._active()
            if not active:
                return
            req = self.rng.choice(active)
        req.finished = True
        self.manager.on_request_finished(req.ctx)
        self._emit({"op": "on_request_finished", "req": req.req_id, "result": None})

    def op_reset(self) -> None:
        self.manager.reset_cache()
        # vLLM never delivers completions of jobs started before a reset.
        self.loads.clear()
        self.stores.clear()
        self._emit({"op": "reset_cache", "result": None})

    def run(self) -> list[dict]:
        spec = self.spec
        ops = [
            (self.op_new_request, 1.0), (self.op_lookup, 1.0), (self.op_prepare_load, spec.load_weight),
            (self.op_complete_load, spec.load_weight * 0.8), (self.op_prepare_store, 3.0),
            (self.op_complete_store, 3.5), (self.op_touch, spec.touch_weight), (self.op_finish, 0.8),
        ]
        funcs = [f for f, _ in ops]
        weights = [w for _, w in ops]
        while len(self.lines) < spec.num_ops:
            if spec.reset_prob and self.rng.random() < spec.reset_prob:
                self.op_reset()
                continue
            if len(self._active()) < 1:
                self.op_new_request()
                continue
            op = self.rng.choices(funcs, weights)[0]
            if op is self.op_new_request and len(self._active()) >= spec.max_active:
                op = self.op_finish
            op()
        self._check_key_order()
        return self.lines

    def _check_key_order(self) -> None:
        keys = [(h, g) for h in self.all_hashes for g in range(NUM_GROUPS)]
        by_tuple = sorted(keys)
        by_bytes = sorted(keys, key=lambda hg: key_of(*hg))
        assert by_tuple == by_bytes, "byte order of vLLM keys differs from tuple order"


def write_sequence(spec: SequenceSpec) -> Path:
    import vllm

    lines = Recorder(spec).run()
    header = {"op": "header", "name": spec.name, "policy": spec.policy, "num_chunks": spec.num_chunks,
              "store_threshold": spec.store_threshold, "max_tracker_size": spec.max_tracker_size,
              "seed": spec.seed, "vllm_version": vllm.__version__}
    path = OUT_DIR / f"{spec.name}.jsonl"
    with path.open("w") as f:
        for record in [header, *lines]:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="sequence names to record (default: all)")
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for spec in SEQUENCES:
        if args.only and spec.name not in args.only:
            continue
        path = write_sequence(spec)
        print(f"{path.relative_to(REPO)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
