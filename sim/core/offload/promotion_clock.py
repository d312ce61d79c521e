"""When CPU↔disk transfers of the tiered offloading manager finish (``tiered_manager.py``).

vLLM's tiers move bytes on real threads against a monotonic clock; the simulator makes each
write (CPU→disk) and promotion (disk→CPU) a job on a ``PromotionClock``: ``StepPromotions``
counts scheduler steps (lockstep against vLLM's own scheduler), ``TimedPromotions`` runs
one FIFO disk queue in simulated seconds (the SimPy replay).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol

from kvtwin.sim.core.errors import require


class PromotionClock(Protocol):
    """When transfers between the CPU and the disk finish.

    ``start`` begins a job (an opaque hashable id) of ``num_bytes``; ``write`` tells a
    CPU→disk write from a disk→CPU promotion. ``poll`` returns the jobs finished since the
    last call, in the order they finished. ``on_schedule_end`` is called once at the end
    of every scheduler step. ``drain`` finishes every job still running, at once, and
    returns them (``reset_cache``).
    """

    def start(self, job: Hashable, num_bytes: int, *, write: bool = False) -> None: ...

    def poll(self) -> list: ...

    def on_schedule_end(self) -> None: ...

    def drain(self) -> list: ...


class StepPromotions:
    """Lockstep: a job started while the clock reads step ``s`` finishes at the start of
    step ``s + steps`` (``s + write_steps`` for a write). The step count advances at each
    ``on_schedule_end``; the first step is 0.

    A promotion asked for by a lookup in step ``s`` is started at that step's
    ``on_schedule_end`` (still step ``s``), so with ``steps=1`` the lookup answers
    HIT_PENDING in step ``s`` and HIT in step ``s + 1``: vLLM's best case.
    """

    def __init__(self, steps: int = 1, write_steps: int | None = None):
        write_steps = steps if write_steps is None else write_steps
        require(isinstance(steps, int) and steps >= 1, "offload.disk.promotion_steps", "an integer >= 1", steps)
        require(isinstance(write_steps, int) and write_steps >= 1, "offload.disk.write_steps", "an integer >= 1",
                write_steps)
        self.steps = steps
        self.write_steps = write_steps
        self.step = 0
        self._seq = 0
        self._due: list[tuple[int, int, Hashable]] = []

    def start(self, job: Hashable, num_bytes: int, *, write: bool = False) -> None:
        self._seq += 1
        heapq.heappush(self._due, (self.step + (self.write_steps if write else self.steps), self._seq, job))

    def poll(self) -> list:
        done = []
        while self._due and self._due[0][0] <= self.step:
            done.append(heapq.heappop(self._due)[2])
        return done

    def on_schedule_end(self) -> None:
        self.step += 1

    def drain(self) -> list:
        done = [job for _, _, job in sorted(self._due)]
        self._due.clear()
        return done

    def pending(self) -> int:
        return len(self._due)


class TimedPromotions:
    """One FIFO disk queue in simulated seconds: a job started at ``now`` finishes at
    ``max(now, previous job's finish) + latency_s + num_bytes / bandwidth_bytes_per_s``.

    Writes and promotions share the queue, so a burst of writes delays the promotions
    behind it. ``now_s_fn`` is the simulated clock (``lambda: env.now``).
    """

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float, now_s_fn: Callable[[], float]):
        require(bandwidth_bytes_per_s > 0, "offload.disk.bandwidth_bytes_per_s", "a number > 0",
                bandwidth_bytes_per_s)
        require(latency_s >= 0, "offload.disk.latency_s", "a number >= 0", latency_s)
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.now_s_fn = now_s_fn
        self.busy_until_s = float("-inf")
        self._queue: deque[tuple[float, Hashable]] = deque()

    def start(self, job: Hashable, num_bytes: int, *, write: bool = False) -> None:
        finish = max(self.now_s_fn(), self.busy_until_s) + self.latency_s + num_bytes / self.bandwidth_bytes_per_s
        self.busy_until_s = finish
        self._queue.append((finish, job))

    def poll(self) -> list:
        now = self.now_s_fn()
        done = []
        while self._queue and self._queue[0][0] <= now:
            done.append(self._queue.popleft()[1])
        return done

    def on_schedule_end(self) -> None:
        return

    def drain(self) -> list:
        done = [job for _, job in self._queue]
        self._queue.clear()
        return done

    def pending(self) -> int:
        return len(self._queue)

    def next_finish_s(self) -> float | None:
        """When the oldest running job finishes (None when idle)."""
        return self._queue[0][0] if self._queue else None
