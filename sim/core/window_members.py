"""A decode window's members and what it knows of each (docs/architecture.md#decode-windows).

Member ``i`` (indexed in running order: those decoding when the window opens, then those
its batches admit or finish prefilling) decodes in window batches ``first_batch(i)`` to
``last_batch(i)``; at window state ``j`` it has ``computed_at_open(i) + j`` computed tokens,
its output ``k`` is the token ``token_base(i) + k``, and its request's fields hold state
``synced(i)``. ``WindowMembers`` keeps these as parallel lists, read once per member and
batch on the window's hot path; ``ReferenceWindowMembers`` keeps one plain object per
member, and ``tests/sim/test_window_members.py`` checks the two answer every sequence of
calls alike.
"""

from __future__ import annotations


class WindowMembers:
    """A window's members as parallel lists, one entry per member index."""

    def __init__(self) -> None:
        self._computed_at_open: list[int] = []
        self._first_batch: list[int] = []
        self._last_batch: list[int] = []
        self._synced: list[int] = []
        self._token_base: list[int] = []

    def add(self, computed_at_open: int, first_batch: int, last_batch: int, synced: int, token_base: int) -> int:
        """A new member; returns its index (the count of members before it)."""
        self._computed_at_open.append(computed_at_open)
        self._first_batch.append(first_batch)
        self._last_batch.append(last_batch)
        self._synced.append(synced)
        self._token_base.append(token_base)
        return len(self._synced) - 1

    def count(self) -> int:
        return len(self._synced)

    def computed_at_open(self, i: int) -> int:
        return self._computed_at_open[i]

    def first_batch(self, i: int) -> int:
        return self._first_batch[i]

    def last_batch(self, i: int) -> int:
        return self._last_batch[i]

    def synced(self, i: int) -> int:
        return self._synced[i]

    def token_base(self, i: int) -> int:
        return self._token_base[i]

    def set_synced(self, i: int, index: int) -> None:
        self._synced[i] = index

    def set_token_base(self, i: int, token_base: int) -> None:
        self._token_base[i] = token_base

    def decodes_in(self, i: int, index: int) -> bool:
        """Whether member ``i`` decodes in window batch ``index``."""
        return self._first_batch[i] <= index <= self._last_batch[i]

    def window_steps(self, i: int, index: int) -> int:
        """Of member ``i``'s batches, those applied in window steps up to ``V_{index-1}``."""
        return max(0, index - self._first_batch[i])

    def computed_at_open_by_index(self) -> list[int]:
        """Every member's ``computed_at_open``, by index (read only: ``LocalKeySum.advance``)."""
        return self._computed_at_open


class _Member:
    def __init__(self, computed_at_open: int, first_batch: int, last_batch: int, synced: int, token_base: int):
        self.computed_at_open = computed_at_open
        self.first_batch = first_batch
        self.last_batch = last_batch
        self.synced = synced
        self.token_base = token_base


class ReferenceWindowMembers:
    """``WindowMembers`` as one plain object per member: the reference the lists must match."""

    def __init__(self) -> None:
        self._members: list[_Member] = []

    def add(self, computed_at_open: int, first_batch: int, last_batch: int, synced: int, token_base: int) -> int:
        self._members.append(_Member(computed_at_open, first_batch, last_batch, synced, token_base))
        return len(self._members) - 1

    def count(self) -> int:
        return len(self._members)

    def computed_at_open(self, i: int) -> int:
        return self._members[i].computed_at_open

    def first_batch(self, i: int) -> int:
        return self._members[i].first_batch

    def last_batch(self, i: int) -> int:
        return self._members[i].last_batch

    def synced(self, i: int) -> int:
        return self._members[i].synced

    def token_base(self, i: int) -> int:
        return self._members[i].token_base

    def set_synced(self, i: int, index: int) -> None:
        self._members[i].synced = index

    def set_token_base(self, i: int, token_base: int) -> None:
        self._members[i].token_base = token_base

    def decodes_in(self, i: int, index: int) -> bool:
        member = self._members[i]
        return member.first_batch <= index <= member.last_batch

    def window_steps(self, i: int, index: int) -> int:
        steps = index - self._members[i].first_batch
        return steps if steps > 0 else 0

    def computed_at_open_by_index(self) -> list[int]:
        return [member.computed_at_open for member in self._members]
