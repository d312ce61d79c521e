"""Value types of the KV offloading tier: keys, lookup results, per-request context.

Reproduces the parts of vLLM 0.33's ``vllm/v1/kv_offload/base.py`` that the scheduler-side
manager needs: ``OffloadKey`` (``make_offload_key`` / ``get_offload_group_idx``),
``ReqContext`` (per-request state slots and key end-token positions), ``LookupResult``,
``OffloadPolicy`` / ``RequestOffloadingContext`` and ``PrepareStoreOutput``. The worker
side (load/store specs as tensors, canonical KV layouts) is not modelled here: a store or
load is described by the chunk ids it touches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

# An offload key is ``(block_hash, group_idx)``; the block hash is an int or bytes, as the
# simulator's hashing produces (``kvtwin.sim.core.hashing``).
#
# vLLM packs the key as ``hash_bytes + group_idx.to_bytes(4, "big")`` and its LRU heap
# breaks rank ties by comparing keys. Ranks only tie between keys of one request at one
# token position, i.e. the same block in different KV cache groups, which share the block
# hash; so the tie is decided by the group index alone, and the tuple order agrees with
# vLLM's byte order (more generally, for equal-length big-endian hashes byte order is
# integer order, which the recorded golden sequences check).
# (block hash, group index). Typed as a plain tuple on purpose: mypyc unboxes a fixed-length
# tuple type into a C struct and would box a new tuple (and hash it afresh) at every dict or
# set operation on a key, which the tier does dozens of times per key.
OffloadKey = tuple

_T = TypeVar("_T")


def make_offload_key(block_hash: object, group_idx: int) -> OffloadKey:
    return (block_hash, group_idx)


def offload_key_group(key: OffloadKey) -> int:
    return key[1]


class LookupResult(Enum):
    """What ``lookup`` says about one key: absent, loadable, being written, or ask later."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class OffloadPolicy(Enum):
    """Which of a request's chunks a tier wants offered for storing."""

    # Only chunks the request computed itself; chunks it got from a prefix hit were
    # already offloaded by the request that computed them.
    CHUNK_LEVEL = "chunk_level"


@dataclass(frozen=True)
class RequestOffloadingContext:
    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass(frozen=True)
class PrepareStoreOutput:
    """The answer to one store offer.

    ``keys_to_store`` are the offered keys that were absent and now own a freshly
    allocated chunk each (``chunk_ids``, aligned with them); ``evicted_keys`` are the
    resident keys dropped to make room, in eviction order.
    """

    keys_to_store: list
    evicted_keys: list
    chunk_ids: list = field(default_factory=list)


class ReqContext:
    """What a manager knows about one request across calls.

    ``get_state`` / ``set_state`` hold one object per type, so each component (the
    manager's access record, the LRU policy's request rank) keeps its own slot without
    knowing about the others. The scheduler records each key's end-token position so
    policies can restore prefix order when stores arrive out of order.
    """

    __slots__ = ("req_id", "_state", "_offload_key_positions")

    def __init__(self, req_id: str):
        self.req_id = req_id
        self._state: dict[type, object] = {}
        self._offload_key_positions: dict[OffloadKey, int] = {}

    def __repr__(self) -> str:
        return f"ReqContext(req_id={self.req_id!r})"

    def set_state(self, value: object) -> None:
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)  # type: ignore[return-value]

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)

    def offload_key_positions(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        """The end-token positions of ``keys``, in order; None as soon as one has none.
        (One call for a request's keys: ``get_offload_key_position`` per key costs a call
        each.)"""
        known = self._offload_key_positions
        positions: list[int] = []
        for key in keys:
            position = known.get(key)
            if position is None:
                return None
            positions.append(position)
        return positions
