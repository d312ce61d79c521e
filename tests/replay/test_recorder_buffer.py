"""The recorder's double buffer keeps every value in the order recorded, however it was
recorded (one at a time, a few at once, or a repeated value) and across its storing blocks."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvtwin.sim.replay.recorder import Float64Buffer

_VALUE = st.floats(allow_nan=False, width=64)
_OPERATION = st.one_of(
    st.tuples(st.just("append"), _VALUE, st.just(1)),
    st.tuples(st.just("extend"), _VALUE, st.integers(0, 5)),
    st.tuples(st.just("repeat"), _VALUE, st.integers(0, 70_000)),
)


@given(st.lists(_OPERATION, max_size=12))
@settings(max_examples=60, deadline=None)
def test_values_come_back_in_order(operations):
    buffer = Float64Buffer()
    expected: list[float] = []
    for kind, value, count in operations:
        if kind == "append":
            buffer.append(value)
        elif kind == "extend":
            values = [value + i for i in range(count)]
            buffer.extend(values)
            expected.extend(values)
            continue
        else:
            buffer.extend_repeated(value, count)
        expected.extend([value] * count)
    assert len(buffer) == len(expected)
    assert buffer.to_array().tolist() == expected
    # Recording goes on after a read.
    buffer.append(1.5)
    assert buffer.to_array().tolist() == expected + [1.5]
