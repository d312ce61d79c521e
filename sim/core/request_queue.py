"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival time)).

docs/semantics.md#preemption: a preempted request goes back to the *front* of the FCFS queue; in the
priority queue "front" is simply its (priority, arrival) order.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvtwin.sim.core.request import Request


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend(self, request: Request) -> None:
        # Put back, it takes its place by priority again.
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()


def remove_from_queue(queue: FCFSRequestQueue | PriorityRequestQueue, request: Request) -> None:
    """Take one request out of ``queue``, the others keeping their order."""
    ahead = []
    while (head := queue.pop()) is not request:
        ahead.append(head)
    for head in reversed(ahead):
        queue.prepend(head)
