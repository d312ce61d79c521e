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


def test_the_steps_table_is_made_once_and_the_rows_go_with_it():
    """A run's step rows are the recorder's largest holding: ``steps_table`` lets them go
    as it makes the table (the default scenario's peak fell from 809 to 745 MiB), so a
    second call must give the same table, not an empty one."""
    from kvtwin.sim.core.engine import EngineCore
    from kvtwin.sim.replay.clock.cluster import run_simulation
    from kvtwin.sim.replay.clock.replica import Replica
    from kvtwin.sim.replay.recorder import MetricsRecorder
    from kvtwin.sim.replay.run import CostModelExecutor, plan_cost_model
    from kvtwin.sim.replay.trace_requests import arrivals_from_trace
    from tests.replay.chat_workload import chat_trace, llama_plan

    plan = llama_plan()
    kv = plan.require_fits()
    engine = EngineCore(kv, plan.engine.scheduler, plan.engine.cache)
    recorder = MetricsRecorder(len(kv.groups))
    run_simulation([Replica(engine, CostModelExecutor(plan_cost_model(plan)))],
                   arrivals_from_trace(chat_trace(20)), recorder)
    num_values = len(recorder._step_values)
    assert num_values > 0
    first = recorder.steps_table()
    second = recorder.steps_table()
    assert second is first and first.num_rows == num_values // recorder.step_width
    assert len(recorder._step_values) == 0  # the packed rows are gone
