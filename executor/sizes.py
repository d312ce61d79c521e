"""How big a ``kvtwin validate`` run is: ``small`` (the default on a CPU) or ``full``.

``full`` validates the scenario as it is: its first N requests (100 on a GPU, 8 on a CPU)
at their recorded lengths and times, on the plan's KV pool. On a CPU that is slow (the
torch reference attends over every prompt token: the default scenario's Mooncake prompts
average 12k tokens, and its first 8 requests took over 25 minutes on two cores) and it
proves little there: a pool planned for a B200 never fills with 8 requests, so nothing is
evicted or preempted.

``small`` keeps every check meaningful in under two minutes on two cores. It takes the
scenario's first ``requests`` requests, cuts each prompt to ``max_prompt_tokens`` and each
output to ``max_output_tokens`` (a prompt keeps its first tokens, so requests that share a
prefix in the trace still share it, up to the cut), lets them all arrive at time 0 (a
burst, whose schedule does not depend on the measured step times, so what a run does is
the same on a busy machine as on an idle one), sets ``max_model_len`` to the longest
request left, and cuts the KV pool to ``pool_requests`` times the blocks that longest
request needs (a scenario whose own pool is smaller keeps its own): the run reuses cached prefixes, evicts cached blocks and preempts running
requests, which checks 1 and 2 are there to check. ``tests/executor/test_validate_size.py``
asserts that it does, on the default scenario.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from kvtwin.sim.core.errors import ConfigError
from kvtwin.sim.scenario.resolve import ResolvedScenario
from kvtwin.traces import schema as col


@dataclass(frozen=True)
class RunSize:
    """A validate run's size: None in a field means "as the scenario has it"."""

    name: str
    requests: int | None  # the first N requests (None: the device's default, DEFAULT_FULL_REQUESTS)
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    burst: bool = False  # every request arrives at time 0
    pool_requests: float | None = None  # the KV pool, in longest requests' blocks (None: the plan's pool)
    # torch's intra-op threads on a CPU (None: torch's default). The small run's matrices are
    # tiny: threads only add synchronisation, and on a loaded two-core machine a run with
    # two threads took eight times as long as with one.
    cpu_threads: int | None = None


SIZES = {
    "small": RunSize("small", requests=32, max_prompt_tokens=1024, max_output_tokens=32, burst=True,
                     pool_requests=2.5, cpu_threads=1),
    "full": RunSize("full", requests=None),
}
# The default size on each device, and the requests of a full run.
DEFAULT_SIZE = {"cpu": "small", "cuda": "full"}
DEFAULT_FULL_REQUESTS = {"cuda": 100, "cpu": 8}


def run_size(name: str) -> RunSize:
    if name not in SIZES:
        raise ConfigError("--size", f"one of {', '.join(SIZES)}", name)
    return SIZES[name]


def requests_of(size: RunSize, device: str, given: int | None) -> int:
    """How many of the trace's requests the run takes: ``--requests`` if given, else the size's."""
    if given is not None:
        if given <= 0:
            raise ConfigError("--requests", "a positive number of requests", given)
        return given
    return size.requests if size.requests is not None else DEFAULT_FULL_REQUESTS.get(device, 8)


def _cut(trace: pa.Table, name: str, limit: int | None) -> pa.Table:
    if limit is None or name not in trace.column_names:
        return trace
    column = trace.column(name)
    cut = pc.min_element_wise(column, pa.scalar(limit, column.type))
    return trace.set_column(trace.schema.get_field_index(name), name, cut)


def sized_trace(trace: pa.Table, size: RunSize) -> pa.Table:
    """The trace's prompts and outputs cut to the size's limits, arriving together if a burst."""
    trace = _cut(_cut(trace, col.PROMPT_TOKENS, size.max_prompt_tokens), col.OUTPUT_TOKENS, size.max_output_tokens)
    if size.max_prompt_tokens is not None and col.PROMPT_TOKEN_IDS in trace.column_names:
        # A trace with real token ids keeps the first tokens, as many as the cut prompt has.
        ids = pc.list_slice(trace.column(col.PROMPT_TOKEN_IDS), 0, size.max_prompt_tokens)
        trace = trace.set_column(trace.schema.get_field_index(col.PROMPT_TOKEN_IDS), col.PROMPT_TOKEN_IDS, ids)
    if size.burst and trace.num_rows:
        index = trace.schema.get_field_index(col.ARRIVAL_TIME_S)
        trace = trace.set_column(index, col.ARRIVAL_TIME_S, pa.array([0.0] * trace.num_rows, pa.float64()))
    return trace


def sized_scenario(resolved: ResolvedScenario, trace: pa.Table, size: RunSize) -> ResolvedScenario:
    """The scenario with ``max_model_len`` the longest request of the (sized) ``trace`` and
    the KV pool cut to ``pool_requests`` of those requests (unchanged for ``full``)."""
    if size.pool_requests is None or trace.num_rows == 0:
        return resolved
    longest = pc.max(pc.add(trace.column(col.PROMPT_TOKENS), trace.column(col.OUTPUT_TOKENS))).as_py()
    block = 16  # a whole number of the smallest block size, so every group's tables line up
    max_model_len = min(resolved.engine.max_model_len, -(-int(longest) // block) * block)
    engine = dataclasses.replace(resolved.engine, max_model_len=max_model_len)
    planned = dataclasses.replace(resolved, engine=engine).plan()
    planned.require_fits()
    blocks = int(planned.blocks_per_request * size.pool_requests) + 1  # + the null block
    if planned.num_blocks <= blocks:
        return dataclasses.replace(resolved, engine=engine)  # the scenario's own pool is already that tight
    engine = dataclasses.replace(engine, kv_cache_memory_bytes=planned.bytes_per_block * blocks)
    return dataclasses.replace(resolved, engine=engine)
