"""``WindowMembers`` (parallel lists, the decode window's hot path) answers every sequence of
calls as ``ReferenceWindowMembers`` (one plain object per member) does
(docs/architecture.md#decode-windows)."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtwin.sim.core.window_members import ReferenceWindowMembers, WindowMembers

# One operation: (name, four small integers it may use as index, batch or value).
OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["add", "set_synced", "set_token_base", "read"]),
              st.integers(0, 40), st.integers(-3, 60), st.integers(-3, 60), st.integers(-1, 1 << 20)),
    max_size=80)


def _public(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_both_implement_the_same_interface():
    assert _public(WindowMembers) == _public(ReferenceWindowMembers)
    for name in _public(WindowMembers):
        assert (inspect.signature(getattr(WindowMembers, name))
                == inspect.signature(getattr(ReferenceWindowMembers, name))), name


def _observe(members, op: str, a: int, b: int, c: int, d: int) -> object:
    """Run one operation; what it returns, or what the member it reads holds."""
    count = members.count()
    if op == "add":
        return members.add(c + b, b, c, a % 3, d)
    if not count:
        return None
    i = a % count
    if op == "set_synced":
        return members.set_synced(i, b)
    if op == "set_token_base":
        return members.set_token_base(i, d)
    return (members.computed_at_open(i), members.first_batch(i), members.last_batch(i), members.synced(i),
            members.token_base(i), members.decodes_in(i, b), members.window_steps(i, c),
            list(members.computed_at_open_by_index()))


@settings(max_examples=300, deadline=None)
@given(operations=OPERATIONS)
def test_the_lists_answer_as_the_reference(operations):
    fast, reference = WindowMembers(), ReferenceWindowMembers()
    for operation in operations:
        assert _observe(fast, *operation) == _observe(reference, *operation), operation
        assert fast.count() == reference.count()


def test_a_member_reads_back_what_was_written():
    """The reference itself, against values written by hand."""
    members = ReferenceWindowMembers()
    assert members.add(100, 0, 7, 0, 5000) == 0
    assert members.add(40, 3, 2, 5, 9000) == 1
    members.set_synced(0, 4)
    members.set_token_base(1, 1234)
    assert (members.synced(0), members.token_base(0), members.token_base(1)) == (4, 5000, 1234)
    assert [members.decodes_in(0, j) for j in (-1, 0, 7, 8)] == [False, True, True, False]
    assert not any(members.decodes_in(1, j) for j in range(10))  # its last batch is before its first
    assert (members.window_steps(1, 2), members.window_steps(1, 9)) == (0, 6)
    assert members.computed_at_open_by_index() == [100, 40]
