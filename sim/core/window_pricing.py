"""How a decode window's batches are priced without running them (``WindowPricing``): the
executor's closed form for a batch of decodes, and the keys those decodes attend per layer
class, kept in closed form for windowed and chunked layers (``LocalKeySum``) as a window's
members come and go (docs/architecture.md#decode-windows)."""

from __future__ import annotations

import heapq
from typing import Any, Protocol

from kvtwin.sim.core.engine import Execution
from kvtwin.sim.core.scheduler_output import SchedulerOutput

# How a layer class's decodes attend their context (``WindowPricing.decode_key_shapes``):
# every key, the last ``W`` keys (sliding window), the keys of the current chunk of ``C``
# (chunked local), or none (a recurrent state, read once whatever the context).
FULL_KEYS = 0
WINDOW_KEYS = 1
CHUNK_KEYS = 2
NO_KEYS = 3


def decode_keys(kind: int, size: int, context_ends: list[int]) -> int:
    """The keys decodes ending at ``context_ends`` attend in a layer of shape ``(kind,
    size)``: what ``decode_attended_keys`` of its spec returns."""
    if kind == FULL_KEYS:
        return sum(context_ends)
    if kind == WINDOW_KEYS:
        return sum(e if e < size else size for e in context_ends)
    if kind == CHUNK_KEYS:
        return sum((e - 1) % size + 1 for e in context_ends)
    return 0


class LocalKeySum:
    """The keys a window batch's member decodes attend in layers of one windowed shape,
    kept in closed form as members come and go and their contexts grow by one a batch.

    At batch ``j`` member ``i`` decodes to context ``e = c0 + j + 1``. Sliding window
    ``W``: it attends ``min(e, W)`` keys, ``W`` from batch ``W - 1 - c0`` on; so the sum
    is ``W`` per capped member plus the uncapped members' contexts. Chunked local ``C``:
    it attends ``(e - 1) mod C + 1 = e - C * floor((c0 + j) / C)`` keys; so the sum is the
    members' contexts less ``C`` times the sum of those floors, each of which grows by one
    at a batch known in advance. Either way a member changes class only at a scheduled
    batch (a heap of them), as it changes block in the KV cache manager."""

    def __init__(self, kind: int, size: int):
        self.kind = kind
        self.size = size
        # Window: capped members' count, the uncapped ones' count and c0 sum. Chunk: the
        # active members' floors' sum (in ``capped``).
        self.capped = 0
        self.num_open = 0
        self.c0_sum_open = 0
        # Member -> its floor (chunk), or -1 uncapped / -2 capped (window); gone: absent.
        self.state: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []

    def join(self, i: int, c0: int, index: int) -> None:
        """Member ``i`` (``c0``) decodes from batch ``index`` on."""
        size = self.size
        if self.kind == WINDOW_KEYS:
            cap_batch = size - 1 - c0
            if cap_batch <= index:
                self.state[i] = -2
                self.capped += 1
            else:
                self.state[i] = -1
                self.num_open += 1
                self.c0_sum_open += c0
                heapq.heappush(self.events, (cap_batch, i))
        else:
            floor = (c0 + index) // size
            self.state[i] = floor
            self.capped += floor
            heapq.heappush(self.events, ((floor + 1) * size - c0, i))

    def leave(self, i: int, c0: int) -> None:
        """Member ``i`` decodes no more (its events are dropped when they come up)."""
        state = self.state.pop(i)
        if self.kind == WINDOW_KEYS:
            if state == -2:
                self.capped -= 1
            else:
                self.num_open -= 1
                self.c0_sum_open -= c0
        else:
            self.capped -= state

    def advance(self, index: int, computed_at_open: list[int]) -> None:
        """Bring every member to batch ``index`` (once per batch, in order)."""
        events = self.events
        state = self.state
        size = self.size
        while events and events[0][0] <= index:
            i = heapq.heappop(events)[1]
            current = state.get(i)
            if current is None:
                continue
            c0 = computed_at_open[i]
            if self.kind == WINDOW_KEYS:
                state[i] = -2
                self.capped += 1
                self.num_open -= 1
                self.c0_sum_open -= c0
            else:
                floor = (c0 + index) // size
                state[i] = floor
                self.capped += floor - current
                heapq.heappush(events, ((floor + 1) * size - c0, i))

    def keys(self, index: int, context_ends_sum: int) -> int:
        """The sum at batch ``index`` (members brought to it; ``context_ends_sum`` theirs)."""
        if self.kind == WINDOW_KEYS:
            return self.size * self.capped + self.c0_sum_open + self.num_open * (index + 1)
        return context_ends_sum - self.size * self.capped


class WindowPricing(Protocol):
    """An executor whose window batches need not run: a closed form prices a batch of
    decodes (with a real part's prefill chunks), and its tokens are ``base + index``."""

    def execute(self, output: SchedulerOutput) -> Execution:
        ...

    def decode_step_cost(self, num_decodes: int, context_ends_sum: int,
                         prefill_items: list[tuple[int, int]] | None = None) -> Any:
        """The cost (its ``total_s`` the seconds) ``execute`` predicts for such a batch."""
        ...

    def decode_key_shapes(self) -> list[tuple[int, int]] | None:
        """Per layer class, how its decodes attend (``FULL_KEYS`` ...); None where every
        class attends the whole context (``decode_step_cost`` then prices a batch)."""
        ...

    def decode_step_cost_by_keys(self, num_decodes: int, attended_keys: list[int],
                                 prefill_items: list[tuple[int, int]] | None = None) -> Any:
        """``decode_step_cost`` given the keys the decodes attend per layer class."""
        ...

    def sample(self, output: SchedulerOutput) -> dict[str, list[int]]:
        ...

    def token_bases(self, request_ids: list[str]) -> list[int | None]:
        ...


def part_decode_ends(part: SchedulerOutput) -> list[int]:
    """The context ends of a window batch's real part's decodes (one-token chunks)."""
    return [computed + 1 for num_new, computed in zip(part.num_scheduled_tokens.values(), part.num_computed_tokens)
            if num_new == 1]


def part_cost_terms(part: SchedulerOutput) -> tuple[int, int, list[tuple[int, int]]]:
    """What a window batch's real part adds to its cost: (decodes, the sum of their context
    ends, prefill chunks as (new tokens, computed before)), as ``step_cost`` splits them."""
    num_decodes = 0
    ends_sum = 0
    prefill_items: list[tuple[int, int]] = []
    for num_new, computed in zip(part.num_scheduled_tokens.values(), part.num_computed_tokens):
        if num_new == 1:
            num_decodes += 1
            ends_sum += computed + 1
        else:
            prefill_items.append((num_new, computed))
    return num_decodes, ends_sum, prefill_items


class WindowBatchTerms:
    """The closed-form terms of a window batch's cost, kept as members join and leave:
    how many members it decodes, the sum of their ``c0`` (their context ends at batch
    ``j`` sum to ``c0_sum_active + num_active * (j + 1)``), and per windowed or chunked
    layer class the keys they attend (``LocalKeySum``). ``key_shapes``: the pricing's
    (``WindowPricing.decode_key_shapes``; None: every layer attends the whole context)."""

    def __init__(self, computed_at_open: list[int], key_shapes: list[tuple[int, int]] | None):
        self.num_active = len(computed_at_open)
        self.c0_sum_active = sum(computed_at_open)
        self.key_shapes = key_shapes
        self.local_sums: dict[tuple[int, int], LocalKeySum] = {}
        if key_shapes is not None:
            for kind, size in key_shapes:
                if kind in (WINDOW_KEYS, CHUNK_KEYS) and (kind, size) not in self.local_sums:
                    local = self.local_sums[(kind, size)] = LocalKeySum(kind, size)
                    for i, c0 in enumerate(computed_at_open):
                        local.join(i, c0, 0)

    def step(self, index: int, joining: list[int], leaving: list[int], computed_at_open: list[int]) -> None:
        """Batch ``index`` (once per batch, in order): members ``joining`` decode from it on,
        those ``leaving`` no more (``computed_at_open`` by member)."""
        for i in joining:
            self.num_active += 1
            self.c0_sum_active += computed_at_open[i]
        for i in leaving:
            self.num_active -= 1
            self.c0_sum_active -= computed_at_open[i]
        if self.local_sums:
            for local in self.local_sums.values():
                for i in joining:
                    local.join(i, computed_at_open[i], index)
                for i in leaving:
                    local.leave(i, computed_at_open[i])
                local.advance(index, computed_at_open)

    def context_ends_sum(self, index: int) -> int:
        """The sum of the context lengths batch ``index``'s member decodes end at."""
        return self.c0_sum_active + self.num_active * (index + 1)

    def attended_keys(self, index: int, part_ends: list[int]) -> list[int]:
        """Per layer class (``key_shapes``), the keys batch ``index``'s decodes attend: its
        member decodes (closed form) and its real part's decodes ending at ``part_ends``."""
        shapes = self.key_shapes
        assert shapes is not None
        ends_sum = self.context_ends_sum(index)
        attended: list[int] = []
        for kind, size in shapes:
            if kind == FULL_KEYS:
                keys = ends_sum
            elif kind == NO_KEYS:
                keys = 0
            else:
                keys = self.local_sums[(kind, size)].keys(index, ends_sum)
            attended.append(keys + decode_keys(kind, size, part_ends) if part_ends else keys)
        return attended
